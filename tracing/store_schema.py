"""The trace store's tables: every column, its type and what it holds, and the migration
that added it (tracing/store.py applies them in order)."""

from __future__ import annotations

REQUEST_COLUMNS = {
    "run_id": "VARCHAR",
    "request_id": "VARCHAR",
    "trace_id": "VARCHAR",
    "root_span_id": "VARCHAR",
    "client_request_id": "VARCHAR",
    "endpoint": "VARCHAR",
    "model": "VARCHAR",
    "arrival_ns": "BIGINT",
    "prompt_tokens": "INTEGER",
    "output_tokens": "INTEGER",
    "cached_tokens": "INTEGER",
    "num_preemptions": "INTEGER",
    "params": "JSON",
    "stream": "BOOLEAN",
    "priority": "BIGINT",
    "finish_reason": "VARCHAR",
    "status": "VARCHAR",  # ok | aborted | error
    "error": "VARCHAR",
    "ttft_ns": "BIGINT",
    "e2e_ns": "BIGINT",
    "queue_ns": "BIGINT",
    # What replay needs, per --trace-prompts (prompt text is never stored).
    "prompt_block_size": "INTEGER",
    "prompt_block_hashes": "BIGINT[]",
    "prompt_token_ids": "INTEGER[]",
    # Migration 2: the whole life of a request, from the first byte the server read to the
    # last byte its socket accepted (NULL where not seen: offline, or never got that far).
    "http_start_ns": "BIGINT",  # the server read the request's first byte
    "handler_ns": "BIGINT",  # body read and validated: the route's handler began
    "sent_ns": "BIGINT",  # handed to the engine client (frontend.enqueue's end)
    "received_ns": "BIGINT",  # the core dequeued it (core.receive's end)
    "first_scheduled_ns": "BIGINT",  # its first step began (core.queue's end)
    "admission_wait_ns": "BIGINT",  # waiting for an admission slot (part of frontend.enqueue)
    "first_delivered_ns": "BIGINT",  # the first chunk with output was accepted by the transport
    "last_delivered_ns": "BIGINT",  # the response's last byte was accepted by the transport
    "delivered_ttft_ns": "BIGINT",  # first_delivered_ns - (http_start_ns or arrival_ns)
    "send_wait_ns": "BIGINT",  # summed time the server's writes waited for the client's socket
    "bytes_sent": "BIGINT",
    "kv_freed_ns": "BIGINT",  # the core freed its KV blocks (finish, abort or error)
    # Migration 3: the root span's parent, the first and last step the trace writer saw the
    # request in (the spans view derives the steps between), and each output step's
    # frontend.emit, together and small (integers that bit-pack to a few bits each; the spans
    # view adds them back up):
    "parent_span_id": "VARCHAR",  # from an incoming traceparent
    "first_step_id": "BIGINT",
    "last_step_id": "BIGINT",
    "emit_step_deltas": "INTEGER[]",  # the emit's step, after the previous (first_step_id)
    "emit_received_us": "BIGINT[]",  # the frontend received it, us after the previous (arrival)
    "emit_delivery_us": "INTEGER[]",  # from received to delivered to the caller, us
    # Migration 4: structured outputs. The grammar's kind (json_schema, json_object, regex,
    # choice, grammar, tool_call; NULL: none), when it was ready (the core.grammar span runs
    # from received_ns to it), how long its compile took (0: from the cache) and whether the
    # cache had it.
    "grammar": "VARCHAR",
    "grammar_ready_ns": "BIGINT",
    "grammar_compile_ns": "BIGINT",
    "grammar_cached": "BOOLEAN",
    "grammar_mask_ns": "BIGINT",  # token masks of the steps it took part in (anyone's grammar)
    # Migration 5: the request body, its size and when it was read whole; from then to
    # handler_ns the API process decoded and validated its JSON.
    "body_bytes": "BIGINT",
    "body_read_ns": "BIGINT",
    # Migration 7: how many requests of its run this row stands for, in a store rebuilt from a
    # sampled window of a fleet's traces (replay import); NULL: every request was kept.
    "sample_weight": "DOUBLE",
    # Migration 8: what ended it where it did not finish (engine.errors.END_CODES, or the API
    # error code of a request refused: queue_full, queue_timeout, engine_restarting, ...), and
    # when it was sent again to a new engine core, having sent its client nothing when its core
    # failed (sent_ns stays the first send: the time between is what the failure cost it).
    "end_code": "VARCHAR",
    "resent_ns": "BIGINT",
}
SPAN_COLUMNS = {
    "run_id": "VARCHAR",
    "request_id": "VARCHAR",
    "trace_id": "VARCHAR",
    "span_id": "VARCHAR",
    "parent_span_id": "VARCHAR",
    "name": "VARCHAR",
    "start_ns": "BIGINT",
    "end_ns": "BIGINT",
    "step_id": "BIGINT",
    "attributes": "JSON",
}
STEP_COLUMNS = {
    "run_id": "VARCHAR",
    "step_id": "BIGINT",
    "schedule_start_ns": "BIGINT",
    "schedule_end_ns": "BIGINT",
    "execute_start_ns": "BIGINT",
    "execute_end_ns": "BIGINT",
    "output_ns": "BIGINT",
    "num_running": "INTEGER",
    "num_waiting": "INTEGER",
    "num_scheduled_tokens": "INTEGER",
    "num_prefill_tokens": "INTEGER",
    "num_decode_tokens": "INTEGER",
    "num_preemptions": "INTEGER",
    "kv_blocks_used": "INTEGER",
    "kv_blocks_total": "INTEGER",
    "prefix_query_tokens": "INTEGER",
    "prefix_hit_tokens": "INTEGER",
    # Who took part (core request ids) and how many tokens each was scheduled.
    "request_ids": "VARCHAR[]",
    "num_scheduled": "INTEGER[]",
    "preempted_request_ids": "VARCHAR[]",
    # Migration 2.
    "update_end_ns": "BIGINT",  # outputs built (update_from_output's end); core.output follows
    "wait_reason": "VARCHAR",  # what held waiting requests back this step (see WAIT_REASONS)
    "kv_blocks_freed_finish": "INTEGER",  # blocks freed since the previous record, by cause
    "kv_blocks_freed_abort": "INTEGER",
    "kv_blocks_freed_preempt": "INTEGER",
    "idle": "BOOLEAN",  # no batch: a record of the KV state after aborts emptied the engine
    "gc_pause_ns": "BIGINT",  # the core's garbage-collection pauses in this step
    # Migration 4: the token masks of the rows sampling under a grammar, computed between
    # schedule_end_ns and execute_start_ns, and how many rows had one.
    "grammar_mask_ns": "BIGINT",
    "grammar_rows": "INTEGER",
    # Migration 5: the sampler's share of execute (the rest is the forward, the greedy head's
    # LM head included): sampling on the full logits (penalties, grammar masks applied,
    # temperature, top-k/p), and logprobs, with the rows that asked and the most asked per token.
    "sample_ns": "BIGINT",
    "logprobs_ns": "BIGINT",
    "logprobs_rows": "INTEGER",
    "max_logprobs": "INTEGER",
}
RUN_COLUMNS = {
    "run_id": "VARCHAR",
    "started_ns": "BIGINT",
    "model": "VARCHAR",
    "version": "VARCHAR",
    "max_model_len": "INTEGER",
    "num_kv_blocks": "INTEGER",
    "block_size": "INTEGER",
    "engine_config": "JSON",
    "trace_prompts": "VARCHAR",
    # Migration 3. "steps": the run's per-step spans live in steps and requests.emit_*, and the
    # spans view derives them; NULL: every span is a row of span_rows (runs recorded before).
    "span_layout": "VARCHAR",
    # Migration 5: the warm-up's price of a step, [a, b, c] ns of execute = a + b * prefill
    # tokens + c * rows (engine.core.warmup); the diagnosis's prior.
    "step_prior": "DOUBLE[]",
    # Migration 6: the replica that recorded the run (its service.instance.id), so that many
    # stores read as one fleet keep every row's origin.
    "replica": "VARCHAR",
}
# Migration 3: the core ids of a request that ran as several ("ID-i": prompts and samples),
# so that the steps table's request_ids map to requests. A lone core id is the request id.
CHILD_COLUMNS = {
    "run_id": "VARCHAR",
    "core_id": "VARCHAR",
    "request_id": "VARCHAR",
    "seq": "INTEGER",
}
PAUSE_COLUMNS = {
    "run_id": "VARCHAR",
    "process": "VARCHAR",  # api | core
    "kind": "VARCHAR",  # gc | loop_lag
    "start_ns": "BIGINT",
    "duration_ns": "BIGINT",
    "detail": "VARCHAR",  # gc: the generation collected
}
# Migration 6: the server's drains, engine restarts and crash loops (service/lifecycle.py).
LIFECYCLE_COLUMNS = {
    "run_id": "VARCHAR",
    "kind": "VARCHAR",  # drain | restart | crash_loop
    "cause": "VARCHAR",  # the signal, or why the engine core failed
    "start_ns": "BIGINT",  # the signal came, or the core was found dead or hung
    "end_ns": "BIGINT",  # the drain ended, or the new core was warm and ready
    "epoch": "INTEGER",  # the core serving after it (its steps are numbered from epoch << 40)
    "num_finished": "INTEGER",  # drain: in flight, finished within --shutdown-timeout
    "num_failed": "INTEGER",  # drain: aborted at the timeout; restart: failed with the core
}
TABLES = {
    "runs": RUN_COLUMNS,
    "requests": REQUEST_COLUMNS,
    "span_rows": SPAN_COLUMNS,  # the spans stored as rows; users query the spans view
    "steps": STEP_COLUMNS,
    "pauses": PAUSE_COLUMNS,
    "request_children": CHILD_COLUMNS,
    "lifecycle": LIFECYCLE_COLUMNS,
}


SCHEMA_VERSION = 8  # the last migration (tracing/store.py MIGRATIONS)


def _from(columns: dict[str, str], first: str, last: str) -> list[str]:
    names = list(columns)
    return names[names.index(first) : names.index(last) + 1]


# Columns each migration added to a table that existed before it (so migrations stay replayable).
ADDED_IN = {
    2: {
        "requests": _from(REQUEST_COLUMNS, "http_start_ns", "kv_freed_ns"),
        "steps": _from(STEP_COLUMNS, "update_end_ns", "gc_pause_ns"),
    },
    3: {
        "requests": _from(REQUEST_COLUMNS, "parent_span_id", "emit_delivery_us"),
        "runs": _from(RUN_COLUMNS, "span_layout", "span_layout"),
    },
    4: {
        "requests": _from(REQUEST_COLUMNS, "grammar", "grammar_mask_ns"),
        "steps": _from(STEP_COLUMNS, "grammar_mask_ns", "grammar_rows"),
    },
    5: {
        "steps": _from(STEP_COLUMNS, "sample_ns", "max_logprobs"),
        "runs": _from(RUN_COLUMNS, "step_prior", "step_prior"),
        "requests": _from(REQUEST_COLUMNS, "body_bytes", "body_read_ns"),
    },
    6: {"runs": _from(RUN_COLUMNS, "replica", "replica")},
    7: {"requests": _from(REQUEST_COLUMNS, "sample_weight", "sample_weight")},
    8: {"requests": _from(REQUEST_COLUMNS, "end_code", "resent_ns")},
}


def columns_at(table: str, version: int) -> list[str]:
    """The columns ``table`` had once migration ``version`` ran (in the order they have now)."""
    later = {c for v, added in ADDED_IN.items() if v > version for c in added.get(table, [])}
    return [c for c in TABLES[table] if c not in later]
