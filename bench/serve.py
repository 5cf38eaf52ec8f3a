"""lumen bench serve: streaming chat load against `lumen serve` and `transformers serve`.

Both servers run the same model on this machine, started by the benchmark,
and get the same requests: streamed chat completions of exactly
--max-tokens tokens (EOS ignored), greedy. Phases alternate between the two
servers: each concurrency level (a closed loop of N streams), then each
Poisson rate (an open loop with seeded arrivals). Per phase: output tokens/s,
TTFT, TPOT and ITL percentiles, and goodput (requests per second that met
both SLOs). Lumen's own batch-1 decode step is timed in this process first,
the yardstick of its single-stream ITL.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.common import check_json_path, machine, parse_ints, percentiles, print_table, write_json
from bench.server import (
    LumenServer,
    TransformersServer,
    add_kv_tokens_option,
    kv_flags,
    streamed_chat,
)

TOPICS = ("rivers", "mountains", "the sea", "forests", "cities", "deserts", "rain", "bridges")


@dataclass
class Sample:
    """One request as the client saw it (seconds from its send)."""

    ttft: float = float("nan")
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None

    @property
    def tpot(self) -> float:
        if self.output_tokens < 2 or not self.chunk_times:
            return float("nan")
        return (self.chunk_times[-1] - self.ttft) / (self.output_tokens - 1)


@dataclass
class Phase:
    system: str
    kind: str  # "concurrency" or "poisson"
    level: float  # streams, or requests per second
    seconds: float
    samples: list[Sample]
    window_ns: tuple[int, int] = (0, 0)
    engine: dict[str, float] = field(default_factory=dict)  # Lumen's own steps, from its trace

    def summary(self, slo_ttft: float, slo_tpot: float) -> dict[str, Any]:
        ok = [s for s in self.samples if s.error is None]
        tokens = sum(s.output_tokens for s in ok)
        itls = [b - a for s in ok for a, b in zip(s.chunk_times, s.chunk_times[1:])]
        good = [s for s in ok if s.ttft <= slo_ttft and s.tpot <= slo_tpot]
        return {
            "system": self.system,
            "kind": self.kind,
            "level": self.level,
            "requests": len(self.samples),
            "errors": len(self.samples) - len(ok),
            "output_tokens": tokens,
            "seconds": self.seconds,
            "output_tok_s": tokens / self.seconds,
            "ttft_s": percentiles([s.ttft for s in ok]),
            "tpot_s": percentiles([s.tpot for s in ok if s.output_tokens > 1]),
            "itl_s": percentiles(itls),
            "goodput_req_s": len(good) / self.seconds,
            "slo_met": len(good),
            **self.engine,
        }


def add_parser(verbs: argparse._SubParsersAction) -> None:
    p = verbs.add_parser(
        "serve", help="streaming load against lumen serve and transformers serve, side by side"
    )
    p.add_argument("--model", default=None, help="model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--concurrency", default="1,16", help="closed-loop stream counts")
    p.add_argument(
        "--requests-per-stream", type=int, default=2, help="requests each stream sends in turn"
    )
    p.add_argument("--rates", default="0.5,1", help="Poisson arrival rates, requests/s ('' = none)")
    p.add_argument("--poisson-requests", type=int, default=16, help="requests per Poisson phase")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--slo-ttft", type=float, default=2.0, help="goodput SLO: TTFT seconds")
    p.add_argument("--slo-tpot", type=float, default=0.2, help="goodput SLO: TPOT seconds")
    p.add_argument("--seed", type=int, default=0, help="seed of the Poisson arrivals")
    p.add_argument("--skip-hf", action="store_true", help="run against lumen serve only")
    add_kv_tokens_option(p)
    p.add_argument("--json", default=None, metavar="PATH", help="write the figures as JSON")
    p.set_defaults(func=run)


def _body(server: LumenServer, i: int, max_tokens: int) -> dict[str, Any]:
    topic = TOPICS[i % len(TOPICS)]
    return streamed_chat(server, f"Write a long story about {topic}. ({i})", max_tokens)


async def _one(client: httpx.AsyncClient, body: dict[str, Any]) -> Sample:
    sample = Sample()
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                sample.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return sample
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    sample.output_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices") or ():
                    if choice.get("delta", {}).get("content"):
                        now = time.perf_counter() - t0
                        if not sample.chunk_times:
                            sample.ttft = now
                        sample.chunk_times.append(now)
    except httpx.HTTPError as e:
        sample.error = f"{type(e).__name__}: {e}"
    if sample.error is None and sample.output_tokens != body["max_tokens"]:
        sample.error = f"got {sample.output_tokens} tokens, asked for {body['max_tokens']}"
    return sample


async def _closed_loop(server: LumenServer, streams: int, per_stream: int, max_tokens: int):
    async def stream(client: httpx.AsyncClient, s: int) -> list[Sample]:
        return [
            await _one(client, _body(server, s * per_stream + k, max_tokens))
            for k in range(per_stream)
        ]

    limits = httpx.Limits(max_connections=streams + 4)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        per = await asyncio.gather(*(stream(client, s) for s in range(streams)))
        return time.perf_counter() - t0, [x for xs in per for x in xs]


async def _open_loop(server: LumenServer, offsets: list[float], max_tokens: int):
    async def at(client: httpx.AsyncClient, i: int, t0: float) -> Sample:
        await asyncio.sleep(max(0.0, t0 + offsets[i] - time.perf_counter()))
        return await _one(client, _body(server, i, max_tokens))

    limits = httpx.Limits(max_connections=len(offsets) + 4)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        samples = await asyncio.gather(*(at(client, i, t0) for i in range(len(offsets))))
        return time.perf_counter() - t0, list(samples)


def _batch1_step(model: str | None, context: int) -> float:
    """Lumen's own decode step at batch 1 (its real worker path), in this process."""
    from bench.roofline import StepTimer
    from engine.config import EngineConfig
    from engine.model_files import resolve_model

    config = EngineConfig(model=model)
    device = config.resolve_device()
    timer = StepTimer(str(resolve_model(model)), device, config.resolve_dtype(device))
    seconds = timer.decode_step(1, context)
    timer.release()
    del timer
    gc.collect()
    return seconds


def run(args: argparse.Namespace) -> int:
    from engine.model_files import resolve_model

    levels = parse_ints(args.concurrency, "--concurrency")
    try:
        rates = [float(x) for x in args.rates.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--rates takes comma-separated numbers, not {args.rates!r}") from None
    if any(r <= 0 for r in rates):
        raise ValueError(f"--rates must be positive, got {args.rates!r}")
    if min(args.requests_per_stream, args.poisson_requests, args.max_tokens) < 1:
        raise ValueError("--requests-per-stream, --poisson-requests, --max-tokens must be >= 1")
    check_json_path(args.json)
    path = resolve_model(args.model)
    context = 48 + args.max_tokens // 2
    step_before = _batch1_step(args.model, context)
    print(f"Lumen batch-1 decode step (in process): {step_before * 1e3:.1f} ms")
    rng = np.random.default_rng(args.seed)
    arrivals = {r: np.cumsum(rng.exponential(1 / r, args.poisson_requests)).tolist() for r in rates}
    phases: list[Phase] = []
    kv = kv_flags(args.kv_tokens)  # the same KV capacity for both servers
    with tempfile.TemporaryDirectory() as tmp:
        servers: list[tuple[str, LumenServer]] = [
            ("lumen", LumenServer(path, *kv, log_path=Path(tmp) / "lumen.log"))
        ]
        try:
            if not args.skip_hf:
                hf = TransformersServer(
                    path, log_path=Path(tmp) / "hf.log", kv_tokens=args.kv_tokens
                )
                servers.append(("hf", hf))
            for _, server in servers:  # warm-up: the first requests pay one-off costs
                asyncio.run(_closed_loop(server, 2, 1, 8))
            plan = [("concurrency", c) for c in levels] + [("poisson", r) for r in rates]
            for kind, level in plan:
                for name, server in servers:
                    t0 = time.time_ns()
                    if kind == "concurrency":
                        per_stream = args.requests_per_stream
                        seconds, samples = asyncio.run(
                            _closed_loop(server, int(level), per_stream, args.max_tokens)
                        )
                    else:
                        seconds, samples = asyncio.run(
                            _open_loop(server, arrivals[level], args.max_tokens)
                        )
                    phase = Phase(name, kind, level, seconds, samples, (t0, time.time_ns()))
                    phases.append(phase)
                    s = phase.summary(args.slo_ttft, args.slo_tpot)
                    print(f"  {name} {kind} {level:g}: {s['output_tok_s']:.1f} tok/s, "
                          f"TTFT p50 {s['ttft_s']['p50'] * 1e3:.0f} ms, "
                          f"ITL p50 {s['itl_s']['p50'] * 1e3:.0f} ms, errors {s['errors']}",
                          flush=True)  # fmt: skip
                    errors = [x.error for x in samples if x.error]
                    if errors:
                        print(f"    first error: {errors[0]}")
        finally:
            for _, server in servers:
                server.stop()
        # Again after the load: on a shared machine the forward itself drifts.
        step_after = _batch1_step(args.model, context)
        print(f"Lumen batch-1 decode step (in process, after): {step_after * 1e3:.1f} ms")
        for phase in phases:
            if phase.system == "lumen":
                phase.engine = _engine_steps(servers[0][1].trace_db, phase.window_ns)
    summaries = [p.summary(args.slo_ttft, args.slo_tpot) for p in phases]
    _print(summaries, args)
    ratios = _ratios(summaries, min(step_before, step_after))
    for key, value in ratios.items():
        print(f"{key}: {value:.3f}")
    write_json(
        args.json,
        {
            "model": path.name,
            "max_tokens": args.max_tokens,
            "slo": {"ttft_s": args.slo_ttft, "tpot_s": args.slo_tpot},
            "lumen_batch1_decode_step_s": {"before": step_before, "after": step_after},
            "phases": summaries,
            **ratios,
            "machine": machine(),
        },
    )
    return 0


def _engine_steps(trace_db: Path, window: tuple[int, int]) -> dict[str, float]:
    """What Lumen's own trace says of a phase's steps: model (execute) time per step and
    as a share of the time the engine was busy."""
    from tracing.store import open_db

    with open_db(trace_db) as con:
        rows = con.execute(
            "SELECT schedule_start_ns, execute_start_ns, execute_end_ns, output_ns, "
            "num_prefill_tokens, num_decode_tokens FROM steps "
            "WHERE schedule_start_ns >= ? AND output_ns <= ? ORDER BY step_id",
            window,
        ).fetchall()
    if not rows:
        return {}
    execute = [(r[2] - r[1]) / 1e9 for r in rows]
    decode_only = [(r[2] - r[1]) / 1e9 for r in rows if r[4] == 0]
    busy = sum(r[3] - r[0] for r in rows) / 1e9
    return {
        "engine_steps": len(rows),
        "engine_execute_s": percentiles(execute),
        "engine_decode_execute_s": percentiles(decode_only),
        "engine_model_time_share": sum(execute) / busy,
    }


def _print(summaries: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(
        f"\n{args.max_tokens} output tokens per request, greedy, EOS ignored; "
        f"goodput SLO: TTFT <= {args.slo_ttft} s and TPOT <= {args.slo_tpot} s"
    )

    def ms(d: dict[str, float], p: str) -> str:
        return f"{d[p] * 1e3:.0f}"

    def engine(s: dict[str, Any]) -> tuple[str, str]:
        if "engine_decode_execute_s" not in s:
            return "", ""
        return ms(s["engine_decode_execute_s"], "p50"), f"{s['engine_model_time_share']:.1%}"

    print_table(
        ("system", "load", "reqs", "tok/s", "TTFT p50/p99 ms", "TPOT p50 ms",
         "ITL p50/p99 ms", "goodput req/s", "decode step p50 ms", "model time"),
        [
            (s["system"],
             f"{s['level']:g} streams" if s["kind"] == "concurrency" else f"{s['level']:g} req/s",
             f"{s['requests'] - s['errors']}/{s['requests']}", f"{s['output_tok_s']:.1f}",
             f"{ms(s['ttft_s'], 'p50')}/{ms(s['ttft_s'], 'p99')}", ms(s["tpot_s"], "p50"),
             f"{ms(s['itl_s'], 'p50')}/{ms(s['itl_s'], 'p99')}", f"{s['goodput_req_s']:.2f}",
             *engine(s))
            for s in summaries
        ],
    )  # fmt: skip
    print("(decode step and model time: Lumen's own trace; model time = execute / busy wall)")


def _ratios(summaries: list[dict[str, Any]], step_b1: float) -> dict[str, float]:
    """Lumen over HF per phase (throughput, goodput: higher is better; TTFT, ITL: lower)."""
    by = {(s["system"], s["kind"], s["level"]): s for s in summaries}
    out: dict[str, float] = {}
    for (system, kind, level), lumen in by.items():
        if system != "lumen":
            continue
        tag = f"{'c' if kind == 'concurrency' else 'rate'}{level:g}"
        if kind == "concurrency" and level == 1:
            out["c1_itl_p50_over_batch1_step_ratio"] = lumen["itl_s"]["p50"] / step_b1
            if "engine_decode_execute_s" in lumen:
                out["c1_itl_p50_over_engine_execute_ratio"] = (
                    lumen["itl_s"]["p50"] / lumen["engine_decode_execute_s"]["p50"]
                )
        if "engine_model_time_share" in lumen:
            out[f"{tag}_model_time_share_ratio"] = lumen["engine_model_time_share"]
        hf = by.get(("hf", kind, level))
        if hf is None:
            continue
        out[f"{tag}_throughput_ratio"] = lumen["output_tok_s"] / hf["output_tok_s"]
        out[f"{tag}_ttft_p50_ratio"] = lumen["ttft_s"]["p50"] / hf["ttft_s"]["p50"]
        out[f"{tag}_itl_p50_ratio"] = lumen["itl_s"]["p50"] / hf["itl_s"]["p50"]
        if hf["goodput_req_s"] > 0:
            out[f"{tag}_goodput_ratio"] = lumen["goodput_req_s"] / hf["goodput_req_s"]
    return out
