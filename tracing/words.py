"""The words of a diagnosis: the parts' words (from ``tracing.parts``), the queue's limits, and
how every sentence writes a number."""

from __future__ import annotations

from tracing.parts import PARTS

# part -> (what the time was, what to do about it), from the registry in tracing.parts
WHAT: dict[str, tuple[str, str]] = {p.key: (p.what, p.knob) for p in PARTS}

# steps.wait_reason -> (what held the queue, what to do)
QUEUE_LIMITS: dict[str | None, tuple[str, str]] = {
    "max_num_seqs": (
        "max_num_seqs (the running batch was full)",
        "raise --max-num-seqs if KV blocks allow, or add capacity",
    ),
    "kv_blocks": (
        "KV blocks (none free for its prompt)",
        "give the KV cache more blocks: --num-kv-blocks or --kv-cache-memory-bytes, or "
        "smaller ones in the same memory: --kv-cache-dtype int8",
    ),
    "token_budget": (
        "token_budget (the step's --max-num-batched-tokens was spent)",
        "raise --max-num-batched-tokens",
    ),
    "preemption": (
        "preemption (preempted requests went first)",
        "more KV blocks (--num-kv-blocks or --kv-cache-memory-bytes; --kv-cache-dtype int8 "
        "stores a token in about a quarter of fp32's bytes) avoid preemption",
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


def count(n: int, noun: str, plural: str | None = None) -> str:
    """'1 request', '3 requests' ('2 bodies' with ``plural``)."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"
