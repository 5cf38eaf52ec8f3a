"""A request's emits as the trace writer records them and the store keeps them: once per step
that gave it tokens, each delivered when its caller got it (several steps in one write share
that instant), and a whole response's one write as its single emit."""

from __future__ import annotations

from pathlib import Path

from engine.frontend import Enqueued, Finished
from engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineInfo, StepRecord
from engine.sampling_params import SamplingParams
from tracing.config import TracingConfig
from tracing.recorder import Tracer
from tracing.store import open_db

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
    tracer = Tracer(
        TracingConfig(trace_db=str(tmp_path / "t.db")),
        EngineInfo("tiny", 64, 16, 16, "float32", "cpu", "0"),
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
    got = {r[0]: r[1:] for r in rows}
    arrival_us = T0 // 1000
    recv_us = {k: _received(k) // 1000 for k in (1, 2, 3, 4)}

    # Streamed: steps 1 to 4; 2 and 3 delivered together (step 3's write), 4 at its close.
    delivered = {1: _received(1) + 5_000, 2: _received(3) + 15_000, 3: _received(3) + 15_000,
                 4: end + 777_000}  # fmt: skip
    assert got["s"] == (
        1,
        [0, 1, 1, 1],
        [recv_us[1] - arrival_us, recv_us[2] - recv_us[1], recv_us[3] - recv_us[2],
         recv_us[4] - recv_us[3]],
        [(delivered[k] - _received(k)) // 1000 for k in (1, 2, 3, 4)],
        4,
    )  # fmt: skip
    # A whole response: its one write, at the close, of the last step's tokens.
    assert got["p"] == (1, [3 - 1], [recv_us[3] - arrival_us],
                        [(end + 777_000 - _received(3)) // 1000], 3)  # fmt: skip
    # n = 2: both sequences' tokens of a step are one emit.
    n_delivered = {1: _received(1) + 9_000, 2: _received(3) + 9_000, 3: _received(3) + 9_000}
    assert got["n"] == (
        1,
        [0, 1, 1],
        [recv_us[1] - arrival_us, recv_us[2] - recv_us[1], recv_us[3] - recv_us[2]],
        [(n_delivered[k] - _received(k)) // 1000 for k in (1, 2, 3)],
        6,
    )  # fmt: skip
