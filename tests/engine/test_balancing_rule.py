"""The data-parallel group's rule on its own (engine.data_parallel): the load rule, prefix
affinity and where affinity gives way. The engines here are the rule's inputs only (their open
requests, their cores' epochs); tests/service/test_data_parallel.py runs the rule on real cores.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from engine.data_parallel import EngineGroup, Routed

BLOCK = 16


@dataclass
class _Engine:
    """What the rule reads of an AsyncLLM."""

    rank: int
    num_open: int = 0
    epoch: int = 0
    is_alive: bool = True
    responsive: bool = True
    hand_over: bool = False
    config: Any = field(default_factory=lambda: SimpleNamespace(block_size=BLOCK))
    info: Any = field(default_factory=lambda: SimpleNamespace(num_kv_blocks=64, kv_windows=[0]))
    processor: Any = None
    tokenizer: Any = None

    def add_stat_logger(self, _: Any) -> None:
        pass


def _group(affinity: int) -> tuple[EngineGroup, list[_Engine]]:
    engines = [_Engine(0), _Engine(1)]
    return EngineGroup(engines, prefix_affinity=affinity), engines  # type: ignore[arg-type]


def _send(group: EngineGroup, prompt: list[int]) -> tuple[int, str]:
    """Route a request and count it open where it went, as generate_prepared does."""
    engine, routed, hashes = group.route(prompt)
    assert engine is not None
    group._sent_since_step[engine.rank] += 1
    group.num_sent[engine.rank] += 1
    engine.num_open += 1  # type: ignore[attr-defined]
    if hashes:
        group._remember(engine.rank, hashes)
    return engine.rank, routed


SHARED = list(range(100, 100 + 4 * BLOCK))


def test_affinity_follows_the_prefix_until_its_engine_is_too_loaded() -> None:
    group, _ = _group(affinity=8)
    assert _send(group, [*SHARED, 1]) == (0, Routed.LOAD)  # nothing held yet: the load rule
    # Engine 0 holds the prefix: the next go there while its load is within 8 of engine 1's
    # (each waiting request counts 4): 4, then 8 ...
    assert [_send(group, [*SHARED, 2 + i]) for i in range(2)] == [(0, Routed.PREFIX)] * 2
    # ... then 12 against 0: too loaded; the load rule sends it to engine 1, which then holds
    # the prefix too, and the less loaded of the two holders takes the next.
    assert _send(group, [*SHARED, 9]) == (1, Routed.LOAD)
    assert _send(group, [*SHARED, 10]) == (1, Routed.PREFIX)
    # A prompt that shares no full block goes by load; so does one shorter than a block, and
    # one that shares less than half its blocks (a system prompt every prompt starts with).
    assert _send(group, list(range(500, 540)))[1] == Routed.LOAD
    assert _send(group, SHARED[: BLOCK - 1])[1] == Routed.LOAD
    assert _send(group, [*SHARED[:BLOCK], *range(900, 900 + 2 * BLOCK)])[1] == Routed.LOAD


def test_a_restarted_core_holds_nothing_and_off_means_load_alone() -> None:
    group, engines = _group(affinity=100)
    assert _send(group, [*SHARED, 1])[0] == 0
    assert _send(group, [*SHARED, 2]) == (0, Routed.PREFIX)
    engines[0].epoch += 1  # its core restarted: an empty cache
    engines[0].num_open = engines[1].num_open = 0
    group.stepped(0, 0)
    assert _send(group, [*SHARED, 3]) == (1, Routed.LOAD)  # by load (fewer sent), not prefix
    off, _ = _group(affinity=0)
    assert [_send(off, [*SHARED, i])[0] for i in range(4)] == [0, 1, 0, 1]
    assert off.route([*SHARED, 5])[2] == []  # no hashing when off
