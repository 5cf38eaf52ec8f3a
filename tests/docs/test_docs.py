"""The documentation checked in the direction that drifts: prose (the README, every page of the
site, the dashboards' JSON) names only flags, metrics and trace-store columns the code has; the
reference pages generate from the code; the README's requests run against a real server."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from service.reference import VLLM_SHARED, commands, known_names, page, parsers
from tests.helpers.server import ROOT, LumenServer

# Flags of other tools that the pages quote, each with its tool: nothing else may be unknown.
OTHER_FLAGS = {
    "--continuous-batching": "transformers serve (a baseline of lumen bench serve)",
    "--cb-num-blocks": "transformers serve",
    "--set": "helm install (the Gateway API Inference Extension's chart)",
    "--scale": "docker compose",
    "--dist": "pytest-xdist",
    "--no-loadscope-reorder": "pytest-xdist",
    "--durations": "pytest",
    "--no-binary": "pip",
    "--strict": "mkdocs build",
    "--directory": "python -m http.server",
}
FLAG = re.compile(r"(?<![\w/.-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*")
# A metric name (not a container image's tag, `image: lumen:cpu`, nor a URL's user:password@).
METRIC = re.compile(r"(?<!image: )\b(lumen|vllm):([a-z_][a-z0-9_]*)\b(?!@)")
GEN_AI = re.compile(r"\bgen_ai\.[a-z_]+(?:\.[a-z_]+)*")
# `table.column` of the store's tables and its view (a column alone reads like any identifier).
COLUMN = re.compile(r"\b(runs|requests|steps|span_rows|spans|pauses|request_children|lifecycle)"
                    r"\.([a-z_][a-z0-9_]*)\b")  # fmt: skip


def prose_files() -> list[Path]:
    docs = sorted((ROOT / "docs").rglob("*.md"))
    return [ROOT / "README.md", *docs, *sorted((ROOT / "dashboards").rglob("*.json"))]


def gen_ai_names() -> set[str]:
    """gen_ai.* names the code sends (metrics, span and metric attributes)."""
    found: set[str] = set()
    for folder in ("tracing", "service", "engine", "replay"):
        for py in (ROOT / folder).rglob("*.py"):
            found |= set(GEN_AI.findall(py.read_text()))
    return found


def unknown_names(text: str, known: dict[str, set[str]], gen_ai: set[str]) -> list[str]:
    """Every flag, metric and store column ``text`` names that the code does not have."""
    from tracing.store_schema import TABLES

    columns = {**TABLES, "spans": TABLES["span_rows"]}
    bad = [f for f in FLAG.findall(text) if f not in known["flags"] and f not in OTHER_FLAGS]
    for prefix, name in METRIC.findall(text):
        # vLLM's name of a metric Lumen has under its own prefix is known; any other is not.
        if f"lumen:{name}" not in known["metrics"]:
            bad.append(f"{prefix}:{name}")
    bad += [n for n in GEN_AI.findall(text) if n not in gen_ai]
    for table, column in COLUMN.findall(text):
        if column not in columns[table] and not _sql_word(column):
            bad.append(f"{table}.{column}")
    return bad


def _sql_word(word: str) -> bool:
    # `requests.db`, `requests.py` and the like name files, not columns.
    return word in {"db", "py", "md", "json", "duckdb"}


@pytest.fixture(scope="module")
def names() -> tuple[dict[str, set[str]], set[str]]:
    return known_names(), gen_ai_names()


def test_prose_names_only_what_the_code_has(names: tuple[dict[str, set[str]], set[str]]) -> None:
    known, gen_ai = names
    found = {}
    for path in prose_files():
        bad = unknown_names(path.read_text(), known, gen_ai)
        if bad:
            found[str(path.relative_to(ROOT))] = sorted(set(bad))
    print(f"checked {len(prose_files())} files against {len(known['flags'])} flags, "
          f"{len(known['metrics'])} metric series, {len(known['columns'])} columns")  # fmt: skip
    assert not found, f"names the code does not have (renamed? removed? a typo?): {found}"


def test_the_check_catches_a_name_that_does_not_exist(
    names: tuple[dict[str, set[str]], set[str]],
) -> None:
    """A page naming a flag, metrics, a column that do not exist fails; real ones pass."""
    known, gen_ai = names
    text = (
        "Start with `lumen serve --shutdown-timeout 30 --max-num-seqz 4`; watch "
        "`lumen:kv_cache_usage_perc` (vLLM: `vllm:kv_cache_usage_perc`) and "
        "`lumen:kv_cache_usage_percent`, `vllm:gpu_cache_usage_perc`; query "
        "`requests.send_wait_ns` and `requests.send_wait_ms`; OTLP sends "
        "`gen_ai.server.time_to_first_token` and `gen_ai.server.time_to_frist_token`."
    )
    assert sorted(unknown_names(text, known, gen_ai)) == sorted([
        "--max-num-seqz", "lumen:kv_cache_usage_percent", "vllm:gpu_cache_usage_perc",
        "requests.send_wait_ms", "gen_ai.server.time_to_frist_token",
    ])  # fmt: skip


def test_the_reference_is_generated_from_the_code() -> None:
    """Each page generates, and holds what the code has now (a flag added to the parser, a
    metric to the registry, a column to the schema shows up without an edit)."""
    cli, metrics, store = page("cli"), page("metrics"), page("store")
    assert "### `lumen serve`" in cli and "`--shutdown-timeout`" in cli
    assert "### `replay regress`" in cli and "### `lumen bench diagnose`" in cli
    assert "`lumen:kv_cache_usage_perc` | gauge | `engine`, `model_name`" in metrics
    assert "`gen_ai.server.time_to_first_token`" in metrics
    assert "| `send_wait_ns` | `BIGINT` | summed time the server's writes waited" in store
    assert "| `core_stall` |" in page("parts")
    environment = page("environment")
    assert "`LUMEN_HOME`" in environment and "`OTEL_EXPORTER_OTLP_ENDPOINT`" in environment
    with pytest.raises(ValueError, match="no reference page"):
        page("nope")


def test_flags_marked_as_vllms_are_lumen_serve_flags() -> None:
    serve = next(cmd for path, cmd, _ in commands(parsers()["lumen"], "lumen")
                 if path == "lumen serve")  # fmt: skip
    flags = {s for a in serve._actions for s in a.option_strings}
    assert flags >= VLLM_SHARED, sorted(VLLM_SHARED - flags)
    assert "`--max-num-seqs` (vLLM)" in page("cli")


def code_blocks(text: str) -> list[tuple[str, str]]:
    """The fenced blocks of a Markdown text: (language, code)."""
    blocks, language, lines = [], None, []
    for line in text.splitlines(keepends=True):
        if line.startswith("```"):
            if language is None:
                language, lines = line[3:].strip(), []
            else:
                blocks.append((language, "".join(lines)))
                language = None
        elif language is not None:
            lines.append(line)
    return blocks


def test_the_readmes_requests_work_as_written(tiny_model_path: Path, tmp_path: Path) -> None:
    """The README's curl and `openai` client examples, run as written against `lumen serve`
    (the tiny model, under the default model's name), only the address changed."""
    if shutil.which("curl") is None:
        pytest.skip("curl not installed (the README's first request uses it)")
    readme = (ROOT / "README.md").read_text()
    blocks = code_blocks(readme)
    curl = next(b for lang, b in blocks if lang in ("", "bash", "sh") and b.startswith("curl"))
    client = next(b for lang, b in blocks if lang == "python" and "OpenAI(" in b)
    address = "http://127.0.0.1:8000"
    assert address in curl and address in client
    log = tmp_path / "serve.log"
    with LumenServer(tiny_model_path, "--served-model-name", "SmolLM2-135M-Instruct",
                     log_path=log) as server:  # fmt: skip
        here = server.base_url
        said = subprocess.run(["bash", "-c", curl.replace(address, here)], capture_output=True,
                              text=True, timeout=60, check=True).stdout  # fmt: skip
        print(said[-400:])
        assert said.count("data: {") >= 2 and "data: [DONE]" in said
        out = subprocess.run([sys.executable, "-c", client.replace(address, here)],
                             capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
        print(out.stdout)
        assert out.stdout.strip()
