"""Fault injection for tests: the sleeps LUMEN_DEBUG_DELAY asks for at named sites."""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

from engine import envs

# The sites, each reached once per step (grammar_compile: once per compile).
SITES = ("schedule", "output", "emit", "grammar_compile", "grammar_mask")


def parse(value: str) -> dict[str, float]:
    """``SITE=SECONDS[,SITE=SECONDS]`` as seconds by site; an unknown site is an error."""
    delays: dict[str, float] = {}
    for item in filter(None, value.split(",")):
        name, _, seconds = item.partition("=")
        site = name.strip()
        if site not in SITES:
            raise ValueError(
                f"{envs.LUMEN_DEBUG_DELAY.name}: unknown site {name!r} (one of {', '.join(SITES)})"
            )
        delays.setdefault(site, float(seconds))  # the first mention of a site wins
    return delays


def nothing() -> None:
    """The hook of a site no fault is armed at."""


def hook(site: str) -> Callable[[], None]:
    """What ``site`` calls each time it is reached: the sleep LUMEN_DEBUG_DELAY sets there, else
    ``nothing``. The component that holds the site calls this as it starts, so the environment
    is read then, never on the hot path, and a component built later may see another value."""
    assert site in SITES, site
    seconds = parse(envs.LUMEN_DEBUG_DELAY.get()).get(site)
    return partial(time.sleep, seconds) if seconds else nothing
