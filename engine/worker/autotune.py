"""How every CPU kernel choice is made: forced by its environment variable, else built, timed
and cached on disk, then logged.

Each chooser (cpu_matmul, cpu_attention, cpu_greedy_head, cpu_int8, cpu_threads) reads its
setting with ``forced``, builds its kernel with ``build``, times the candidates with
``best_of`` / ``best_of_each`` inside ``decide``, and logs with ``log``. ``decide`` keeps
each decision in a small JSON file (LUMEN_AUTOTUNE_DIR, by default LUMEN_HOME/autotune),
keyed by:

- the decision's name and the model shape it was timed on,
- the machine: its CPU (native_build.cpu_key) and the thread team timing it,
- the versions: torch's, Lumen's, and a hash of the kernels' sources and choosers,

so a second start on the same machine takes the same kernels without timing them.
``LUMEN_AUTOTUNE=retune`` times them again and overwrites the cache.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import subprocess
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from engine import cache_files, envs
from engine.version import __version__
from engine.worker import native_build

logger = logging.getLogger(__name__)

AUTO = "auto"
MODES = ("cache", "retune")
# What a failed build raises: the chooser falls back to torch's path (or fails, if forced).
BUILD_ERRORS = (RuntimeError, OSError, subprocess.SubprocessError)
CHOOSERS = ("autotune", "cpu_matmul", "cpu_attention", "cpu_greedy_head", "cpu_int8",
            "cpu_int4", "cpu_gguf", "weight_only", "cpu_threads", "native_build")  # fmt: skip
K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class Decision:
    choice: Any  # JSON-able: a kernel's name, a row or thread count, a name per row count
    why: str  # the timings behind it (prefixed "cached: " where read from the cache)
    cached: bool = False


def forced(var: envs.EnvVar, options: tuple[str, ...]) -> str:
    """``var``'s value, one of ``options`` (``auto`` times the candidates)."""
    value = var.get().strip() or AUTO
    if value not in options:
        raise ValueError(f"{var.name} must be one of {', '.join(options)}, not {value!r}")
    return value


def build(stem: str, source_name: str, defines: tuple[str, ...] = ()) -> Path:
    """The kernel's library (native_build: compiled once per machine); raises one of
    BUILD_ERRORS where it cannot be built."""
    return native_build.compile_library(stem, source_name, defines)


def best_of(fn: Callable[[], object], repeat: int = 5) -> float:
    """The fastest of ``repeat`` timed calls of ``fn``, after one untimed."""
    return best_of_each({0: fn}, repeat)[0]


def best_of_each(
    fns: Mapping[K, Callable[[], object]],
    rounds: int = 5,
    before: Callable[[K], object] | None = None,
) -> dict[K, float]:
    """Each candidate's fastest call over ``rounds`` interleaved rounds (so all see the
    machine's same state), after one untimed call each; ``before(key)`` runs untimed
    before each call."""
    for key, fn in fns.items():
        if before is not None:
            before(key)
        fn()  # the first run pays one-off costs
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for key, fn in fns.items():
            if before is not None:
                before(key)
            t0 = time.perf_counter()
            fn()
            best[key] = min(best[key], time.perf_counter() - t0)
    return best


def decide(name: str, shape: Mapping[str, Any], measure: Callable[[], tuple[Any, str]]) -> Decision:
    """The decision ``name`` for ``shape``: read from the cache where an earlier start on this
    machine and these versions made it, else ``measure()``'s (choice, why), then cached."""
    key = {"decision": name, "shape": dict(shape), **_machine_and_versions()}
    text = json.dumps(key, sort_keys=True)
    path = cache_dir() / f"{name}-{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"
    if mode() == "cache" and (entry := _read(path)) is not None and entry.get("key") == key:
        return Decision(entry["choice"], f"cached: {entry['why']}", cached=True)
    choice, why = measure()
    entry = {"key": key, "choice": choice, "why": why}
    cache_files.write_json(path, entry, "the kernel decision")
    return Decision(choice, why)


def log(subject: str, text: str) -> None:
    """One chooser's decision, as the engine's log shows it at start."""
    logger.info("%s: %s", subject, text)


def mode() -> str:
    value = envs.LUMEN_AUTOTUNE.get().strip() or MODES[0]
    if value not in MODES:
        raise ValueError(f"LUMEN_AUTOTUNE must be one of {', '.join(MODES)}, not {value!r}")
    return value


def cache_dir() -> Path:
    folder = envs.LUMEN_AUTOTUNE_DIR.get().strip()
    return Path(folder).expanduser() if folder else envs.lumen_home() / "autotune"


def _machine_and_versions() -> dict[str, Any]:
    return {
        "cpu": hashlib.sha256(native_build.cpu_key().encode()).hexdigest()[:16],
        "threads": torch.get_num_threads(),  # the team timing it (a container may have fewer)
        "torch": torch.__version__,
        "lumen": __version__,
        "sources": source_hash(),
    }


@functools.cache
def source_hash() -> str:
    """A hash of the kernels' C sources and of the modules that time them: an edit to
    either times them again."""
    digest = hashlib.sha256()
    here = Path(__file__).parent
    files = sorted(native_build.SOURCES.glob("*.c")) + [here / f"{m}.py" for m in CHOOSERS]
    for f in files:
        digest.update(f.name.encode() + b"\0" + f.read_bytes())
    return digest.hexdigest()[:16]


def _read(path: Path) -> dict[str, Any] | None:
    entry = cache_files.read_json(path, "the cached kernel decision")  # None: time again
    return entry if entry is not None and {"choice", "why"} <= entry.keys() else None
