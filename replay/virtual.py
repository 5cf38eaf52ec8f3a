"""`replay run --virtual`: the engine's VirtualCore (its real scheduler and KV cache) on a
simulated clock, with a step-cost model calibrated from measured steps. No model runs, so a
run takes seconds and its report is identical every time; it answers what-if questions
(another token budget, fewer KV blocks, a faster model)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.config import EngineConfig
from engine.core.virtual import VirtualCore
from engine.messages import EngineCoreRequest
from replay.cost_model import Features, StepCostModel, scheduled_features
from replay.report import percentiles
from replay.workload import ReplayRequest

__all__ = ["StepCostModel", "VirtualResult", "render", "run_virtual"]


@dataclass
class VirtualResult:
    num_requests: int
    num_steps: int
    num_preemptions: int
    seconds: float
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    max_step_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    # The range of steps the run held, as the cost model counts it (rows, prefill tokens...).
    seen: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {
            "num_requests": self.num_requests,
            "num_steps": self.num_steps,
            "num_preemptions": self.num_preemptions,
            "num_prefill_tokens": self.num_prefill_tokens,
            "num_decode_tokens": self.num_decode_tokens,
            "num_prefix_hit_tokens": self.num_prefix_hit_tokens,
            "max_step_tokens": self.max_step_tokens,
            "seconds": round(self.seconds, 9),
            **{
                name: {k: round(v, 9) for k, v in percentiles(values).items()}
                for name, values in (
                    ("ttft_s", self.ttft_s),
                    ("tpot_s", self.tpot_s),
                    ("itl_s", self.itl_s),
                    ("e2e_s", self.e2e_s),
                )
            },
        }


def run_virtual(
    work: list[ReplayRequest],
    config: EngineConfig,
    cost: StepCostModel,
    *,
    speed: float = 1.0,
    step_noise: bool = False,
) -> VirtualResult:
    """The workload through a VirtualCore built from ``config`` (its KV blocks, context length,
    token budget, max_num_seqs, prefix caching and policy), each step priced by ``cost`` and,
    with ``step_noise``, scaled by a seeded draw from the fit's measured / predicted spread."""
    core = VirtualCore(config)
    coef = cost.coef
    noise = cost.noise() if step_noise else None
    max_model_len = core.max_model_len
    arrival = {f"v{i}": r.offset_s / speed for i, r in enumerate(work)}
    token_times: dict[str, list[float]] = {rid: [] for rid in arrival}
    clock, i = 0.0, 0
    result = VirtualResult(len(work), 0, 0, 0.0)
    decoding = Features()
    while i < len(work) or core.has_requests():
        while i < len(work) and work[i].offset_s / speed <= clock:
            r = work[i]
            room = max_model_len - len(r.prompt_token_ids)
            if room < 1:
                raise ValueError(f"a prompt of {len(r.prompt_token_ids)} tokens does not fit "
                                 f"max_model_len {max_model_len}")  # fmt: skip
            # A client that hung up after k tokens: the request ends there (the core aborts it).
            wanted = r.hang_up_after or r.params.max_tokens or room
            params = r.params.clone(max_tokens=min(wanted, room))
            core.add_request(
                EngineCoreRequest(f"v{i}", r.prompt_token_ids, params, [],
                                  arrival_ns=int(clock * 1e9), priority=r.priority)
            )  # fmt: skip
            i += 1
        if not core.has_requests():
            clock = work[i].offset_s / speed
            continue
        out, outputs = core.step()
        if not out.req_ids:
            if i < len(work):  # blocked until more arrive (or something frees)
                clock = max(clock, work[i].offset_s / speed)
                continue
            raise ValueError("the virtual engine cannot schedule anything: is the KV pool "
                             "smaller than one request?")  # fmt: skip
        for rid in out.preempted_req_ids:
            decoding.forget(rid)
        features = scheduled_features(out, decoding)
        seconds = float(coef @ features)
        clock += seconds * noise() if noise is not None else seconds
        _widen(result.seen, features)
        result.num_steps += 1
        result.num_preemptions += out.num_preemptions
        result.num_prefill_tokens += out.num_prefill_tokens
        result.num_decode_tokens += out.num_decode_tokens
        result.num_prefix_hit_tokens += out.num_prefix_hit_tokens
        result.max_step_tokens = max(result.max_step_tokens, out.num_scheduled_tokens)
        for o in outputs:
            token_times[o.request_id].append(clock)
    result.seconds = clock
    every = config.stream_interval
    for rid, times in token_times.items():
        if not times:
            continue
        result.ttft_s.append(times[0] - arrival[rid])
        result.e2e_s.append(times[-1] - arrival[rid])
        # The gaps between writes: with --stream-interval N the first token, then every Nth
        # after it, and the last (engine.output_processor), as the real run's ITL is.
        writes = times if every == 1 else [*times[:-1:every], times[-1]]
        result.itl_s += [b - a for a, b in zip(writes, writes[1:])]  # noqa: RUF007
        if len(times) > 1:
            result.tpot_s.append((times[-1] - times[0]) / (len(times) - 1))
    return result


def _widen(seen: dict[str, int], f: np.ndarray) -> None:
    for key, value in zip(("rows", "prefill_tokens", "decode_tokens", "context_per_row"),
                          (f[3], f[1], f[2], f[4] / max(f[2], 1))):  # fmt: skip
        seen[key] = max(seen.get(key, 0), int(value))


def render(result: VirtualResult, engine: EngineConfig, cost: StepCostModel) -> str:
    data = result.to_json()
    lines = [
        f"virtual run: {result.num_requests} requests, {result.num_steps} steps, "
        f"{result.num_preemptions} preemptions, {result.seconds:.3f} simulated s",
        f"engine: {engine.num_kv_blocks} KV blocks of {engine.block_size}, token budget "
        f"{engine.max_num_batched_tokens}, max {engine.max_num_seqs} running",
        f"step cost: {cost.describe()}",
        cost.describe_fit(),
        *(f"EXTRAPOLATED: the run held {w}" for w in cost.extrapolation(result.seen)),
        "",
        f"{'':<8}{'p50':>10}{'p90':>10}{'p99':>10}{'max':>10}",
    ]
    for name in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        if data[name]:
            cells = "".join(f"{data[name][k] * 1000:>8.1f}ms" for k in ("p50", "p90", "p99", "max"))
            lines.append(f"{name.removesuffix('_s').upper():<8}{cells}")
    return "\n".join(lines)
