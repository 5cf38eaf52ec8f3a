"""lumen bench tracing-overhead: the same HTTP load with tracing off and on, interleaved.

Two servers on the same model run side by side: one with --no-trace-db and no
OTLP, one recording a trace db and exporting every boundary span over OTLP to
a local receiver. Rounds alternate off/on; each pair gives a throughput ratio,
and the median ratio is the figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from bench.server import LumenServer
from tracing.receiver import OtlpReceiver


def add_parser(verbs: argparse._SubParsersAction) -> None:
    p = verbs.add_parser("tracing-overhead", help="HTTP throughput with tracing off vs on")
    p.add_argument("--model", default=None, help="model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--concurrency", type=int, default=8, help="streaming clients at once")
    p.add_argument("--requests", type=int, default=16, help="requests per round")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--pairs", type=int, default=3, help="interleaved off/on pairs")
    p.add_argument("--otlp-detail", default="boundary", help="what the traced server exports")
    p.add_argument("--json", default=None, metavar="PATH", help="write the figures as JSON")
    p.set_defaults(func=run)


async def _round(server: LumenServer, args: argparse.Namespace) -> tuple[float, int]:
    """Seconds for ``args.requests`` streamed chats at ``args.concurrency``; tokens received."""
    gate = asyncio.Semaphore(args.concurrency)
    tokens = 0

    async def one(client: httpx.AsyncClient, i: int) -> None:
        nonlocal tokens
        body = {
            "messages": [{"role": "user", "content": f"Request {i}: write about rivers."}],
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with gate, client.stream("POST", "/v1/chat/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith('data: {"id"') and '"usage":{' in line:
                    tokens += json.loads(line[6:])["usage"]["completion_tokens"]

    async with httpx.AsyncClient(base_url=server.base_url, timeout=600) as client:
        start = time.perf_counter()
        await asyncio.gather(*(one(client, i) for i in range(args.requests)))
        return time.perf_counter() - start, tokens


def run(args: argparse.Namespace) -> int:
    if min(args.concurrency, args.requests, args.max_tokens, args.pairs) < 1:
        raise ValueError("--concurrency, --requests, --max-tokens and --pairs must be >= 1")
    model = args.model or "SmolLM2-135M-Instruct"
    with tempfile.TemporaryDirectory() as tmp, OtlpReceiver() as receiver:
        d = Path(tmp)
        off = LumenServer(model, "--no-trace-db", log_path=d / "off.log")
        on = LumenServer(
            model, "--otlp-traces-endpoint", receiver.endpoint, "--otlp-detail",
            args.otlp_detail, log_path=d / "on.log", trace_db=d / "trace.db",
        )  # fmt: skip
        try:
            for server in (off, on):  # warm-up
                asyncio.run(_round(server, argparse.Namespace(**{**vars(args), "requests": 2})))
            rates: dict[str, list[float]] = {"off": [], "on": []}
            for pair in range(args.pairs):
                order = (("off", off), ("on", on)) if pair % 2 == 0 else (("on", on), ("off", off))
                for name, server in order:
                    seconds, tokens = asyncio.run(_round(server, args))
                    rates[name].append(tokens / seconds)
                    print(f"pair {pair + 1} {name:>3}: {tokens} tokens in {seconds:.1f} s "
                          f"= {tokens / seconds:.1f} tok/s")  # fmt: skip
            time.sleep(1.5)  # let the traced server flush and export
            num_spans = len(receiver.spans)
            dropped = on.metrics()
        finally:
            off.stop()
            on.stop()
    ratios = [b / a for a, b in zip(rates["off"], rates["on"])]
    median = statistics.median(ratios)
    loss = 1 - median
    print(
        f"\ntracing on / off throughput: median {median:.3f} over {args.pairs} pairs "
        f"(range {min(ratios):.3f}-{max(ratios):.3f}); loss {loss:.1%} (target <= 3%)"
    )
    print(f"OTLP receiver got {num_spans} spans; dropped: "
          f"{sum(v for k, v in dropped.items() if 'dropped_total' in k):.0f}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "tok_s_off": rates["off"],
                    "tok_s_on": rates["on"],
                    "pair_ratios": ratios,
                    "on_off_ratio_median": median,
                    "loss": loss,
                    "otlp_spans": num_spans,
                    "concurrency": args.concurrency,
                    "requests_per_round": args.requests,
                    "max_tokens": args.max_tokens,
                },
                indent=2,
            )
        )
    return 0
