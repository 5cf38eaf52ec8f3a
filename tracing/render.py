"""A diagnosis as text: `replay report` (a run) and `lumen trace why` (one request)."""

from __future__ import annotations

import textwrap
from collections import Counter

from tracing.diagnosis import (
    DECODE_PARTS,
    TAIL_PERCENTILE,
    TTFT_PARTS,
    Finding,
    RequestDiagnosis,
    RunDiagnosis,
)
from tracing.judge import dominant_words
from tracing.verdict import headline
from tracing.words import WHAT, ms

SECTIONS = {
    "failures": "Failures",
    "causes": "Causes",
    "gaps": "Token gaps",
    "paid": "Every request paid",
    "steps": "Steps",
    "cancellations": "Cancellations",
    "lifecycle": "Drains and engine restarts",
}
LABELS = {
    "ttft_s": "TTFT",
    "delivered_ttft_s": "delivered TTFT",
    "tpot_s": "TPOT",
    "itl_s": "ITL",
    "e2e_s": "E2E",
}
WIDTH = 100
SLOWEST = 5  # requests the report lists with what dominated each (as `lumen trace top`)


def _fill(text: str, initial_indent: str = "", subsequent_indent: str = "") -> str:
    """Wrapped at WIDTH, never inside a word: "--max-num-batched-tokens" stays whole, so a
    knob can be copied (and searched for) from the text."""
    return textwrap.fill(
        text, WIDTH, initial_indent=initial_indent, subsequent_indent=subsequent_indent,
        break_on_hyphens=False, break_long_words=False,
    )  # fmt: skip


def _bullet(text: str) -> str:
    return _fill(text, initial_indent="  - ", subsequent_indent="    ")


def percentile_table(summary: dict[str, dict[str, float]]) -> list[str]:
    lines = [f"{'':<16}" + "".join(f"{k:>12}" for k in ("p50", "p90", "p99", "max"))]
    for key, pct in summary.items():
        if pct:
            cells = "".join(f"{ms(pct[k] * 1e9):>12}" for k in ("p50", "p90", "p99", "max"))
            lines.append(f"{LABELS.get(key, key):<16}{cells}")
    return lines


def sampling(run: RunDiagnosis) -> str | None:
    """What a store rebuilt from a sampled window holds, in words (None: every request)."""
    weights = [r.weight for r in run.requests]
    if all(w == 1.0 for w in weights):
        return None
    rest = max(weights)
    return (f"A sampled window: {len(weights)} requests kept of about {round(sum(weights))} "
            f"({sum(w == 1.0 for w in weights)} failed or slow ones kept whole, the rest 1 in "
            f"{rest:.1f}); the percentiles weigh each kept request by the requests it stands "
            "for, and the verdict reads the kept ones.")  # fmt: skip


def render_run(run: RunDiagnosis) -> str:
    counts = f"{run.num_ok} ok, {run.num_aborted} aborted, {run.num_error} error"
    busy = sum(not s.idle for s in run.steps)
    replica = f" on replica {run.replica}" if run.replica else ""
    lines = [
        f"run {run.run_id}{replica}: {len(run.requests)} requests ({counts}), {busy} engine steps",
        "",
    ]
    if sampled := sampling(run):
        lines[-1:-1] = [_fill(sampled)]
    lines += [*percentile_table(run.summary), "", _fill(headline(run))]
    if largest := _largest(run):
        lines.append(_fill("Largest first: " + largest + "."))
    for section, title in SECTIONS.items():
        found = [f.text for f in run.findings if f.section == section and f.kind != "expected"]
        if section == "causes":
            found += [f.text for f in run.findings if f.kind == "expected"]
        if found:
            lines += ["", title, *(_bullet(t) for t in found)]
    lines += slowest_requests(run)
    lines += _part_tables(run)
    return "\n".join(lines)


def slowest_requests(run: RunDiagnosis, limit: int = SLOWEST) -> list[str]:
    """The slowest requests end to end and the part that dominated each: the words `lumen
    trace top` and `lumen trace why` print for them."""
    slow = sorted(run.requests, key=lambda r: -r.e2e_ns)[:limit]
    if not slow:
        return []
    lines = ["", "Slowest requests (end to end) and what dominated each"]
    lines += [f"  {r.request_id} ({r.status}) {ms(r.e2e_ns)}: {dominant_words(r)}" for r in slow]
    return lines


def _largest(run: RunDiagnosis, limit: int = 3) -> str:
    """The named findings with the most time, across sections, so the biggest reads first."""
    who = {"cause": "the slow tail", "paid": "every request", "step": "steps",
           "gap": "token gaps"}  # fmt: skip
    named = sorted((f for f in run.findings if f.kind in who and f.ms > 0), key=lambda f: -f.ms)[
        :limit
    ]

    def label(f: Finding) -> str:
        if f.label:
            return f.label
        return WHAT[f.part][0] if f.part in WHAT else f.text.split(" (")[0].split(":")[0]

    labels = Counter(label(f) for f in named)

    def phase(f: Finding) -> str:  # one part in both phases: say which
        return f", {PHASE_WORDS[f.phase]}" if labels[label(f)] > 1 and f.phase else ""

    return "; ".join(f"{label(f)} ({ms(f.ms * 1e6)}, {who[f.kind]}{phase(f)})" for f in named)


PHASE_WORDS = {"ttft": "before the first token", "decode": "after the first token"}


def _part_tables(run: RunDiagnosis) -> list[str]:
    lines = []
    for phase, parts, unit in (
        ("ttft", TTFT_PARTS, "ms"),
        ("decode", DECODE_PARTS, "ms per token"),
    ):
        stats = run.parts.get(phase)
        if not stats:
            continue
        title = "Time to first delivered token" if phase == "ttft" else "After the first token"
        lines += [
            "",
            f"{title} by part ({unit}): median request, and what the slowest "
            f"{100 - TAIL_PERCENTILE}% paid on top",
        ]
        for part, stat in sorted(stats.items(), key=lambda kv: -kv[1].median_ns):
            if abs(stat.median_ns) < 5e4 and abs(stat.tail_extra_ns) < 5e4:
                continue  # rounds to 0.0 ms: nothing to read
            lines.append(
                f"  {parts[part]:<60}{stat.median_ns / 1e6:>10.1f}"
                f"{stat.tail_extra_ns / 1e6:>+10.1f}"
            )
    return lines


def render_request(req: RequestDiagnosis, sentences: list[str]) -> str:
    head = (
        f"{req.request_id}  {req.status}  prompt {req.prompt_tokens:,}, output "
        f"{req.output_tokens:,} tokens  e2e {ms(req.e2e_ns)}  dominated by {dominant_words(req)}"
    )
    lines = [head, *(_fill(s) for s in sentences)]
    for phase, mine, parts in (
        ("ttft", req.ttft, TTFT_PARTS),
        ("decode", req.decode, DECODE_PARTS),
    ):
        if not mine:
            continue
        total = sum(mine.values()) or 1
        n = max(req.output_tokens - 1, 1) if phase == "decode" else 1
        medians = req.run_medians.get(phase, {})
        title = (
            "Time to first delivered token"
            if phase == "ttft"
            else f"After the first token ({n} tokens; the run's median for as many)"
        )
        lines += ["", f"{title:<62}{'ms':>10}{'share':>7}{'run median':>12}"]
        for part, ns in sorted(mine.items(), key=lambda kv: -kv[1]):
            median = medians[part] * n if part in medians else None
            if abs(ns) < 5e4 and (median is None or abs(median) < 5e4):
                continue
            cell = f"{median / 1e6:>12.1f}" if median is not None else f"{'-':>12}"
            lines.append(f"  {parts[part]:<60}{ns / 1e6:>10.1f}{ns / total:>7.0%}{cell}")
    return "\n".join(lines)
