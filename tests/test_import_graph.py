"""Lumen's modules import one another without a cycle, lazy and type-checking imports included."""

from __future__ import annotations

from graphlib import CycleError, TopologicalSorter

import grimp

PACKAGES = ("engine", "service", "tracing", "replay", "bench")


def test_no_import_cycle() -> None:
    # import-linter's contracts see cycles between siblings of one package only; a loop across
    # packages (tracing.otlp -> engine -> engine.llm -> tracing.recorder -> tracing.otlp, once)
    # needs the whole graph.
    graph = grimp.build_graph(*PACKAGES)
    imports = {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}
    try:
        TopologicalSorter(imports).prepare()
    except CycleError as error:
        raise AssertionError(f"import cycle: {' -> '.join(reversed(error.args[1]))}") from None


def test_lumen_serve_spawns_its_core_before_the_heavy_imports() -> None:
    """`lumen serve` spawns the engine core before it imports the server (service/cli.py): what
    the parser and the launch import comes first, so numpy, duckdb and torch must not be in it
    (0.3 s of a 2-core machine's start before they were moved to where they are used)."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys; from service.cli import build_parser; "
        "build_parser().parse_args(['serve', 'm']); import engine.launch; "
        "print(sorted(m for m in ('numpy', 'duckdb', 'torch', 'fastapi') if m in sys.modules))"
    )
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
