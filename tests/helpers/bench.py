"""Runs `lumen bench` subcommands in a fresh interpreter, as a user would, for the bench tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def lumen_bench(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "service.cli", "bench", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def bench_json(tmp_path: Path, *args: str) -> tuple[str, dict]:
    """Run ``lumen bench ARGS --json``; its stdout and the JSON it wrote."""
    out = tmp_path / f"{args[0]}.json"
    r = lumen_bench(*args, "--json", str(out))
    assert r.returncode == 0, r.stderr
    return r.stdout, json.loads(out.read_text())


def ratio_keys(doc: dict) -> list[str]:
    return [k for k in doc if "ratio" in k]
