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
    "lora_slots": (
        "LoRA slots (--max-loras adapters were already in the batch; its adapter waited)",
        "raise --max-loras, or send each adapter's requests to fewer replicas (a router that "
        "reads lora_requests_info)",
    ),
    None: (
        "no recorded limit (load above capacity?)",
        "add capacity, or check --max-num-seqs, --num-kv-blocks and --max-num-batched-tokens",
    ),
}


def ms(ns: float) -> str:
    """Milliseconds as every sentence and table writes them (one decimal)."""
    return f"{ns / 1e6:,.1f} ms"


# A restarted core numbers its steps from epoch << 40, data-parallel engine r from r << 56
# (engine/core/engine_core_proc.py): such an id read whole is a 17-digit number.
_EPOCH_SHIFT, _RANK_SHIFT = 40, 56


def step_name(step_id: int) -> str:
    """'step 39', or 'step 39 of engine 1 (step_id 72057594037927975)' and 'step 5 after 1
    restart (step_id ...)' where the id carries an engine or a restart: the step as counted,
    and the id to look it up by."""
    n = step_id & ((1 << _EPOCH_SHIFT) - 1)
    rank, epoch = step_id >> _RANK_SHIFT, (step_id >> _EPOCH_SHIFT) & 0xFFFF
    if not rank and not epoch:
        return f"step {step_id}"
    whose = f" of engine {rank}" if rank else ""
    after = f" after {count(epoch, 'restart')}" if epoch else ""
    return f"step {n}{whose}{after} (step_id {step_id})"


def tokens_of(n: int) -> str:
    return f"{n:,}"


def count(n: int, noun: str, plural: str | None = None) -> str:
    """'1 request', '3 requests' ('2 bodies' with ``plural``)."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"
