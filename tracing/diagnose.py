"""Why a request, or a run, was slow: each request's time broken into causes, judged against what
the time should be, and put into words (`replay report`, `lumen trace why`).

A request's life has two phases, each cut into parts that sum to it (interval arithmetic over
the store's instants; what no record covers is kept in ``unattributed``, never spread):

    TTFT    first byte read -> first chunk delivered (non-streamed: -> first token at the
            frontend, the final write belongs to the decode phase)
    decode  the end of the TTFT phase -> the response's last byte accepted

Steps a request took part in are split by the run's own step-cost model (``tracing.shares``,
whose docstring states every formula): its own prefill and row, other requests' prefill (its
"neighbours", named), and the batch's other rows. Pauses (GC, event-loop lag) are carved out
of the parts of their process that they overlap. Columns an older trace lacks, or a request
never reached, count as 0 or fall back to the spans. The run verdict and the words live in
``tracing.verdict``; its rule is described there and applied by ``tracing.judge``, which also
decides each request's dominant part (what `lumen trace top` prints). The parts themselves are
registered in ``tracing.parts``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from tracing import diagnose_load as load
from tracing import (
    engine_split,
    failures,
    render,
    settings,
    shares,
    speculation,
    stalls,
    step_members,
    verdict,
    why,
)
from tracing.diagnose_load import RequestFacts
from tracing.diagnosis import (
    DECODE_PARTS,
    EXPECTED_PARTS,
    MIN_CAUSE_NS,
    MIN_CAUSE_SHARE,
    TAIL_PERCENTILE,
    TTFT_PARTS,
    Finding,
    LifecycleRow,
    PartStat,
    RequestDiagnosis,
    RunDiagnosis,
    StepFacts,
    percentiles,
    summarize,
)
from tracing.emit_columns import closes_write
from tracing.gaps import GapCutter
from tracing.in_flight import Held, InFlight
from tracing.pauses import Intervals, Pauses, pauses_of
from tracing.request_windows import Window, delivered_ttft, window_of, writes_of
from tracing.shares import StepShare
from tracing.step_fit import step_weights
from tracing.store import DbPath, latest_run, open_db

__all__ = [
    "DECODE_PARTS", "EXPECTED_PARTS", "MIN_CAUSE_NS", "MIN_CAUSE_SHARE", "TAIL_PERCENTILE",
    "TTFT_PARTS", "Finding", "PartStat", "RequestDiagnosis", "RunDiagnosis", "StepFacts",
    "diagnose_run", "explain_request", "find_request_ids", "percentiles", "render_request",
    "render_run", "summarize",
]  # fmt: skip


@dataclass
class _Run:
    """What a request's decomposition reads besides its own row."""

    step_parts: dict[tuple[str, str], StepShare]
    pauses: tuple[Pauses, Pauses]  # api, core
    preemptions: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    neighbours: step_members.Neighbours = field(default_factory=dict)
    wait_reasons: dict[str, str] = field(default_factory=dict)
    in_flight: InFlight | None = None
    prefills: dict[int, list[tuple[str, int]]] = field(default_factory=dict)  # step -> prefills
    restarts: Intervals = field(default_factory=lambda: Intervals([]))  # the engine's
    gaps: GapCutter | None = None
    lifecycle: list[LifecycleRow] = field(default_factory=list)
    # Data-parallel runs: when another engine had room for a request this one queued.
    others_room: Intervals = field(default_factory=lambda: Intervals([]))
    # When the core did not run though it had work: long stretches between busy steps.
    core_idle: Intervals = field(default_factory=lambda: Intervals([]))


def diagnose_run(db_path: DbPath, run_id: str | None = None) -> RunDiagnosis:
    """Every request of a run decomposed, the steps, the percentiles and the verdict."""
    with open_db(db_path, timeout=10) as con:
        run_id = run_id or latest_run(con)
        facts = load.load_run(con, run_id)
    requests: list[RequestDiagnosis] = []
    prefills: dict[int, list[tuple[str, int]]] = {}
    for engine in engine_split.by_engine(facts):  # each data-parallel engine's steps are its own
        served, engine_prefills = _decompose_all(engine)
        requests += served
        prefills.update(engine_prefills)
    if len(requests) > 1:  # in arrival order, as the run's rows
        order = {r.request_id: i for i, r in enumerate(facts.requests)}
        requests.sort(key=lambda r: order.get(r.request_id, 0))
    statuses = [r.status for r in requests]
    run = RunDiagnosis(
        run_id=run_id,
        requests=requests,
        steps=facts.steps,
        summary=summarize(requests),
        findings=[],
        num_ok=statuses.count("ok"),
        num_aborted=statuses.count("aborted"),
        num_error=statuses.count("error"),
        prefill_members=prefills,
        pauses=[
            (p.process, p.kind, p.start_ns, p.duration_ns) for p in facts.pauses if p.kind != "cpu"
        ],  # the API process's busy stretches are not pauses
        api_busy=[
            (p.start_ns, p.start_ns + p.duration_ns) for p in facts.pauses if p.kind == "cpu"
        ],
        step_prior=facts.step_prior,
        lifecycle=facts.lifecycle,
        stream_interval=facts.stream_interval,
        replica=facts.replica,
    )
    verdict.judge(run)
    return run


def _decompose_all(
    facts: load.RunFacts,
) -> tuple[list[RequestDiagnosis], dict[int, list[tuple[str, int]]]]:
    """Every request of ``facts`` (a run, or one engine's part of it) decomposed over its
    steps; and each step's prefilling requests."""
    windows = [window_of(r) for r in facts.requests]
    win = shares.Windows(
        request_id=[r.request_id for r in facts.requests],
        first_token=np.array([-1 if w.first_token is None else w.first_token for w in windows],
                             dtype=np.int64),
        start=np.array([w.start for w in windows], dtype=np.int64),
        ttft_end=np.array([w.ttft_end for w in windows], dtype=np.int64),
        end=np.array([w.end for w in windows], dtype=np.int64),
        need=np.array([max((r.prompt_tokens or 0) - (r.cached_tokens or 0), 1)
                       if r.prompt_tokens else 0 for r in facts.requests], dtype=np.int64),
    )  # fmt: skip
    busy = [s for s in facts.steps if not s.idle]
    weights = step_weights(
        np.array([s.prefill_tokens for s in busy], dtype=np.int64),
        np.array([s.rows for s in busy], dtype=np.int64),
        np.array([s.forward_ns for s in busy], dtype=np.int64),
        facts.step_prior,
        np.array([s.full_rows for s in busy], dtype=np.int64),
    )
    placed = shares.place(facts.members, facts.step_times, win)
    # From here on, each step knows its recompute tokens (rows a preemption sent back).
    steps = replace(facts.step_times,
                    recompute_tokens=shares.recompute_tokens(facts.members.tokens, placed,
                                                             facts.step_times))  # fmt: skip
    pauses = pauses_of(facts.pauses)
    excess = stalls.stall_excess(steps, weights, pauses[1].gc)
    phases = stalls.phase_stalls(steps, pauses[1].gc)
    taken = stalls.api_taken(steps, excess, pauses[0])
    contended = stalls.api_contention(steps, weights, pauses[1].gc, pauses[0], excess)
    parts = shares.step_shares(facts.members, placed, steps, win, weights,
                               pauses[1].gc, excess, phases, taken, contended)  # fmt: skip
    preempted = step_members.preemptions(facts.preempted, facts.members, placed, steps, win)
    prefills = step_members.prefill_members(facts.members, placed)
    ctx = _Run(
        step_parts=parts,
        pauses=pauses,
        restarts=Intervals([(p.start_ns, p.start_ns + p.duration_ns) for p in facts.pauses
                            if p.process == "server" and p.kind == "restart"]),
        in_flight=InFlight(steps, weights, contended),
        preemptions=preempted,
        neighbours=step_members.neighbours(facts.members, placed),
        prefills=prefills,
        wait_reasons=step_members.wait_reasons(
            [r.received_ns for r in facts.requests],
            [r.first_scheduled_ns for r in facts.requests],
            win, parts, facts.steps,
        ),
        gaps=GapCutter(steps, facts.members, placed, weights, pauses, preempted,
                       facts.stream_interval),
        lifecycle=facts.lifecycle,
        others_room=Intervals([(a, b) for a, b, _ in facts.others_room]),
        # No step ran, less the core's GC pauses, which the pauses table names as GC.
        core_idle=Intervals(shares.idle_spans(steps, shares.out_end(steps))
                            if len(steps.step_id) else []).minus(pauses[1].gc),
    )  # fmt: skip
    requests = [_decompose(i, row, w, ctx) for i, (row, w) in
                enumerate(zip(facts.requests, windows))]  # fmt: skip
    return requests, prefills


def _named(db_path: DbPath) -> str:
    return str(db_path) if isinstance(db_path, str | Path) else " ".join(map(str, db_path))


def find_request_ids(db_path: DbPath, request_id: str) -> list[str]:
    """The request rows an id names: itself, or a completion's per-prompt ID-0, ID-1, ..."""
    with open_db(db_path, timeout=10) as con:
        ids = load.matching_ids(con, request_id)
    if not ids:
        raise ValueError(f"request {request_id!r} is not in {_named(db_path)}")
    return ids


def explain_request(db_path: DbPath, request_id: str) -> tuple[RequestDiagnosis, list[str]]:
    """One request decomposed, and sentences on its TTFT and worst token gaps, against its run."""
    with open_db(db_path, timeout=10) as con:
        run_id = load.run_of(con, request_id)
    if run_id is None:
        raise ValueError(f"request {request_id!r} is not in {_named(db_path)}")
    run = diagnose_run(db_path, run_id)
    req = next(r for r in run.requests if r.request_id == request_id)
    req.run_medians = {
        phase: {part: stat.median_ns for part, stat in stats.items()}
        for phase, stats in run.parts.items()
    }
    with open_db(db_path, timeout=10) as con:
        spec = speculation.sentences(con, run_id, request_id)
    return req, why.explain(req, run) + spec


def render_run(diag: RunDiagnosis) -> str:
    """The text `replay report` prints."""
    return render.render_run(diag)


def render_request(req: RequestDiagnosis, sentences: list[str]) -> str:
    """The text `lumen trace why` prints: the sentences, and its parts against the run's."""
    return render.render_request(req, sentences)


# -- one request's decomposition -------------------------------------------------------------


def _decompose(index: int, row: RequestFacts, window: Window, run: _Run) -> RequestDiagnosis:
    rid = row.request_id
    start, first_token, ttft_end, end = window
    stream = row.stream is not False
    req = RequestDiagnosis(
        request_id=rid,
        status=row.status or "error",
        arrival_ns=row.arrival_ns,
        start_ns=start,
        prompt_tokens=row.prompt_tokens or 0,
        output_tokens=row.output_tokens or 0,
        ttft_ns=row.ttft_ns,
        delivered_ttft_ns=delivered_ttft(row, start, stream),
        e2e_ns=row.e2e_ns or 0,
        num_preemptions=row.num_preemptions or 0,
        stream=stream,
        end_ns=end,
        send_wait_ns=row.send_wait_ns,
        bytes_sent=row.bytes_sent,
        kv_freed_ns=row.kv_freed_ns,
        wait_reason=run.wait_reasons.get(rid),
        body_bytes=row.body_bytes,
        weight=row.sample_weight or 1.0,
        engine=row.engine,
        routed=row.routed,
        lora_name=row.lora_name,
    )
    if row.body_read_ns and row.handler_ns and row.handler_ns >= row.body_read_ns:
        req.parse_span = (row.body_read_ns, row.handler_ns)
    if row.handler_ns and row.sent_ns and row.sent_ns >= row.handler_ns:
        req.frontend_span = (row.handler_ns, row.sent_ns - (row.admission_wait_ns or 0))
    steps_t = run.step_parts.get((rid, "ttft"))
    steps_d = run.step_parts.get((rid, "decode"))
    req.ttft, held_by = _ttft_parts(row, run, start, ttft_end, steps_t, steps_d)
    if first_token is not None and end > ttft_end:
        req.decode = _decode_parts(row, run, ttft_end, end, steps_d, req.ttft["delivery"])
    writes = writes_of(row)
    req.gaps_ns = [int(b.end_ns - a.end_ns) for a, b in itertools.pairwise(writes)]
    req.gap_step_ids = [w.last_step for w in writes[1:]]
    if run.gaps is not None and stream:
        req.long_gaps = run.gaps.cut(index, rid, writes, row.send_wait_ns or 0)
    req.failure = failures.classify(req.status, row.end_code, row.error, end, run.lifecycle)
    req.resent_ns = row.resent_ns
    req.settings = settings.settings_of(row.params, row.grammar)
    for phase in ("ttft", "decode"):
        found = dict(run.neighbours.get((rid, phase), {}))
        if phase == "ttft" and held_by is not None:
            for other, n in run.prefills.get(held_by, []):  # the prefill in flight when it came
                had, ids = found.get(other, (0, []))
                found[other] = (had + n, sorted({*ids, held_by}))
        if found:
            req.neighbour_steps[phase] = found
            for other, (n, _) in found.items():
                req.neighbours[other] = req.neighbours.get(other, 0) + n
    mine = [*(steps_t.step_ids if steps_t else []), *(steps_d.step_ids if steps_d else [])]
    req.step_ids = sorted(set(mine))
    return req


def _ttft_parts(
    row: RequestFacts,
    run: _Run,
    lo: int,
    hi: int,
    steps: StepShare | None,
    later: StepShare | None,
) -> tuple[dict[str, int], int | None]:
    """Its TTFT parts, and the step in flight whose prefill held it on its way in (None: none
    did)."""
    parts = dict.fromkeys(TTFT_PARTS, 0)
    held_by = None
    api, core = run.pauses
    handler = row.handler_ns if row.http_start_ns else lo  # offline: no HTTP part
    sent, received = row.sent_ns, row.received_ns
    first = steps or later
    first_step = first.first_start if first else None
    # Its first step began; a request that never ran waited in the queue to its end.
    never_ran = received and row.ttft_ns is None and first_step is None
    scheduled = first_step or row.first_scheduled_ns or (hi if never_ran else None)
    # Without step records its prefill's end is unknown: that time stays unattributed.
    last_out = steps.last_output if steps else (scheduled if never_ran else None)

    def span(a: int | None, b: int | None) -> tuple[int, int] | None:
        return None if a is None or b is None else (max(a, lo), max(min(b, hi), a, lo))

    # Its way in while a step ran that it then waited for at the core is that step's wait: had
    # it been sent any time after the step began, it would have waited for the same end (the
    # critical path; a large body parsed meanwhile cost it nothing). Counted from ``way_in``.
    began = None
    if run.in_flight and sent and received and not row.resent_ns:
        began = run.in_flight.began_under(sent, received)
    way_in = sent if began is None else max(began, lo)

    def upto(t: int | None) -> int | None:
        return None if t is None or way_in is None else min(t, way_in)

    # The body read whole: receiving it before, decoding and validating its JSON after.
    read = min(max(row.body_read_ns, lo), handler) if row.body_read_ns and handler else handler
    for part, window in (
        ("http", span(lo, upto(read))), ("parse", span(read, upto(handler))),
        ("frontend", span(handler, way_in)),
    ):  # fmt: skip
        if window:
            parts[part] = api.carve(parts, *window)
    admission = min(row.admission_wait_ns or 0, parts["frontend"])
    parts["admission"], parts["frontend"] = admission, parts["frontend"] - admission
    if (window := span(handler, way_in)) and parts["frontend"]:
        # Waiting for a new engine core (Serving._gate): the restart rows over the window.
        waited = min(run.restarts.within(*window), parts["frontend"])
        parts["engine_restart"], parts["frontend"] = waited, parts["frontend"] - waited
    if row.resent_ns and (window := span(sent, row.resent_ns)):
        # Sent again to a new core after its first failed (service/lifecycle.py): its time on
        # the failed core and the wait for the next one are what the failure cost it.
        parts["engine_restart"] += window[1] - window[0]
        sent = window[1]
    if window := span(sent if began is None else way_in, received):
        # A core GC pause holds new requests as a step does: named as GC.
        ipc = core.carve(parts, *window)
        # The step in flight, up to its expected time: expected (InFlight), but for
        # its prefill's share, other requests' prefill (a smaller token budget cuts it), its
        # sampler's, the sampler's parts (the settings of the rows it ran for), and what the
        # API process's CPU or GC beside its forward slowed it by, theirs.
        held = run.in_flight.held(*window) if run.in_flight else Held(0, 0, {}, None)
        waited = min(held.waited, ipc)
        prefill = min(held.prefill, waited)
        left = waited - prefill
        for part, ns in held.parts.items():
            took = min(ns, left)
            parts[part] += took
            left -= took
        parts["step_in_flight"], parts["ipc"] = left, ipc - waited
        if parts["ipc"] >= MIN_CAUSE_NS:
            # A healthy core reads its input within a millisecond of a step's end: one that
            # took this long past the step in flight had stopped (or starved of CPU).
            parts["core_stall"], parts["ipc"] = parts["ipc"], 0
        parts["neighbour_prefill"] += prefill
        if prefill:
            held_by = held.step
    if window := span(received, scheduled):
        # Structured outputs: until its grammar compiled it was not in the queue at all, and
        # a compile that ended during a step joins the queue when that step ends: had it
        # compiled at once, the request would have run in that step.
        ready = row.grammar_ready_ns
        if ready and run.in_flight and (joined := run.in_flight.next_start(ready)):
            ready = joined
        cut = min(max(ready, window[0]), window[1]) if ready else window[0]
        parts["grammar_compile"] = core.carve(parts, window[0], cut)
        parts["queue"] = core.carve(parts, cut, window[1])
        if stalled := min(run.core_idle.within(cut, window[1]), parts["queue"]):
            parts["core_stall"] += stalled  # queued while the core ran no step
            parts["queue"] -= stalled
        # Several engines: queued here while another engine had room (the balancing's).
        if room := min(run.others_room.within(cut, window[1]), parts["queue"]):
            parts["imbalance"], parts["queue"] = room, parts["queue"] - room
    if steps and (window := span(scheduled, last_out)):
        for key in _STEP_KEYS_TTFT:
            parts[key] += round(getattr(steps, key))
        gap = window[1] - window[0] - steps.total
        gap_gc = min(max(gap, 0), max(core.within(*window) - round(steps.gc), 0))
        parts["gc"] += gap_gc
        parts["chunk_wait"] = gap - gap_gc
        if (k := len(steps.step_ids)) > 1:
            # A prefill split into k chunks paid k steps' fixed cost, and k times the rows
            # sharing them, where one step would do: the other k - 1 are the split's.
            own, rows = round(steps.own_row * (k - 1) / k), round(steps.decode * (k - 1) / k)
            parts["own_prefill"] -= own
            parts["decode"] -= rows
            parts["chunk_wait"] += own + rows
    if window := span(last_out, hi):
        tail = window[1] - window[0]
        # The writes its socket waited on (emit_columns.closes_write), not the emits.
        writes = sum(closes_write([e for e in row.emit_ends_ns or [] if e is not None]))
        writes = writes or max(row.output_tokens or 0, 1)
        delivery = min(tail, (row.send_wait_ns or 0) // writes) if row.stream is not False else 0
        parts["emit"] = api.carve(parts, window[0], window[1] - delivery)
        parts["delivery"] = api.carve(parts, window[1] - delivery, window[1])
    parts["unattributed"] = (hi - lo) - sum(parts.values())
    return parts, held_by


# A StepShare's parts, as each phase takes them.
_STEP_KEYS_TTFT = (
    "own_prefill", "neighbour_prefill", "recompute", "decode", "schedule", "output", "gc",
    "grammar_mask", "sampling", "logprobs", "speculation", "core_stall", "loop_lag", "api_cpu",
)  # fmt: skip
_STEP_KEYS_DECODE = (
    "decode", "neighbour_prefill", "recompute", "preempted", "schedule", "output", "gc",
    "grammar_mask", "sampling", "logprobs", "speculation", "core_stall", "loop_lag", "api_cpu",
)  # fmt: skip


def _decode_parts(
    row: RequestFacts, run: _Run, lo: int, hi: int, steps: StepShare | None, ttft_delivery: int
) -> dict[str, int]:
    parts = dict.fromkeys(DECODE_PARTS, 0)
    api, core = run.pauses
    tail_start = min(max(steps.last_output, lo), hi) if steps else lo
    # The last token reached the frontend, then waited on the client's socket.
    reached = row.last_emit_start_ns
    reached = hi if reached is None else min(max(reached, tail_start), hi)
    if not steps and (row.output_tokens or 0) >= 2:
        tail_start = reached  # no step records of its decode: that time stays unattributed
    if steps:
        for key in _STEP_KEYS_DECODE:
            parts[key] += round(getattr(steps, key))
        gap = tail_start - lo - steps.total
        preempted = sum(
            max(0, min(b, tail_start) - max(a, lo))
            for a, b in run.preemptions.get(row.request_id, [])
        )
        parts["preempted"] += min(max(gap, 0), preempted)
        waited = parts["preempted"] - round(steps.preempted)
        gap_gc = min(
            max(gap - waited, 0),
            max(core.within(lo, tail_start) - round(steps.gc), 0),
        )
        parts["gc"] += gap_gc
        parts["between_steps"] = gap - waited - gap_gc
        # Its turn came with every step, so a long stretch with none was the core stalling.
        stalled = min(run.core_idle.within(lo, tail_start), max(parts["between_steps"], 0))
        parts["core_stall"] += stalled
        parts["between_steps"] -= stalled
    parts["emit"] = api.carve(parts, tail_start, reached)
    # The last output's write: its wait on the client's socket is what send_wait_ns has left
    # after the first write's share (a failed request's last write is the error, not a wait).
    tail = api.carve(parts, reached, hi)
    left = (row.send_wait_ns or 0) - ttft_delivery
    parts["delivery"] = min(tail, max(left, 0))
    parts["emit"] += tail - parts["delivery"]
    parts["unattributed"] = (hi - lo) - sum(parts.values())
    return parts
