"""A request's instants as its client saw them, from its row (tracing.diagnose_load): its
phases, the writes that reached it, and its delivered TTFT."""

from __future__ import annotations

import itertools
from typing import NamedTuple

from tracing.diagnose_load import RequestFacts
from tracing.emit_columns import closes_write
from tracing.gaps import Write


class Window(NamedTuple):
    """A request's phases: TTFT [start, ttft_end], decode [ttft_end, end] (instants, ns)."""

    start: int
    first_token: int | None  # arrival + ttft: the first token reached the frontend
    ttft_end: int
    end: int


def window_of(row: RequestFacts) -> Window:
    arrival, ttft = row.arrival_ns, row.ttft_ns
    first_token = arrival + ttft if ttft is not None else None
    start = row.http_start_ns or arrival
    end = row.last_delivered_ns or arrival + (row.e2e_ns or 0)
    if first_token is None:
        ttft_end = end  # it never got a token: its whole life is the TTFT phase
    elif row.stream is not False:
        ttft_end = row.first_delivered_ns or first_token
    else:
        ttft_end = first_token  # the one write of the final response ends the decode phase
    ttft_end = max(ttft_end, start)
    return Window(start, first_token, ttft_end, max(end, ttft_end))


def writes_of(row: RequestFacts) -> list[Write]:
    """The writes its client saw (emit_columns.closes_write: the emits one write delivered
    share its end), each with its first and last emit's step and receipt."""
    ends = row.emit_ends_ns or []
    steps, starts = row.emit_step_ids or [], row.emit_starts_ns or []
    emits = [(end, step, start) for end, step, start in
             itertools.zip_longest(ends, steps[: len(ends)], starts[: len(ends)])
             if end is not None]  # fmt: skip
    out, first = [], 0
    for i, last in enumerate(closes_write([end for end, _, _ in emits])):
        if last:
            end, step, start = emits[i]
            _, step0, start0 = emits[first]
            out.append(Write(int(end), step0, step, start0, start))
            first = i + 1
    return out


def delivered_ttft(row: RequestFacts, start: int, stream: bool) -> int | None:
    """Streams only: a whole response's one write is not a first token its client saw."""
    if not stream:
        return None
    if row.delivered_ttft_ns is not None:
        return row.delivered_ttft_ns
    if row.first_delivered_ns is not None and row.ttft_ns is not None:
        return row.first_delivered_ns - start
    return None
