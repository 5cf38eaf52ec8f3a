"""Prometheus metrics with vLLM V1's names and semantics under the `lumen:` prefix (DESIGN §4).

Counters get prometheus_client's ``_total`` suffix, as vLLM's do. Every
labelled series is created up front so dashboards have data from the first
scrape.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from engine.kv_layout import kv_capacity
from engine.messages import EngineStats
from engine.stats import IterationStats
from service.engine_metrics import EngineMetrics, Twin, observe_all
from tracing.spans import BOUNDARIES

if TYPE_CHECKING:
    from tracing.recorder import TracerStats

REJECT_REASONS = ("queue_full", "queue_timeout", "engine_dead", "engine_restarting",
                  "shutting_down")  # fmt: skip
# The server's lifecycle (service/lifecycle.py): lumen:engine_state is 1 for the current one.
ENGINE_STATES = ("starting", "ready", "unresponsive", "restarting", "draining", "stopping")
# Histogram buckets as vLLM V1 chose them.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
BOUNDARY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                    0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)  # fmt: skip
GRAMMAR_BUCKETS = (0.00001, 0.000025, 0.00005, *BOUNDARY_BUCKETS)  # a mask takes tens of us
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


def token_buckets(max_value: int) -> list[float]:
    """1-2-5 buckets up to max_value, as vLLM builds them for token counts."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


class ServerMetrics:
    """The server's registry; ``record`` is the AsyncLLM stat logger, called per output batch."""

    def __init__(self, model_name: str, max_model_len: int) -> None:
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        self._lora_info: Twin | None = None  # enable_lora
        self._max_loras = ""
        m = ["model_name"]

        # The plain metrics are kept as their one (model_name) child.
        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, m, registry=r).labels(model_name)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, m, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Any:
            return Histogram(name, doc, m, buckets=buckets, registry=r).labels(model_name)

        # What an engine's outputs count carries its rank as the label ``engine``, as vLLM's
        # metrics do: the families here (``fam``: those labelled by model and engine alone),
        # each engine's children in its EngineMetrics.
        e = [*m, "engine"]
        fam: dict[str, Any] = {}
        self._engine_families = fam

        def engine_counter(key: str, name: str, doc: str) -> None:
            fam[key] = Counter(name, doc, e, registry=r)

        def engine_histogram(key: str, name: str, doc: str, buckets: Sequence[float]) -> None:
            fam[key] = Histogram(name, doc, e, buckets=buckets, registry=r)

        # The gauges of each engine's state (label ``engine``: its data-parallel rank) that a
        # router reads (llm-d's scheduler, the Gateway API Inference Extension's endpoint
        # picker), also under vLLM's own names and labels, set together with Lumen's.
        def for_routers(name: str, doc: str) -> Twin:
            return Twin(
                Gauge(f"lumen:{name}", doc, [*m, "engine"], registry=r),
                Gauge(f"vllm:{name}", f"{doc} vLLM's name, for routers.", [*m, "engine"],
                      registry=r),
            )  # fmt: skip

        self._per_engine = (
            for_routers("num_requests_running", "Requests in the running batch."),
            for_routers("num_requests_waiting", "Requests waiting to be scheduled."),
            for_routers("kv_cache_usage_perc", "KV cache usage (1 = 100 percent)."),
        )
        self._engines: dict[str, EngineMetrics] = {}
        # vLLM's cache_config_info (its label names, four of its CacheConfig's fields, and the
        # engine's index), and what it holds in tokens and requests.
        info = ["block_size", "num_gpu_blocks", "cache_dtype", "enable_prefix_caching", "engine"]
        self.cache_info = Twin(
            Gauge("lumen:cache_config_info",
                  "The KV cache's configuration (labels; the value is 1).", info, registry=r),
            Gauge("vllm:cache_config_info", "The KV cache's configuration (labels; the value "
                  "is 1). vLLM's name, for routers.", info, registry=r),
        )  # fmt: skip
        self.kv_tokens = gauge(
            "lumen:kv_cache_capacity_tokens",
            "Tokens of every layer the KV cache holds (its blocks shared out over the KV groups).",
        )  # fmt: skip
        self.kv_blocks_per_request = Gauge(
            "lumen:kv_cache_blocks_per_request",
            "KV blocks one request of max_model_len tokens holds at most, per layer kind: full "
            "(every token kept) or sliding_window_<W> (the window's blocks only).",
            [*m, "layer_kind", "num_layers"], registry=r,
        )  # fmt: skip
        self.max_concurrency = gauge(
            "lumen:kv_cache_max_concurrency",
            "Requests of max_model_len tokens the KV cache holds at once (vLLM's 'Maximum "
            "concurrency' at start).",
        )  # fmt: skip
        self.num_admitted = gauge(
            "lumen:num_requests_admitted", "HTTP requests admitted and not yet finished."
        )
        self.num_admission_waiting = gauge(
            "lumen:num_requests_admission_waiting", "HTTP requests waiting for an admission slot."
        )
        engine_counter("preemptions", "lumen:num_preemptions", "Preemptions by the scheduler.")
        engine_counter(
            "prefix_queries", "lumen:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
        )  # fmt: skip
        engine_counter("prefix_hits", "lumen:prefix_cache_hits", "Prefix-cache hit tokens.")
        engine_counter("prompt_tokens", "lumen:prompt_tokens", "Prefill tokens processed.")
        engine_counter("generation_tokens", "lumen:generation_tokens", "Generation tokens.")
        self.stall_aborts = counter(
            "lumen:stream_stall_aborts", "Requests aborted because their reader stalled."
        )
        self.disconnects = counter(
            "lumen:client_disconnects", "Requests aborted because their client went away."
        )
        self.ipc_backpressure = counter(
            "lumen:ipc_backpressure", "Sends to the engine core that its full queue pushed back."
        )
        engine_histogram(
            "ttft", "lumen:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS
        )
        engine_histogram(
            "itl", "lumen:inter_token_latency_seconds", "Inter-token latency.", ITL_BUCKETS
        )
        engine_histogram(
            "e2e", "lumen:e2e_request_latency_seconds", "End-to-end request latency.",
            LATENCY_BUCKETS,
        )  # fmt: skip
        engine_histogram(
            "tpot", "lumen:request_time_per_output_token_seconds",
            "Per request: time from the first to the last token over the tokens after the first.",
            ITL_BUCKETS,
        )  # fmt: skip
        engine_histogram(
            "queue_time", "lumen:request_queue_time_seconds", "Time in the core's waiting queue.",
            LATENCY_BUCKETS,
        )  # fmt: skip
        tokens = token_buckets(max_model_len)
        engine_histogram(
            "request_prompt_tokens", "lumen:request_prompt_tokens", "Prompt tokens per request.",
            tokens,
        )  # fmt: skip
        engine_histogram(
            "request_generation_tokens", "lumen:request_generation_tokens",
            "Generated tokens per request.", tokens,
        )  # fmt: skip
        self._success = Counter(
            "lumen:request_success", "Finished requests by finish reason.",
            [*e, "finished_reason"], registry=r,
        )  # fmt: skip
        rejections = Counter(
            "lumen:admission_rejections", "Requests refused by admission control.",
            [*m, "reason"], registry=r,
        )  # fmt: skip
        self.rejections = {k: rejections.labels(model_name, k) for k in REJECT_REASONS}
        self.engine_restarts = counter(
            "lumen:engine_restarts",
            "Engine cores the supervisor started after one died or hung.",
        )
        state = Gauge(
            "lumen:engine_state", "The server's lifecycle state: 1 for the current one.",
            [*m, "state"], registry=r,
        )  # fmt: skip
        self.engine_state = {k: state.labels(model_name, k) for k in ENGINE_STATES}
        boundary = Histogram(
            "lumen:boundary_latency_seconds", "Time spent in each request boundary (per step "
            "for the per-step ones).", [*m, "boundary"], buckets=BOUNDARY_BUCKETS, registry=r,
        )  # fmt: skip
        self.boundary = {k: boundary.labels(model_name, k) for k in BOUNDARIES}
        self.trace_rows_dropped = counter(
            "lumen:trace_rows_dropped", "Trace db rows dropped because the store was busy too long."
        )
        self.trace_flushes = counter(
            "lumen:trace_flushes", "Trace db flushes that wrote rows (spaced further apart "
            "under load, --trace-flush-interval)."
        )  # fmt: skip
        self.trace_flush_cpu_seconds = counter(
            "lumen:trace_flush_cpu_seconds", "CPU the trace writer spent in trace db flushes: "
            "its rate is the share of a core the store costs."
        )  # fmt: skip
        self.otlp_spans_dropped = counter(
            "lumen:otlp_spans_dropped", "Spans not exported (queue full or collector failing)."
        )
        self.delivery_lag = histogram(
            "lumen:delivery_lag_seconds",
            "Per request: its last token reached the frontend -> its last byte was accepted by "
            "the client's socket (a slow reader shows here).",
            BOUNDARY_BUCKETS,
        )
        self.delivery_wait = histogram(
            "lumen:delivery_wait_seconds",
            "Per request: the time all its writes waited for the client's socket to take them "
            "(a reader that pauses mid-stream shows here, not only in the last token's lag).",
            BOUNDARY_BUCKETS,
        )
        self.loop_lag = histogram(
            "lumen:event_loop_lag_seconds",
            "API process: how late the event loop woke a timer (sampled every 10 ms).",
            BOUNDARY_BUCKETS,
        )
        gc_pause = Histogram(
            "lumen:gc_pause_seconds", "Garbage-collection pauses, by process (a core's: its "
            "engine).", [*e, "process"], buckets=BOUNDARY_BUCKETS, registry=r,
        )  # fmt: skip
        self.gc_pause_api = gc_pause.labels(model_name, "", "api")
        self._gc_pause = gc_pause
        # Structured outputs (engine/core/grammar.py): compiles, by whether the cache had it,
        # and each step's token masks.
        self._grammar_compile = Histogram(
            "lumen:grammar_compile_seconds", "Structured outputs: compiling a request's grammar "
            "(0 for a cache hit), per request.", [*e, "cached"], buckets=GRAMMAR_BUCKETS,
            registry=r,
        )  # fmt: skip
        engine_histogram(
            "grammar_mask", "lumen:grammar_mask_seconds", "Structured outputs: computing the "
            "token masks of the rows that sample under a grammar, per step that has any.",
            GRAMMAR_BUCKETS,
        )  # fmt: skip
        engine_counter(
            "grammar_rows", "lumen:grammar_rows",
            "Structured outputs: rows sampled under a grammar (tokens).",
        )  # fmt: skip
        # The sampler beside the masks: what a step's rows that are not plain greedy (a grammar,
        # penalties, temperature, top-k/p) cost every row of it, and logprobs.
        engine_histogram(
            "sampler", "lumen:sampler_seconds", "The sampler on the full logits (grammar masks "
            "applied, penalties, temperature, top-k/p), per step that ran it.", GRAMMAR_BUCKETS,
        )  # fmt: skip
        engine_histogram(
            "logprobs", "lumen:logprobs_seconds", "Computing logprobs, per step whose rows asked.",
            GRAMMAR_BUCKETS,
        )  # fmt: skip
        # Speculative decoding (--speculative-config), as vLLM's spec_decode_* counters.
        engine_counter(
            "spec_drafts", "lumen:spec_decode_num_drafts",
            "Speculative decoding: rows that verified drafts (one per row per step).",
        )  # fmt: skip
        engine_counter(
            "spec_draft_tokens", "lumen:spec_decode_num_draft_tokens",
            "Speculative decoding: draft tokens verified.",
        )  # fmt: skip
        engine_counter(
            "spec_accepted_tokens", "lumen:spec_decode_num_accepted_tokens",
            "Speculative decoding: draft tokens the target kept.",
        )  # fmt: skip
        self._spec_per_pos = Counter(
            "lumen:spec_decode_num_accepted_tokens_per_pos", "Speculative decoding: draft "
            "tokens kept, by their position among a row's drafts (0: the first).",
            [*e, "position"], registry=r,
        )  # fmt: skip
        engine_histogram(
            "spec_propose", "lumen:spec_decode_propose_seconds", "Speculative decoding: the "
            "proposer's time for the next step's drafts, per step that proposed.", GRAMMAR_BUCKETS,
        )  # fmt: skip
        self._mirrored: dict[str, float] = {}  # counter name -> the total already counted
        self.for_engine(0)

    def for_engine(self, rank: int) -> EngineMetrics:
        """The stat logger of data-parallel engine ``rank``: its gauges carry its label."""
        engine = str(rank)
        if engine not in self._engines:
            running, waiting, usage = (t.labels(self.model_name, engine) for t in self._per_engine)
            self._engines[engine] = EngineMetrics(self, engine, running, waiting, usage)
        return self._engines[engine]

    def describe_cache(
        self, block_size: int, num_blocks: int, max_model_len: int, cache_dtype: str,
        prefix_caching: bool, kv_windows: list[int], kv_group_size: int, engines: int = 1,
    ) -> None:  # fmt: skip
        """The KV cache's size, once the engines are ready (each has one of this size)."""
        for rank in range(engines):
            labels = (str(block_size), str(num_blocks), cache_dtype, str(prefix_caching),
                      str(rank))  # fmt: skip
            self.cache_info.labels(*labels).set(1)
        capacity = kv_capacity(kv_windows or [0], kv_group_size, num_blocks, block_size,
                               max_model_len)  # fmt: skip
        self.kv_tokens.set(capacity.tokens)
        self.max_concurrency.set(capacity.max_concurrency)
        for kind, layers, _, blocks in capacity.kinds:
            self.kv_blocks_per_request.labels(self.model_name, kind, str(layers)).set(blocks)

    def observe_delivery(self, lag_s: float, waited_s: float) -> None:
        """Called from the trace writer thread."""
        self.delivery_lag.observe(lag_s)
        self.delivery_wait.observe(waited_s)

    def observe_boundary(self, name: str, seconds: Sequence[float]) -> None:
        """Durations of one boundary (a request's emits come together). Called from the trace
        writer thread (prometheus_client is thread-safe)."""
        if (child := self.boundary.get(name)) is not None:
            observe_all(child, seconds)

    def set_tracer_stats(self, stats: TracerStats) -> None:
        self._mirror("trace_rows_dropped", stats.num_dropped_rows)
        self._mirror("otlp_spans_dropped", stats.num_dropped_spans)
        self._mirror("trace_flushes", stats.num_flushes)
        self._mirror("trace_flush_cpu_seconds", stats.flush_cpu_s)

    def _mirror(self, name: str, total: float) -> None:
        """Bring a counter up to a running total kept elsewhere (read at scrape time)."""
        seen = self._mirrored.get(name, 0)
        if total > seen:
            getattr(self, name).inc(total - seen)
            self._mirrored[name] = total

    def record(self, stats: IterationStats, engine: EngineMetrics | None = None) -> None:
        """One output batch of engine ``engine`` (None: engine 0)."""
        (engine or self.for_engine(0)).record(stats)

    def set_engine_stats(self, s: EngineStats, rank: int = 0) -> None:
        """Fresh gauges of engine ``rank`` at scrape time (the last step's go stale when idle)."""
        engine = self.for_engine(rank)
        engine.num_running.set(s.num_running)
        engine.num_waiting.set(s.num_waiting)
        if s.num_kv_blocks_total:
            engine.kv_usage.set(s.num_kv_blocks_used / s.num_kv_blocks_total)

    def enable_lora(self, max_loras: int) -> None:
        """vLLM's lora_requests_info (its labels; its value the time of the last update, by
        which the Gateway API Inference Extension's endpoint picker finds the newest series),
        also under Lumen's prefix."""
        labels = ["running_lora_adapters", "waiting_lora_adapters", "max_lora"]
        doc = (
            "LoRA adapters of the running and waiting requests (comma-separated) and the "
            "most in one batch; the value is when it was last updated (Unix seconds)."
        )
        self._max_loras = str(max_loras)
        self._lora_info = Twin(
            Gauge("lumen:lora_requests_info", doc, labels, registry=self.registry),
            Gauge("vllm:lora_requests_info", f"{doc} vLLM's name, for routers.", labels,
                  registry=self.registry),
        )  # fmt: skip

    def set_lora_info(self, stats: Sequence[EngineStats]) -> None:
        """The adapters of every engine's requests, at scrape time: one series, the newest."""
        info = self._lora_info
        if info is None:
            return
        running = sorted({n for s in stats for n in s.running_loras})
        waiting = sorted({n for s in stats for n in s.waiting_loras})
        for gauge in (info.lumen, info.vllm):
            gauge.clear()
        info.labels(",".join(running), ",".join(waiting), self._max_loras).set(time.time())

    def set_backpressure(self, num_ipc_backpressure: int) -> None:
        """The engines' pushed-back sends, a running total (read at scrape time)."""
        self._mirror("ipc_backpressure", num_ipc_backpressure)

    def set_state(self, name: str) -> None:
        for k, g in self.engine_state.items():
            g.set(1 if k == name else 0)

    def reject(self, reason: str) -> None:
        self.rejections[reason].inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
