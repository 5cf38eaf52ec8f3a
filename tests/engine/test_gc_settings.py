"""The server processes' garbage-collector settings once started (engine.gc_pauses.settle_heap).

Each case runs in a fresh interpreter: freezing the heap is for the life of a process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBE = (
    "import gc, json; from engine.gc_pauses import settle_heap; before = gc.get_threshold(); "
    "settle_heap(); print(json.dumps([before, gc.get_threshold(), gc.get_freeze_count()]))"
)


def _probe(setting: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "LUMEN_GC"}
    if setting is not None:
        env["LUMEN_GC"] = setting
    return subprocess.run(
        [sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip


def test_serving_freezes_the_start_up_heap_and_raises_the_young_threshold() -> None:
    import json

    from engine.gc_pauses import SERVING_GC_THRESHOLDS

    done = _probe(None)
    assert done.returncode == 0, done.stderr
    before, after, frozen = json.loads(done.stdout)
    assert tuple(after) == SERVING_GC_THRESHOLDS != tuple(before)
    assert frozen > 1000, frozen  # the modules and everything imported: out of the GC's sight


def test_default_keeps_pythons_settings() -> None:
    import json

    done = _probe("default")
    assert done.returncode == 0, done.stderr
    before, after, frozen = json.loads(done.stdout)
    assert before == after and frozen == 0


@pytest.mark.parametrize("value", ["off", "Serving"])
def test_a_bad_setting_stops_lumen_serve_before_it_starts(value: str, tmp_path: Path) -> None:
    env = {**os.environ, "LUMEN_GC": value, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "service.cli", "serve", "--model", str(tmp_path / "none")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines == [f"lumen: error: LUMEN_GC must be serving or default, not {value!r}"], lines
