"""Verdicts on what single requests met: their failures (counted first), their long token gaps
(each cut into parts by tracing.gaps, named by its largest), the time of their life no record
explains, and the requests a failed core left that were sent again to the next one."""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from tracing.diagnosis import MIN_CAUSE_NS, Finding, RequestDiagnosis, RunDiagnosis
from tracing.failures import KINDS, SERVER_KINDS, Failure
from tracing.gaps import GAP_FACTOR, Gap
from tracing.judge import gap_calls, passes
from tracing.words import WHAT, count, ms, step_name

LISTED = 4  # requests a sentence names by id


def failure_findings(run: RunDiagnosis) -> list[Finding]:
    """One sentence per kind of failure of the server's making (client cancellations have
    their own section), and one for the requests sent again to a new core."""
    by_kind: dict[str, list[tuple[RequestDiagnosis, Failure]]] = defaultdict(list)
    for r in run.requests:
        if r.failure is not None and r.failure.kind in SERVER_KINDS:
            by_kind[r.failure.kind].append((r, r.failure))
    out = []
    for kind in KINDS:
        found = by_kind.get(kind)
        if not found:
            continue
        sent = [r for r, _ in found if r.output_tokens]
        ids = [r.request_id for r, _ in found]
        text = (
            f"{count(len(found), 'request')} {found[0][1].words}: {_ids(ids)}"
            + (f"; {len(sent)} of them had sent output" if kind in ("crash", "hang") else "")
            + "."
        )
        out.append(Finding("failure", text, part=kind, request_ids=ids, section="failures",
                           ms=max(r.e2e_ns for r, _ in found) / 1e6))  # fmt: skip
    resent = [r for r in run.requests if r.resent_ns]
    if resent:
        waited = float(np.median([r.ttft.get("engine_restart", 0) for r in resent]))
        served = sum(r.status == "ok" for r in resent)
        out.append(Finding(
            "info",
            f"{count(len(resent), 'request')} had sent no output when the engine core failed: "
            f"sent again to the new core, {served} served; each lost {ms(waited)} "
            f"at the median to the failure (its time on the failed core and the wait for the "
            f"next): {_ids([r.request_id for r in resent])}.",
            part="engine_restart", section="failures",
        ))  # fmt: skip
    return out


def gap_findings(run: RunDiagnosis) -> list[Finding]:
    """The run's long token gaps grouped by the part that was the largest in each: one
    sentence per part that is not expected compute and cost some request the bars against its
    life (judge.gap_calls), the longest gap first."""
    by_part: dict[str, list[tuple[RequestDiagnosis, Gap]]] = defaultdict(list)
    for r in run.requests:
        named = gap_calls(r)
        for gap in r.long_gaps:
            if gap.named in named:
                by_part[gap.named].append((r, gap))
    out = []
    for part, found in by_part.items():
        found.sort(key=lambda rg: -rg[1].ns)
        r, worst = found[0]
        share = worst.parts[part]
        reqs = sorted({x.request_id for x, _ in found})
        text = (
            f"{count(len(found), 'token gap')} of {count(len(reqs), 'request')} "
            f"ran over {GAP_FACTOR:g}x their request's median gap and {ms(MIN_CAUSE_NS)}, "
            f"most of each in {WHAT[part][0]}: the longest {ms(worst.ns)} in {r.request_id} "
            f"({ms(share)} of it{_step(worst)}); {_ids(reqs)}: {WHAT[part][1] or 'see the steps'}."
        )
        out.append(Finding("gap", text, ms=worst.ns / 1e6, part=part, request_ids=reqs,
                           section="gaps"))  # fmt: skip
    out.sort(key=lambda f: -f.ms)
    return out


def remainder_findings(run: RunDiagnosis) -> list[Finding]:
    """Requests that finished with time no record explains, large against their life (a
    failed request's remainder is its failure, named apart)."""
    unexplained = [
        (r.ttft.get("unattributed", 0) + r.decode.get("unattributed", 0), r)
        for r in run.requests
        if r.failure is None
    ]
    large = [(u, r) for u, r in unexplained if passes(u, r.ttft_phase_ns + r.decode_phase_ns)]
    large.sort(key=lambda x: -x[0])
    if not large:
        return []
    u, worst = large[0]
    ids = [r.request_id for _, r in large]
    text = (
        f"{count(len(large), 'request')} spent time no recorded boundary explains, the most "
        f"{ms(u)} of {worst.request_id}'s {ms(worst.ttft_phase_ns + worst.decode_phase_ns)}: "
        f"{_ids(ids)}: {WHAT['unattributed'][1]}."
    )
    return [Finding("cause", text, ms=u / 1e6, part="unattributed", request_ids=ids)]


def _ids(ids: list[str]) -> str:
    more = f" and {len(ids) - LISTED} more" if len(ids) > LISTED else ""
    return ", ".join(ids[:LISTED]) + more


def _step(gap: Gap) -> str:
    return (
        f"; its write's first token came from {step_name(gap.step_id)}"
        if gap.step_id is not None
        else ""
    )
