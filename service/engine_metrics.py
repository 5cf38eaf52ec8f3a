"""One engine's Prometheus series (its gauges, and its children of each family ServerMetrics
declares with the label ``engine``), and what one output batch of it adds to them."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from typing import Any

from engine.stats import IterationStats

FINISH_REASONS = ("stop", "length", "abort", "error")


def observe_all(histogram: Any, values: Sequence[float]) -> None:
    """``histogram.observe(v)`` for each value, counted per bucket first: one increment per
    bucket touched, not one observe (a lock and a bucket search) per value. A batch's
    inter-token latencies are one per streamed token and mostly fall in one bucket. It reads
    prometheus_client's Histogram internals (``_upper_bounds``, ``_buckets``, ``_sum``);
    tests/service/test_metrics.py holds it to ``observe``."""
    bounds = histogram._upper_bounds  # ascending, the last +Inf
    counts: dict[int, int] = {}
    for v in values:
        i = bisect_left(bounds, v)  # the first bound >= v, as observe's `v <= bound`
        counts[i] = counts.get(i, 0) + 1
    histogram._sum.inc(sum(values))
    for i, n in counts.items():
        histogram._buckets[i].inc(n)


class EngineMetrics:
    """One engine's series (its gauges, and its children of every metric its outputs count),
    and the stat logger its AsyncLLM reports to (``record``)."""

    __slots__ = (
        "e2e", "engine", "gc_pause_core", "generation_tokens", "grammar_compile", "grammar_mask",
        "grammar_rows", "itl", "kv_usage", "logprobs", "metrics", "num_running", "num_waiting",
        "preemptions", "prefix_hits", "prefix_queries", "prompt_tokens", "queue_time",
        "request_generation_tokens", "request_prompt_tokens", "sampler", "spec_accepted_tokens",
        "spec_draft_tokens", "spec_drafts", "spec_per_pos", "spec_propose", "success", "tpot",
        "ttft",
    )  # fmt: skip
    # Each engine's children (set from ServerMetrics' families in __init__).
    preemptions: Any
    prefix_queries: Any
    prefix_hits: Any
    prompt_tokens: Any
    generation_tokens: Any
    ttft: Any
    itl: Any
    e2e: Any
    tpot: Any
    queue_time: Any
    request_prompt_tokens: Any
    request_generation_tokens: Any
    grammar_mask: Any
    grammar_rows: Any
    sampler: Any
    logprobs: Any
    spec_drafts: Any
    spec_draft_tokens: Any
    spec_accepted_tokens: Any
    spec_propose: Any

    def __init__(
        self, metrics: Any, engine: str, running: Twin, waiting: Twin, usage: Twin
    ) -> None:
        """``metrics``: the server's ServerMetrics (service/metrics.py, which imports this
        module), whose families with the ``engine`` label give this engine its children."""
        self.metrics, self.engine = metrics, engine
        self.num_running, self.num_waiting, self.kv_usage = running, waiting, usage
        model = metrics.model_name
        for key, family in metrics._engine_families.items():
            setattr(self, key, family.labels(model, engine))
        self.success = {k: metrics._success.labels(model, engine, k) for k in FINISH_REASONS}
        self.grammar_compile = {
            k: metrics._grammar_compile.labels(model, engine, k) for k in ("false", "true")
        }
        self.gc_pause_core = metrics._gc_pause.labels(model, engine, "core")
        self.spec_per_pos: list[Any] = []  # by position, grown as drafts reach it

    def count_drafts(self, drafted: list[int], accepted: list[int]) -> None:
        """One step's rows: drafts verified and kept (a row's kept drafts are its first ones)."""
        rows = tokens = kept = 0
        for d, a in zip(drafted, accepted):
            if not d:
                continue
            rows, tokens, kept = rows + 1, tokens + d, kept + a
            while len(self.spec_per_pos) < d:
                position = str(len(self.spec_per_pos))
                child = self.metrics._spec_per_pos.labels(self.metrics.model_name, self.engine,
                                                          position)  # fmt: skip
                self.spec_per_pos.append(child)
            for j in range(a):
                self.spec_per_pos[j].inc()
        self.spec_drafts.inc(rows)
        self.spec_draft_tokens.inc(tokens)
        self.spec_accepted_tokens.inc(kept)

    def record(self, stats: IterationStats) -> None:
        """One output batch of this engine (the stat logger's call)."""
        e = self
        if stats.step is not None:
            step = stats.step
            e.num_running.set(step.num_running)
            e.num_waiting.set(step.num_waiting)
            if step.num_kv_blocks_total:
                e.kv_usage.set(step.num_kv_blocks_used / step.num_kv_blocks_total)
            if step.num_preemptions:
                e.preemptions.inc(step.num_preemptions)
            if step.num_prefix_query_tokens:
                e.prefix_queries.inc(step.num_prefix_query_tokens)
                e.prefix_hits.inc(step.num_prefix_hit_tokens)
            for _, duration_ns, _ in step.gc_pauses:
                e.gc_pause_core.observe(duration_ns / 1e9)
            if step.num_grammar_rows:
                e.grammar_mask.observe(step.grammar_mask_ns / 1e9)
                e.grammar_rows.inc(step.num_grammar_rows)
            if step.sample_ns:
                e.sampler.observe(step.sample_ns / 1e9)
            if step.logprobs_ns:
                e.logprobs.observe(step.logprobs_ns / 1e9)
            if step.propose_ns:
                e.spec_propose.observe(step.propose_ns / 1e9)
            if step.num_drafted:
                e.count_drafts(step.num_drafted, step.num_accepted)
        for seconds, cached in stats.grammar_compiles:
            e.grammar_compile["true" if cached else "false"].observe(seconds)
        if stats.num_prompt_tokens:
            e.prompt_tokens.inc(stats.num_prompt_tokens)
        if stats.num_generation_tokens:
            e.generation_tokens.inc(stats.num_generation_tokens)
        for v in stats.ttfts_s:
            e.ttft.observe(v)
        if stats.itls_s:
            observe_all(e.itl, stats.itls_s)
        for f in stats.finished:
            e.success[f.finish_reason].inc()
            e.e2e.observe((f.finished_ns - f.arrival_ns) / 1e9)
            if f.first_token_ns and f.num_generation_tokens > 1:
                e.tpot.observe(
                    (f.finished_ns - f.first_token_ns) / 1e9 / (f.num_generation_tokens - 1)
                )
            if f.scheduled_ns and f.queued_ns:
                e.queue_time.observe(max(0, f.scheduled_ns - f.queued_ns) / 1e9)
            e.request_prompt_tokens.observe(f.num_prompt_tokens)
            e.request_generation_tokens.observe(f.num_generation_tokens)


class Twin:
    """Two gauges set together: Lumen's, and the same figure under vLLM's name."""

    __slots__ = ("lumen", "vllm")

    def __init__(self, lumen: Any, vllm: Any) -> None:
        self.lumen, self.vllm = lumen, vllm

    def set(self, value: float) -> None:
        self.lumen.set(value)
        self.vllm.set(value)

    def labels(self, *values: str) -> Twin:
        return Twin(self.lumen.labels(*values), self.vllm.labels(*values))
