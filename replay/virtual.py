"""`replay run --virtual`: the engine's VirtualCore (its real scheduler and KV cache) on a
simulated clock, with a step-cost model calibrated from measured steps. No model runs, so a
run takes seconds and its report is identical every time; it answers what-if questions
(another token budget, fewer KV blocks, a faster model)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from engine.config import EngineConfig
from engine.core.virtual import VirtualCore
from engine.messages import EngineCoreRequest
from engine.worker.messages import SchedulerOutput
from replay.report import percentiles
from replay.workload import ReplayRequest
from tracing.store import open_db


@dataclass(frozen=True)
class StepCostModel:
    """Seconds per step = base + prefill tokens * a + decode tokens * b + requests * c."""

    base_s: float
    prefill_token_s: float
    decode_token_s: float
    request_s: float
    num_steps: int = 0  # how many measured steps it was fitted on

    def cost(self, out: SchedulerOutput) -> float:
        return (
            self.base_s
            + out.num_prefill_tokens * self.prefill_token_s
            + out.num_decode_tokens * self.decode_token_s
            + len(out.req_ids) * self.request_s
        )

    @classmethod
    def calibrate(cls, db: str | Path) -> StepCostModel:
        """Least squares over the steps of every run in ``db`` (negative terms dropped)."""
        with open_db(db, timeout=10) as con:
            rows = con.execute(
                "SELECT output_ns - schedule_start_ns, num_prefill_tokens, num_decode_tokens, "
                "len(request_ids) FROM steps WHERE num_scheduled_tokens > 0"
            ).fetchall()
        if len(rows) < 8:
            raise ValueError(f"{db} has {len(rows)} measured steps; calibration needs 8 or more")
        a = np.array(rows, dtype=float)
        y, x = a[:, 0] / 1e9, np.column_stack([np.ones(len(a)), a[:, 1:]])
        active = [0, 1, 2, 3]
        while True:  # non-negative least squares, by dropping the most negative term
            coef = np.zeros(4)
            coef[active] = np.linalg.lstsq(x[:, active], y, rcond=None)[0]
            if (coef >= 0).all():
                break
            active.remove(int(np.argmin(coef)))
        return cls(*(float(c) for c in coef), num_steps=len(rows))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> StepCostModel:
        try:
            return cls(**json.loads(Path(path).read_text()))
        except (OSError, ValueError, TypeError) as e:
            raise ValueError(f"{path} is not a step-cost model ({e})") from None


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
    work: list[ReplayRequest], config: EngineConfig, cost: StepCostModel, *, speed: float = 1.0
) -> VirtualResult:
    """The workload through a VirtualCore built from ``config`` (its KV blocks, context length,
    token budget, max_num_seqs, prefix caching and policy), each step priced by ``cost``."""
    core = VirtualCore(config)
    max_model_len = core.max_model_len
    arrival = {f"v{i}": r.offset_s / speed for i, r in enumerate(work)}
    token_times: dict[str, list[float]] = {rid: [] for rid in arrival}
    clock, i = 0.0, 0
    result = VirtualResult(len(work), 0, 0, 0.0)
    while i < len(work) or core.has_requests():
        while i < len(work) and work[i].offset_s / speed <= clock:
            r = work[i]
            room = max_model_len - len(r.prompt_token_ids)
            if room < 1:
                raise ValueError(f"a prompt of {len(r.prompt_token_ids)} tokens does not fit "
                                 f"max_model_len {max_model_len}")  # fmt: skip
            params = r.params.clone(max_tokens=min(r.params.max_tokens or room, room))
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
        clock += cost.cost(out)
        result.num_steps += 1
        result.num_preemptions += out.num_preemptions
        result.num_prefill_tokens += out.num_prefill_tokens
        result.num_decode_tokens += out.num_decode_tokens
        result.num_prefix_hit_tokens += out.num_prefix_hit_tokens
        result.max_step_tokens = max(result.max_step_tokens, out.num_scheduled_tokens)
        for o in outputs:
            token_times[o.request_id].append(clock)
    result.seconds = clock
    for rid, times in token_times.items():
        if not times:
            continue
        result.ttft_s.append(times[0] - arrival[rid])
        result.e2e_s.append(times[-1] - arrival[rid])
        result.itl_s += [b - a for a, b in zip(times, times[1:])]  # noqa: RUF007
        if len(times) > 1:
            result.tpot_s.append((times[-1] - times[0]) / (len(times) - 1))
    return result


def render(result: VirtualResult, engine: EngineConfig, cost: StepCostModel) -> str:
    data = result.to_json()
    lines = [
        f"virtual run: {result.num_requests} requests, {result.num_steps} steps, "
        f"{result.num_preemptions} preemptions, {result.seconds:.3f} simulated s",
        f"engine: {engine.num_kv_blocks} KV blocks of {engine.block_size}, token budget "
        f"{engine.max_num_batched_tokens}, max {engine.max_num_seqs} running; step cost "
        f"{cost.base_s * 1e3:.3f} ms + {cost.prefill_token_s * 1e6:.2f} us/prefill token + "
        f"{cost.decode_token_s * 1e6:.2f} us/decode token + {cost.request_s * 1e6:.2f} us/request",
        "",
        f"{'':<8}{'p50':>10}{'p90':>10}{'p99':>10}{'max':>10}",
    ]
    for name in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        if data[name]:
            cells = "".join(f"{data[name][k] * 1000:>8.1f}ms" for k in ("p50", "p90", "p99", "max"))
            lines.append(f"{name.removesuffix('_s').upper():<8}{cells}")
    return "\n".join(lines)
