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
