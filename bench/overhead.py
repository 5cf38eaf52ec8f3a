"""lumen bench overhead: what the serving stack costs per token, with a model that costs nothing.

The tiny random Llama (2 layers, hidden 64: bench.tiny_model, as in the test suite) is served
by `lumen serve` with tracing on (the default trace db), by `lumen serve --no-trace-db`, and by
`transformers serve --continuous-batching`. Each gets the same closed-loop streaming load at
each level of concurrent streams, levels interleaved across the servers. Per server and level:
delivered tokens per second, and CPU per delivered token of the server (all its processes, to
the nanosecond through Linux's per-process CPU clocks) and of this client (a raw-socket HTTP/1.1
client, as light as one gets in Python: on 2 cores it competes with the server). At the end the
traced server's trace db, checkpointed, in bytes per generated token.

Tracing's cost pairs the traced and untraced servers round by round (every other round runs the
servers in reverse order), as a share of the untraced server's CPU per token: over the whole
server (`tracing_cpu`), over the API process alone (`tracing_api`: the engine core runs the same
code traced or not, so its difference is noise, 6-8% of the server between rounds on 2 cores),
and the trace writer thread's (`trace_writer`); with five or more rounds, each with a 90%
interval of its median (bench.tracing_shares).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from bench import tracing_shares
from bench.common import check_json_path, machine, parse_ints, print_table, write_json
from bench.server import (
    LumenServer,
    TransformersServer,
    add_kv_tokens_option,
    kv_flags,
    metric,
    streamed_chat,
)
from tracing.config import OTLP_DETAILS
from tracing.receiver import OtlpReceiver

PROMPT = "Write a long story about a lighthouse keeper and the sea."
WRITER = "trace-writer"  # tracing.recorder's thread


def add_parser(verbs: argparse._SubParsersAction) -> None:
    p = verbs.add_parser(
        "overhead",
        help="server CPU per token and tokens/s with a model that costs nothing, against "
        "transformers serve",
    )
    p.add_argument("--streams", default="16,64,256", help="concurrent streams, per level")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--tokens-per-level", type=int, default=16384,
                   help="tokens each server generates per level (rounded up to whole requests "
                        "per stream)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=1, help="times each level is run per server")
    p.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                   help="also an untraced server of N engines (--data-parallel-size N), beside "
                   "the one-engine servers")  # fmt: skip
    p.add_argument("--skip-hf", action="store_true", help="no transformers serve baseline")
    p.add_argument("--stream-interval", type=int, default=1, metavar="N",
                   help="also an untraced Lumen server that sends tokens N at a time (lumen "
                        "serve --stream-interval N), beside the others: its API process's and "
                        "its client's CPU per token against the untraced server's")  # fmt: skip
    p.add_argument("--otlp", default="", metavar="DETAILS",
                   help="also a traced server per --otlp-detail listed (request, boundary, step, "
                        "store), each exporting to a local OTLP receiver: OTLP bytes and the "
                        "exporter's CPU per token")  # fmt: skip
    add_kv_tokens_option(p)
    p.add_argument("--model", default=None,
                   help="serve this model instead of building the tiny one")  # fmt: skip
    p.add_argument("--json", default=None, metavar="PATH", help="write the figures as JSON")
    p.set_defaults(func=run)


@dataclass
class Level:
    system: str
    streams: int
    seconds: float
    tokens: int
    requests: int
    errors: list[str]
    server_cpu_s: float
    children_cpu_s: float  # of server_cpu_s: Lumen's engine core (and workers)
    client_cpu_s: float
    writer_cpu_s: float  # of server_cpu_s: the trace-writer thread (Lumen's)
    extra: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        per = max(self.tokens, 1)
        return {
            "system": self.system,
            "streams": self.streams,
            "seconds": self.seconds,
            "tokens": self.tokens,
            "requests": self.requests,
            "errors": len(self.errors),
            "tok_s": self.tokens / self.seconds if self.seconds else math.nan,
            "server_cpu_us_per_token": self.server_cpu_s / per * 1e6,
            "children_cpu_us_per_token": self.children_cpu_s / per * 1e6,
            "api_cpu_us_per_token": (self.server_cpu_s - self.children_cpu_s) / per * 1e6,
            "client_cpu_us_per_token": self.client_cpu_s / per * 1e6,
            "trace_writer_cpu_us_per_token": self.writer_cpu_s / per * 1e6,
        }


def tree_cpu_seconds(pid: int) -> tuple[float, float]:
    """User + system CPU of a process, and of its live descendants."""
    try:
        root = psutil.Process(pid)
        children = root.children(recursive=True)
    except psutil.NoSuchProcess:
        return 0.0, 0.0
    return process_cpu_seconds(root), sum(process_cpu_seconds(c) for c in children)


def process_cpu_seconds(proc: psutil.Process) -> float:
    """Its CPU to the nanosecond, exited threads included: Linux's CPU clock of another
    process. /proc's clock ticks (10 ms) were 0.7% of a 16,384-token level's server CPU, and
    0.6 us a token of its trace writer's."""
    try:
        return time.clock_gettime(((~proc.pid) << 3) | 2)  # MAKE_PROCESS_CPUCLOCK(pid, SCHED)
    except (OSError, AttributeError):  # not Linux, or it ended
        try:
            t = proc.cpu_times()
        except psutil.NoSuchProcess:
            return 0.0
        return t.user + t.system


def thread_cpu_seconds(pid: int, name: str) -> float:
    """User + system CPU of the threads of a process that the OS knows by ``name``
    (engine.background.name_os_thread), to the nanosecond where /proc has schedstat; 0 where
    /proc has none."""
    total, tick = 0.0, os.sysconf("SC_CLK_TCK")
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    for tid in tids:
        task = f"/proc/{pid}/task/{tid}"
        try:
            with open(f"{task}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended
            continue
        if stat[stat.index("(") + 1 : stat.rindex(")")] == name:
            total += _task_cpu_seconds(task, stat, tick)
    return total


def _task_cpu_seconds(task: str, stat: str, tick: int) -> float:
    """A thread's CPU: its schedstat's nanoseconds on a CPU, else its stat's clock ticks."""
    try:
        with open(f"{task}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):  # no schedstat here, or the thread just ended
        utime, stime = stat[stat.rindex(")") + 2 :].split()[11:13]
        return (int(utime) + int(stime)) / tick


class _Stream:
    """One keep-alive HTTP/1.1 connection issuing streamed chats one after another."""

    def __init__(self, port: int, body: dict[str, Any]) -> None:
        self.port = port
        payload = json.dumps(body).encode()
        self.request = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def one(self) -> tuple[int, str | None]:
        """Tokens delivered (the usage chunk's count, else content chunks) and an error."""
        if self.writer is None or self.writer.is_closing():
            self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        reader, writer = self.reader, self.writer
        assert reader is not None
        writer.write(self.request)
        status = await reader.readline()
        headers: dict[bytes, bytes] = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip().lower()
        if headers.get(b"transfer-encoding") == b"chunked":
            body = await _chunked(reader)
        elif b"content-length" in headers:
            body = await reader.readexactly(int(headers[b"content-length"]))
        else:
            body = await reader.read()
        if headers.get(b"connection") == b"close" or (
            b"content-length" not in headers and (headers.get(b"transfer-encoding") != b"chunked")
        ):
            writer.close()
        if b" 200 " not in status:
            return 0, f"{status.decode().strip()}: {body[:200]!r}"
        content, usage = 0, None
        for event in body.split(b"\n\n"):
            if not event.startswith(b"data: {"):
                continue
            if b'"usage":{' in event:
                usage = json.loads(event[6:])["usage"]["completion_tokens"]
            if b'"content":"' in event and b'"content":""' not in event:
                content += 1
        return (usage if usage is not None else content), None

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def _chunked(reader: asyncio.StreamReader) -> bytes:
    parts: list[bytes] = []
    while True:
        size = int((await reader.readline()).split(b";")[0], 16)
        if size == 0:
            await reader.readline()
            return b"".join(parts)
        parts.append(await reader.readexactly(size))
        await reader.readline()


async def _load(port: int, body: dict[str, Any], streams: int, per_stream: int):
    async def stream(k: int) -> tuple[int, list[str]]:
        conn = _Stream(port, body)
        tokens, errors = 0, []
        try:
            for _ in range(per_stream):
                n, error = await conn.one()
                tokens += n
                if error:
                    errors.append(error)
        finally:
            conn.close()
        return tokens, errors

    t0 = time.perf_counter()
    done = await asyncio.gather(*(stream(k) for k in range(streams)))
    return time.perf_counter() - t0, sum(t for t, _ in done), [e for _, es in done for e in es]


def _body(server: LumenServer, max_tokens: int) -> dict[str, Any]:
    return streamed_chat(server, PROMPT, max_tokens)


def measure(
    name: str, server: LumenServer, streams: int, per_stream: int, max_tokens: int
) -> Level:
    body, pid = _body(server, max_tokens), server.proc.pid
    (top0, kids0), client0 = tree_cpu_seconds(pid), time.process_time()
    writer0 = thread_cpu_seconds(pid, WRITER)
    seconds, tokens, errors = asyncio.run(_load(server.port, body, streams, per_stream))
    top, kids = tree_cpu_seconds(pid)
    writer, client = thread_cpu_seconds(pid, WRITER), time.process_time() - client0
    if name.startswith("lumen"):
        # The level's events are handled on its bill, not the next one's, traced or not: the
        # trace writer thread's CPU until it is idle again, and a traced one's until its next
        # flush has stored the level's rows, is added (not the rest of the server's: its
        # /metrics answers to the polls that wait for the flush are this bench's cost, as is
        # the client's CPU in those polls). An untraced writer handles the load's last events
        # after it too: 0-0.5 us a token, which only the traced server's bill held before.
        if name.startswith("lumen (traced"):
            _wait_for_a_flush(server)
        done = _wait_for_idle_writer(pid)
        top, writer = top + done - writer, done
    return Level(
        name, streams, seconds, tokens, streams * per_stream, errors,
        top + kids - top0 - kids0, kids - kids0, client, writer - writer0,
    )  # fmt: skip


def _wait_for_idle_writer(pid: int, timeout: float = 10.0) -> float:
    """The trace writer thread's CPU once it has handled every event: idle, it only wakes to
    poll (every 50 ms, microseconds each), so 0.1 s with under 0.2 ms of CPU."""
    deadline = time.monotonic() + timeout
    before = thread_cpu_seconds(pid, WRITER)
    while True:
        time.sleep(0.1)
        now = thread_cpu_seconds(pid, WRITER)
        if now - before < 2e-4 or time.monotonic() > deadline:
            return now
        before = now


def _wait_for_a_flush(server: LumenServer, timeout: float = 30.0) -> None:
    """Until the trace writer has flushed after now: under load its flushes are up to 10 s
    apart, and the one after a pause stores what the load left."""
    flushes = metric(server.metrics(), "lumen:trace_flushes_total")
    deadline = time.monotonic() + timeout
    while metric(server.metrics(), "lumen:trace_flushes_total") <= flushes:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{server.name}: no trace db flush within {timeout:.0f} s")
        time.sleep(0.05)


def store_bytes_per_token(trace_db: Path) -> dict[str, float]:
    """The trace db after a checkpoint: bytes, generated tokens, and the ratio."""
    import duckdb

    con = duckdb.connect(str(trace_db))
    try:
        con.execute("CHECKPOINT")
        row = con.execute("SELECT coalesce(sum(output_tokens), 0) FROM requests").fetchone()
        tokens = row[0] if row else 0  # an aggregate: always one row
    finally:
        con.close()
    size = trace_db.stat().st_size
    return {"bytes": size, "tokens": int(tokens), "bytes_per_token": size / max(tokens, 1)}


def run(args: argparse.Namespace) -> int:
    from bench.tiny_model import build_tiny_llama
    from engine.model_files import resolve_model

    levels = parse_ints(args.streams, "--streams")
    if min(args.max_tokens, args.tokens_per_level, args.rounds, args.stream_interval) < 1:
        raise ValueError(
            "--max-tokens, --tokens-per-level, --rounds and --stream-interval must be >= 1"
        )
    check_json_path(args.json)
    results: list[Level] = []
    details = [d for d in args.otlp.split(",") if d]
    if bad := set(details) - set(OTLP_DETAILS):
        raise ValueError(f"--otlp takes {', '.join(OTLP_DETAILS)}, not {', '.join(sorted(bad))}")
    receivers: dict[str, OtlpReceiver] = {}
    otlp: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="lumen-overhead-") as tmp_dir, ExitStack() as stack:
        tmp = Path(tmp_dir)
        model = (Path(args.model) if args.model
                 else build_tiny_llama(tmp / "tiny-llama", resolve_model(None)))  # fmt: skip
        top = str(max(levels))
        common = ("--max-num-seqs", top, "--max-concurrent-requests", str(4 * max(levels)),
                  *kv_flags(args.kv_tokens))  # fmt: skip
        servers: list[tuple[str, LumenServer]] = []
        try:
            servers.append(
                (
                    "lumen (traced)",
                    LumenServer(
                        model, *common, log_path=tmp / "traced.log", trace_db=tmp / "trace.db"
                    ),
                )
            )
            servers.append(("lumen (no trace db)", LumenServer(
                model, *common, "--no-trace-db", log_path=tmp / "untraced.log")))  # fmt: skip
            if args.data_parallel_size > 1:
                dp = str(args.data_parallel_size)
                servers.append((f"lumen (no trace db, {dp} engines)", LumenServer(
                    model, *common, "--no-trace-db", "--data-parallel-size", dp,
                    log_path=tmp / "dp.log")))  # fmt: skip
            if args.stream_interval > 1:
                servers.append((_interval_name(args.stream_interval), LumenServer(
                    model, *common, "--no-trace-db", "--stream-interval",
                    str(args.stream_interval), log_path=tmp / "interval.log")))  # fmt: skip
            for detail in details:
                receiver = stack.enter_context(OtlpReceiver())
                receivers[f"lumen (traced, otlp {detail})"] = receiver
                servers.append((f"lumen (traced, otlp {detail})", LumenServer(
                    model, *common, "--otlp-traces-endpoint", receiver.endpoint,
                    "--otlp-detail", detail, log_path=tmp / f"otlp-{detail}.log",
                    trace_db=tmp / f"otlp-{detail}.db")))  # fmt: skip
            if not args.skip_hf:
                servers.append(("transformers serve", TransformersServer(
                    model, log_path=tmp / "hf.log", kv_tokens=args.kv_tokens)))  # fmt: skip
            for _, server in servers:  # the first requests pay one-off costs
                asyncio.run(_load(server.port, _body(server, 8), 4, 1))
            for round_ in range(args.rounds):
                # Every other round runs the servers in reverse: a drift of the machine's speed
                # within a round falls on each server alike.
                order = servers if round_ % 2 == 0 else servers[::-1]
                for streams in levels:
                    per_stream = math.ceil(args.tokens_per_level / (streams * args.max_tokens))
                    for name, server in order:
                        level = measure(name, server, streams, per_stream, args.max_tokens)
                        results.append(level)
                        s = level.summary()
                        print(f"  {name}, {streams} streams: {s['tok_s']:,.0f} tok/s, server "
                              f"{s['server_cpu_us_per_token']:.0f} us/token, client "
                              f"{s['client_cpu_us_per_token']:.0f} us/token, "
                              f"errors {s['errors']}", flush=True)  # fmt: skip
                        if level.errors:
                            print(f"    first error: {level.errors[0]}")
            for name, server in servers:
                if name in receivers:
                    generated = sum(v for k, v in server.metrics().items()
                                    if k.startswith("lumen:generation_tokens_total"))  # fmt: skip
                    otlp[name] = {"generated_tokens": generated}
        finally:
            for _, server in servers:
                server.stop()  # its drain flushes what is left to the receiver
        for name, receiver in receivers.items():
            otlp[name].update(bytes=receiver.num_bytes, spans=len(receiver.spans),
                              bytes_per_token=receiver.num_bytes / max(otlp[name][
                                  "generated_tokens"], 1))  # fmt: skip
        store = store_bytes_per_token(tmp / "trace.db")
    summaries = [r.summary() for r in results]
    _print(summaries, store)
    _print_otlp(summaries, otlp)
    ratios = _ratios(summaries, levels, args.stream_interval)
    intervals = tracing_shares.intervals(summaries, levels)
    for key, value in ratios.items():
        if (i := intervals.get(key)) is not None:
            print(f"{key}: {value:.3f} ({tracing_shares.INTERVAL:.0%} interval {i['low']:.3f} to "
                  f"{i['high']:.3f}, {i['rounds']} paired rounds)")  # fmt: skip
        else:
            print(f"{key}: {value:.3f}")
    write_json(args.json, {"max_tokens": args.max_tokens, "levels": summaries, "store": store,
                           "otlp": otlp, **ratios, "intervals": intervals,
                           "machine": machine()})  # fmt: skip
    return 0


def _median_by(summaries: list[dict[str, Any]], key: str) -> dict[tuple[str, int], float]:
    groups: dict[tuple[str, int], list[float]] = {}
    for s in summaries:
        groups.setdefault((s["system"], s["streams"]), []).append(s[key])
    return {k: statistics.median(v) for k, v in groups.items()}


def _print(summaries: list[dict[str, Any]], store: dict[str, float]) -> None:
    tok = _median_by(summaries, "tok_s")
    cpu = _median_by(summaries, "server_cpu_us_per_token")
    kids = _median_by(summaries, "children_cpu_us_per_token")
    client = _median_by(summaries, "client_cpu_us_per_token")
    writer = _median_by(summaries, "trace_writer_cpu_us_per_token")
    rows = [
        [system, str(streams), f"{tok[key]:,.0f}", f"{cpu[key]:.0f}",
         f"{cpu[key] - kids[key]:.0f} / {kids[key]:.0f}",
         f"{writer[key]:.1f}" if system.startswith("lumen") else "", f"{client[key]:.0f}"]
        for key in tok
        for system, streams in [key]
    ]  # fmt: skip
    print()
    print_table(["server", "streams", "tok/s", "server us/token", "of which main / children",
                 "of which trace writer", "client us/token"], rows)  # fmt: skip
    print(f"trace db: {store['bytes']:,} bytes for {store['tokens']:,} generated tokens, "
          f"{store['bytes_per_token']:.1f} bytes per token (after a checkpoint)")  # fmt: skip


def _print_otlp(summaries: list[dict[str, Any]], otlp: dict[str, dict[str, float]]) -> None:
    """OTLP bytes per generated token, and the exporter's CPU per token: the server's against
    the traced one that exports nothing, per level."""
    cpu = _median_by(summaries, "server_cpu_us_per_token")
    for name, figures in otlp.items():
        extra = ", ".join(
            f"{streams} streams +{cpu[name, streams] - cpu['lumen (traced)', streams]:.1f} us"
            for system, streams in cpu if system == name
        )  # fmt: skip
        print(f"{name}: {figures['bytes']:,} OTLP bytes, {figures['spans']:,} spans for "
              f"{figures['generated_tokens']:,.0f} tokens = {figures['bytes_per_token']:.1f} "
              f"bytes per token; exporter CPU per token over the traced server: "
              f"{extra}")  # fmt: skip


def _interval_name(n: int) -> str:
    return f"lumen (no trace db, --stream-interval {n})"


def _ratios(
    summaries: list[dict[str, Any]], levels: list[int], stream_interval: int = 1
) -> dict[str, float]:
    tok = _median_by(summaries, "tok_s")
    cpu = _median_by(summaries, "server_cpu_us_per_token")
    out: dict[str, float] = {}
    lumen, hf = "lumen (traced)", "transformers serve"
    held, every = _interval_name(stream_interval), "lumen (no trace db)"
    if stream_interval > 1:
        api = _median_by(summaries, "api_cpu_us_per_token")
        client = _median_by(summaries, "client_cpu_us_per_token")
    for streams in levels:
        if (hf, streams) in cpu:
            out[f"s{streams}_cpu_per_token_ratio"] = cpu[lumen, streams] / cpu[hf, streams]
            out[f"s{streams}_tok_s_ratio"] = tok[lumen, streams] / tok[hf, streams]
        if (held, streams) in cpu:  # N tokens a write against one
            out[f"s{streams}_stream_interval_api_ratio"] = api[held, streams] / api[every, streams]
            out[f"s{streams}_stream_interval_client_ratio"] = (
                client[held, streams] / client[every, streams]
            )
    out.update(tracing_shares.medians(summaries, levels))
    lo, hi = min(levels), max(levels)
    if lo != hi:  # flat in load: Lumen's own cost at the most streams over the fewest
        out[f"cpu_per_token_s{hi}_over_s{lo}_ratio"] = cpu[lumen, hi] / cpu[lumen, lo]
    return out
