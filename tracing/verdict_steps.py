"""Verdicts from the steps table: cold and outlier steps (tracing/slow_steps.py), long prefill
chunks stalling decodes, scheduler and output CPU, batch growth, pauses, and what
cancellations left in the KV cache."""

from __future__ import annotations

import numpy as np

from tracing.diagnosis import (
    MIN_CAUSE_NS,
    MIN_CAUSE_SHARE,
    Finding,
    RequestDiagnosis,
    RunDiagnosis,
    StepFacts,
)
from tracing.judge import passes
from tracing.slow_steps import PAUSE_WORDS, cold_and_outliers, expected_ns
from tracing.slow_steps import step_finding as _step
from tracing.stalls import stall_limit
from tracing.step_fit import (
    MIN_PRICED_PREFILL,
    StepFit,
    fit_step_shape,
)
from tracing.words import WHAT, count, ms, step_name, tokens_of

STALL_FACTOR = 2.0  # a mixed step this many times the median decode-only step stalls decodes
MIN_STEP_CPU_NS = 2_000_000  # scheduler / output CPU per step worth naming (with the share)


def busy_steps(run: RunDiagnosis) -> list[StepFacts]:
    return [s for s in run.steps if not s.idle and s.prefill_tokens + s.decode_tokens > 0]


def prefill_of(run: RunDiagnosis, step: StepFacts) -> str:
    """'a 2,047-token prefill chunk of REQ' for the largest prefill in the step."""
    members = run.prefill_members.get(step.step_id)
    if not members:
        return f"{tokens_of(step.prefill_tokens)} prefill tokens"
    rid, n = max(members, key=lambda m: m[1])
    more = f" and {count(len(members) - 1, 'other prefill')}" if len(members) > 1 else ""
    return f"a {tokens_of(n)}-token prefill chunk of {rid}{more}"


def step_findings(run: RunDiagnosis, said: list[Finding]) -> list[Finding]:
    busy = busy_steps(run)
    if not busy:
        return []
    named = {f.part for f in said}
    fit = shape_model(busy, run.step_prior)
    coef = None if fit is None else fit.coef
    stalls, typical = stall_steps(busy, coef)
    out = cold_and_outliers(run, busy, coef, {s.step_id for s in stalls})
    out += _stalls(run, stalls, typical)
    out += _cpu(run, busy, named)
    out += _growth(busy, coef)
    out += _priced_by_prior(busy, fit)
    out += _speculation(busy)
    out += _pauses(run)
    return out


def shape_model(busy: list[StepFacts], prior: list[float] | None = None) -> StepFit | None:
    """Forward time = a + b * prefill tokens + c * rows + f * full rows
    (tracing.step_fit.fit_step_shape)."""
    return fit_step_shape(
        np.array([s.prefill_tokens for s in busy]),
        np.array([s.rows or s.running for s in busy]),
        np.array([s.forward_ns for s in busy]),
        prior,
        np.array([s.full_rows for s in busy]),
    )


def stall_steps(
    busy: list[StepFacts], coef: np.ndarray | None = None
) -> tuple[list[StepFacts], float]:
    """Steps whose prefill held up decodes, and the median decode-only step.

    With the run's shape model, the prefill itself must account for the time (its tokens at
    the fitted cost per prefill token pass MIN_CAUSE_NS): a step slow for another reason is
    an outlier, not a stall. Without one (too few steps), the prefill must at least be one a
    fit could price (MIN_PRICED_PREFILL tokens): a few prompt tokens in a step slowed by
    contention stall nothing. A step far past its expected time even for a long prompt
    (tracing.stalls.stall_excess) is the core stalling, not its prefill."""
    decode_only = [s.forward_ns for s in busy if s.prefill_tokens == 0 and s.decode_tokens > 0]
    if not decode_only:
        return [], 0.0
    typical = float(np.median(decode_only))
    stalls = [
        s
        for s in busy
        if s.prefill_tokens
        and s.decode_tokens
        and s.forward_ns >= MIN_CAUSE_NS
        and s.forward_ns >= STALL_FACTOR * typical
        and (
            s.prefill_tokens >= MIN_PRICED_PREFILL
            if coef is None
            else coef[1] * s.prefill_tokens >= MIN_CAUSE_NS
            and s.forward_ns < stall_limit(expected_ns(coef, s), coef[1] * s.prefill_tokens)
        )
    ]
    return stalls, typical


def _stalls(run: RunDiagnosis, stalls: list[StepFacts], typical: float) -> list[Finding]:
    """The stalls worth naming: a step's time over the typical decode-only step is at least
    MIN_CAUSE_SHARE of the median request's decode phase (a prefill mixed into a step is how
    chunked prefill works; it is a cause when it moves a decoder's time, not a token's)."""
    phases = [r.decode_phase_ns for r in run.requests if r.output_tokens >= 2]
    decode_phase = float(np.median(phases)) if phases else 0.0
    stalls = [s for s in stalls if s.forward_ns - typical >= MIN_CAUSE_SHARE * decode_phase]
    if not stalls:
        return []
    worst = max(stalls, key=lambda s: s.forward_ns)
    more = f"; {count(len(stalls) - 1, 'more such step')}" if len(stalls) > 1 else ""
    itl = run.summary.get("itl_s", {}).get("p99")
    quoted = f" p99 ITL is {ms(itl * 1e9)}." if itl is not None else ""
    chunk = prefill_of(run, worst)
    text = (
        f"{chunk[0].upper()}{chunk[1:]} stalled "
        f"{count(worst.decode_tokens, 'decoding request')} for {ms(worst.forward_ns)} "
        f"({step_name(worst.step_id)}; decode-only steps take {ms(typical)}){more}.{quoted} "
        "--max-num-batched-tokens caps the chunk."
    )
    ids = [rid for rid, _ in run.prefill_members.get(worst.step_id, [])]
    return [_step(text, worst.forward_ns / 1e6, "neighbour_prefill", ids)]


def _cpu(run: RunDiagnosis, busy: list[StepFacts], named: set[str | None]) -> list[Finding]:
    """Scheduler CPU, and output building and sending, per step."""
    out = []
    step_ns = float(np.median([s.end_ns - s.start_ns for s in busy])) or 1.0
    sched = np.array([s.schedule_ns - s.grammar_mask_ns for s in busy], dtype=float)
    per_request = [r.ttft.get("schedule", 0) + r.decode.get("schedule", 0) for r in run.requests]
    summed = float(np.median(per_request)) if per_request else 0.0
    typical = float(np.median(sched))
    large = typical >= MIN_STEP_CPU_NS and typical >= MIN_CAUSE_SHARE * step_ns
    if "schedule" not in named and large:  # summed per request: the part rule (verdict)
        worst = busy[int(np.argmax(sched))]
        text = (
            f"Scheduler CPU: the scheduler took {ms(typical)} of each {ms(step_ns)} step "
            f"at the median ({typical / step_ns:.0%}), up to {ms(worst.schedule_ns)} at "
            f"{count(worst.running, 'running request')} ({step_name(worst.step_id)}); "
            f"{ms(summed)} over a request's steps at the median: {WHAT['schedule'][1]}."
        )
        out.append(_step(text, typical / 1e6, "schedule"))
    out += _grammar_masks(busy, named, step_ns)
    out += _sampler(busy, named)
    output = float(np.median([s.output_ns for s in busy]))
    if "output" not in named and output >= MIN_STEP_CPU_NS and output >= MIN_CAUSE_SHARE * step_ns:
        builds = [s.build_ns for s in busy if s.build_ns is not None]
        split = ""
        if builds:
            build = float(np.median(builds))
            split = f": {ms(build)} building them, {ms(max(output - build, 0))} sending them"
        text = (
            f"Core output: a step's outputs took {ms(output)} to build and send at the "
            f"median ({output / step_ns:.0%} of the step{split}): {WHAT['output'][1]}."
        )
        out.append(_step(text, output / 1e6, "output"))
    return out


def _grammar_masks(busy: list[StepFacts], named: set[str | None], step_ns: float) -> list[Finding]:
    """Structured outputs' token masks: every row of a step waits for them."""
    masked = [s for s in busy if s.grammar_mask_ns]
    if not masked or "grammar_mask" in named:
        return []
    typical = float(np.median([s.grammar_mask_ns for s in masked]))
    if typical < MIN_STEP_CPU_NS or typical < MIN_CAUSE_SHARE * step_ns:
        return []
    worst = max(masked, key=lambda s: s.grammar_mask_ns)
    text = (
        f"Grammar masks: computing structured outputs' token masks took {ms(typical)} of each "
        f"{ms(step_ns)} step at the median in {count(len(masked), 'step')} that had any, up to "
        f"{ms(worst.grammar_mask_ns)} ({step_name(worst.step_id)}); every request in those steps "
        f"waited for them: {WHAT['grammar_mask'][1]}."
    )
    return [_step(text, typical / 1e6, "grammar_mask")]


def sampler_words(busy: list[StepFacts], part: str) -> str | None:
    """'top-20 logprobs for 48 rows took 9.1 ms of a 12.4 ms step at the median, in 120
    steps' (part: logprobs | sampling), or None where no step had any."""
    key = "logprobs_ns" if part == "logprobs" else "sample_ns"
    had = [s for s in busy if getattr(s, key)]
    if not had:
        return None
    took = float(np.median([getattr(s, key) for s in had]))
    step = float(np.median([s.execute_ns for s in had]))
    if part == "logprobs":
        rows = int(np.median([s.logprobs_rows for s in had]))
        k = max(s.max_logprobs for s in had)
        what = f"{f'top-{k} logprobs' if k else 'logprobs'} for {count(rows, 'row')}"
    else:
        rows = int(np.median([s.rows or s.running for s in had]))
        what = f"sampling on the full logits for {count(rows, 'row')}"
    return (
        f"{what} took {ms(took)} of a {ms(step)} step at the median, in {count(len(had), 'step')}"
    )


def _sampler(busy: list[StepFacts], named: set[str | None]) -> list[Finding]:
    """The sampler and logprobs inside execute: every row of a step waits for them."""
    out = []
    for part, key in (("logprobs", "logprobs_ns"), ("sampling", "sample_ns")):
        had = [s for s in busy if getattr(s, key)]
        if part in named or not had:
            continue
        typical = float(np.median([getattr(s, key) for s in had]))
        step_ns = float(np.median([s.execute_ns for s in had]))
        if typical < MIN_STEP_CPU_NS or typical < MIN_CAUSE_SHARE * step_ns:
            continue
        words = sampler_words(busy, part)
        text = f"{words[0].upper()}{words[1:]}" if words else part
        out.append(_step(f"{text}; every row of those steps waited: {WHAT[part][1]}.",
                         typical / 1e6, part))  # fmt: skip
    return out


def _priced_by_prior(busy: list[StepFacts], fit: StepFit | None) -> list[Finding]:
    """Say when a price rests on the warm-up's prior rather than the run's own steps."""
    if fit is None or fit.source == "run":
        return []
    coef = fit.coef
    if fit.source == "prior-all":
        text = (
            f"Step prices come from the warm-up ({count(len(busy), 'step')}, too few to fit): "
            f"{ms(coef[0])} a step, {coef[1] / 1e3:,.0f} us a prefill token, {ms(coef[2])} a row."
        )
    else:
        text = (
            f"A prefill token is priced from the warm-up ({coef[1] / 1e3:,.0f} us a token on this "
            "machine and model): the run's own prefills are too few or too short to price one."
        )
    return [Finding("info", text, section="steps")]


def _speculation(busy: list[StepFacts]) -> list[Finding]:
    """Speculative decoding over the run: drafts verified and kept, and the steps the batch-size
    rule (disable_by_batch_size) kept from proposing (information; the refused drafts' cost is
    the speculation part's)."""
    if not any(s.spec_tokens >= 0 for s in busy):
        return []  # no speculative decoding
    verifying = [s for s in busy if s.drafted]
    drafted, kept = sum(s.drafted for s in verifying), sum(s.kept for s in verifying)
    share = f" and kept {kept:,} ({kept / drafted:.0%})" if drafted else ""
    text = (f"Speculative decoding: {count(len(verifying), 'step')} verified "
            f"{drafted:,} drafts{share}." if verifying
            else "Speculative decoding: no step verified drafts.")  # fmt: skip
    stopped = [s for s in busy if s.spec_tokens == 0]
    if stopped:
        most = max(s.running for s in stopped)
        text += (f" The batch-size rule (disable_by_batch_size) let no request propose in "
                 f"{count(len(stopped), 'step')} of {len(busy):,}, with up to {most} "
                 "running.")  # fmt: skip
    return [Finding("info", text, section="steps")]


def _growth(busy: list[StepFacts], coef: np.ndarray | None) -> list[Finding]:
    """How execute time grows with the batch (information, not a cause)."""
    if coef is None:
        return []
    rows = [s.rows or s.running for s in busy]
    lo, hi = min(rows), max(rows)
    if coef[2] * (hi - lo) < MIN_CAUSE_NS:
        return []

    def at(n: int) -> str:
        return ms(coef[0] + coef[2] * n)

    text = (
        f"Execution grows with the batch: each running request adds {ms(coef[2])} to a step "
        f"({at(hi)} at {count(hi, 'request')} against {at(lo)} at {lo}, fitted over "
        f"{count(len(busy), 'step')})."
    )
    return [Finding("info", text, ms=coef[2] * (hi - lo) / 1e6, section="steps")]


WAITING_PARTS = ("http", "frontend", "admission", "loop_lag", "ipc", "step_in_flight", "queue")


def _pauses(run: RunDiagnosis) -> list[Finding]:
    """Pauses while requests were in flight (start-up's are not theirs), of a kind that cost
    some request both bars against its own life (its gc or loop_lag part): a 20 ms lag in a
    run of 3 s requests is the machine's noise, not a cause."""
    if not run.requests:
        return []
    costly = {
        kind
        for kind in PAUSE_WORDS
        if any(
            passes(r.ttft.get(kind, 0) + r.decode.get(kind, 0), r.ttft_phase_ns + r.decode_phase_ns)
            for r in run.requests
        )
    }
    lo = min(r.start_ns for r in run.requests)
    hi = max(r.end_ns for r in run.requests)
    out = []
    for process in ("api", "core"):
        for kind, words in PAUSE_WORDS.items():
            if kind not in costly:
                continue
            durations = [
                d
                for p, k, s, d in run.pauses
                if p == process and k == kind and s < hi and s + d > lo
            ]
            if durations and max(durations) >= MIN_CAUSE_NS:
                text = (
                    f"The {process} process paused for {words} "
                    f"{count(len(durations), 'time')}, {ms(sum(durations))} in all, the "
                    f"longest {ms(max(durations))}: {WHAT[kind][1]}."
                )
                out.append(_step(text, max(durations) / 1e6, kind))
    return out


def longest_step_during(
    run: RunDiagnosis, reqs: list[RequestDiagnosis], phase: str
) -> StepFacts | None:
    """The longest step that ran while these requests waited outside a step of their own
    (TTFT: before their first step; decode: steps they sat out)."""
    busy = busy_steps(run)
    if not busy:
        return None
    starts = np.array([s.start_ns for s in busy])
    ends = np.array([s.end_ns for s in busy])
    execute = np.array([s.execute_ns for s in busy])
    ids = np.array([s.step_id for s in busy])
    best: int | None = None
    for r in reqs:
        if phase == "ttft":
            lo, hi = r.start_ns, r.start_ns + sum(r.ttft.get(k, 0) for k in WAITING_PARTS)
        else:
            lo, hi = r.start_ns + r.ttft_phase_ns, r.end_ns
        first, last = int(np.searchsorted(ends, lo)), int(np.searchsorted(starts, hi))
        if last <= first:
            continue
        during = np.where(np.isin(ids[first:last], r.step_ids), -1, execute[first:last])
        i = first + int(np.argmax(during))
        if during.max() >= 0 and (best is None or execute[i] > execute[best]):
            best = i
    return None if best is None else busy[best]


def cancellations(run: RunDiagnosis) -> list[Finding]:
    """How many were cancelled, and the KV blocks in use once the last cancellation was done."""
    if not run.num_aborted:
        return []
    n = run.num_aborted
    text = (
        f"{count(n, 'request')} {'was' if n == 1 else 'were'} cancelled ({run.num_ok} ok, "
        f"{run.num_error} error)"
    )
    aborted = [r for r in run.requests if r.status == "aborted"]
    last_abort = max(r.arrival_ns + r.e2e_ns for r in aborted)
    last_end = max(r.arrival_ns + r.e2e_ns for r in run.requests)
    after = [s for s in run.steps if s.start_ns >= last_abort]
    if not after:
        # The core can record its idle state a moment before the frontend closes the last
        # cancelled stream: the abort reaches the core ahead of the frontend's bookkeeping. The
        # core records idle only once nothing runs, so an idle record after the last busy step
        # holds the state after every abort. After by step id, not by time: the last busy
        # step's output is stamped once it is sent, which can be after the idle record's start.
        last_busy = max((s.step_id for s in run.steps if not s.idle), default=-1)
        after = [s for s in run.steps if s.idle and s.step_id > last_busy]
    if not after:
        text += "; no step record follows the last cancellation: the KV state after it is unknown."
        return [Finding("info", text, section="cancellations")]
    last = max(after, key=lambda s: (s.start_ns, s.step_id))
    if last.kv_blocks_used and (last.start_ns >= last_end or last.idle):
        leak = (
            f"{last.kv_blocks_used} KV blocks still held after every request ended (of "
            f"{last.kv_blocks_total}, step record {last.step_id}): blocks leak on abort "
            "(abort propagation, finished ids or block refcounts)."
        )
        return [
            Finding("info", text + ".", section="cancellations"),
            Finding("cause", leak, part="kv", section="cancellations"),
        ]
    freed = [r.kv_freed_ns - (r.arrival_ns + r.e2e_ns) for r in aborted if r.kv_freed_ns]
    within = f" (freed within {ms(max(max(freed), 0))}: requests.kv_freed_ns)" if freed else ""
    text += (
        f"; KV blocks in use after the last cancellation: {last.kv_blocks_used} of "
        f"{last.kv_blocks_total}{within}."
    )
    return [Finding("info", text, section="cancellations")]
