"""One suite, three clients: InprocClient, SyncMPClient and AsyncMPClient behave the same."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.client import InprocClient
from engine.config import EngineConfig
from engine.messages import FinishReason, UtilityMethod
from engine.mp_client import SyncMPClient
from tests.helpers.clients import AsyncAdapter
from tests.helpers.factories import make_core_request as req

CONFIG = EngineConfig(num_kv_blocks=128, max_num_seqs=32)


@pytest.fixture(scope="module", params=["inproc", "sync_mp", "async_mp"])
def client(request: pytest.FixtureRequest, tiny_model_path: Path) -> Iterator[Any]:
    path = str(tiny_model_path)
    made: Any = {
        "inproc": lambda: InprocClient(CONFIG, path),
        "sync_mp": lambda: SyncMPClient(CONFIG, path),
        "async_mp": lambda: AsyncAdapter(CONFIG, path),
    }[request.param]()
    yield made
    made.shutdown()


def collect(client: Any, until: set[str], max_batches: int = 500) -> dict[str, list[Any]]:
    """Outputs per request id until every id in ``until`` has finished."""
    seen: dict[str, list[Any]] = {}
    pending = set(until)
    for _ in range(max_batches):
        if not pending:
            return seen
        for out in client.get_output(timeout=30).outputs:
            seen.setdefault(out.request_id, []).append(out)
            if out.finish_reason is not None:
                pending.discard(out.request_id)
    raise AssertionError(f"requests {pending} did not finish")


def tokens(outs: list[Any]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def assert_idle(client: Any) -> None:
    stats = client.call_utility(UtilityMethod.GET_STATS)
    assert (stats.num_running, stats.num_waiting, stats.num_kv_blocks_used) == (0, 0, 0)


REFERENCE: dict[str, list[int]] = {}


def test_add_and_stream_until_finished(client: Any) -> None:
    client.add_request(req("s1", [11, 12, 13, 14, 15], max_tokens=7))
    client.add_request(req("s2", list(range(100, 140)), max_tokens=3))
    seen = collect(client, {"s1", "s2"})
    assert [len(o.new_token_ids) for o in seen["s1"]] == [1] * 7
    assert seen["s1"][-1].finish_reason == FinishReason.LENGTH
    assert len(tokens(seen["s2"])) == 3
    # Same weights, same greedy tokens, whichever client carried them.
    for rid in ("s1", "s2"):
        assert REFERENCE.setdefault(rid, tokens(seen[rid])) == tokens(seen[rid])
    assert client.get_output(timeout=0.1).outputs == []  # nothing open: empty at once
    assert_idle(client)


def test_abort_drops_later_outputs_and_frees_blocks(client: Any) -> None:
    client.add_request(req("a1", list(range(50, 90)), max_tokens=200))
    client.add_request(req("a2", [7, 8, 9], max_tokens=5))
    first = client.get_output(timeout=30)
    assert first.outputs
    client.abort_requests(["a1"])
    seen = collect(client, {"a2"})
    assert "a1" not in seen
    early = [o for o in first.outputs if o.request_id == "a2"]
    assert len(tokens(early + seen["a2"])) == 5
    assert_idle(client)


def test_reused_id_after_abort_never_gets_the_old_outputs(client: Any) -> None:
    client.add_request(req("ref", [11, 12, 13, 14, 15], max_tokens=4))
    expected = tokens(collect(client, {"ref"})["ref"])
    for attempt in range(5):
        client.add_request(req("r", list(range(200, 260)), max_tokens=100))
        for _ in range(attempt):
            client.get_output(timeout=30)
        client.abort_requests(["r"])
        client.add_request(req("r", [11, 12, 13, 14, 15], max_tokens=4))
        seen = collect(client, {"r"})
        # Only the new request's tokens.
        assert tokens(seen["r"]) == expected
    assert_idle(client)


def test_abort_storm_leaves_nothing_running(client: Any) -> None:
    ids = [f"storm-{i}" for i in range(300)]
    for i, rid in enumerate(ids):
        client.add_request(req(rid, [3 + i % 50, 9, 27, 81], max_tokens=50))
        if i % 3 == 2:
            client.abort_requests(ids[i - 2 : i + 1])
        if i % 50 == 0:
            client.get_output(timeout=30)
    client.abort_requests(ids)
    while client.get_output(timeout=30).outputs:
        pass
    assert_idle(client)


def test_a_refused_request_errors_alone(client: Any) -> None:
    too_long = client.info.max_model_len + 1
    client.add_request(req("bad", [5] * too_long))
    client.add_request(req("badtok", [5, 10**6]))  # the core checks ids too
    client.add_request(req("good", [5, 6, 7], max_tokens=2))
    seen = collect(client, {"bad", "badtok", "good"})
    assert seen["bad"][-1].finish_reason == FinishReason.ERROR
    assert str(too_long) in seen["bad"][-1].error
    assert "token ids" in seen["badtok"][-1].error
    assert len(tokens(seen["good"])) == 2


def test_utilities(client: Any, tmp_path: Path) -> None:
    client.add_request(req("u", list(range(300, 340)), max_tokens=2))
    collect(client, {"u"})
    stats = client.call_utility(UtilityMethod.GET_STATS)
    assert stats.num_kv_blocks_total == 128 and stats.num_kv_blocks_cached > 0
    assert client.call_utility(UtilityMethod.RESET_PREFIX_CACHE) > 0
    assert client.call_utility(UtilityMethod.GET_STATS).num_kv_blocks_cached == 0
    client.call_utility(UtilityMethod.SLEEP)
    assert client.call_utility(UtilityMethod.GET_STATS).sleeping
    client.call_utility(UtilityMethod.WAKE_UP)
    trace = tmp_path / "profile.json"
    client.call_utility(UtilityMethod.START_PROFILE, str(trace))
    client.add_request(req("p", [1, 2, 3], max_tokens=2))
    collect(client, {"p"})
    client.call_utility(UtilityMethod.STOP_PROFILE)
    assert trace.stat().st_size > 0
    with pytest.raises(ValueError, match="folder"):
        client.call_utility(UtilityMethod.START_PROFILE, str(tmp_path / "no" / "x.json"))
    client.add_request(req("busy", [1, 2, 3], max_tokens=50))
    with pytest.raises(ValueError, match="in flight"):
        client.call_utility(UtilityMethod.SLEEP)
    client.abort_requests(["busy"])
    while client.get_output(timeout=30).outputs:
        pass
    assert_idle(client)


def test_boundary_timestamps_follow_one_clock(client: Any) -> None:
    """arrival (frontend) <= received (core) <= schedule <= execute <= output: one clock."""
    request = req("clock", [21, 22, 23, 24], max_tokens=3)
    client.add_request(request)
    firsts, steps = [], []
    while len(firsts) < 3:
        batch = client.get_output(timeout=30)
        mine = [o for o in batch.outputs if o.request_id == "clock"]
        if mine:
            steps.append(batch.step)
        firsts += mine
    assert request.arrival_ns <= firsts[0].received_ns <= steps[0].schedule_end_ns
    assert all("clock" in s.req_ids for s in steps)
    assert steps[0].num_scheduled[steps[0].req_ids.index("clock")] == 4  # the prompt
    assert [o.received_ns for o in firsts[1:]] == [0, 0]  # sent once
    for s in steps:
        assert s.schedule_start_ns <= s.schedule_end_ns <= s.execute_start_ns
        assert s.execute_start_ns <= s.execute_end_ns <= s.output_ns
