"""`replay run`: recorded requests, open-loop at their recorded offsets (/ --speed), through
the real EngineCore and workers (AsyncLLM over the AsyncMPClient, as the server), recorded
into a fresh trace db."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from engine.async_llm import AsyncLLM
from engine.config import EngineConfig
from engine.data_parallel import EngineGroup, start_group
from engine.lora import LoRARequest
from engine.model_config import ModelConfig
from engine.model_files import resolve_model
from replay.workload import ReplayRequest, load_workload, lora_adapters, recorded_engines
from tracing.config import TracingConfig
from tracing.recorder import Tracer
from tracing.store import latest_run, open_db

logger = logging.getLogger(__name__)


@dataclass
class RunResult:
    run_id: str  # the fresh run, in the output db
    source_run_id: str
    num_requests: int
    num_failed: int
    seconds: float
    output_tokens: int
    arrival_errors_s: list[float] = field(default_factory=list)  # sent - scheduled

    def arrival_error_summary(self) -> str:
        errs = sorted(self.arrival_errors_s)
        p50, p99 = errs[len(errs) // 2], errs[min(len(errs) - 1, int(len(errs) * 0.99))]
        return (f"arrival error: p50 {p50 * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms, "
                f"max {errs[-1] * 1000:.1f} ms")  # fmt: skip


@functools.lru_cache(maxsize=4)
def vocabulary(model_path: str) -> np.ndarray:
    """Token ids synthetic prompts may use: the vocabulary without special or added tokens
    (once per model in a process: a regression gate or a validation replays several times)."""
    from engine.processor import load_tokenizer

    tok = load_tokenizer(model_path)
    special = set(tok.all_special_ids) | set(tok.added_tokens_decoder)
    size = ModelConfig.from_path(model_path).vocab_size
    ids = np.setdiff1d(np.arange(size), np.fromiter(special, dtype=np.int64))
    ids.setflags(write=False)  # shared by every caller of the cache
    return ids


async def run_replay(
    db: str,
    out: str,
    engine_config: EngineConfig,
    *,
    speed: float = 1.0,
    limit: int | None = None,
    run_id: str | None = None,
    window: tuple[float, float] = (0.0, float("inf")),
    progress: bool = True,
    engine: AsyncLLM | EngineGroup | None = None,
    lora_modules: list[str] | None = None,
) -> RunResult:
    """One replay into ``out``, through a fresh engine, or through ``engine`` when given (left
    running for the next replay: one start for several runs, as the regression gate does).
    ``lora_modules``: name=path of each LoRA adapter the recording's requests ran."""
    if speed <= 0:
        raise ValueError("--speed must be positive")
    path = str(resolve_model(engine_config.model))
    source_run, work = load_workload(
        db, vocab=vocabulary(path), run_id=run_id, limit=limit, window=window
    )
    loras = {name: LoRARequest(name, i, folder) for i, (name, folder)
             in enumerate(lora_adapters(work, lora_modules).items(), 1)}  # fmt: skip
    if loras and not engine_config.enable_lora:
        engine_config = dataclasses.replace(engine_config, enable_lora=True,
                                            max_loras=len(loras))  # fmt: skip
    owned = engine is None
    # A recording of several engines replays on as many, each request on its recorded one.
    engines = recorded_engines(db, source_run)
    if engine is None:
        engine = AsyncLLM(engine_config) if engines == 1 else start_group(engine_config, engines)
    pinned = len(engine.members) == engines > 1
    too_long = [r for r in work if len(r.prompt_token_ids) >= engine.max_model_len]
    if too_long:
        if owned:
            await engine.shutdown()
        raise ValueError(
            f"{len(too_long)} prompts do not fit max_model_len {engine.max_model_len} "
            "(import with --max-prompt-len or --scale-lengths)"
        )
    tracer = Tracer(
        TracingConfig(trace_db=out, trace_prompts="hashes"), engine.info,
        engine_config=engine_config, data_parallel_size=len(engine.members),
    )  # fmt: skip
    engine.observe(tracer)  # a shared engine's next replay observes with its own tracer
    bar = tqdm(total=len(work), desc="replay", disable=not progress, unit="req")
    errors: list[float] = []
    failed = 0
    tokens = 0

    async def one(req: ReplayRequest, start: float) -> None:
        nonlocal failed, tokens
        due = start + req.offset_s / speed
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        errors.append(time.monotonic() - due)
        max_room = engine.max_model_len - len(req.prompt_token_ids)
        params = req.params.clone(max_tokens=min(req.params.max_tokens or max_room, max_room))
        prompt: Any = {"prompt_token_ids": req.prompt_token_ids}
        lora = loras.get(req.lora_name) if req.lora_name else None
        prepared = engine.prepare(prompt, params, lora)
        if isinstance(engine, EngineGroup) and pinned:  # on its recorded engine
            stream = engine.generate_prepared(
                prepared, priority=req.priority, data_parallel_rank=req.engine or 0
            )
        else:
            stream = engine.generate_prepared(prepared, priority=req.priority)
        got = 0
        try:
            async for o in stream:
                got += sum(len(c.token_ids) for c in o.outputs)
                if req.hang_up_after and got >= req.hang_up_after:
                    break  # the recorded client left here: closing the stream aborts it
            tokens += got
            await stream.aclose()
        except Exception as e:
            failed += 1
            logger.warning("replayed request %s failed: %s", req.request_id, e)
        bar.update()

    try:
        start = time.monotonic() + 0.2
        await asyncio.gather(*(one(r, start) for r in work))  # open loop: nobody waits
        seconds = time.monotonic() - start
    finally:
        bar.close()
        if owned:
            await engine.shutdown()
        await asyncio.to_thread(tracer.shutdown)
    return RunResult(tracer.run_id, source_run, len(work), failed, seconds, tokens, errors)


def summarize(result: RunResult) -> str:
    mean_err = statistics.mean(result.arrival_errors_s) * 1000
    return (
        f"replayed {result.num_requests} requests of run {result.source_run_id} in "
        f"{result.seconds:.1f} s ({result.output_tokens:,} output tokens, "
        f"{result.num_failed} failed); {result.arrival_error_summary()} (mean {mean_err:.1f} ms)"
    )


async def run_replay_http(
    db: str,
    url: str,
    *,
    model: str | None = None,
    api_key: str | None = None,
    speed: float = 1.0,
    limit: int | None = None,
    run_id: str | None = None,
    window: tuple[float, float] = (0.0, float("inf")),
    progress: bool = True,
    pin_engines: bool = False,
    lora_modules: list[str] | None = None,
) -> tuple[RunResult, dict[str, list[float]]]:
    """The same open-loop replay against a running server (`/v1/completions`, the prompts as
    token ids), each client as recorded: streamed or not, hanging up after the tokens it read,
    reading slowly through a small receive buffer. The server records the trace; the client
    times TTFT and e2e. ``pin_engines``: each request to its recorded engine (vLLM's
    X-data-parallel-rank header; the server has the recording's engines). A request that ran a
    LoRA adapter names it as its model (``lora_modules`` given: each must be among them)."""
    import socket

    import httpx

    if speed <= 0:
        raise ValueError("--speed must be positive")
    path = str(resolve_model(model))
    source_run, work = load_workload(
        db, vocab=vocabulary(path), run_id=run_id, limit=limit, window=window
    )
    if lora_modules is not None:
        lora_adapters(work, lora_modules)  # each adapter the requests ran has its folder
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    bar = tqdm(total=len(work), desc="replay", disable=not progress, unit="req")
    errors: list[float] = []
    client_s: dict[str, list[float]] = {"ttft_s": [], "e2e_s": []}
    failed = tokens = 0

    async def one(clients: dict[bool, httpx.AsyncClient], req: ReplayRequest, start: float) -> None:
        nonlocal failed, tokens
        client = clients[req.read_interval_s > 0]
        due = start + req.offset_s / speed
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        sent = time.monotonic()
        errors.append(sent - due)
        p = req.params
        body: dict[str, Any] = {
            "prompt": req.prompt_token_ids, "max_tokens": p.max_tokens, "ignore_eos": True,
            "temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k, "min_p": p.min_p,
            "seed": p.seed, "n": p.n, "logprobs": p.logprobs,
            "presence_penalty": p.presence_penalty, "frequency_penalty": p.frequency_penalty,
            "repetition_penalty": p.repetition_penalty, "priority": req.priority,
            "stream": req.stream,
        }  # fmt: skip
        if req.lora_name is not None:
            body["model"] = req.lora_name
        if (so := p.structured_outputs) is not None:  # its grammar, as vLLM's field sends it
            fields = {"json": so.json, "regex": so.regex, "choice": so.choice,
                      "grammar": so.grammar, "json_object": so.json_object or None}  # fmt: skip
            body["structured_outputs"] = {k: v for k, v in fields.items() if v is not None}
        if req.stream:
            body["stream_options"] = {"include_usage": True}
        first, got = 0.0, 0
        pinned = {"X-data-parallel-rank": str(req.engine or 0)} if pin_engines else None
        try:
            async with client.stream("POST", "/v1/completions", json=body, headers=pinned) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                async for line in r.aiter_lines():
                    if not req.stream:
                        line = "data: " + line  # one JSON body: its usage is all there is
                    if line.startswith('data: {"id"') and '"text":"' in line:
                        first, got = first or time.monotonic(), got + 1
                        if req.hang_up_after and got >= req.hang_up_after:
                            tokens += got
                            break  # the recorded client disconnected here
                        if req.read_interval_s:
                            await asyncio.sleep(req.read_interval_s)
                    if '"usage":{' in line:
                        tokens += int(line.split('"completion_tokens":')[1].split(",")[0])
            client_s["ttft_s"].append((first or time.monotonic()) - sent)
            client_s["e2e_s"].append(time.monotonic() - sent)
        except (httpx.HTTPError, RuntimeError) as e:
            failed += 1
            logger.warning("replayed request %s failed: %s", req.request_id, e)
        bar.update()

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    # Slow readers read through a 4 KiB receive buffer, so the server's writes wait on them.
    small = httpx.AsyncHTTPTransport(
        limits=limits, socket_options=[(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)]
    )
    options: dict[str, Any] = dict(base_url=url.rstrip("/"), headers=headers, timeout=None)
    async with (
        httpx.AsyncClient(limits=limits, **options) as fast,
        httpx.AsyncClient(transport=small, **options) as slow,
    ):
        start = time.monotonic() + 0.2
        await asyncio.gather(*(one({False: fast, True: slow}, r, start) for r in work))
        seconds = time.monotonic() - start
    bar.close()
    return RunResult("(the server's)", source_run, len(work), failed, seconds, tokens, errors), (
        client_s
    )


def run_replay_served(
    db: str, out: str, config: EngineConfig, **options: Any
) -> tuple[RunResult, dict[str, list[float]]]:
    """The replay through a real `lumen serve` that this starts with ``config`` (as the
    recording's server ran) and stops when done; the server records it into ``out``.
    ``options``: run_replay_http's (speed, limit, run_id, window, progress)."""
    from engine.arg_utils import option_flags
    from replay.server import LumenServer

    model = str(resolve_model(config.model))
    flags = option_flags(config, skip=("model", "core_process"))
    if modules := options.get("lora_modules"):  # the recording's adapters, where it ran any
        flags += ["--lora-modules", *modules] + ([] if config.enable_lora else ["--enable-lora"])
    # A recording of several engines: as many, each request sent to its recorded one.
    engines = recorded_engines(db, options.get("run_id"))
    if engines > 1:
        flags += ["--data-parallel-size", str(engines)]
        options = {**options, "pin_engines": True}
    with tempfile.TemporaryDirectory(prefix="lumen-replay-") as tmp:
        log = Path(tmp) / "serve.log"
        with LumenServer(model, *flags, log_path=log, trace_db=Path(out)) as server:
            result, client_s = asyncio.run(
                run_replay_http(db, server.base_url, model=model, **options)
            )
    with open_db(out, timeout=10) as con:
        result.run_id = latest_run(con)
    return result, client_s


def replay_for_real(
    db: str, out: str, config: EngineConfig, *, served: bool, **options: Any
) -> RunResult:
    """One real replay: through a `lumen serve` started for it (``served``) or in-process."""
    if served:
        return run_replay_served(db, out, config, **options)[0]
    return asyncio.run(run_replay(db, out, config, **options))
