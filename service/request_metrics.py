"""The server's timing of one response, for its caller: vLLM's per-request ``metrics`` object
(its field names: ``--enable-per-request-metrics`` on the server, or the request's own
``include_metrics``; ``stream_options.include_timing`` is an alias) and the ``Server-Timing``
header of a whole response, from the same figures.

TTFT as the server saw it: from the first byte it read to the first token delivered (a stream:
its first chunk with output accepted by the client's socket; a whole response: its first token
ready at the frontend). Measured, not modelled: the parts are the spans between these instants,
each clamped to the one before, so they sum to it exactly::

    receive         first byte read -> the route's handler began (the body read and decoded)
    frontend        -> handed to the engine (chat template, tokenizer, admission wait)
    step_in_flight  -> the core took it (IPC, and the step the core was running: it takes new
                       requests between steps)
    queue           -> its first step began (waiting for a slot, KV blocks or token budget)
    prefill         -> its first token reached the frontend (its prefill steps, and back)
    delivery        -> that token's chunk was accepted by the client's socket (0: not a stream)

vLLM's fields keep their names: ``time_to_first_token_ms`` is this TTFT (vLLM's own counts from
the first step), ``queue_time_ms`` the core's queue, ``generation_time_ms`` first -> last token,
``mean_itl_ms``, ``tokens_per_second`` (output tokens over first step -> last token). For several
prompts or samples, the figures are those of the one whose first token came first (what the
client saw first), named by ``request_id``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

PARTS = ("receive", "frontend", "step_in_flight", "queue", "prefill", "delivery")


def request_metrics(
    timings: Sequence[tuple[str, dict[str, Any]]],
    *,
    http_start_ns: int,
    handler_ns: int,
    first_delivered_ns: int,
    num_tokens: int,
    now_ns: int,
) -> dict[str, Any]:
    """The metrics object of a response whose prompts finished with ``timings`` (each engine
    request's id and its final output's instants, engine.output_processor's ``timing``)."""
    done = [(rid, t) for rid, t in timings if t.get("first_token_ns")]
    if not done:
        return {"time_to_first_token_ms": None, "total_ms": _ms(now_ns - http_start_ns)}
    rid, t = min(done, key=lambda x: x[1]["first_token_ns"])
    first, last = t["first_token_ns"], t.get("last_token_ns") or t["first_token_ns"]
    instants = [http_start_ns, handler_ns, t.get("sent_ns", 0), t.get("queued_ns", 0),
                t.get("scheduled_ns", 0), first, first_delivered_ns or first]  # fmt: skip
    at = http_start_ns
    parts = {}
    for name, instant in zip(PARTS, instants[1:]):
        end = max(int(instant or at), at)
        parts[name] = _ms(end - at)
        at = end
    n = int(t.get("num_generation_tokens") or num_tokens)  # its own (n > 1: its samples')
    scheduled = t.get("scheduled_ns") or first
    out: dict[str, Any] = {
        "time_to_first_token_ms": _ms(at - http_start_ns),
        "generation_time_ms": _ms(last - first),
        "queue_time_ms": parts["queue"],
        "mean_itl_ms": _ms((last - first) / (n - 1)) if n > 1 else None,
        "tokens_per_second": round(n / ((last - scheduled) / 1e9), 1) if last > scheduled else None,
        "ttft_parts_ms": parts,
        "total_ms": _ms(now_ns - http_start_ns),
    }
    if len(timings) > 1:
        out["request_id"] = rid
    return out


def server_timing_header(metrics: dict[str, Any]) -> str:
    """Server-Timing of a whole response: its TTFT (for several prompts, ``desc`` names whose),
    the TTFT's parts, decode and total, in milliseconds."""
    ttft = metrics.get("time_to_first_token_ms")
    desc = f';desc="{metrics["request_id"]}"' if "request_id" in metrics else ""
    items = [f"ttft;dur={ttft}{desc}"] if ttft is not None else []
    items += [f"{k};dur={v}" for k, v in metrics.get("ttft_parts_ms", {}).items()]
    if metrics.get("generation_time_ms") is not None:
        items.append(f"decode;dur={metrics['generation_time_ms']}")
    items.append(f"total;dur={metrics['total_ms']}")
    return ", ".join(items)


def _ms(ns: float) -> float:
    return round(ns / 1e6, 3)


def spec_decode_metrics(timing: dict[str, Any], *, detailed: bool) -> dict[str, Any] | None:
    """``metrics.speculative_decoding`` of a request whose steps verified drafts (None: it
    verified none), from its final output's counts (engine/output_processor.py). A step that
    verifies k drafts and keeps a of them gives a + 1 tokens: ``mean_acceptance_length`` is
    that, averaged over its steps that verified drafts; ``acceptance_histogram[a]`` counts the
    steps that kept a."""
    steps = timing.get("spec_steps")
    if not steps:
        return None
    drafted, kept = timing["spec_draft_tokens"], timing["spec_accepted_tokens"]
    hist = list(timing["spec_histogram"])
    out: dict[str, Any] = {
        "num_spec_steps": steps,
        "num_draft_tokens": drafted,
        "num_accepted_tokens": kept,
        "draft_acceptance_rate": round(kept / drafted, 4) if drafted else None,
        "mean_acceptance_length": round(1 + kept / steps, 4),
        "acceptance_histogram": hist,
    }
    if detailed:  # kept drafts are each step's first ones: position j kept where a > j
        positions = int(timing.get("spec_max_drafts") or len(hist) - 1)
        out["accepted_per_position"] = [sum(hist[j + 1 :]) for j in range(positions)]
    return out
