"""Runs `lumen bench` subcommands in a fresh interpreter, as a user would, for the bench tests."""

from __future__ import annotations

import contextlib
import io
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


def lumen_bench_refused(*args: str) -> tuple[int, str]:
    """``lumen bench ARGS`` through the CLI's own ``main`` in this process: its exit status and
    stderr. For arguments the CLI refuses before a benchmark starts, where a fresh interpreter
    would add only its 2-3 s of imports."""
    from service.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = main(["bench", *args])
        except SystemExit as e:  # argparse's refusals
            code = e.code if isinstance(e.code, int) else 1
    return code, err.getvalue()


def bench_json(tmp_path: Path, *args: str) -> tuple[str, dict]:
    """Run ``lumen bench ARGS --json``; its stdout and the JSON it wrote."""
    out = tmp_path / f"{args[0]}.json"
    r = lumen_bench(*args, "--json", str(out))
    assert r.returncode == 0, r.stderr
    return r.stdout, json.loads(out.read_text())


def ratio_keys(doc: dict) -> list[str]:
    return [k for k in doc if "ratio" in k]
