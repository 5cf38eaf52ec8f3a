"""How the words name a step: as counted on its engine and core, with the id to look it up by."""

from __future__ import annotations

from engine.core.engine_core_proc import STEP_EPOCH_BITS, STEP_RANK_BITS
from tracing.words import step_name


def test_a_step_of_another_engine_or_a_restarted_core_is_named_as_counted() -> None:
    assert step_name(39) == "step 39"
    engine_1 = (1 << STEP_RANK_BITS) | 39
    assert step_name(engine_1) == f"step 39 of engine 1 (step_id {engine_1})"
    restarted = (2 << STEP_EPOCH_BITS) | 5
    assert step_name(restarted) == f"step 5 after 2 restarts (step_id {restarted})"
    both = (3 << STEP_RANK_BITS) | (1 << STEP_EPOCH_BITS) | 7
    assert step_name(both) == f"step 7 of engine 3 after 1 restart (step_id {both})"
