"""Runs `lumen bench` subcommands through the CLI's own entry point, for the bench tests."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
from pathlib import Path


def lumen_bench(*args: str) -> subprocess.CompletedProcess:
    """``lumen bench ARGS`` through the CLI's own ``main`` in this process: its exit status,
    stdout and stderr. The servers and baselines a benchmark starts are processes of their own,
    as for a user; a fresh interpreter for the CLI itself would add 3 s of CPU (torch,
    transformers and the engine imported again) to each of the suite's ten benchmark runs."""
    from service.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["bench", *args])
        except SystemExit as e:  # argparse's refusals, as the process would exit
            code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
    return subprocess.CompletedProcess(["lumen", "bench", *args], code, out.getvalue(),
                                       err.getvalue())  # fmt: skip


def lumen_bench_refused(*args: str) -> tuple[int, str]:
    """``lumen bench ARGS`` where the CLI refuses the arguments: its exit status and stderr."""
    r = lumen_bench(*args)
    return r.returncode, r.stderr


def bench_json(tmp_path: Path, *args: str) -> tuple[str, dict]:
    """Run ``lumen bench ARGS --json``; its stdout and the JSON it wrote."""
    out = tmp_path / f"{args[0]}.json"
    r = lumen_bench(*args, "--json", str(out))
    assert r.returncode == 0, r.stderr
    return r.stdout, json.loads(out.read_text())


def ratio_keys(doc: dict) -> list[str]:
    return [k for k in doc if "ratio" in k]
