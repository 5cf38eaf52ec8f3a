"""The SQL of the trace store's spans view, one text per migration that (re)defines it
(tracing.store's migrations 3 and 4): a migration replays its own text, so a file written
before a later migration still migrates step by step."""

from __future__ import annotations

# The spans users query (DESIGN §3): the stored rows, and for runs with span_layout 'steps' the
# spans derived from the request rows (llm_request, frontend.enqueue, and core.receive and
# core.queue of a request that ran as one sequence; a request of several keeps those as rows),
# from the steps each request took part in (core.schedule, worker.execute, core.output) and from
# its emit_* lists (frontend.emit). A derived span's id is its request's root span id XOR (step
# id + 1, sequence, boundary): the ids OTLP exports (tracing.spans.span_id_of).
SPANS_VIEW = """
CREATE VIEW spans AS
SELECT * FROM span_rows
UNION ALL
SELECT r.run_id, r.request_id, r.trace_id,
    CASE b.code WHEN 0 THEN r.root_span_id
        ELSE format('{:016x}', xor(('0x' || r.root_span_id)::UBIGINT, b.code::UBIGINT)) END,
    CASE b.code WHEN 0 THEN r.parent_span_id ELSE r.root_span_id END,
    b.name,
    CASE b.code WHEN 0 THEN least(coalesce(r.http_start_ns, r.arrival_ns), r.arrival_ns)
        WHEN 5 THEN r.arrival_ns WHEN 6 THEN coalesce(r.sent_ns, r.received_ns)
        ELSE coalesce(r.received_ns, r.first_scheduled_ns) END,
    CASE b.code WHEN 0 THEN r.arrival_ns + r.e2e_ns
        WHEN 5 THEN greatest(coalesce(r.sent_ns, r.arrival_ns + r.e2e_ns), r.arrival_ns)
        WHEN 6 THEN greatest(r.received_ns, coalesce(r.sent_ns, r.received_ns))
        ELSE greatest(r.first_scheduled_ns, coalesce(r.received_ns, r.first_scheduled_ns)) END,
    NULL,
    CASE b.code WHEN 0 THEN json_object(
        'gen_ai.request.id', r.request_id, 'gen_ai.request.model', r.model,
        'gen_ai.response.model', r.model,
        'gen_ai.usage.prompt_tokens', r.prompt_tokens,
        'gen_ai.usage.completion_tokens', r.output_tokens,
        'gen_ai.latency.e2e', r.e2e_ns / 1e9, 'lumen.endpoint', r.endpoint,
        'lumen.status', r.status, 'lumen.stream', r.stream,
        'gen_ai.response.finish_reasons', CASE WHEN r.finish_reason IS NOT NULL
            THEN [r.finish_reason] END,
        'gen_ai.latency.time_to_first_token', r.ttft_ns / 1e9,
        'lumen.delivered_ttft', CASE WHEN r.stream THEN r.delivered_ttft_ns / 1e9 END,
        -- params omit SamplingParams' defaults
        'gen_ai.request.max_tokens', coalesce(r.params->'max_tokens', '16'::JSON),
        'gen_ai.request.temperature', coalesce(r.params->'temperature', '1.0'::JSON),
        'gen_ai.request.top_p', coalesce(r.params->'top_p', '1.0'::JSON),
        'gen_ai.request.n', coalesce(r.params->'n', '1'::JSON),
        'lumen.client_request_id', r.client_request_id, 'lumen.error', r.error)::VARCHAR
    ELSE '{}' END
FROM requests r JOIN runs USING (run_id)
CROSS JOIN (VALUES (0, 'llm_request'), (5, 'frontend.enqueue'), (6, 'core.receive'),
    (7, 'core.queue')) b(code, name)
WHERE runs.span_layout = 'steps' AND (b.code IN (0, 5) OR (
    CASE b.code WHEN 6 THEN r.received_ns ELSE r.first_scheduled_ns END IS NOT NULL
    AND NOT EXISTS (SELECT 1 FROM request_children c
                    WHERE c.run_id = r.run_id AND c.request_id = r.request_id)))
UNION ALL
SELECT r.run_id, r.request_id, r.trace_id,
    format('{:016x}', xor(('0x' || r.root_span_id)::UBIGINT,
        ((m.step_id + 1)::UBIGINT << 16) | (coalesce(c.seq, 0)::UBIGINT << 4) | b.code)),
    r.root_span_id, b.name,
    CASE b.code WHEN 1 THEN m.schedule_start_ns WHEN 2 THEN m.execute_start_ns
        ELSE m.execute_end_ns END,
    CASE b.code WHEN 1 THEN m.schedule_end_ns WHEN 2 THEN m.execute_end_ns
        ELSE greatest(m.output_ns, m.execute_end_ns) END,
    m.step_id,
    CASE WHEN c.seq IS NULL THEN json_object('tokens', m.tokens)
        ELSE json_object('tokens', m.tokens, 'seq', c.seq) END
FROM (
    SELECT s.*, unnest(s.request_ids) AS core_id, unnest(s.num_scheduled) AS tokens
    FROM steps s JOIN runs USING (run_id) WHERE runs.span_layout = 'steps'
) m
LEFT JOIN request_children c ON c.run_id = m.run_id AND c.core_id = m.core_id
JOIN requests r ON r.run_id = m.run_id AND r.request_id = coalesce(c.request_id, m.core_id)
    AND m.step_id BETWEEN r.first_step_id AND r.last_step_id
CROSS JOIN (VALUES (1, 'core.schedule'), (2, 'worker.execute'), (3, 'core.output')) b(code, name)
UNION ALL
SELECT e.run_id, e.request_id, e.trace_id,
    format('{:016x}', xor(('0x' || e.root_span_id)::UBIGINT,
        ((e.step + 1)::UBIGINT << 16) | 4::UBIGINT)),
    e.root_span_id, 'frontend.emit', e.received, e.received + e.delivery, e.step, '{}'
FROM (
    SELECT run_id, request_id, trace_id, root_span_id,
        (coalesce(first_step_id, 0) + sum(ds) OVER w)::BIGINT AS step,
        ((arrival_ns // 1000 + sum(dr) OVER w) * 1000)::BIGINT AS received,
        greatest(dd, 0)::BIGINT * 1000 AS delivery
    FROM (
        SELECT run_id, request_id, trace_id, root_span_id, first_step_id, arrival_ns,
            unnest(emit_step_deltas) AS ds, unnest(emit_received_us) AS dr,
            unnest(emit_delivery_us) AS dd, generate_subscripts(emit_step_deltas, 1) AS i
        FROM requests WHERE emit_step_deltas IS NOT NULL
    )
    WINDOW w AS (PARTITION BY run_id, request_id ORDER BY i)
) e
"""


# Migration 4's view: migration 3's, plus a request's core.grammar span (code 8: dequeued ->
# its grammar compiled), derived from its row like core.queue.
SPANS_VIEW_4 = (
    SPANS_VIEW.replace(
        "WHEN 5 THEN r.arrival_ns WHEN 6 THEN coalesce(r.sent_ns, r.received_ns)",
        "WHEN 5 THEN r.arrival_ns WHEN 6 THEN coalesce(r.sent_ns, r.received_ns)\n"
        "        WHEN 8 THEN r.received_ns",
    )
    .replace(
        "        WHEN 6 THEN greatest(r.received_ns, coalesce(r.sent_ns, r.received_ns))",
        "        WHEN 6 THEN greatest(r.received_ns, coalesce(r.sent_ns, r.received_ns))\n"
        "        WHEN 8 THEN greatest(r.grammar_ready_ns, r.received_ns)",
    )
    .replace(
        "    ELSE '{}' END\nFROM requests r",
        "    WHEN 8 THEN json_object('lumen.grammar', r.grammar, 'lumen.grammar.compile_ns',\n"
        "        r.grammar_compile_ns, 'lumen.grammar.cached', r.grammar_cached)::VARCHAR\n"
        "    ELSE '{}' END\nFROM requests r",
    )
    .replace(
        "    (7, 'core.queue')) b(code, name)",
        "    (7, 'core.queue'), (8, 'core.grammar')) b(code, name)",
    )
    .replace(
        "    CASE b.code WHEN 6 THEN r.received_ns ELSE r.first_scheduled_ns END IS NOT NULL",
        "    CASE b.code WHEN 6 THEN r.received_ns WHEN 8 THEN r.grammar_ready_ns\n"
        "        ELSE r.first_scheduled_ns END IS NOT NULL\n"
        "    AND (b.code <> 8 OR r.received_ns IS NOT NULL)",
    )
)
assert SPANS_VIEW_4.count("core.grammar") == 1 and SPANS_VIEW_4.count("WHEN 8") == 4


# Migration 7's view: the root span's token counts under the GenAI conventions' current names
# (gen_ai.usage.input_tokens, output_tokens), the old ones (prompt_tokens, completion_tokens)
# kept beside them for one release.
SPANS_VIEW_7 = SPANS_VIEW_4.replace(
    "        'gen_ai.usage.prompt_tokens', r.prompt_tokens,\n"
    "        'gen_ai.usage.completion_tokens', r.output_tokens,\n",
    "        'gen_ai.usage.input_tokens', r.prompt_tokens,\n"
    "        'gen_ai.usage.output_tokens', r.output_tokens,\n"
    "        'gen_ai.usage.prompt_tokens', r.prompt_tokens,\n"
    "        'gen_ai.usage.completion_tokens', r.output_tokens,\n",
)
assert SPANS_VIEW_7.count("gen_ai.usage.") == 4
