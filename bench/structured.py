"""lumen bench structured: what structured outputs cost, and who pays.

One `lumen serve`, phases interleaved --rounds times: plain streamed chats alone; beside as
many more plain streams; beside as many streams whose output is held to a JSON schema (free
text fields: the costliest masks, every token a string character). Reported side by side: the
plain streams' inter-token latency in each (beside grammar over beside plain is what the masks
cost their neighbours, in a batch of the same size), the grammar streams' own, and from the
trace store the grammar compile times (each new schema once, then the cache) and the per-step
token-mask time.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import check_json_path, machine, percentiles, print_table, write_json
from bench.server import LumenServer

SCHEMA = {
    "type": "object",
    # minLength: the stream runs to max_tokens like the plain ones (ignore_eos), same batch size.
    "properties": {"title": {"type": "string"}, "story": {"type": "string", "minLength": 2000}},
    "required": ["title", "story"],
    "additionalProperties": False,
}


def add_parser(verbs: argparse._SubParsersAction) -> None:
    p = verbs.add_parser("structured", help="structured outputs: compile, masks, neighbours' ITL")
    p.add_argument("--model", default=None, help="model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--streams", type=int, default=4, help="plain streams")
    p.add_argument("--grammar-streams", type=int, default=4, help="streams under a JSON schema")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--rounds", type=int, default=2, help="alone / beside pairs, interleaved")
    p.add_argument("--json", default=None, metavar="PATH", help="write the figures as JSON")
    p.set_defaults(func=run)


async def _stream(client: httpx.AsyncClient, body: dict[str, Any]) -> list[float]:
    """The gaps between a stream's content chunks (seconds)."""
    stamps: list[float] = []
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"content":"' in line and '"content":""' not in line:
                stamps.append(time.perf_counter())
    return [b - a for a, b in itertools.pairwise(stamps)]


def _body(i: int, args: argparse.Namespace, grammar: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": f"Tell story number {i} about a lighthouse."}],
        "max_tokens": args.max_tokens,
        "stream": True,
        "temperature": 0,
    }
    if grammar:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "story", "schema": SCHEMA},
        }
    else:
        body["ignore_eos"] = True
    return body


async def _phase(server: LumenServer, args: argparse.Namespace, beside: str, k: int):
    """The plain streams' gaps, and those of the streams beside them (``beside``: none, plain
    or grammar)."""
    n = 0 if beside == "none" else args.grammar_streams
    async with httpx.AsyncClient(base_url=server.base_url, timeout=600) as client:
        plain = [_stream(client, _body(k * 100 + i, args, False)) for i in range(args.streams)]
        others = [_stream(client, _body(k * 100 + i, args, beside == "grammar")) for i in range(n)]
        gaps = await asyncio.gather(*plain, *others)
    flat = [[g for gs in part for g in gs] for part in (gaps[: args.streams], gaps[args.streams :])]
    return flat[0], flat[1]


def _store_figures(db: Path) -> dict[str, Any]:
    from tracing.store import open_db

    with open_db(db, timeout=30) as con:
        compiles = con.execute(
            "SELECT grammar_compile_ns, grammar_cached, grammar_ready_ns - received_ns "
            "FROM requests WHERE grammar IS NOT NULL ORDER BY arrival_ns"
        ).fetchall()
        masks = con.execute(
            "SELECT grammar_mask_ns, grammar_rows, output_ns - schedule_start_ns FROM steps "
            "WHERE grammar_rows > 0"
        ).fetchall()
    fresh = [c for c, cached, _ in compiles if not cached]
    return {
        "grammar_requests": len(compiles),
        "compiles": len(fresh),
        "cache_hits": sum(1 for _, cached, _ in compiles if cached),
        "compile_ms": [c / 1e6 for c in fresh],
        "first_wait_ms": compiles[0][2] / 1e6 if compiles else None,
        "cached_wait_ms": statistics.median([w / 1e6 for _, cached, w in compiles if cached])
        if any(cached for _, cached, _ in compiles)
        else None,
        "mask_ms_per_step": percentiles([m / 1e6 for m, _, _ in masks]),
        "mask_us_per_row": statistics.median([m / r / 1e3 for m, r, _ in masks]) if masks else None,
        "mask_share_of_step": statistics.median([m / s for m, _, s in masks if s])
        if masks
        else None,
    }


def run(args: argparse.Namespace) -> int:
    from engine.model_files import resolve_model

    if min(args.streams, args.grammar_streams, args.max_tokens, args.rounds) < 1:
        raise ValueError("--streams, --grammar-streams, --max-tokens and --rounds must be >= 1")
    check_json_path(args.json)
    model = resolve_model(args.model)
    itl: dict[str, list[float]] = {
        "plain alone": [], "plain beside plain": [], "plain beside grammar": [],
        "grammar streams": [],
    }  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="lumen-structured-") as tmp:
        db = Path(tmp) / "trace.db"
        with LumenServer(model, "--trace-flush-interval", "0.2", log_path=Path(tmp) / "s.log",
                         trace_db=db) as server:  # fmt: skip
            asyncio.run(_phase(server, args, "grammar", 99))  # warm: not counted
            for k in range(args.rounds):
                itl["plain alone"] += asyncio.run(_phase(server, args, "none", k))[0]
                itl["plain beside plain"] += asyncio.run(_phase(server, args, "plain", k))[0]
                plain, held = asyncio.run(_phase(server, args, "grammar", k))
                itl["plain beside grammar"] += plain
                itl["grammar streams"] += held
            time.sleep(1.0)  # the last flush
        store = _store_figures(db)
    stats = {k: percentiles([g * 1e3 for g in v]) for k, v in itl.items()}
    rows = [[k, f"{s['p50']:.1f}", f"{s['p90']:.1f}", f"{s['p99']:.1f}"] for k, s in stats.items()]
    print_table(["ITL (ms)", "p50", "p90", "p99"], rows)
    ratio = stats["plain beside grammar"]["p50"] / stats["plain beside plain"]["p50"]
    print(f"plain ITL p50 beside grammar streams / beside as many plain streams: {ratio:.2f}")
    masks = store["mask_ms_per_step"]
    compiles = ", ".join(f"{c:.2f}" for c in store["compile_ms"])
    print(
        f"grammar: {store['compiles']} compiles ({compiles} ms), {store['cache_hits']} cache "
        f"hits; the first request waited "
        f"{store['first_wait_ms'] or 0:.1f} ms for its grammar, a cached one "
        f"{store['cached_wait_ms'] or 0:.2f} ms; masks per step p50 {masks['p50']:.2f} ms, "
        f"p99 {masks['p99']:.2f} ms ({store['mask_us_per_row'] or 0:.0f} us per row, "
        f"{(store['mask_share_of_step'] or 0):.0%} of the step at the median)"
    )
    write_json(args.json, {
        "model": model.name, "streams": args.streams, "grammar_streams": args.grammar_streams,
        "itl_ms": stats, "plain_beside_grammar_over_beside_plain_p50": ratio, "store": store,
        "machine": machine(),
    })  # fmt: skip
    return 0
