"""The trace store's rows of the engine's own records: a step's (its StepRecord, as the
steps table holds it) and a run's (what the engine reported when it started)."""

from __future__ import annotations

import time
from typing import Any

import msgspec

from engine.kv_layout import kv_capacity
from engine.messages import EngineInfo
from tracing.config import TracingConfig


def step_row(run_id: str, s: Any) -> tuple[Any, ...]:
    """A steps row (store_schema.STEP_COLUMNS, in order) of a StepRecord."""
    return (
        run_id, s.step_id, s.schedule_start_ns, s.schedule_end_ns, s.execute_start_ns,
        s.execute_end_ns, s.output_ns, s.num_running, s.num_waiting, s.num_scheduled_tokens,
        s.num_prefill_tokens, s.num_decode_tokens, s.num_preemptions, s.num_kv_blocks_used,
        s.num_kv_blocks_total, s.num_prefix_query_tokens, s.num_prefix_hit_tokens,
        list(s.req_ids), list(s.num_scheduled), list(s.preempted_req_ids),
        s.update_end_ns or None, s.wait_reason or None, *(s.num_blocks_freed or (0, 0, 0)),
        s.idle, s.gc_pause_ns, s.grammar_mask_ns or None, s.num_grammar_rows or None,
        s.sample_ns, s.logprobs_ns, s.num_logprobs_rows, s.max_logprobs,
        list(s.num_drafted) or None, list(s.num_accepted) or None, s.propose_ns or None,
        s.num_spec_tokens if s.num_spec_tokens >= 0 else None, list(s.loras) or None,
    )  # fmt: skip


def run_row(
    run_id: str,
    info: EngineInfo,
    engine_config: Any,
    config: TracingConfig,
    replica: str,
    data_parallel_size: int = 1,
) -> tuple[Any, ...]:
    """The runs row (store_schema.RUN_COLUMNS, in order) of a server or LLM that starts."""
    try:
        cfg = msgspec.json.encode(engine_config).decode() if engine_config is not None else None
    except TypeError:
        cfg = None
    return (
        run_id, time.time_ns(), info.model, info.version, info.max_model_len, info.num_kv_blocks,
        info.block_size, cfg, config.trace_prompts, "steps", list(info.step_prior) or None,
        replica, list(info.kv_windows) or None, info.kv_group_size or None,
        _max_concurrency(info), data_parallel_size,
    )  # fmt: skip


def _max_concurrency(info: EngineInfo) -> float | None:
    if not info.kv_group_size:
        return None
    return kv_capacity(
        info.kv_windows, info.kv_group_size, info.num_kv_blocks, info.block_size,
        info.max_model_len,
    ).max_concurrency  # fmt: skip
