"""`replay report`: latency percentiles of a recorded run and the verdict on where its time went,
from ``tracing.diagnose`` (the same numbers and words as `lumen trace why`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tracing.diagnose import (
    TTFT_PARTS,
    RequestDiagnosis,
    diagnose_run,
    percentiles,
    render_run,
)
from tracing.store import DbPath, latest_run, open_db

__all__ = [
    "PARTS",
    "RequestTimes",
    "load_times",
    "percentiles",
    "render_text",
]

# What a request's time to its first delivered token is made of (ns per part; see diagnose).
PARTS = TTFT_PARTS


@dataclass
class RequestTimes:
    """One served request's latencies, as `replay diff` and the HTML page read them."""

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

    @classmethod
    def of(cls, r: RequestDiagnosis) -> RequestTimes:
        assert r.ttft_ns is not None
        return cls(
            r.request_id,
            r.ttft_ns,
            r.e2e_ns,
            r.output_tokens,
            parts=dict(r.ttft),
            arrival_ns=r.arrival_ns,
            preemptions=r.num_preemptions,
            itls_ns=list(r.gaps_ns),
        )


def load_times(db: DbPath, run_id: str | None = None) -> tuple[str, list[RequestTimes]]:
    """The run's finished requests that got a token (by default the latest run that has one)."""
    if run_id is None:
        with open_db(db, timeout=10) as con:
            run_id = latest_run(con, served_only=True)
    run = diagnose_run(db, run_id)
    served = [r for r in run.requests if r.status == "ok" and r.ttft_ns is not None]
    return run.run_id, [RequestTimes.of(r) for r in served]


def render_text(db: DbPath, run_id: str | None = None) -> str:
    return render_run(diagnose_run(db, run_id))
