"""Parts judged together (tracing.judge.call_group), for a run: one cost spread over several
parts, each under the bars and their sum over them, named as one finding by its largest part.

- The API process: its one event loop receives and decodes the bodies, templates, tokenizes
  and emits.
- A grammar, where it is the most common setting of the rows in the tail's (or every
  request's) sampled steps (settings.grammar_leads): its rows take their steps onto the full
  logits and the sampler, and fill masks before the forward. A 4-field schema on two rows of a
  SmolLM2 load cost 2.4 ms a token in the sampler and 0.9 ms in the masks, each under the bars.
"""

from __future__ import annotations

from tracing import settings
from tracing.diagnosis import TAIL_PERCENTILE, Finding, RequestDiagnosis, RunDiagnosis
from tracing.judge import API_PROCESS, GRAMMAR_COST, call_group
from tracing.words import WHAT, ms


def group_findings(
    run: RunDiagnosis, phase: str, reqs: list[RequestDiagnosis], tail: list[RequestDiagnosis],
    scale: float, found: list[Finding],
) -> list[Finding]:  # fmt: skip
    """The groups' findings in a phase, where none of a group's parts was found alone."""
    stats = run.parts[phase]
    called = {f.part for f in found if f.part}
    out = []
    for parts in (API_PROCESS, GRAMMAR_COST):
        got = call_group(stats, called, run.phase_median_ns[phase], scale,
                         len(tail) < len(reqs), parts)  # fmt: skip
        if got is None:
            continue
        call, order = got
        whose = tail if call.beyond else reqs
        if parts is GRAMMAR_COST and not settings.grammar_leads(run, whose):
            continue
        values = {k: (stats[k].tail_extra_ns, stats[k].tail_paid_ns) if call.beyond
                  else (stats[k].median_ns, stats[k].median_ns * scale) for k in order}  # fmt: skip
        listed = ", ".join(f"{WHAT[k][0]} {_amount(phase, *v)}" for k, v in values.items()
                           if abs(v[1]) >= 50_000)  # fmt: skip
        paid = sum(v[1] for v in values.values())
        who = (f"The slowest {100 - TAIL_PERCENTILE}% of requests spent" if call.beyond
               else "Every request spent")  # fmt: skip
        more = "more than the median request " if call.beyond else ""
        if parts is API_PROCESS:
            where, label = "in the API process", "the API process"
            why = ("its one event loop receives and decodes the bodies, templates, tokenizes "
                   f"and emits: {WHAT[order[0]][1]}")  # fmt: skip
        else:
            rows = settings.paid_words(run, whose)
            where, label = f"in their steps' grammar ({rows})", "a grammar"
            why = ("its rows take their steps onto the full logits and fill masks, and every "
                   f"row waits for both: {WHAT['grammar_mask'][1]}")  # fmt: skip
        text = (f"{who} {_amount(phase, call.ns, paid)} {more}{where}, each part under the bars "
                f"and together over them ({listed}): {why}.")  # fmt: skip
        kind, section = ("cause", "causes") if call.beyond else ("paid", "paid")
        out.append(Finding(kind, text, ms=paid / 1e6, part=order[0], section=section,
                           label=label, phase=phase))  # fmt: skip
    return out


def _amount(phase: str, v: float, paid: float) -> str:
    """``v`` a request (TTFT) or per output token, which came to ``paid`` over the decode."""
    return ms(v) if phase == "ttft" else f"{ms(v)} per token ({ms(paid)})"
