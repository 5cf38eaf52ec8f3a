"""A request's emits as the store keeps them (store_schema.REQUEST_COLUMNS' emit_* lists):
the step after the previous, the instant received after the previous (us; the first after the
arrival) and the wait from received to delivered (us, between the two instants in us).

The trace writer does not work them out per request as it closes: its row holds the recorded
lists (``Emits``, the same in all three columns' places), and the flush builds the three
columns of all its requests at once, with numpy. Per emit that is ~60 ns against ~190 for a
Python loop per request and pyarrow's conversion of the lists it built (a recorded 64-stream
run's 40,960 emits).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from tracing.store_schema import REQUEST_COLUMNS

EMIT_COLUMNS = ("emit_step_deltas", "emit_received_us", "emit_delivery_us")
EMIT_INDEX = tuple(list(REQUEST_COLUMNS).index(c) for c in EMIT_COLUMNS)


class Emits(NamedTuple):
    """One request's emits as recorded (tracing.spans.RequestTrace), equally long."""

    steps: list[int]
    received: list[int]  # ns
    delivered: list[int]  # ns
    first_step: int  # the first step id the writer saw it in
    arrival_ns: int

    def lists(self) -> tuple[list[int], list[int], list[int]]:
        """The three columns' values for this request alone."""
        step_deltas, received_deltas, delivery_us = [], [], []
        last_step, last_received_us = self.first_step, self.arrival_ns // 1000
        for step, received, delivered in zip(self.steps, self.received, self.delivered):
            received_us = received // 1000
            step_deltas.append(step - last_step)
            received_deltas.append(received_us - last_received_us)
            delivery_us.append(delivered // 1000 - received_us)
            last_step, last_received_us = step, received_us
        return step_deltas, received_deltas, delivery_us


def closes_write(ends: Sequence[int | None]) -> list[bool]:
    """For a request's emits in order, whether each is the last that its write delivered. The
    emits one write delivered share its end (tokens held back by --stream-interval, or text
    that could still begin a stop string), and the last of them, the step that sent them,
    stands for the write: the client saw their tokens together."""
    n = len(ends)
    return [i + 1 == n or ends[i + 1] != ends[i] for i in range(n)]


def emits_of(
    steps: list[int], received: list[int], delivered: list[int], first_step: int, arrival_ns: int
) -> Emits | None:
    """The request's emits, or None if none was delivered (the lists are kept, not copied:
    the request is closed, and nothing appends to them any more)."""
    n = len(delivered)
    if not n:
        return None
    if len(steps) != n or len(received) != n:  # not after a close: emit_arrays chains the
        # three lists and needs them equally long, so cut them as zip would
        n = min(n, len(steps), len(received))
        steps, received, delivered = steps[:n], received[:n], delivered[:n]
    return Emits(steps, received, delivered, first_step, arrival_ns)


def with_emit_lists(row: tuple[Any, ...]) -> tuple[Any, ...]:
    """A requests row whose emit columns hold plain lists (for a consumer of single rows)."""
    emits = row[EMIT_INDEX[0]]
    if not isinstance(emits, Emits):
        return row
    out = list(row)
    for i, values in zip(EMIT_INDEX, emits.lists()):
        out[i] = values
    return tuple(out)


def emit_arrays(values: Sequence[Emits | None], types: Sequence[Any]) -> list[Any] | None:
    """The three emit columns of these rows (the values of emit_step_deltas) as Arrow arrays
    of ``types``, built at once. None where no row holds an Emits, or one holds plain lists
    (rows not from the trace writer): their columns convert as they are. A value its column
    cannot hold is a ValueError naming the column."""
    import numpy as np
    import pyarrow as pa

    kept = [e for e in values if e is not None]
    if not kept or any(not isinstance(e, Emits) for e in kept):
        return None
    lengths = np.fromiter((len(e.delivered) for e in kept), np.int64, len(kept))
    total = int(lengths.sum())
    offsets = np.zeros(len(values) + 1, np.int32)  # a null row's list is empty
    sizes = np.zeros(len(values), np.int64)
    present = np.fromiter((e is not None for e in values), np.bool_, len(values))
    sizes[present] = lengths
    np.cumsum(sizes, out=offsets[1:])
    starts = offsets[:-1][present]

    def flat(lists: Iterable[list[int]]) -> Any:
        return np.fromiter(itertools.chain.from_iterable(lists), np.int64, total)

    steps = flat(e.steps for e in kept)
    received = flat(e.received for e in kept)
    delivered = flat(e.delivered for e in kept)
    before = np.empty(total, np.int64)  # each emit's predecessor; a request's first: its start
    before[1:] = steps[:-1]
    before[starts] = np.fromiter((e.first_step for e in kept), np.int64, len(kept))
    step_deltas = steps - before
    received_us = received // 1000
    before[1:] = received_us[:-1]
    before[starts] = np.fromiter((e.arrival_ns for e in kept), np.int64, len(kept)) // 1000
    received_deltas = received_us - before
    # From the instants in us, not their difference: emits one write delivered (tokens held
    # back) share their end to the us in the spans view, and read as one write.
    delivery_us = delivered // 1000 - received_us
    mask = pa.array(~present) if not present.all() else None
    arrays = []
    for name, column, typ in zip(EMIT_COLUMNS, (step_deltas, received_deltas, delivery_us), types):
        try:
            values = pa.array(column, type=typ.value_type)  # a safe cast: overflow raises
        except (pa.ArrowInvalid, OverflowError) as e:
            raise ValueError(f"requests.{name}: {e}") from None
        arrays.append(pa.ListArray.from_arrays(pa.array(offsets), values, type=typ, mask=mask))
    return arrays
