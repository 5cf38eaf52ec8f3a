"""`replay report`: latency percentiles of a recorded run, and where the slow tail's time went,
boundary by boundary, against the median request."""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from tracing.store import latest_run, open_db

# What a request's time to first token is made of (all in ns).
PARTS = {
    "enqueue": "frontend.enqueue (parse, template, tokenize)",
    "receive": "core.receive (IPC and the core's input queue)",
    "queue": "queueing in core.schedule before the first step",
    "prefill": "worker.execute of its prefill steps",
    "chunking": "waiting between its prefill chunks (other requests' steps)",
    "output": "core.output (outputs leaving the core)",
    "emit": "frontend.emit of the first token",
}


@dataclass
class RequestTimes:
    request_id: str
    ttft_ns: int
    e2e_ns: int
    output_tokens: int
    parts: dict[str, int] = field(default_factory=dict)
    arrival_ns: int = 0
    emit_ends_ns: list[int] = field(default_factory=list)
    prefill_steps: int = 0
    preemptions: int = 0
    itls_ns: list[int] = field(default_factory=list)

    @property
    def tpot_ns(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e_ns - self.ttft_ns) / (self.output_tokens - 1)


def load_times(db: str, run_id: str | None = None) -> tuple[str, list[RequestTimes]]:
    with open_db(db, timeout=10) as con:
        run_id = run_id or latest_run(con, served_only=True)
        reqs = con.execute(
            "SELECT request_id, arrival_ns, ttft_ns, e2e_ns, output_tokens, num_preemptions "
            "FROM requests WHERE run_id = ? AND status = 'ok' AND ttft_ns IS NOT NULL",
            [run_id],
        ).fetchall()
        spans = con.execute(
            "SELECT request_id, name, start_ns, end_ns, step_id FROM spans WHERE run_id = ? "
            "AND name <> 'llm_request' ORDER BY request_id, start_ns",
            [run_id],
        ).fetchall()
    by_request: dict[str, list[tuple]] = defaultdict(list)
    for rid, *rest in spans:
        by_request[rid].append(tuple(rest))
    out = []
    for rid, arrival, ttft, e2e, n_out, preempted in reqs:
        t = RequestTimes(rid, ttft, e2e, n_out, preemptions=preempted, arrival_ns=arrival)
        _decompose(t, arrival + ttft, by_request[rid])
        out.append(t)
    return run_id, out


def _decompose(t: RequestTimes, first_token_ns: int, spans: list[tuple]) -> None:
    parts = dict.fromkeys(PARTS, 0)
    schedules = [s for s in spans if s[0] == "core.schedule"]
    emits = sorted(s[2] for s in spans if s[0] == "frontend.emit")
    for name, start, end, _step in spans:
        if name == "frontend.enqueue":
            parts["enqueue"] += end - start
        elif name == "core.receive":
            parts["receive"] = max(parts["receive"], end - start)
    before = [s for s in schedules if s[2] <= first_token_ns]
    if before:
        parts["queue"] = before[0][2] - before[0][1]
        parts["chunking"] = sum(s[2] - s[1] for s in before[1:])
    prefill_steps = {s[3] for s in before}
    t.prefill_steps = len(prefill_steps)
    for name, start, end, step in spans:
        if step in prefill_steps and name == "worker.execute":
            parts["prefill"] += end - start
        elif step in prefill_steps and name == "core.output":
            parts["output"] += end - start
        elif name == "frontend.emit" and end == emits[0]:
            parts["emit"] = end - start
    # The gaps between a prefill step's output and the next one's schedule also wait.
    parts["chunking"] += max(0, t.ttft_ns - sum(parts.values()))
    t.parts = parts
    t.itls_ns = [int(b - a) for a, b in itertools.pairwise(emits)]
    t.emit_ends_ns = emits


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    a = np.asarray(values, dtype=float)
    return {
        "p50": float(np.percentile(a, 50)),
        "p90": float(np.percentile(a, 90)),
        "p99": float(np.percentile(a, 99)),
        "max": float(a.max()),
    }


def summary(times: list[RequestTimes]) -> dict[str, dict[str, float]]:
    return {
        "ttft_s": percentiles([t.ttft_ns / 1e9 for t in times]),
        "tpot_s": percentiles([t.tpot_ns / 1e9 for t in times if t.tpot_ns is not None]),
        "itl_s": percentiles([i / 1e9 for t in times for i in t.itls_ns]),
        "e2e_s": percentiles([t.e2e_ns / 1e9 for t in times]),
    }


def attribute_ttft(times: list[RequestTimes]) -> tuple[dict[str, float], str]:
    """Per part: the tail's mean extra time over the median request, as a share; a verdict."""
    ttfts = np.array([t.ttft_ns for t in times], dtype=float)
    p90, p50, p99 = np.percentile(ttfts, [90, 50, 99])
    tail = [t for t in times if t.ttft_ns >= p90]
    median = min(times, key=lambda t: abs(t.ttft_ns - p50))
    extra = {k: np.mean([t.parts[k] for t in tail]) - median.parts[k] for k in PARTS}
    gap = sum(max(v, 0.0) for v in extra.values()) or 1.0
    shares = {k: max(v, 0.0) / gap for k, v in extra.items()}
    top = max(shares, key=shares.get)  # type: ignore[arg-type]
    steps = np.mean([t.prefill_steps for t in tail])
    preempted = sum(t.preemptions for t in tail)
    verdict = (
        f"p99 TTFT {p99 / 1e9:.3g} s against a median of {p50 / 1e9:.3g} s: "
        f"{shares[top]:.0%} of the tail's extra time is {PARTS[top]}"
    )
    verdict += {
        "queue": "; requests waited for a slot in the running batch (load above capacity, "
        "or max_num_seqs / KV blocks too small)",
        "chunking": f"; their prompts took {steps:.1f} prefill steps each, sharing steps with "
        "other requests; a larger max_num_batched_tokens would prefill them in fewer steps",
        "prefill": "; long prompts: prefill compute dominates (prefix caching helps where "
        "prompts share a prefix)",
        "receive": "; the core takes new requests between steps, so arrivals wait for the "
        "step in flight: long steps (large prefill chunks; see max_num_batched_tokens) or CPU "
        "contention between processes lengthen that wait",
        "output": "; outputs waited to leave the core (a slow frontend reader?)",
        "emit": "; the frontend was slow to deliver (CPU contention in the server process?)",
        "enqueue": "; tokenization and templating in the frontend took the time",
    }[top]
    if preempted:
        verdict += f"; {preempted} preemptions hit the tail (a larger KV cache avoids them)"
    return shares, verdict + "."


@dataclass
class Step:
    start_ns: int
    end_ns: int
    execute_ns: int
    prefill: int
    decode: int
    running: int
    waiting: int
    preemptions: int


def load_steps(db: str, run_id: str) -> list[Step]:
    with open_db(db, timeout=10) as con:
        rows = con.execute(
            "SELECT schedule_start_ns, output_ns, execute_end_ns - execute_start_ns, "
            "num_prefill_tokens, num_decode_tokens, num_running, num_waiting, num_preemptions "
            "FROM steps WHERE run_id = ? ORDER BY schedule_start_ns",
            [run_id],
        ).fetchall()
    return [Step(*r) for r in rows]


def attribute_steps(times: list[RequestTimes], steps: list[Step]) -> list[str]:
    """Which steps the tail met: what ran while it waited, and what made tokens late."""
    if not steps:
        return []
    lines = []
    starts = np.array([s.start_ns for s in steps])
    ttfts = np.array([t.ttft_ns for t in times])
    p50, p90 = np.percentile(ttfts, [50, 90])

    def met(group: list[RequestTimes]) -> list[Step]:
        seen: list[Step] = []
        for t in group:
            lo, hi = np.searchsorted(starts, [t.arrival_ns, t.arrival_ns + t.ttft_ns])
            seen += steps[lo:hi]
        return seen

    tail = met([t for t in times if t.ttft_ns >= p90])
    median = met([min(times, key=lambda t: abs(t.ttft_ns - p50))])
    if tail:
        prefill, running = np.mean([s.prefill for s in tail]), np.mean([s.running for s in tail])
        m_prefill = np.mean([s.prefill for s in median] or [0])
        m_running = np.mean([s.running for s in median] or [0])
        lines.append(
            f"While the TTFT tail waited, each step carried {prefill:.0f} prefill tokens for "
            f"{running:.1f} running requests on average (the median request: {m_prefill:.0f} "
            f"and {m_running:.1f}), {max(s.waiting for s in tail)} requests waiting at most, "
            f"{sum(s.preemptions for s in tail)} preemptions."
        )
    # Token gaps: which steps produced the slowest ones.
    gaps = [(b - a, b) for t in times for a, b in itertools.pairwise(t.emit_ends_ns)]
    if len(gaps) >= 10:
        gaps.sort()
        cut = gaps[int(len(gaps) * 0.99) - 1][0]
        slow = [end for gap, end in gaps if gap >= cut]
        ends = np.array([s.end_ns for s in steps])
        culprits = [steps[min(int(np.searchsorted(ends, e)), len(steps) - 1)] for e in slow]
        with_prefill = sum(s.prefill > 0 for s in culprits) / len(culprits)
        mixed = [s.execute_ns for s in steps if s.prefill > 0]
        decode_only = [s.execute_ns for s in steps if s.prefill == 0 and s.decode > 0]
        line = f"p99 ITL {cut / 1e6:.1f} ms: {with_prefill:.0%} of the slowest 1% token gaps end "
        line += "at a step that carried prefill"
        if mixed and decode_only:
            line += (f"; such steps executed in {np.mean(mixed) / 1e6:.1f} ms against "
                     f"{np.mean(decode_only) / 1e6:.1f} ms for decode-only steps")  # fmt: skip
        big = [s for s in steps if s.running >= np.percentile([x.running for x in steps], 90)]
        if big and decode_only:
            line += (
                f"; the fullest 10% of steps ({np.mean([s.running for s in big]):.0f} "
                f"requests) took {np.mean([s.execute_ns for s in big]) / 1e6:.1f} ms"
            )
        lines.append(line + ".")
    return lines


def render_text(db: str, run_id: str | None = None) -> str:
    run_id, times = load_times(db, run_id)
    if not times:
        raise ValueError(f"run {run_id} has no finished request")
    lines = [f"run {run_id}: {len(times)} requests", ""]
    lines.append(f"{'':<8}{'p50':>10}{'p90':>10}{'p99':>10}{'max':>10}")
    for name, pct in summary(times).items():
        if pct:
            label = name.removesuffix("_s").upper()
            cells = "".join(f"{pct[k] * 1000:>8.1f}ms" for k in ("p50", "p90", "p99", "max"))
            lines.append(f"{label:<8}{cells}")
    shares, verdict = attribute_ttft(times)
    lines += ["", "TTFT tail (>= p90) against the median request, by boundary:"]
    for k, share in sorted(shares.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {share:>5.0%}  {PARTS[k]}")
    lines += ["", verdict, *attribute_steps(times, load_steps(db, run_id))]
    return "\n".join(lines)
