"""`lumen trace show ID` (a request's waterfall), `lumen trace top` (the slowest requests and the
part that dominated each, as `trace why` and `replay report` judge it) and `lumen trace why ID`
(what one request's time went to, in sentences)."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

from tracing.emit_columns import closes_write
from tracing.spans import BOUNDARIES, GRAMMAR_SPAN

DEFAULT_DB = "traces/trace.db"
# Several stores (or a folder of them) read as one fleet, each row with its replica.
DB_OPTION: dict[str, Any] = {
    "nargs": "+", "default": [DEFAULT_DB], "metavar": "DB",
    "help": f"trace db, several, or a folder of them: one fleet (default {DEFAULT_DB})",
}  # fmt: skip
WIDTH = 40


def add_parser(nouns: Any) -> None:
    trace = nouns.add_parser("trace", help="read the trace store")
    verbs = trace.add_subparsers(dest="verb", required=True)
    show = verbs.add_parser("show", help="one request's spans as a waterfall")
    show.add_argument("request_id", nargs="?")
    show.add_argument("--db", **DB_OPTION)
    show.set_defaults(func=_show)
    top = verbs.add_parser("top", help="the slowest requests and what dominated each")
    top.add_argument("--db", **DB_OPTION)
    top.add_argument("--limit", type=int, default=10)
    top.add_argument("--by", choices=("e2e", "ttft"), default="e2e")
    top.set_defaults(func=_top)
    why = verbs.add_parser("why", help="one request's time explained, against its run")
    why.add_argument("request_id", nargs="?")
    why.add_argument("--db", **DB_OPTION)
    why.set_defaults(func=_why)


def _ms(ns: int | None) -> str:
    return "-" if ns is None else f"{ns / 1e6:,.1f}"


def _highlight(text: str) -> str:
    return f"\033[1;31m{text}\033[0m" if sys.stdout.isatty() else text


def _the_request(args: argparse.Namespace) -> None:
    """The request id, where it came after ``--db`` (which takes several values, so it took
    the id too): the last of them that is no file or folder."""
    if args.request_id is None:
        if len(args.db) > 1 and not Path(args.db[-1]).exists():
            args.request_id, args.db = args.db[-1], args.db[:-1]
        else:
            raise ValueError("give the request id (its x-request-id), before --db or after it")


def _show(args: argparse.Namespace) -> int:
    from tracing.store import open_db  # duckdb: `lumen serve` builds this parser before its core

    _the_request(args)
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
            raise ValueError(f"request {args.request_id!r} is not in {' '.join(args.db)}")
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
        emits = name == "frontend.emit"
        closing = closes_write([e for _, e in mine]) if emits else [True] * len(mine)
        held = _held(mine, closing)
        if mine:  # a write's own time once, from the emit that sent it
            total = sum(e - s for (s, e), closes in zip(mine, closing) if closes)
            rows.append((name, len(mine), total, mine))
        if held:
            rows.append((HELD, len(held), sum(e - s for s, e in held), held))
    if not rows:
        return
    slowest = max((r for r in rows if r[0] != HELD), key=lambda r: r[2])[0]
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


# The emits one write delivered (emit_columns.closes_write): each but the last was held from
# its start to the last one's, the output that sent them. The hold is shown apart, and the
# write's own time (the last one's span) counts once in frontend.emit's total.
HELD = "  held to send"


def _held(emits: list[tuple[int, int]], closing: list[bool]) -> list[tuple[int, int]]:
    held, sent_at = [], 0
    for (s, _), closes in zip(reversed(emits), reversed(closing)):
        if closes:
            sent_at = s
        else:
            held.append((s, sent_at))
    return held[::-1]


def _why(args: argparse.Namespace) -> int:
    from tracing.diagnose import explain_request, find_request_ids, render_request

    _the_request(args)
    # A completion with several prompts is one engine request per prompt: ID-0, ID-1, ...
    for i, rid in enumerate(find_request_ids(args.db, args.request_id)):
        print(("\n" if i else "") + render_request(*explain_request(args.db, rid)))
    return 0


def _top(args: argparse.Namespace) -> int:
    from tracing.diagnose import diagnose_run
    from tracing.judge import dominant_words
    from tracing.store import open_db

    order = "e2e_ns" if args.by == "e2e" else "ttft_ns"
    with open_db(args.db) as con:
        # A fleet's rows name their replica (tracing.fleet); one store's do not need to.
        fleet = con.execute(
            "SELECT count(*) FROM information_schema.columns "
            "WHERE table_name = 'requests' AND column_name = 'replica'"
        ).fetchone() != (0,)
        rows = con.execute(
            f"SELECT run_id, request_id, {'replica' if fleet else 'NULL'} FROM requests "
            f"WHERE {order} IS NOT NULL ORDER BY {order} DESC LIMIT ?",
            [args.limit],
        ).fetchall()
    if not rows:
        print(f"no requests in {' '.join(args.db)}")
        return 0
    # What dominated each is its run's diagnosis: the same words as `trace why` and the report.
    runs = {run_id: diagnose_run(args.db, run_id) for run_id in dict.fromkeys(r[0] for r in rows)}
    width = max((len(str(r[2])) for r in rows), default=0) + 2 if fleet else 0
    print(f"{'request':<30}{'replica' if fleet else '':<{width}}{'status':<9}{'e2e ms':>10}"
          f"{'TTFT ms':>10}{'in':>7}{'out':>7}  dominated by")  # fmt: skip
    for run_id, rid, replica in rows:
        r = next(q for q in runs[run_id].requests if q.request_id == rid)
        print(f"{rid:<30}{replica or '':<{width}}{r.status:<9}{_ms(r.e2e_ns):>10}"
              f"{_ms(r.ttft_ns):>10}{r.prompt_tokens:>7}{r.output_tokens:>7}  "
              f"{dominant_words(r)}")  # fmt: skip
    return 0
