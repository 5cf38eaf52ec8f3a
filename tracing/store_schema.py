"""The trace store's tables: every column, its type and what it holds (the reference page
docs/reference/store.md is built from these rows), and the migration that added it
(tracing/store.py applies them in order). Times ``*_ns`` are Unix epoch nanoseconds; NULL is
"not seen" (offline, or the request never got that far)."""

from __future__ import annotations

Row = tuple[str, str, str]  # column, type, what it holds


def _types(rows: list[Row]) -> dict[str, str]:
    return {name: typ for name, typ, _ in rows}


REQUEST_ROWS: list[Row] = [
    ("run_id", "VARCHAR", "the run (one server start) it belongs to"),
    ("request_id", "VARCHAR", "the id its response carried (cmpl-..., chatcmpl-...)"),
    ("trace_id", "VARCHAR", "its OpenTelemetry trace id"),
    ("root_span_id", "VARCHAR", "its root span's id"),
    ("client_request_id", "VARCHAR", "the caller's X-Request-Id, where it sent one"),
    (
        "endpoint",
        "VARCHAR",
        "the route it came by (/v1/chat/completions, /v1/completions, offline)",
    ),
    ("model", "VARCHAR", "the model name it asked for"),
    ("arrival_ns", "BIGINT", "the frontend took it (frontend.enqueue's start)"),
    ("prompt_tokens", "INTEGER", "its prompt's tokens"),
    ("output_tokens", "INTEGER", "tokens it generated"),
    ("cached_tokens", "INTEGER", "prompt tokens found in the prefix cache"),
    ("num_preemptions", "INTEGER", "times the scheduler preempted it"),
    ("params", "JSON", "its sampling parameters"),
    ("stream", "BOOLEAN", "whether it streamed"),
    ("priority", "BIGINT", "its priority (--scheduling-policy priority)"),
    ("finish_reason", "VARCHAR", "stop, length, abort or error"),
    ("status", "VARCHAR", "ok, aborted or error"),
    ("error", "VARCHAR", "the error's message, where it failed"),
    ("ttft_ns", "BIGINT", "time to its first token, from arrival_ns"),
    ("e2e_ns", "BIGINT", "its whole time, from arrival_ns"),
    ("queue_ns", "BIGINT", "its time waiting in the scheduler's queue"),
    # What replay needs, per --trace-prompts (prompt text is never stored).
    ("prompt_block_size", "INTEGER", "tokens a prompt block hash covers (--trace-prompts hashes)"),
    ("prompt_block_hashes", "BIGINT[]", "its prompt's block hashes (--trace-prompts hashes)"),
    ("prompt_token_ids", "INTEGER[]", "its prompt's token ids (--trace-prompts tokens)"),
    # Migration 2: the whole life of a request, from the first byte the server read to the
    # last byte its socket accepted.
    ("http_start_ns", "BIGINT", "the server read the request's first byte"),
    ("handler_ns", "BIGINT", "body read and validated: the route's handler began"),
    ("sent_ns", "BIGINT", "handed to the engine client (frontend.enqueue's end)"),
    ("received_ns", "BIGINT", "the core dequeued it (core.receive's end)"),
    ("first_scheduled_ns", "BIGINT", "its first step began (core.queue's end)"),
    ("admission_wait_ns", "BIGINT", "waiting for an admission slot (part of frontend.enqueue)"),
    ("first_delivered_ns", "BIGINT", "the first chunk with output was accepted by the transport"),
    ("last_delivered_ns", "BIGINT", "the response's last byte was accepted by the transport"),
    ("delivered_ttft_ns", "BIGINT", "first_delivered_ns - (http_start_ns or arrival_ns)"),
    ("send_wait_ns", "BIGINT", "summed time the server's writes waited for the client's socket"),
    ("bytes_sent", "BIGINT", "bytes of its response the transport accepted"),
    ("kv_freed_ns", "BIGINT", "the core freed its KV blocks (finish, abort or error)"),
    # Migration 3: the first and last step the trace writer saw it in (the spans view derives
    # the steps between), and each output step's frontend.emit, as small integers.
    ("parent_span_id", "VARCHAR", "its root span's parent, from an incoming traceparent"),
    ("first_step_id", "BIGINT", "the first step it took part in"),
    ("last_step_id", "BIGINT", "the last step it took part in"),
    (
        "emit_step_deltas",
        "INTEGER[]",
        "each emit's step, after the previous (first: after first_step_id)",
    ),
    (
        "emit_received_us",
        "BIGINT[]",
        "the frontend received each emit, us after the previous (first: after arrival_ns)",
    ),
    ("emit_delivery_us", "INTEGER[]", "each emit, from received to delivered to the caller, us"),
    # Migration 4: structured outputs.
    (
        "grammar",
        "VARCHAR",
        (
            "its grammar's kind: json_schema, json_object, regex, choice, "
            "grammar, tool_call (NULL: none)"
        ),
    ),
    (
        "grammar_ready_ns",
        "BIGINT",
        "its grammar was ready (core.grammar runs from received_ns to it)",
    ),
    ("grammar_compile_ns", "BIGINT", "its grammar's compile (0: from the cache)"),
    ("grammar_cached", "BOOLEAN", "whether the grammar cache had it"),
    ("grammar_mask_ns", "BIGINT", "token masks of the steps it took part in (anyone's grammar)"),
    # Migration 5: from body_read_ns to handler_ns the API process decoded and validated it.
    ("body_bytes", "BIGINT", "its request body's size"),
    ("body_read_ns", "BIGINT", "its body was read whole"),
    # Migration 7.
    (
        "sample_weight",
        "DOUBLE",
        (
            "requests of its run this row stands for, in a store rebuilt "
            "from a sampled window of a fleet's traces (replay import; "
            "NULL: all kept)"
        ),
    ),
    # Migration 8.
    (
        "end_code",
        "VARCHAR",
        (
            "what ended it where it did not finish "
            "(engine.errors.END_CODES, or the API error code of a "
            "refusal: queue_full, queue_timeout, engine_restarting, ...)"
        ),
    ),
    (
        "resent_ns",
        "BIGINT",
        (
            "sent again to a new engine core, having sent its client "
            "nothing when its core failed (sent_ns stays the first send)"
        ),
    ),
    # Migration 10.
    (
        "engine",
        "INTEGER",
        "the data-parallel engine that served it (--data-parallel-size; the last it was sent to)",
    ),
    # Migration 11.
    (
        "routed",
        "VARCHAR",
        (
            "why it went to that engine: load (the lowest 4 x waiting + running), prefix "
            "(--data-parallel-prefix-affinity: its prompt's leading blocks were sent there), "
            "pinned (X-data-parallel-rank), handed (sent again after an engine failed it "
            "before output); "
            "NULL: one engine"
        ),
    ),
    # Migration 13.
    (
        "lora_name",
        "VARCHAR",
        "the LoRA adapter it ran with (--enable-lora; NULL: the base model); model keeps the "
        "name it asked for",
    ),
]
SPAN_ROWS: list[Row] = [
    ("run_id", "VARCHAR", "the run"),
    ("request_id", "VARCHAR", "the request"),
    ("trace_id", "VARCHAR", "its OpenTelemetry trace id"),
    ("span_id", "VARCHAR", "the span's id"),
    ("parent_span_id", "VARCHAR", "its parent span's id"),
    (
        "name",
        "VARCHAR",
        (
            "the boundary: frontend.enqueue, core.receive, core.queue, "
            "core.schedule, worker.execute, core.output, frontend.emit, "
            "..."
        ),
    ),
    ("start_ns", "BIGINT", "it began"),
    ("end_ns", "BIGINT", "it ended"),
    ("step_id", "BIGINT", "the engine step it belongs to (NULL: none)"),
    ("attributes", "JSON", "its attributes"),
]
STEP_ROWS: list[Row] = [
    ("run_id", "VARCHAR", "the run"),
    (
        "step_id",
        "BIGINT",
        "the step (engine r's from r << 56; from epoch << 40 after its core's restarts)",
    ),
    ("schedule_start_ns", "BIGINT", "the scheduler began"),
    ("schedule_end_ns", "BIGINT", "the scheduler ended"),
    ("execute_start_ns", "BIGINT", "the forward began"),
    ("execute_end_ns", "BIGINT", "the forward and sampler ended"),
    ("output_ns", "BIGINT", "the step's outputs left the core"),
    ("num_running", "INTEGER", "requests running"),
    ("num_waiting", "INTEGER", "requests waiting"),
    ("num_scheduled_tokens", "INTEGER", "tokens scheduled"),
    ("num_prefill_tokens", "INTEGER", "of them prompt tokens"),
    ("num_decode_tokens", "INTEGER", "of them decode tokens"),
    ("num_preemptions", "INTEGER", "requests preempted this step"),
    ("kv_blocks_used", "INTEGER", "KV blocks in use"),
    ("kv_blocks_total", "INTEGER", "KV blocks in all"),
    ("prefix_query_tokens", "INTEGER", "prompt tokens looked up in the prefix cache"),
    ("prefix_hit_tokens", "INTEGER", "of them found"),
    # Who took part (core request ids) and how many tokens each was scheduled.
    ("request_ids", "VARCHAR[]", "the core ids of the requests it scheduled"),
    ("num_scheduled", "INTEGER[]", "tokens each was scheduled"),
    ("preempted_request_ids", "VARCHAR[]", "the core ids it preempted"),
    # Migration 2.
    ("update_end_ns", "BIGINT", "outputs built (update_from_output's end); core.output follows"),
    (
        "wait_reason",
        "VARCHAR",
        "what held waiting requests back this step (engine.core WAIT_REASONS)",
    ),
    (
        "kv_blocks_freed_finish",
        "INTEGER",
        "blocks freed since the previous record by requests that finished",
    ),
    ("kv_blocks_freed_abort", "INTEGER", "... by aborts"),
    ("kv_blocks_freed_preempt", "INTEGER", "... by preemptions"),
    ("idle", "BOOLEAN", "no batch: a record of the KV state after aborts emptied the engine"),
    ("gc_pause_ns", "BIGINT", "the core's garbage-collection pauses in this step"),
    # Migration 4: computed between schedule_end_ns and execute_start_ns.
    ("grammar_mask_ns", "BIGINT", "the token masks of the rows sampling under a grammar"),
    ("grammar_rows", "INTEGER", "rows with a grammar"),
    # Migration 5: the sampler's share of execute (the rest is the forward, the greedy head's
    # LM head included).
    (
        "sample_ns",
        "BIGINT",
        "sampling on the full logits (penalties, grammar masks applied, temperature, top-k/p)",
    ),
    ("logprobs_ns", "BIGINT", "logprobs"),
    ("logprobs_rows", "INTEGER", "rows that asked for logprobs"),
    ("max_logprobs", "INTEGER", "the most logprobs a row asked per token"),
    # Migration 12: speculative decoding (--speculative-config).
    (
        "num_drafted",
        "INTEGER[]",
        "drafts each request verified, per request_ids row (null: no row verified any); its "
        "tokens in num_scheduled are 1 + these",
    ),
    (
        "num_accepted",
        "INTEGER[]",
        "of them kept (the request's output tokens this step: these + 1); the rest were "
        "thrown away, never output",
    ),
    ("propose_ns", "BIGINT", "the proposer's time for the next step's drafts (inside execute)"),
    (
        "spec_tokens",
        "INTEGER",
        "drafts a request could propose this step (0: the batch-size rule let none; null: no "
        "speculative decoding)",
    ),
    # Migration 13: LoRA adapters (--enable-lora).
    ("loras", "VARCHAR[]", "the LoRA adapters its rows ran with (null: the base model alone)"),
]
RUN_ROWS: list[Row] = [
    ("run_id", "VARCHAR", "the run: one server (or LLM) start"),
    ("started_ns", "BIGINT", "it started"),
    ("model", "VARCHAR", "the model served"),
    ("version", "VARCHAR", "Lumen's version"),
    ("max_model_len", "INTEGER", "the context length"),
    ("num_kv_blocks", "INTEGER", "KV blocks"),
    ("block_size", "INTEGER", "tokens a KV block holds"),
    ("engine_config", "JSON", "the engine's configuration"),
    (
        "trace_prompts",
        "VARCHAR",
        "what was kept of prompts: none, hashes or tokens (--trace-prompts)",
    ),
    # Migration 3.
    (
        "span_layout",
        "VARCHAR",
        (
            "steps: per-step spans live in steps and requests.emit_*, the "
            "spans view derives them; NULL: every span is a row of "
            "span_rows"
        ),
    ),
    # Migration 5.
    (
        "step_prior",
        "DOUBLE[]",
        (
            "the warm-up's price of a step, [a, b, c, f, g] ns of execute = a + "
            "b x prefill tokens + c x rows, plus f x rows + g on a step on the full logits "
            "(the diagnosis's prior; older stores hold [a, b, c, f] or [a, b, c])"
        ),
    ),
    # Migration 6.
    ("replica", "VARCHAR", "the replica that recorded it (its service.instance.id)"),
    # Migration 9.
    (
        "kv_windows",
        "INTEGER[]",
        "per KV group, its sliding window in tokens (0: it keeps every block); NULL: not told",
    ),
    ("kv_group_size", "INTEGER", "layers per KV group: the layers a block holds"),
    (
        "kv_max_concurrency",
        "DOUBLE",
        "requests of max_model_len tokens the KV cache held at once (windows' freeing counted)",
    ),
    # Migration 10.
    (
        "data_parallel_size",
        "INTEGER",
        "its engines (--data-parallel-size): a step's is step_id >> 56, a request's engine",
    ),
]
# Migration 3: the core ids of a request that ran as several ("ID-i": prompts and samples),
# so that the steps table's request_ids map to requests. A lone core id is the request id.
CHILD_ROWS: list[Row] = [
    ("run_id", "VARCHAR", "the run"),
    ("core_id", "VARCHAR", "a core id of the request (ID-i)"),
    ("request_id", "VARCHAR", "the request"),
    ("seq", "INTEGER", "which of its prompts or samples"),
]
PAUSE_ROWS: list[Row] = [
    ("run_id", "VARCHAR", "the run"),
    ("process", "VARCHAR", "api or core"),
    ("kind", "VARCHAR", "gc, loop_lag, or cpu (the API process busy: not a pause)"),
    ("start_ns", "BIGINT", "it began"),
    ("duration_ns", "BIGINT", "how long"),
    ("detail", "VARCHAR", "gc: the generation collected"),
    # Migration 14.
    ("cpu_ns", "BIGINT", "cpu: the process's CPU time in it (all its threads)"),
]
# Migration 6 (service/lifecycle.py).
LIFECYCLE_ROWS: list[Row] = [
    ("run_id", "VARCHAR", "the run"),
    ("kind", "VARCHAR", "drain, restart or crash_loop"),
    ("cause", "VARCHAR", "the signal, or why the engine core failed"),
    ("start_ns", "BIGINT", "the signal came, or the core was found dead or hung"),
    ("end_ns", "BIGINT", "the drain ended, or the new core was warm and ready"),
    ("epoch", "INTEGER", "the core serving after it (its steps are numbered from epoch << 40)"),
    ("num_finished", "INTEGER", "drain: in flight, finished within --shutdown-timeout"),
    ("num_failed", "INTEGER", "drain: aborted at the timeout; restart: failed with the core"),
    # Migration 10.
    ("engine", "INTEGER", "restart and crash_loop: the data-parallel engine (NULL: a drain)"),
]
REQUEST_COLUMNS = _types(REQUEST_ROWS)
SPAN_COLUMNS = _types(SPAN_ROWS)
STEP_COLUMNS = _types(STEP_ROWS)
RUN_COLUMNS = _types(RUN_ROWS)
CHILD_COLUMNS = _types(CHILD_ROWS)
PAUSE_COLUMNS = _types(PAUSE_ROWS)
LIFECYCLE_COLUMNS = _types(LIFECYCLE_ROWS)
TABLES = {
    "runs": RUN_COLUMNS,
    "requests": REQUEST_COLUMNS,
    "span_rows": SPAN_COLUMNS,  # the spans stored as rows; users query the spans view
    "steps": STEP_COLUMNS,
    "pauses": PAUSE_COLUMNS,
    "request_children": CHILD_COLUMNS,
    "lifecycle": LIFECYCLE_COLUMNS,
}
# What each table holds, and its rows (the reference page).
TABLE_DOCS: dict[str, tuple[str, list[Row]]] = {
    "runs": ("one row a server (or LLM) start", RUN_ROWS),
    "requests": ("one row a request: its whole life, boundary by boundary", REQUEST_ROWS),
    "steps": ("one row an engine step", STEP_ROWS),
    "span_rows": (
        "spans stored as rows (query the spans view, which adds the per-step spans)",
        SPAN_ROWS,
    ),
    "pauses": (
        "garbage-collection pauses and event-loop lags of the API process and the core, and "
        "the API process's busy stretches (at least half a core for 20 ms)",
        PAUSE_ROWS,
    ),
    "request_children": (
        "the core ids of a request that ran as several (prompts, samples)",
        CHILD_ROWS,
    ),
    "lifecycle": ("the server's drains, engine restarts and crash loops", LIFECYCLE_ROWS),
}


SCHEMA_VERSION = 14  # the last migration (tracing/store_migrations.py MIGRATIONS)


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
    9: {"runs": _from(RUN_COLUMNS, "kv_windows", "kv_max_concurrency")},
    10: {
        "requests": _from(REQUEST_COLUMNS, "engine", "engine"),
        "lifecycle": _from(LIFECYCLE_COLUMNS, "engine", "engine"),
        "runs": _from(RUN_COLUMNS, "data_parallel_size", "data_parallel_size"),
    },
    11: {"requests": _from(REQUEST_COLUMNS, "routed", "routed")},
    12: {"steps": _from(STEP_COLUMNS, "num_drafted", "spec_tokens")},
    13: {
        "requests": _from(REQUEST_COLUMNS, "lora_name", "lora_name"),
        "steps": _from(STEP_COLUMNS, "loras", "loras"),
    },
    14: {"pauses": _from(PAUSE_COLUMNS, "cpu_ns", "cpu_ns")},
}


def columns_at(table: str, version: int) -> list[str]:
    """The columns ``table`` had once migration ``version`` ran (in the order they have now)."""
    later = {c for v, added in ADDED_IN.items() if v > version for c in added.get(table, [])}
    return [c for c in TABLES[table] if c not in later]
