"""A request's emits as the trace writer records them and the store keeps them: once per step
that gave it tokens, each delivered when its caller got it (several steps in one write share
that instant), and a whole response's one write as its single emit."""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
import pytest

from engine.frontend import Enqueued, Finished
from engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineInfo, StepRecord
from engine.sampling_params import SamplingParams
from tracing.config import TracingConfig
from tracing.emit_columns import Emits, emit_arrays, emits_of
from tracing.recorder import Tracer
from tracing.store import open_db, write_new
from tracing.store_schema import TABLES

T0 = 1_764_800_000_000_000_000  # ns since the epoch, as the server stamps them
MS = 1_000_000


def _step(step_id: int, members: list[str]) -> StepRecord:
    at = T0 + step_id * 10 * MS
    return StepRecord(step_id, at, at + 1, at + 2, at + 3, at + 4, len(members), 0,
                      len(members), 0, len(members), 0, 1, 16, 0, 0, req_ids=members,
                      num_scheduled=[1] * len(members))  # fmt: skip


def _received(step_id: int) -> int:
    return T0 + step_id * 10 * MS + 123_457  # not a whole us: the store floors


def test_emits_once_per_step_delivered_as_the_caller_got_them(tmp_path: Path) -> None:
    observed: list[tuple[str, tuple[float, ...]]] = []
    tracer = Tracer(
        TracingConfig(trace_db=str(tmp_path / "t.db")),
        EngineInfo("tiny", 64, 16, 16, "float32", "cpu", "0"),
        observe_boundary=lambda name, seconds: observed.append((name, tuple(seconds))),
    )
    try:
        requests = {"s": (["s"], True), "p": (["p"], False), "n": (["n-0", "n-1"], True)}
        for rid, (children, stream) in requests.items():
            tracer.enqueued(Enqueued(rid, children, [1, 2, 3], SamplingParams(), 0, T0, T0 + 1,
                                     stream))  # fmt: skip
        for step_id in (1, 2, 3):
            members = ["s", "p", "n-0", "n-1"]
            outs = [EngineCoreOutput(m, [7], received_ns=T0 + 2 if step_id == 1 else 0)
                    for m in members]  # fmt: skip
            tracer.outputs(EngineCoreOutputs(outs, _step(step_id, members)), _received(step_id),
                           [])  # fmt: skip
            if step_id != 2:  # steps 2 and 3 of "s" and "n" reach their callers in one write
                tracer.delivered_many([("s", _received(step_id) + 5_000 * step_id),
                                       ("n", _received(step_id) + 9_000)])  # fmt: skip
        # One more step for "s" only, not delivered before it closes.
        tracer.outputs(EngineCoreOutputs([EngineCoreOutput("s", [7])], _step(4, ["s"])),
                       _received(4), [])  # fmt: skip
        end = T0 + 100 * MS
        for rid in requests:
            tracer.finished(Finished(rid, "ok", "length", end))
            tracer.closed(rid, end + 777_000)
    finally:
        tracer.shutdown()
    with open_db(tmp_path / "t.db") as con:
        rows = con.execute(
            "SELECT request_id, first_step_id, emit_step_deltas, emit_received_us, "
            "emit_delivery_us, output_tokens FROM requests ORDER BY request_id"
        ).fetchall()
        ends = con.execute(
            "SELECT step_id, end_ns FROM spans WHERE request_id = 's' "
            "AND name = 'frontend.emit' ORDER BY step_id"
        ).fetchall()
    got = {r[0]: r[1:] for r in rows}
    arrival_us = T0 // 1000
    recv_us = {k: _received(k) // 1000 for k in (1, 2, 3, 4)}

    # Streamed: steps 1 to 4; 2 and 3 delivered together (step 3's write), 4 at its close.
    # Each wait is between the two instants in us: emits of one write end at one us.
    delivered = {1: _received(1) + 5_000, 2: _received(3) + 15_000, 3: _received(3) + 15_000,
                 4: end + 777_000}  # fmt: skip
    assert got["s"] == (
        1,
        [0, 1, 1, 1],
        [recv_us[1] - arrival_us, recv_us[2] - recv_us[1], recv_us[3] - recv_us[2],
         recv_us[4] - recv_us[3]],
        [delivered[k] // 1000 - recv_us[k] for k in (1, 2, 3, 4)],
        4,
    )  # fmt: skip
    # The spans view: the emits of one write end at one instant (to the us), so that readers
    # such as the diagnosis's token gaps see one write.
    assert [step for step, _ in ends] == [1, 2, 3, 4]
    assert ends[1][1] == ends[2][1] == delivered[3] // 1000 * 1000 != ends[0][1]
    # The frontend.emit histogram: once per write, the wait of the step that sent it.
    emit_waits = sorted(x for name, seconds in observed if name == "frontend.emit"
                        for x in seconds)  # fmt: skip
    writes = [delivered[k] - _received(k) for k in (1, 3, 4)]  # "s": step 2 went with 3
    writes += [end + 777_000 - _received(3)]  # "p"
    writes += [
        n_delivered - _received(k)
        for k, n_delivered in ((1, _received(1) + 9_000), (3, _received(3) + 9_000))
    ]
    assert emit_waits == sorted(w / 1e9 for w in writes)
    # A whole response: its one write, at the close, of the last step's tokens.
    assert got["p"] == (1, [3 - 1], [recv_us[3] - arrival_us],
                        [(end + 777_000) // 1000 - recv_us[3]], 3)  # fmt: skip
    # n = 2: both sequences' tokens of a step are one emit.
    n_delivered = {1: _received(1) + 9_000, 2: _received(3) + 9_000, 3: _received(3) + 9_000}
    assert got["n"] == (
        1,
        [0, 1, 1],
        [recv_us[1] - arrival_us, recv_us[2] - recv_us[1], recv_us[3] - recv_us[2]],
        [n_delivered[k] // 1000 - recv_us[k] for k in (1, 2, 3)],
        6,
    )  # fmt: skip


def test_a_flush_builds_every_requests_emit_columns_as_each_alone() -> None:
    """The flush builds the three columns of all its requests at once: the same values as one
    request at a time, with rows that have no emits (NULL) among them."""
    rng = random.Random(7)
    emits: list[Emits | None] = []
    for i in range(60):
        n = rng.choice([0, 1, 2, 5, 64])
        received = sorted(T0 + rng.randrange(10**10) for _ in range(n))
        steps = sorted(rng.randrange(1, 10**6) for _ in range(n))
        delivered = [r + rng.randrange(10**8) for r in received]
        arrival = received[0] - rng.randrange(10**9) if n else T0
        emits.append(emits_of(steps, received, delivered, steps[0] - i % 3 if n else 0, arrival))
    assert emits.count(None) > 0
    types = [pa.list_(pa.int32()), pa.list_(pa.int64()), pa.list_(pa.int32())]
    arrays = emit_arrays(emits, types)
    assert arrays is not None
    for k, array in enumerate(arrays):
        assert array.type == types[k]
        assert array.to_pylist() == [e.lists()[k] if e is not None else None for e in emits]
    # Rows that hold plain lists (an import's) convert as they are.
    assert emit_arrays([None, [1, 2]], types) is None
    assert emit_arrays([None, None], types) is None


def test_an_emit_its_column_cannot_hold_is_named(tmp_path: Path) -> None:
    """A delivery 40 minutes after its tokens came does not fit the us in an INTEGER."""
    requests = {name: None for name in TABLES["requests"]}
    late = emits_of([5], [T0], [T0 + 40 * 60 * 10**9], 5, T0 - 1)
    requests.update(run_id="run", request_id="r", emit_step_deltas=late, emit_received_us=late,
                    emit_delivery_us=late)  # fmt: skip
    with pytest.raises(ValueError, match="emit_delivery_us"):
        write_new(tmp_path / "t.db", {"requests": [tuple(requests.values())]})


def test_the_writers_rows_and_an_imports_flush_together(tmp_path: Path) -> None:
    """A row holding its emits as recorded beside one holding plain lists: both as given."""
    blank = {name: None for name in TABLES["requests"]}
    recorded = emits_of([7, 8], [T0 + 5_000, T0 + 9_000], [T0 + 6_000, T0 + 12_000], 7, T0)
    writers = {**blank, "run_id": "run", "request_id": "w", "emit_step_deltas": recorded,
               "emit_received_us": recorded, "emit_delivery_us": recorded}  # fmt: skip
    imported = {**blank, "run_id": "run", "request_id": "i", "emit_step_deltas": [0, 2],
                "emit_received_us": [3, 4], "emit_delivery_us": [5, 6]}  # fmt: skip
    write_new(tmp_path / "t.db", {"requests": [tuple(writers.values()), tuple(imported.values())]})
    with open_db(tmp_path / "t.db") as con:
        got = con.execute(
            "SELECT request_id, emit_step_deltas, emit_received_us, emit_delivery_us "
            "FROM requests ORDER BY request_id"
        ).fetchall()
    assert got == [("i", [0, 2], [3, 4], [5, 6]), ("w", [0, 1], [5, 4], [1, 3])]
