"""LUMEN_DEBUG_DELAY's fault hook: a no-op when unset, a sleep at the sites it names."""

from __future__ import annotations

import time

import pytest

from engine import faults


def test_unset_every_site_resolves_to_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LUMEN_DEBUG_DELAY", raising=False)
    assert all(faults.hook(site) is faults.nothing for site in faults.SITES)
    monkeypatch.setenv("LUMEN_DEBUG_DELAY", "emit=0.5")
    assert faults.hook("schedule") is faults.nothing  # only the named site is armed


def test_a_named_site_sleeps_its_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LUMEN_DEBUG_DELAY", " schedule=0.05,grammar_mask=0.01")
    assert faults.parse(" schedule=0.05,grammar_mask=0.01") == {
        "schedule": 0.05,
        "grammar_mask": 0.01,
    }
    inject = faults.hook("schedule")
    started = time.perf_counter()
    inject()
    assert time.perf_counter() - started >= 0.05
    # The environment is read when the hook is made (a component's start), not at each call.
    monkeypatch.delenv("LUMEN_DEBUG_DELAY")
    started = time.perf_counter()
    inject()
    assert time.perf_counter() - started >= 0.05


def test_an_unknown_site_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LUMEN_DEBUG_DELAY", "schedule=0.01,scheduler=0.01")
    with pytest.raises(ValueError, match=r"LUMEN_DEBUG_DELAY: unknown site 'scheduler' \(one of"):
        faults.hook("schedule")
    with pytest.raises(ValueError):
        faults.parse("schedule=fast")
