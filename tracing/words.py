"""The words of a diagnosis: what each part means to an operator and the knob that moves it."""

from __future__ import annotations

# part -> (what the time was, what to do about it)
WHAT = {
    "http": (
        "receiving and parsing the HTTP request",
        "a slow client upload or a busy API process (see event-loop lag)",
    ),
    "frontend": (
        "frontend CPU (chat template, tokenize) before reaching the engine",
        "long prompts and chat histories cost template and tokenizer time in the API "
        "process; shorten or cache them, or give the API process more CPU",
    ),
    "admission": (
        "waiting for an admission slot",
        "raise --max-concurrent-requests if the engine has room",
    ),
    "loop_lag": (
        "event-loop lag in the API process",
        "something blocks the API event loop (CPU-heavy work in a handler, a large "
        "tokenization); see the pauses table",
    ),
    "ipc": (
        "reaching the core (IPC and the core's input queue)",
        "the core takes new requests between steps, so arrivals wait for the step in "
        "flight: long steps (cap them with --max-num-batched-tokens) or CPU contention "
        "lengthen this",
    ),
    "queue": ("waiting in the core's queue", ""),
    "grammar_compile": (
        "waiting for its grammar to compile (structured outputs)",
        "compiled grammars are cached by schema: reuse the same schemas; with --no-warmup the "
        "first grammar after start also loads the tokenizer the grammar engine needs",
    ),
    "grammar_mask": (
        "computing structured outputs' token masks in the steps it shared",
        "every row in a step waits for the masks of the rows under a grammar: simpler "
        "schemas (fewer alternatives, bounded strings) cost less per token",
    ),
    "neighbour_prefill": (
        "other requests' prefill in the steps it shared",
        "a smaller --max-num-batched-tokens caps how much prefill one step carries",
    ),
    "decode": ("the batch's other rows in the steps it shared", ""),
    "own_prefill": ("its own prefill", ""),
    "chunk_wait": (
        "waiting between its prefill chunks",
        "a larger --max-num-batched-tokens prefills a long prompt in fewer steps",
    ),
    "schedule": (
        "scheduler CPU",
        "the scheduler's cost grows with running requests and prefix-cache lookups; "
        "profile the core process",
    ),
    "output": (
        "building and sending outputs in the core",
        "output building grows with the batch; a frontend slow to read the core's "
        "socket shows here too",
    ),
    "gc": (
        "garbage-collection pauses",
        "fewer allocations per step (LUMEN_GC=serving, the default, freezes the start-up heap); "
        "see the pauses table",
    ),
    "emit": (
        "getting outputs back to the frontend, detokenizing and emitting",
        "CPU contention in the API process (detokenize, stop strings; see event-loop lag)",
    ),
    "delivery": ("delivery to the client", "a slow reader"),
    "between_steps": (
        "the core between its steps",
        "the core takes new requests and aborts between steps, and a request "
        "left out of a step (token budget) waits here",
    ),
    "preempted": (
        "waiting after a preemption (recompute)",
        "more KV blocks (--num-kv-blocks or --kv-cache-memory-bytes) or a lower "
        "--max-num-seqs avoid preemption",
    ),
    "unattributed": (
        "time no recorded boundary explains",
        "the trace lacks a boundary there (an older trace db, or a request that "
        "never got that far)",
    ),
}

# steps.wait_reason -> (what held the queue, what to do)
QUEUE_LIMITS: dict[str | None, tuple[str, str]] = {
    "max_num_seqs": (
        "max_num_seqs (the running batch was full)",
        "raise --max-num-seqs if KV blocks allow, or add capacity",
    ),
    "kv_blocks": (
        "KV blocks (none free for its prompt)",
        "give the KV cache more blocks: --num-kv-blocks or --kv-cache-memory-bytes",
    ),
    "token_budget": (
        "token_budget (the step's --max-num-batched-tokens was spent)",
        "raise --max-num-batched-tokens",
    ),
    "preemption": (
        "preemption (preempted requests went first)",
        "more KV blocks (--num-kv-blocks or --kv-cache-memory-bytes) avoid preemption",
    ),
    None: (
        "no recorded limit (load above capacity?)",
        "add capacity, or check --max-num-seqs, --num-kv-blocks and --max-num-batched-tokens",
    ),
}


def ms(ns: float) -> str:
    """Milliseconds as every sentence and table writes them (one decimal)."""
    return f"{ns / 1e6:,.1f} ms"


def tokens_of(n: int) -> str:
    return f"{n:,}"


def count(n: int, noun: str) -> str:
    """'1 request', '3 requests'."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"
