"""`lumen trace show ID` (a request's waterfall), `lumen trace top` (the slowest requests) and
`lumen trace why ID` (what one request's time went to, in sentences)."""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any

from tracing.spans import BOUNDARIES, GRAMMAR_SPAN
from tracing.store import open_db

DEFAULT_DB = "traces/trace.db"
WIDTH = 40


def add_parser(nouns: Any) -> None:
    trace = nouns.add_parser("trace", help="read the trace store")
    verbs = trace.add_subparsers(dest="verb", required=True)
    show = verbs.add_parser("show", help="one request's spans as a waterfall")
    show.add_argument("request_id")
    show.add_argument("--db", default=DEFAULT_DB, help=f"trace db (default {DEFAULT_DB})")
    show.set_defaults(func=_show)
    top = verbs.add_parser("top", help="the slowest requests and what dominated each")
    top.add_argument("--db", default=DEFAULT_DB, help=f"trace db (default {DEFAULT_DB})")
    top.add_argument("--limit", type=int, default=10)
    top.add_argument("--by", choices=("e2e", "ttft"), default="e2e")
    top.set_defaults(func=_top)
    why = verbs.add_parser("why", help="one request's time explained, against its run")
    why.add_argument("request_id")
    why.add_argument("--db", default=DEFAULT_DB, help=f"trace db (default {DEFAULT_DB})")
    why.set_defaults(func=_why)


def _ms(ns: int | None) -> str:
    return "-" if ns is None else f"{ns / 1e6:,.1f}"


def _highlight(text: str) -> str:
    return f"\033[1;31m{text}\033[0m" if sys.stdout.isatty() else text


def _show(args: argparse.Namespace) -> int:
    with open_db(args.db) as con:
        # A completion with several prompts is one engine request per prompt: ID-0, ID-1, ...
        reqs = con.execute(
            "SELECT request_id, status, endpoint, prompt_tokens, output_tokens, ttft_ns, e2e_ns, "
            "finish_reason, error, arrival_ns, queue_ns, trace_id FROM requests "
            "WHERE request_id = ? OR regexp_full_match(request_id, ?) "
            "ORDER BY request_id, arrival_ns DESC",
            [args.request_id, re.escape(args.request_id) + r"-\d+"],
        ).fetchall()
        if not reqs:
            raise ValueError(f"request {args.request_id!r} is not in {args.db}")
        shown: set[str] = set()
        for req in reqs:
            if req[0] in shown:
                continue  # an older run's request with the same id
            shown.add(req[0])
            spans = con.execute(
                "SELECT name, start_ns, end_ns FROM spans WHERE request_id = ? AND trace_id = ? "
                "ORDER BY start_ns",
                [req[0], req[-1]],
            ).fetchall()
            _waterfall(req[:-1], spans)
    return 0


def _waterfall(req: tuple[Any, ...], spans: list[tuple[str, int, int]]) -> None:
    rid, status, endpoint, n_in, n_out, ttft, e2e, finish, error, arrival, queue = req
    print(
        f"{rid}  {status} ({finish})  {endpoint}  prompt {n_in}, output {n_out} tokens  "
        f"TTFT {_ms(ttft)} ms  e2e {_ms(e2e)} ms"
    )
    if error:
        print(f"error: {error}")
    e2e = max(e2e or 1, 1)
    rows = []
    for name in (*BOUNDARIES[:3], GRAMMAR_SPAN, *BOUNDARIES[3:]):  # core.grammar: if it has one
        mine = [(s, e) for n, s, e in spans if n == name]
        if mine:
            rows.append((name, len(mine), sum(e - s for s, e in mine), mine))
    if not rows:
        return
    slowest = max(rows, key=lambda r: r[2])[0]
    print(f"\n{'boundary':<18}{'n':>6}{'total ms':>11}{'share':>7}  0 ms {'.' * (WIDTH - 10)} "
          f"{e2e / 1e6:,.1f} ms")  # fmt: skip
    for name, count, total, mine in rows:
        cells = [" "] * WIDTH
        for s, e in mine:
            first = min(WIDTH - 1, int((s - arrival) / e2e * WIDTH))
            last = min(WIDTH - 1, max(first, int((e - arrival) / e2e * WIDTH)))
            for i in range(max(first, 0), last + 1):
                cells[i] = "█"
        line = f"{name:<18}{count:>6}{total / 1e6:>11,.1f}{total / e2e:>7.0%}  |{''.join(cells)}|"
        print(_highlight(line + "  <- slowest") if name == slowest else line)
    total = next(r[2] for r in rows if r[0] == slowest)
    note = f" (of which {_ms(queue)} ms waiting in the core's queue)" if slowest == (
        "core.schedule") and queue else ""  # fmt: skip
    print(f"\nslowest boundary: {slowest}, {total / 1e6:,.1f} ms, {total / e2e:.0%} of e2e{note}\n")


def _why(args: argparse.Namespace) -> int:
    from tracing.diagnose import explain_request, find_request_ids, render_request

    # A completion with several prompts is one engine request per prompt: ID-0, ID-1, ...
    for i, rid in enumerate(find_request_ids(args.db, args.request_id)):
        print(("\n" if i else "") + render_request(*explain_request(args.db, rid)))
    return 0


# Per request, its time per boundary. A first core.schedule span that began before its step
# (traces written before core.queue existed) waited in the queue: that part is core.queue.
_TOP_SQL = """
WITH r AS (
    SELECT * FROM requests WHERE {order} IS NOT NULL ORDER BY {order} DESC LIMIT ?
),
s AS (
    SELECT s.request_id, s.name, s.start_ns, s.end_ns,
        greatest(s.start_ns, least(coalesce(st.schedule_start_ns, s.start_ns), s.end_ns)) AS cut
    FROM spans s JOIN r ON s.request_id = r.request_id AND s.trace_id = r.trace_id
    LEFT JOIN steps st ON s.name = 'core.schedule' AND st.run_id = s.run_id
        AND st.step_id = s.step_id
    WHERE s.name <> 'llm_request'
),
parts AS (
    SELECT request_id, name, end_ns - cut AS ns FROM s WHERE name = 'core.schedule'
    UNION ALL
    SELECT request_id, 'core.queue', cut - start_ns FROM s WHERE name = 'core.schedule'
    UNION ALL
    SELECT request_id, name, end_ns - start_ns FROM s WHERE name <> 'core.schedule'
),
b AS (SELECT request_id, name, sum(ns) AS total FROM parts GROUP BY ALL HAVING sum(ns) > 0),
d AS (SELECT request_id, arg_max(name, total) AS name, max(total) AS total
      FROM b GROUP BY request_id)
SELECT r.request_id, r.status, r.e2e_ns, r.ttft_ns, r.prompt_tokens,
       r.output_tokens, d.name, d.total
FROM r LEFT JOIN d USING (request_id) ORDER BY r.{order} DESC
"""


def _top(args: argparse.Namespace) -> int:
    order = "e2e_ns" if args.by == "e2e" else "ttft_ns"
    with open_db(args.db) as con:
        rows = con.execute(_TOP_SQL.format(order=order), [args.limit]).fetchall()
    if not rows:
        print(f"no requests in {args.db}")
        return 0
    print(f"{'request':<30}{'status':<9}{'e2e ms':>10}{'TTFT ms':>10}{'in':>7}{'out':>7}  "
          "dominated by")  # fmt: skip
    for rid, status, e2e, ttft, n_in, n_out, name, total in rows:
        share = f"{name} ({total / max(e2e, 1):.0%})" if name else "-"
        print(f"{rid:<30}{status:<9}{_ms(e2e):>10}{_ms(ttft):>10}{n_in:>7}{n_out:>7}  {share}")
    return 0
