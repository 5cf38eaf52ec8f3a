"""lumen bench cold-start: the first burst after start against a warm one.

A fresh `lumen serve` answers /health 200 only once the engine is ready; the first requests
must then be as fast as later ones. Per mode (the default warm-up, and --no-warmup), a fresh
server gets a burst of concurrent streamed chats as soon as it is healthy, then, after a
pause, more bursts of the same shape: the figure is the slowest time to first token of the
first burst over the median of the later bursts' slowest.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import check_json_path, machine, print_table, write_json
from bench.server import LumenServer, streamed_chat


def add_parser(verbs: argparse._SubParsersAction) -> None:
    p = verbs.add_parser("cold-start", help="the first burst after start against a warm burst")
    p.add_argument("--model", default=None, help="model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--burst", type=int, default=8, help="concurrent requests per burst")
    p.add_argument("--max-tokens", type=int, default=16, help="output tokens per request")
    p.add_argument(
        "--prompt-repeat",
        type=int,
        default=1,
        help="repeat each prompt's sentence this many times (longer prefills)",
    )
    p.add_argument("--warm-bursts", type=int, default=3, help="bursts after the first")
    p.add_argument("--json", default=None, metavar="PATH", help="write the figures as JSON")
    p.set_defaults(func=run)


async def _ttft(
    client: httpx.AsyncClient, server: LumenServer, i: int, args: argparse.Namespace
) -> float:
    text = f"Question {i}: " + "what do lighthouses tell ships at night? " * args.prompt_repeat
    body = streamed_chat(server, text, args.max_tokens)
    t0 = time.perf_counter()
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        ttft = None
        async for line in r.aiter_lines():  # to the end: a whole request
            if (
                ttft is None
                and line.startswith("data: {")
                and '"content":"' in line
                and ('"content":""' not in line)
            ):
                ttft = time.perf_counter() - t0
    if ttft is None:
        raise RuntimeError("the stream ended without a token")
    return ttft


async def _burst(server: LumenServer, args: argparse.Namespace, first: int) -> float:
    """The slowest TTFT of a burst of concurrent requests."""
    async with httpx.AsyncClient(base_url=server.base_url, timeout=600) as client:
        ttfts = await asyncio.gather(
            *(_ttft(client, server, first + i, args) for i in range(args.burst))
        )
    return max(ttfts)


def measure(model: Path, mode: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    flags = ["--no-warmup"] if mode == "--no-warmup" else []
    log = tmp / f"serve{len(flags)}.log"
    with LumenServer(model, *flags, "--no-trace-db", log_path=log) as server:
        first = asyncio.run(_burst(server, args, 0))
        warm = []
        for k in range(args.warm_bursts):
            time.sleep(0.5)
            warm.append(asyncio.run(_burst(server, args, (k + 1) * args.burst)))
        found = re.search(r"warm-up ([0-9.]+)s", server.log())
    median_warm = statistics.median(warm)
    return {
        "mode": mode,
        "first_burst_slowest_ttft_s": first,
        "warm_bursts_slowest_ttft_s": warm,
        "first_over_warm_ratio": first / median_warm,
        "warmup_s": float(found.group(1)) if found else None,
    }


def run(args: argparse.Namespace) -> int:
    from engine.model_files import resolve_model

    if min(args.burst, args.max_tokens, args.warm_bursts, args.prompt_repeat) < 1:
        raise ValueError("--burst, --max-tokens, --warm-bursts and --prompt-repeat must be >= 1")
    check_json_path(args.json)
    model = resolve_model(args.model)
    with tempfile.TemporaryDirectory(prefix="lumen-cold-") as tmp:
        results = [measure(model, mode, args, Path(tmp)) for mode in ("warm-up", "--no-warmup")]
    rows = [
        [r["mode"], f"{r['warmup_s'] or 0:.2f} s", f"{r['first_burst_slowest_ttft_s'] * 1e3:,.0f}",
         f"{statistics.median(r['warm_bursts_slowest_ttft_s']) * 1e3:,.0f}",
         f"{r['first_over_warm_ratio']:.2f}"]
        for r in results
    ]  # fmt: skip
    print_table(["start", "warm-up", "first burst ms", "warm burst ms", "first / warm"], rows)
    write_json(args.json, {"model": model.name, "burst": args.burst, "results": results,
                           "machine": machine()})  # fmt: skip
    return 0
