"""Writes the Grafana dashboards in dashboards/grafana/dashboards/ from the panel lists below.

Run `python dashboards/generate.py` after changing a panel; a test checks that the
committed JSON is what this script writes.
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).resolve().parent / "grafana" / "dashboards"
PROM = {"type": "prometheus", "uid": "prometheus"}
TEMPO = {"type": "tempo", "uid": "tempo"}
CH = {"type": "grafana-clickhouse-datasource", "uid": "clickhouse"}
M = 'model_name=~"$model"'
RATE = "$__rate_interval"


def q(metric: str, quantile: float, by: str = "le") -> str:
    return f"histogram_quantile({quantile}, sum by ({by}) (rate({metric}_bucket{{{M}}}[{RATE}])))"


def quantiles(metric: str) -> list[tuple[str, str]]:
    return [(q(metric, v), f"p{int(v * 100)}") for v in (0.5, 0.9, 0.99)]


# (title, unit, [(expr, legend)], stacked)
OVERVIEW = [
    ("Requests finished by reason", "reqps",
     [(f"sum by (finished_reason) (rate(lumen:request_success_total{{{M}}}[{RATE}]))",
       "{{finished_reason}}")], False),
    ("Time to first token", "s", quantiles("lumen:time_to_first_token_seconds"), False),
    ("Time per output token", "s",
     quantiles("lumen:request_time_per_output_token_seconds"), False),
    ("Inter-token latency", "s", quantiles("lumen:inter_token_latency_seconds"), False),
    ("End-to-end latency", "s", quantiles("lumen:e2e_request_latency_seconds"), False),
    ("Queue time in the core", "s", quantiles("lumen:request_queue_time_seconds"), False),
    ("Token throughput", "short",
     [(f"sum(rate(lumen:prompt_tokens_total{{{M}}}[{RATE}]))", "prompt tokens/s"),
      (f"sum(rate(lumen:generation_tokens_total{{{M}}}[{RATE}]))", "generated tokens/s")],
     False),
    ("Running and waiting requests", "short",
     [(f"sum(lumen:num_requests_running{{{M}}})", "running"),
      (f"sum(lumen:num_requests_waiting{{{M}}})", "waiting"),
      (f"sum(lumen:num_requests_admission_waiting{{{M}}})", "waiting for admission")], False),
    ("KV cache usage", "percentunit",
     [(f"max(lumen:kv_cache_usage_perc{{{M}}})", "used")], False),
    ("Preemptions", "short",
     [(f"sum(rate(lumen:num_preemptions_total{{{M}}}[{RATE}]))", "preemptions/s")], False),
    ("Prefix cache hit rate", "percentunit",
     [(f"sum(rate(lumen:prefix_cache_hits_total{{{M}}}[{RATE}])) / "
       f"clamp_min(sum(rate(lumen:prefix_cache_queries_total{{{M}}}[{RATE}])), 1e-9)",
       "hit tokens / queried tokens")], False),
    ("Admission rejections and aborts", "reqps",
     [(f"sum by (reason) (rate(lumen:admission_rejections_total{{{M}}}[{RATE}]))",
       "refused: {{reason}}"),
      (f"sum(rate(lumen:client_disconnects_total{{{M}}}[{RATE}]))", "client disconnects"),
      (f"sum(rate(lumen:stream_stall_aborts_total{{{M}}}[{RATE}]))", "stalled readers")],
     False),
    # Per engine (--data-parallel-size): one series per engine, so a rank that takes more than
    # its share, or sits idle while another queues, shows apart.
    ("Requests per engine", "short",
     [(f"sum by (engine) (lumen:num_requests_running{{{M}}})", "running: engine {{engine}}"),
      (f"sum by (engine) (lumen:num_requests_waiting{{{M}}})", "waiting: engine {{engine}}")],
     False),
    ("KV cache usage per engine", "percentunit",
     [(f"max by (engine) (lumen:kv_cache_usage_perc{{{M}}})", "engine {{engine}}")], False),
    # The lifecycle (service/lifecycle.py): the state is a 1 on its own series, so a restart
    # or a drain shows as a step from "ready" to another state and back.
    ("Engine state and restarts", "short",
     [(f"max by (state) (lumen:engine_state{{{M}}}) > 0", "state: {{state}}"),
      (f"sum(increase(lumen:engine_restarts_total{{{M}}}[{RATE}]))", "restarts")], False),
]  # fmt: skip

BOUNDARIES = [
    ("Boundary latency p50 (stacked)", "s",
     [(q("lumen:boundary_latency_seconds", 0.5, "le, boundary"), "{{boundary}}")], True),
    ("Boundary latency p99 (stacked)", "s",
     [(q("lumen:boundary_latency_seconds", 0.99, "le, boundary"), "{{boundary}}")], True),
    ("Time spent per boundary (all requests)", "s",
     [(f"sum by (boundary) (rate(lumen:boundary_latency_seconds_sum{{{M}}}[{RATE}]))",
       "{{boundary}}")], True),
    ("Jitter: p99 - p50", "s",
     [(f"{q('lumen:time_to_first_token_seconds', 0.99)} - "
       f"{q('lumen:time_to_first_token_seconds', 0.5)}", "TTFT"),
      (f"{q('lumen:inter_token_latency_seconds', 0.99)} - "
       f"{q('lumen:inter_token_latency_seconds', 0.5)}", "ITL")], False),
    ("Delivery lag: last token -> last byte accepted by the client", "s",
     quantiles("lumen:delivery_lag_seconds"), False),
    ("Event-loop lag in the API process", "s",
     quantiles("lumen:event_loop_lag_seconds"), False),
    ("Garbage-collection pauses", "s",
     [(q("lumen:gc_pause_seconds", 0.99, "le, process"), "p99 {{process}}"),
      (f"sum by (process) (rate(lumen:gc_pause_seconds_sum{{{M}}}[{RATE}]))",
       "paused s/s {{process}}")], False),
    ("Trace export health", "short",
     [(f"sum(rate(lumen:otlp_spans_dropped_total{{{M}}}[{RATE}]))", "OTLP spans dropped/s"),
      (f"sum(rate(lumen:trace_rows_dropped_total{{{M}}}[{RATE}]))", "trace db rows dropped/s")],
     False),
    ("Trace db flushes: the writer's CPU (share of a core) and flushes/s", "short",
     [(f"sum(rate(lumen:trace_flush_cpu_seconds_total{{{M}}}[{RATE}]))", "flush CPU s/s"),
      (f"sum(rate(lumen:trace_flushes_total{{{M}}}[{RATE}]))", "flushes/s")], False),
]  # fmt: skip

FIND_A_REQUEST = """\
**Finding a request.** Every response carries its id in the `x-request-id` header
(`chatcmpl-…`, `cmpl-…`). In Tempo, search for the span attribute `lumen.request_id`
(or `gen_ai.request.id` on the root span `llm_request`); a client that sent a W3C
`traceparent` finds the request under its own trace id. On the server host,
`lumen trace top` lists the slowest requests and `lumen trace show ID` draws one
request's waterfall from the trace db."""


# The fleet dashboard reads the request roots Lumen exports at --otlp-detail store, as the
# collector's ClickHouse exporter keeps them (tail-sampled: dashboards/otel-collector).
REPLICA = "ResourceAttributes['service.instance.id']"
ROOTS = ("FROM otel_traces WHERE $__timeFilter(Timestamp) AND ServiceName = 'lumen' "
         "AND SpanName = 'llm_request'")  # fmt: skip
# A kept request stands for itself if Lumen marked it (failed or slow: every one is kept), else
# for 100 / $sample_percent requests (the collector's share of the rest); in integers.
WEIGHT = "toUInt64(if(SpanAttributes['lumen.sample.keep'] != '', $sample_percent, 100))"
ATTR = "SpanAttributes['{}']"
NUM = "toFloat64OrZero(SpanAttributes['{}'])"
TTFT_S = NUM.format("gen_ai.latency.time_to_first_token")
TPOT_S = (f"({NUM.format('gen_ai.latency.e2e')} - {TTFT_S}) / "
          f"({NUM.format('gen_ai.usage.output_tokens')} - 1)")  # fmt: skip


def weighted(value: str, where: str) -> str:
    """p50 and p90 of ``value`` per replica over time, each kept request weighed."""
    cells = ", ".join(f"quantileExactWeighted({q})({value}, {WEIGHT}) AS p{int(q * 100)}"
                      for q in (0.5, 0.9))  # fmt: skip
    return (f"SELECT $__timeInterval(Timestamp) AS time, {REPLICA} AS replica, {cells} "
            f"{ROOTS} AND {where} GROUP BY time, replica ORDER BY time")  # fmt: skip


SLOWEST = (
    f"SELECT Timestamp AS time, {REPLICA} AS replica, {ATTR.format('gen_ai.request.id')} "
    f"AS request, round(Duration / 1e9, 3) AS e2e_s, round({TTFT_S}, 3) AS ttft_s, "
    f"{ATTR.format('gen_ai.usage.output_tokens')} AS output_tokens, "
    f"{ATTR.format('lumen.status')} AS status, "
    f"{ATTR.format('lumen.slowest_phase')} AS slowest_phase "
    f"{ROOTS} ORDER BY Duration DESC LIMIT 20"
)
KEPT = (
    f"SELECT $__timeInterval(Timestamp) AS time, {REPLICA} AS replica, "
    "countIf(SpanName = 'llm_request' AND SpanAttributes['lumen.sample.keep'] != '') AS marked, "
    "countIf(SpanName = 'llm_request' AND SpanAttributes['lumen.sample.keep'] = '') AS sampled, "
    "countIf(SpanName = 'lumen.step') AS steps FROM otel_traces WHERE "
    "$__timeFilter(Timestamp) AND ServiceName = 'lumen' GROUP BY time, replica ORDER BY time"
)
# Per model name asked for (the base model's, or a LoRA adapter's: gen_ai.request.model), over
# the range: LoRA's latency per adapter without a Prometheus label per adapter.
TPOT_OK = (f"{ATTR.format('lumen.status')} = 'ok' AND "
           f"{NUM.format('gen_ai.usage.output_tokens')} >= 2")  # fmt: skip
BY_MODEL = (
    f"SELECT {ATTR.format('gen_ai.request.model')} AS model, "
    f"intDiv(sum({WEIGHT}), $sample_percent) AS requests, "
    f"round(quantileExactWeighted(0.5)({TTFT_S}, {WEIGHT}), 3) AS ttft_p50_s, "
    f"round(quantileExactWeighted(0.9)({TTFT_S}, {WEIGHT}), 3) AS ttft_p90_s, "
    f"round(quantileExactWeightedIf(0.5)({TPOT_S}, {WEIGHT}, {TPOT_OK}), 4) AS tpot_p50_s, "
    f"round(quantileExactWeightedIf(0.9)({TPOT_S}, {WEIGHT}, {TPOT_OK}), 4) AS tpot_p90_s "
    f"{ROOTS} GROUP BY model ORDER BY requests DESC"
)
EXPLAIN = """\
**Why was it slow?** `slowest_phase` is where most of a request's time went, as its replica's
trace writer measured it. For the whole diagnosis (the step, the neighbour, the knob), rebuild
its run around it from ClickHouse and ask Lumen, on any machine:

    replay import http://lumen:lumen@CLICKHOUSE:8123/otel \\
        --format clickhouse --request ID --out one.db
    lumen trace why ID --db one.db

The percentiles weigh each kept request by the requests it stands for: the collector keeps every
failed or slow one and $sample_percent% of the rest (dashboards/otel-collector/config.yaml)."""


def sample_percent_variable() -> dict:
    return {"name": "sample_percent", "label": "share of the rest kept (%)", "type": "constant",
            "query": "10", "hide": 2}  # fmt: skip


def ch_target(sql: str, table: bool) -> dict:
    return {"refId": "A", "datasource": CH, "editorType": "sql",
            "queryType": "table" if table else "timeseries", "format": 1 if table else 0,
            "rawSql": sql}  # fmt: skip


def fleet_panels() -> list[dict]:
    def panel(pid: int, kind: str, title: str, unit: str, sql: str, pos: dict) -> dict:
        return {"id": pid, "type": kind, "title": title, "datasource": CH, "gridPos": pos,
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "targets": [ch_target(sql, kind == "table")]}  # fmt: skip

    ok = f"{ATTR.format('lumen.status')} = 'ok'"
    return [
        panel(1, "timeseries", "Time to first token per replica", "s",
              weighted(TTFT_S, f"{ATTR.format('gen_ai.latency.time_to_first_token')} != ''"),
              {"h": 8, "w": 12, "x": 0, "y": 0}),
        panel(2, "timeseries", "Time per output token per replica", "s",
              weighted(TPOT_S, f"{ok} AND {NUM.format('gen_ai.usage.output_tokens')} >= 2"),
              {"h": 8, "w": 12, "x": 12, "y": 0}),
        panel(3, "table", "Slowest requests, and where their time went", "none", SLOWEST,
              {"h": 10, "w": 24, "x": 0, "y": 8}),
        panel(4, "timeseries", "Kept traces per replica: marked, sampled, engine steps", "short",
              KEPT, {"h": 8, "w": 12, "x": 0, "y": 18}),
        {"id": 5, "type": "text", "title": "Explaining a request of the fleet",
         "gridPos": {"h": 8, "w": 12, "x": 12, "y": 18},
         "options": {"mode": "markdown", "content": EXPLAIN}},
        panel(6, "table", "Per model and LoRA adapter: requests, TTFT and TPOT", "none",
              BY_MODEL, {"h": 8, "w": 24, "x": 0, "y": 26}),
    ]  # fmt: skip


def model_variable() -> dict:
    return {
        "name": "model",
        "label": "model",
        "type": "query",
        "datasource": PROM,
        "query": {"query": "label_values(lumen:num_requests_running, model_name)",
                  "refId": "model"},
        "definition": "label_values(lumen:num_requests_running, model_name)",
        "includeAll": True,
        "multi": True,
        "current": {"text": "All", "value": "$__all"},
        "refresh": 2,
    }  # fmt: skip


def timeseries(pid: int, title: str, unit: str, targets: list, stacked: bool) -> dict:
    x, y = (pid - 1) % 2 * 12, (pid - 1) // 2 * 8
    return {
        "id": pid,
        "type": "timeseries",
        "title": title,
        "datasource": PROM,
        "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
        "fieldConfig": {
            "defaults": {
                "unit": unit,
                "custom": {"stacking": {"mode": "normal" if stacked else "none"},
                           "fillOpacity": 30 if stacked else 5},
            },
            "overrides": [],
        },
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
        "targets": [
            {"refId": chr(ord("A") + i), "datasource": PROM, "expr": expr, "legendFormat": legend}
            for i, (expr, legend) in enumerate(targets)
        ],
    }  # fmt: skip


def dashboard(uid: str, title: str, panels: list[dict], variables: list[dict]) -> dict:
    return {
        "uid": uid,
        "title": title,
        "tags": ["lumen"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "templating": {"list": variables},
        "panels": panels,
    }


def build() -> dict[str, dict]:
    overview = [timeseries(i + 1, *p) for i, p in enumerate(OVERVIEW)]
    boundaries = [timeseries(i + 1, *p) for i, p in enumerate(BOUNDARIES)]
    traces = [
        {
            "id": 1, "type": "text", "title": "How to find a request",
            "gridPos": {"h": 6, "w": 24, "x": 0, "y": 0},
            "options": {"mode": "markdown", "content": FIND_A_REQUEST},
        },
        {
            "id": 2, "type": "table", "title": "Recent Lumen traces (click one for its waterfall)",
            "datasource": TEMPO, "gridPos": {"h": 14, "w": 24, "x": 0, "y": 6},
            "targets": [{"refId": "A", "datasource": TEMPO, "queryType": "traceql",
                         "query": '{ resource.service.name = "lumen" && name = "llm_request" }',
                         "limit": 50}],
        },
        {
            "id": 3, "type": "table", "title": "Slowest requests in the time range",
            "datasource": TEMPO, "gridPos": {"h": 10, "w": 24, "x": 0, "y": 20},
            "targets": [{"refId": "A", "datasource": TEMPO, "queryType": "traceql",
                         "query": '{ name = "llm_request" && duration > 2s }', "limit": 20}],
        },
    ]  # fmt: skip
    return {
        "lumen-overview.json": dashboard("lumen-overview", "Lumen: overview", overview,
                                         [model_variable()]),
        "lumen-boundaries.json": dashboard("lumen-boundaries", "Lumen: boundaries", boundaries,
                                           [model_variable()]),
        "lumen-traces.json": dashboard("lumen-traces", "Lumen: traces", traces, []),
        "lumen-fleet.json": dashboard("lumen-fleet", "Lumen: fleet", fleet_panels(),
                                      [sample_percent_variable()]),
    }  # fmt: skip


def render(board: dict) -> str:
    return json.dumps(board, indent=2) + "\n"


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    for name, board in build().items():
        (OUT / name).write_text(render(board))
        print(OUT / name)
