"""Labels from the client, predictions from the diagnosis, and the confusion matrix between them.

Labels (never from the diagnosis). A request's effect is what the primitive did to it, as the
client measured it against the same request in the control: its TTFT and end-to-end time
(each passes at 20 ms and 10% of the control's), and its longest gap between chunks (passes at
20 ms, 4x its own median gap, and 20 ms over the control's longest). Each bar is at least twice
the controls' own spread, and an end-to-end time's at least twice the controls' drift (the most
any request's end-to-end time moved between them, as a share: e2e_drift). A paused reader's effect
is the time the server's writes waited on it: its pause, less the time the server took to fill
the buffers it found full when it resumed (at the control's byte rate). A request is positive
at 1.5x the bar or more, negative under 0.67x, and left out in between (gray: within the
measurements' noise of the bar). A request the primitive failed or cancelled is positive. A
server process's speed moves by 15-30% from one start to the next on a shared 2-core machine
(the same load's decode steps at 19 ms in one run and 25 ms in the next), so each run's times
are first set to one speed: the client probes each server with one stream alone before its load
(client.probe), and a run's times are scaled by the controls' mean probe over its own (not
for a delay of fixed length: FIXED_DELAYS). The probe is the diagnosis's too (one request
served alone before the load), but it is not scored: only the requests the client timed are. A
run is positive for its primitive's cause when a request is, negative when every request is,
and negative for every other cause; a control is negative for all.

Predictions. What `replay report` names (its causes, what every request paid, its steps, its
failures and cancellations) and what each request's `lumen trace why` names, as causes
(CAUSE_OF): read from the findings' parts and words, so the diagnosis of an older tree is
scored the same way.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.diagnose.client import Seen
from bench.diagnose.scenarios import CAUSES, Run

BAR_S = 0.020
SHARE = 0.10
# The server's send buffer (service/http_timing.py: about 80 KiB) and a pausing reader's receive
# buffer (the client asks 4 KiB; the kernel doubles it).
BUFFERS = 80 * 1024 + 2 * 4096
GAP_FACTOR = 4.0
OWN_RATE_BYTES = 8192  # a paused reader's own byte rate is used once it had read this much
POSITIVE, NEGATIVE = 1.5, 0.67  # of the bar: surely past it, surely under it
Z90 = 1.6449  # a two-sided 90% interval
MAX_SPEED_FACTOR = 1.5  # a run's times set to the controls' speed by at most this either way
# A probe whose chunks come faster than this measures the socket, not the machine: the tiny
# model's tokens (0.2-0.5 ms) arrive coalesced, and its probes' median gaps were 0.03-0.4 ms at
# random (against its controls' end-to-end ratio: correlation 0.11; SmolLM2's 25 ms: 0.54;
# Gemma 3's: 0.89). Such runs are labelled as measured.
MIN_PROBE_S = 0.005
# Causes whose effect is a delay of fixed length (a GC pause, a stopped core) or a failure: their
# runs are labelled as measured (a 30 ms pause is 30 ms at any speed). A paused reader's effect
# is its server's wait (reader_effect, from its pause), and its run's other requests are only
# the machine's: that run is set to one speed like the rest.
FIXED_DELAYS = {"gc", "hang", "crash", "cancel"}

# A finding's part (or the failure it names) -> the cause it names; parts not here name a cause
# outside the primitives' (reported as "other"), expected compute names none.
PART_CAUSE = {
    "neighbour_prefill": "prefill", "preempted": "kv_blocks", "recompute": "kv_blocks",
    "chunk_wait": "token_budget",
    "parse": "api_cpu", "http": "api_cpu", "frontend": "api_cpu", "loop_lag": "api_cpu",
    "api_cpu": "api_cpu",
    "grammar_mask": "grammar", "grammar_compile": "grammar", "logprobs": "logprobs",
    "delivery": "slow_reader", "gc": "gc", "crash": "crash", "hang": "hang",
    "client": "cancel", "core_stall": "hang", "imbalance": "imbalance",
    "speculation": "speculation",
}  # fmt: skip
EXPECTED = {"own_prefill", "decode", "step_in_flight"}
REFUSED = "invalid_request_error"  # a request the server refused (400): the generator's error
# How a verdict on the sampler names the setting its rows paid for (tracing/settings.py, the
# most common first): a grammar, logprobs; else penalties and temperature.
SAMPLER_PAID = (("for rows with a grammar", "grammar"), ("for rows with logprobs", "logprobs"))


@dataclass
class Named:
    """What a diagnosis named: for the run, and for each request (by id)."""

    run: set[str]
    requests: dict[str, set[str]]
    text: str = ""


def verdict_of(db: Path) -> Named:
    """The diagnosis of the db's run, as causes (the report's, and each request's)."""
    from tracing.diagnose import diagnose_run, render_run
    from tracing.judge import request_calls, slow_delivery_ns
    from tracing.why import explain

    run = diagnose_run(db)
    restart_cause = _restart_cause(run)
    named: set[str] = set()
    for f in run.findings:
        named |= _finding_causes(f, run, restart_cause)
    per: dict[str, set[str]] = {}
    for req in run.requests:
        mine: set[str] = set()
        for phase in ("ttft", "decode"):
            for call in request_calls(req, run, phase):
                # The sampler's words name what its rows paid for: `lumen trace why`'s.
                words = " ".join(explain(req, run)) if call.part == "sampling" else ""
                mine |= _part_causes(call.part, req.wait_reason, restart_cause, words)
        if slow_delivery_ns(req) is not None:
            mine.add("slow_reader")
        for part in _gap_parts(req):
            mine |= _part_causes(part, req.wait_reason, restart_cause, "")
        failure = getattr(req, "failure", None)
        if failure is not None:
            mine |= _part_causes(failure.kind, None, restart_cause, "")
        elif req.status == "aborted":
            mine.add("cancel")
        elif req.status == "error" and restart_cause:
            mine.add(restart_cause)
        per[req.request_id] = mine
    return Named(named, per, render_run(run))


def _gap_parts(req: Any) -> list[str]:
    """The parts that named a request's long gaps (an older tree named every long gap's)."""
    try:
        from tracing.judge import gap_calls
    except ImportError:
        return [g.named for g in getattr(req, "long_gaps", None) or [] if g.named is not None]
    return list(gap_calls(req))


def _restart_cause(run: Any) -> str | None:
    """crash or hang: what the run's engine restarts say (the lifecycle table)."""
    kinds = [r for r in getattr(run, "lifecycle", []) if r.kind in ("restart", "crash_loop")]
    if not kinds:
        return None
    return "hang" if any(r.cause.startswith("hung") for r in kinds) else "crash"


def _finding_causes(f: Any, run: Any, restart: str | None) -> set[str]:
    if f.section == "cancellations":
        return {"cancel"} if "cancelled" in f.text else _part_causes(f.part, None, restart, f.text)
    if f.section == "lifecycle":
        return (
            {restart or "crash"}
            if f.text.startswith(("The engine core failed", "Crash"))
            else set()
        )
    if f.kind not in ("cause", "paid", "step", "failure", "gap"):
        return set()
    if f.part is None:
        if "took at least" in f.text:
            return {"core_stall"} if "core" in f.text and "stall" in f.text else {"slow_step"}
        return {"cold"} if f.text.startswith("Cold start") else {"other"}
    return _part_causes(f.part, _queue_reason(f.text), restart, f.text)


def _queue_reason(text: str) -> str | None:
    for key, reason in (
        ("max_num_seqs", "max_num_seqs"), ("KV blocks", "kv_blocks"),
        ("preemption", "preemption"), ("token_budget", "token_budget"),
        ("LoRA slots", "lora_slots"),
    ):  # fmt: skip
        if key in text:
            return reason
    return None


def _part_causes(part: str | None, reason: str | None, restart: str | None, text: str) -> set[str]:
    if part is None or part in EXPECTED:
        return set()
    if part == "queue":
        by_reason = {"max_num_seqs": "max_num_seqs", "kv_blocks": "kv_blocks",
                     "preemption": "kv_blocks", "token_budget": "token_budget",
                     "lora_slots": "lora_slots"}  # fmt: skip
        return {by_reason.get(reason or "", "queue")}
    if part == "sampling":  # the setting the words say its rows paid for
        return {next((c for words, c in SAMPLER_PAID if words in text), "penalties")}
    if part == "engine_restart":
        return {restart or "crash"}
    return {PART_CAUSE.get(part, part)}


# -- labels ------------------------------------------------------------------------------------


def effect(controls: Sequence[Seen], primitive: Seen, drift: float = 0.0) -> float:
    """The primitive's effect on a request, in bars (1.0: exactly at the bar): its TTFT, its
    end to end time, its longest gap, each against the controls' mean, over the larger of the
    bar and twice the two controls' spread (the run's noise). ``drift``: how far apart the
    controls' end-to-end times were, as a share, at most over the group's requests (the
    machine's speed moving between runs moves every request's alike: e2e_drift)."""
    ratios = [0.0]

    def against(value: float | None, base: Sequence[float | None], floor: float,
                share: float = 0.0) -> None:  # fmt: skip
        got = [b for b in base if b is not None]
        if value is None or len(got) < len(base):
            return
        mean = float(np.mean(got))
        noise = max(max(got) - min(got), share * mean)
        ratios.append((value - mean) / max(floor, SHARE * mean, 2 * noise))

    against(primitive.ttft_s, [c.ttft_s for c in controls], BAR_S)
    if primitive.status == "ok" and all(c.status == "ok" for c in controls):
        against(primitive.e2e_s, [c.e2e_s for c in controls], BAR_S, drift)
    gaps = primitive.gaps()
    if len(gaps) >= 2:
        longest, median = max(gaps), float(np.median(gaps))
        before = [max(c.gaps(), default=0.0) for c in controls]
        spread = max(before) - min(before)
        over = (longest - float(np.mean(before))) / max(BAR_S, 2 * spread)
        ratios.append(min(longest / BAR_S, longest / (GAP_FACTOR * median) if median else 9.0,
                          over))  # fmt: skip
    return max(ratios)


def reader_effect(controls: Sequence[Seen], primitive: Seen, pause_s: float) -> float:
    """A paused reader's effect: the time the server's writes waited on it, in bars (of 20 ms
    and 4x the controls' median gap). While it paused, the server filled the buffers between
    them at its byte rate before the pause (the controls' where it had read little), then
    waited out the rest of the pause; or the rest of its response fit in them, and it never
    waited. What they held is what the reader read at once when it resumed, and the server's
    transport buffer (client.py); a run recorded before the reader measured that assumes
    BUFFERS bytes."""
    spans = [(c.num_bytes, c.end_s - c.first_s) for c in controls if c.first_s is not None]
    if primitive.paused_at_s is None or not spans:
        return 0.0
    if primitive.buffered_bytes is not None:
        if primitive.ended_in_buffers:
            return 0.0
        held = float(primitive.buffered_bytes)
    else:
        if float(np.mean([n for n, _ in spans])) - primitive.bytes_before_pause <= BUFFERS:
            return 0.0
        held = float(BUFFERS)
    # Its own byte rate before it paused (the same run, on the same machine at the same time),
    # where it had read enough to tell; else the controls'.
    first, at = primitive.first_s, primitive.paused_at_s
    if first is not None and primitive.bytes_before_pause >= OWN_RATE_BYTES and at > first:
        rate = primitive.bytes_before_pause / (at - first)
    else:
        rate = float(np.mean([n / max(t, 1e-3) for n, t in spans]))  # bytes a second
    waited = pause_s - held / max(rate, 1.0)
    gaps = [g for c in controls for g in c.gaps()]
    bar = max(BAR_S, GAP_FACTOR * float(np.median(gaps))) if gaps else BAR_S
    return waited / bar


def e2e_drift(controls: Sequence[list[Seen]]) -> float:
    """How far apart the controls' end-to-end times were, as a share of their mean, at most
    over the requests they share. The same load run twice on a 2-core machine ends 10-20%
    apart on the tiny model (its steps take about a millisecond); a request's end-to-end time
    past the controls by less than that is the machine, whatever the primitive."""
    if len(controls) < 2:
        return 0.0
    by_index = [{s.index: s for s in c if s.status == "ok" and not s.extra} for c in controls]
    shares = []
    for i in set.intersection(*(set(b) for b in by_index)):
        e2e = [b[i].e2e_s for b in by_index]
        shares.append((max(e2e) - min(e2e)) / max(float(np.mean(e2e)), 1e-3))
    return max(shares, default=0.0)


def grade(ratio: float) -> str:
    return "pos" if ratio >= POSITIVE else "neg" if ratio < NEGATIVE else "gray"


def at_one_speed(
    controls: Sequence[list[Seen]], primitive: list[Seen],
    speeds: Sequence[float | None], speed: float | None,
) -> tuple[list[list[Seen]], list[Seen]]:  # fmt: skip
    """The controls' and the primitive's times as at the controls' mean speed (each probe's
    median gap: client.probe), by at most MAX_SPEED_FACTOR either way; as measured where a
    probe is missing or under MIN_PROBE_S."""
    known = [s for s in speeds if s and s >= MIN_PROBE_S]
    if not speed or speed < MIN_PROBE_S or not known or len(known) < len(speeds):
        return list(controls), primitive
    ref = float(np.mean(known))

    def factor(s: float) -> float:
        return min(max(ref / s, 1 / MAX_SPEED_FACTOR), MAX_SPEED_FACTOR)

    scaled = [[x.scaled(factor(s)) for x in c] for c, s in zip(controls, speeds) if s]
    return scaled, [x.scaled(factor(speed)) for x in primitive]


def labels(
    run: Run, controls: Sequence[list[Seen]], primitive: list[Seen],
    speeds: Sequence[float | None] = (), speed: float | None = None,
) -> tuple[str, dict[str, str]]:  # fmt: skip
    """The run's label for its cause, and each of its requests' (by request id), against the
    group's controls; at one speed where the runs were probed (``speeds``: the controls',
    ``speed``: the primitive's)."""
    if run.cause not in FIXED_DELAYS:
        controls, primitive = at_one_speed(controls, primitive, speeds, speed)
    by_index = [{s.index: s for s in control} for control in controls]
    drift = e2e_drift(controls)
    per: dict[str, str] = {}
    asks = {a.index: a for a in run.asks}
    for s in primitive:
        base = [b[s.index] for b in by_index if s.index in b]
        if s.extra or len(base) < len(by_index) or not s.request_id:
            continue
        if s.code == REFUSED:
            continue  # the primitive made the server refuse it (a 400): nothing to diagnose
        if s.status == "cancelled" or (s.status == "failed" and base[0].status == "ok"):
            per[s.request_id] = "pos"
        elif asks[s.index].pause_after is not None:
            per[s.request_id] = grade(reader_effect(base, s, asks[s.index].pause_s))
        elif run.cause == "slow_reader":
            # A paused reader slows no one else (its writes wait on its own connection): the
            # others' times moved with the machine, as a control's would.
            per[s.request_id] = "neg"
        else:
            per[s.request_id] = grade(effect(base, s, drift))
    grades = set(per.values())
    if not grades:  # no request to judge it by (each refused): not scored
        return "gray", per
    overall = "pos" if "pos" in grades else "neg" if grades <= {"neg"} else "gray"
    return overall, per


# -- the matrix ----------------------------------------------------------------------------------


@dataclass
class Cell:
    tp: int = 0
    fp: int = 0
    fn: int = 0
    tn: int = 0
    gray: int = 0
    misses: list[str] = field(default_factory=list)  # "FN seed=..": a miss, to replay

    def add(self, label: str, named: bool, where: str) -> None:
        if label == "gray":
            self.gray += 1
        elif label == "pos":
            self.tp += named
            self.fn += not named
            if not named:
                self.misses.append(f"FN {where}")
        else:
            self.fp += named
            self.tn += not named
            if named:
                self.misses.append(f"FP {where}")

    def precision(self) -> tuple[float, float, float]:
        return wilson(self.tp, self.tp + self.fp)

    def recall(self) -> tuple[float, float, float]:
        return wilson(self.tp, self.tp + self.fn)


def wilson(k: int, n: int) -> tuple[float, float, float]:
    """The share k/n and its 90% Wilson interval (nan without trials)."""
    if n == 0:
        return math.nan, math.nan, math.nan
    p = k / n
    denom = 1 + Z90**2 / n
    mid = (p + Z90**2 / (2 * n)) / denom
    half = Z90 * math.sqrt(p * (1 - p) / n + Z90**2 / (4 * n * n)) / denom
    return p, max(0.0, mid - half), min(1.0, mid + half)


@dataclass
class Matrix:
    """Per cause, over runs and over requests; and the controls' false alarms."""

    runs: dict[str, Cell] = field(default_factory=lambda: defaultdict(Cell))
    requests: dict[str, Cell] = field(default_factory=lambda: defaultdict(Cell))
    num_controls: int = 0
    alarms: list[str] = field(default_factory=list)  # a control where something was named
    others: Counter[str] = field(default_factory=Counter)  # names outside the primitives'

    def add_run(self, cause: str | None, label: str, named: Named, where: str,
                request_labels: dict[str, str], timed: set[str] | None = None) -> None:  # fmt: skip
        """``timed``: the requests the client timed (the others, its speed probe, not scored)."""
        for c in CAUSES:
            self.runs[c].add(label if c == cause else "neg", c in named.run, where)
        self.others.update(n for n in named.run if n not in CAUSES)
        for rid, mine in named.requests.items():
            if timed is not None and rid not in timed:
                continue
            own = request_labels.get(rid)
            for c in CAUSES:
                lab = (own or "gray") if c == cause else "neg"
                if own is None and c == cause:
                    continue  # the primitive's own request, or one not in the control
                self.requests[c].add(lab, c in mine, f"{where} {rid}")
        if cause is None:
            self.num_controls += 1
            if named.run:
                self.alarms.append(f"{where}: {', '.join(sorted(named.run))}")

    def to_json(self) -> dict[str, Any]:
        def cells(table: dict[str, Cell]) -> dict[str, Any]:
            return {c: {"tp": x.tp, "fp": x.fp, "fn": x.fn, "tn": x.tn, "gray": x.gray,
                        "precision": x.precision(), "recall": x.recall(), "misses": x.misses}
                    for c, x in table.items()}  # fmt: skip

        return {"runs": cells(self.runs), "requests": cells(self.requests),
                "controls": self.num_controls, "false_alarms": self.alarms,
                "other_names": dict(self.others)}  # fmt: skip

    def render(self) -> str:
        lines = []
        for title, table in (("per run", self.runs), ("per request", self.requests)):
            lines += ["", f"Causes {title}: precision and recall (90% interval), counts",
                      f"  {'cause':<14}{'precision':>22}{'recall':>22}{'tp':>6}{'fp':>5}"
                      f"{'fn':>5}{'tn':>6}{'gray':>6}"]  # fmt: skip
            for c in CAUSES:
                x = table[c]
                lines.append(f"  {c:<14}{_pct(x.precision()):>22}{_pct(x.recall()):>22}"
                             f"{x.tp:>6}{x.fp:>5}{x.fn:>5}{x.tn:>6}{x.gray:>6}")  # fmt: skip
        rate = wilson(len(self.alarms), self.num_controls)
        lines += ["", f"Healthy controls: {len(self.alarms)} of {self.num_controls} named "
                      f"something ({_pct(rate)})"]  # fmt: skip
        lines += [f"  {a}" for a in self.alarms[:20]]
        if self.others:
            lines.append("Named outside the primitives' causes: "
                         + ", ".join(f"{k} {v}" for k, v in self.others.most_common()))  # fmt: skip
        return "\n".join(lines)


def _pct(x: tuple[float, float, float]) -> str:
    p, lo, hi = x
    return "-" if math.isnan(p) else f"{p:.2f} ({lo:.2f}-{hi:.2f})"
