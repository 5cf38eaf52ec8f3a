"""A run's trace db laid out by hand for the diagnosis tests: requests arrive, steps run whom
they are told to, and the rows follow (the steps, requests and span rows the trace writer
would have written)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tracing.store import TraceStore, row

RUN = "run-1"
MS = 1_000_000
T0 = 1_700_000_000_000_000_000
BLOCK = 16
NUM_BLOCKS = 512


@dataclass
class Req:
    rid: str
    prompt: int
    output: int
    http_start: int
    sent: int
    received: int
    stream: bool = True
    reader_ns: int = 0  # how long each write waits on a slow reader's socket
    stream_interval: int = 1  # tokens a write takes (lumen serve --stream-interval)
    written: int = 0  # emits delivered so far
    computed: int = 0
    first_token: int | None = None
    emits: list[tuple[int, int, int]] = field(default_factory=list)  # step, received, delivered
    steps: list[tuple[int, ...]] = field(default_factory=list)  # id and the step's instants
    status: str | None = None
    end: int = 0
    kv_freed: int | None = None
    pause_at: int | None = None  # the write (1-based) a reader pausing mid-stream holds up
    pause_ns: int = 0  # ... for this long
    grammar: str | None = None  # its structured output's kind
    grammar_ready: int = 0  # when its grammar compiled (ns; 0: none recorded)
    params: dict[str, Any] | None = None  # its sampling parameters (requests.params)
    end_code: str | None = None
    resent: int = 0  # when it was sent again to a new core (ns; 0: it was not)

    @property
    def handler(self) -> int:
        return self.http_start + MS // 5


class Trace:
    """A run laid out by hand: requests arrive, steps run whom they are told to, rows follow
    (a request finishes when it has its output tokens)."""

    def __init__(self) -> None:
        self.now = T0
        self.reqs: dict[str, Req] = {}
        self.steps: list[tuple[Any, ...]] = []
        self.pauses: list[tuple[Any, ...]] = []
        self.step_prior: list[float] | None = None  # the warm-up's [a, b, c(, f, g)] ns, if any
        self.lifecycle_rows: list[tuple[Any, ...]] = []
        self.engine_config: dict[str, Any] | None = None  # the server's options, if any

    def request(
        self, rid: str, at_ms: float, *, prompt: int = 32, output: int = 8,
        frontend_ms: float = 1.0, ipc_ms: float = 0.2, **kw: Any,
    ) -> None:  # fmt: skip
        start = T0 + int(at_ms * MS)
        sent = start + MS // 5 + int(frontend_ms * MS)
        self.reqs[rid] = Req(rid, prompt, output, start, sent, sent + int(ipc_ms * MS), **kw)

    def step(
        self, rows: dict[str, int], exec_ms: float, *, at_ms: float = 0.0,
        schedule_ms: float = 0.2, output_ms: float = 0.2, wait_reason: str = "", waiting: int = 0,
        preempted: tuple[str, ...] = (), logprobs_ms: float = 0.0, sample_ms: float = 0.0,
        gc_ms: float = 0.0, held_ms: float = 0.0,
    ) -> None:  # fmt: skip
        """A step of ``exec_ms`` (of which ``logprobs_ms`` computed top-20 logprobs for every
        row, ``sample_ms`` ran the sampler on the full logits and ``gc_ms`` the core's GC);
        its tokens reach the frontend ``held_ms`` late (the core stopped before they left)."""
        arrived = max(self.reqs[rid].received for rid in rows)
        start = max(self.now, arrived, T0 + int(at_ms * MS)) + MS // 10
        execute = start + int(schedule_ms * MS)
        executed = execute + int(exec_ms * MS)
        out = executed + int(output_ms * MS)
        step_id, prefill = len(self.steps), 0
        for rid, n in rows.items():
            r = self.reqs[rid]
            assert r.status is None, rid
            r.steps.append((step_id, start, execute, executed, out))
            prefill += n if r.computed < r.prompt else 0
            r.computed += n
            if r.computed >= r.prompt:
                self._token(r, step_id, out + int(held_ms * MS))
        live = [r for r in self.reqs.values() if r.status is None and r.computed]
        self.steps.append(row(
            "steps", run_id=RUN, step_id=step_id, schedule_start_ns=start, schedule_end_ns=execute,
            execute_start_ns=execute, execute_end_ns=executed, output_ns=out,
            num_running=len(live), num_waiting=waiting, num_scheduled_tokens=sum(rows.values()),
            num_prefill_tokens=prefill, num_decode_tokens=sum(rows.values()) - prefill,
            num_preemptions=0, kv_blocks_used=sum(math.ceil(r.computed / BLOCK) for r in live),
            kv_blocks_total=NUM_BLOCKS, request_ids=list(rows), num_scheduled=list(rows.values()),
            preempted_request_ids=list(preempted), update_end_ns=executed + MS // 10,
            wait_reason=wait_reason, idle=False, gc_pause_ns=int(gc_ms * MS),
            sample_ns=int(sample_ms * MS),
            logprobs_ns=int(logprobs_ms * MS), logprobs_rows=len(rows) if logprobs_ms else 0,
            max_logprobs=20 if logprobs_ms else 0,
        ))  # fmt: skip
        if gc_ms:  # the core's GC in the step, as its pause rows record it
            self.pause("core", "gc", (execute - T0) / MS, gc_ms)
        self.now = out
        for r in live:
            if len(r.emits) >= r.output:
                self._finish(r, "ok", out)

    def _token(self, r: Req, step_id: int, out: int) -> None:
        received = out + MS // 10
        r.first_token = r.first_token or received
        r.emits.append((step_id, received, 0))
        n = len(r.emits)
        if 1 < n < r.output and n - r.written < r.stream_interval:
            return  # held: the write that sends it is a later step's
        last = r.emits[r.written - 1][2] if r.written else 0
        delivered = max(received, last) + MS // 5 + r.reader_ns
        if r.pause_at is not None and n == r.pause_at:
            delivered += r.pause_ns  # its reader paused: the write waited on its socket
        r.emits[r.written :] = [(step, got, delivered) for step, got, _ in r.emits[r.written :]]
        r.written = n

    def _finish(self, r: Req, status: str, at: int) -> None:
        r.status, r.kv_freed = status, at
        r.end = max([at, *(d for _, _, d in r.emits)]) + MS // 20

    def abort(self, rid: str, at_ms: float) -> None:
        self._finish(self.reqs[rid], "aborted", T0 + int(at_ms * MS))
        self.reqs[rid].kv_freed = self.reqs[rid].end + MS // 2

    def fail(self, rid: str, at_ms: float, code: str) -> None:
        """It ended with an error: ``code`` says what ended it (requests.end_code)."""
        self._finish(self.reqs[rid], "error", T0 + int(at_ms * MS))
        self.reqs[rid].end_code = code

    def lifecycle(self, kind: str, cause: str, at_ms: float, took_ms: float, **counts: int) -> None:
        """A drain, engine restart or crash loop of the server (the lifecycle table)."""
        self.lifecycle_rows.append(row(
            "lifecycle", run_id=RUN, kind=kind, cause=cause, start_ns=T0 + int(at_ms * MS),
            end_ns=T0 + int((at_ms + took_ms) * MS), epoch=1, **counts,
        ))  # fmt: skip

    def idle(self, at_ms: float, kv_used: int = 0) -> None:
        """The KV state once aborts emptied the engine."""
        at = T0 + int(at_ms * MS)
        self.steps.append(row(
            "steps", run_id=RUN, step_id=len(self.steps), schedule_start_ns=at,
            schedule_end_ns=at, execute_start_ns=at, execute_end_ns=at, output_ns=at,
            num_running=0, num_waiting=0, num_scheduled_tokens=0, num_prefill_tokens=0,
            num_decode_tokens=0, kv_blocks_used=kv_used, kv_blocks_total=NUM_BLOCKS,
            request_ids=[], num_scheduled=[], update_end_ns=at, idle=True,
        ))  # fmt: skip

    def pause(
        self, process: str, kind: str, at_ms: float, duration_ms: float,
        cpu_ms: float | None = None,
    ) -> None:  # fmt: skip
        """A pauses row (``kind`` cpu: a busy stretch, with ``cpu_ms`` of CPU)."""
        self.pauses.append(row(
            "pauses", run_id=RUN, process=process, kind=kind, start_ns=T0 + int(at_ms * MS),
            duration_ns=int(duration_ms * MS),
            cpu_ns=None if cpu_ms is None else int(cpu_ms * MS),
        ))  # fmt: skip

    def request_rows(self) -> list[tuple[Any, ...]]:
        rows = []
        for r in self.reqs.values():
            first = r.emits[0][2] if r.emits and r.stream else None
            rows.append(row(
                "requests", run_id=RUN, request_id=r.rid, trace_id=f"t-{r.rid}",
                arrival_ns=r.handler, prompt_tokens=r.prompt, output_tokens=len(r.emits),
                stream=r.stream, status=r.status, e2e_ns=r.end - r.handler,
                ttft_ns=r.first_token - r.handler if r.first_token else None,
                http_start_ns=r.http_start, handler_ns=r.handler, sent_ns=r.sent,
                received_ns=r.received, first_scheduled_ns=r.steps[0][1] if r.steps else None,
                first_delivered_ns=first, last_delivered_ns=r.emits[-1][2] if r.emits else None,
                delivered_ttft_ns=first - r.http_start if first else None,
                send_wait_ns=r.reader_ns * len({d for _, _, d in r.emits}) + r.pause_ns,
                bytes_sent=6 * len(r.emits),
                kv_freed_ns=r.kv_freed, grammar=r.grammar, end_code=r.end_code,
                grammar_ready_ns=r.grammar_ready or None, resent_ns=r.resent or None,
                params=json.dumps(r.params) if r.params is not None else None,
            ))  # fmt: skip
        return rows

    def span_rows(self) -> list[tuple[Any, ...]]:
        """Spans as the recorder wrote them before core.queue: the first core.schedule span
        begins when the core received the request."""
        rows = []
        for r in self.reqs.values():
            spans = [("llm_request", r.handler, r.end, None),
                     ("frontend.enqueue", r.handler, r.sent, None),
                     ("core.receive", r.sent, r.received, None)]  # fmt: skip
            for i, (step, start, execute, executed, out) in enumerate(r.steps):
                spans += [("core.schedule", r.received if i == 0 else start, execute, step),
                          ("worker.execute", execute, executed, step),
                          ("core.output", executed, out, step)]  # fmt: skip
            spans += [("frontend.emit", received, delivered, step)
                      for step, received, delivered in r.emits]  # fmt: skip
            rows += [
                row("span_rows", run_id=RUN, request_id=r.rid, trace_id=f"t-{r.rid}",
                    span_id=f"{len(rows) + i:016x}", name=name, start_ns=a, end_ns=b, step_id=step,
                    attributes="{}")
                for i, (name, a, b, step) in enumerate(spans)
            ]  # fmt: skip
        return rows

    def write(self, path: Path) -> Path:
        assert all(r.status for r in self.reqs.values()), "every request must end"
        store = TraceStore(path, max_buffered_rows=10_000_000)
        config = json.dumps(self.engine_config) if self.engine_config is not None else None
        runs = [row("runs", run_id=RUN, started_ns=T0, step_prior=self.step_prior,
                    engine_config=config)]  # fmt: skip
        store.add_all({"runs": runs, "requests": self.request_rows(), "steps": self.steps,
                       "span_rows": self.span_rows(), "pauses": self.pauses,
                       "lifecycle": self.lifecycle_rows})  # fmt: skip
        assert store.flush()
        store.close()
        return path


def serve_alone(
    tr: Trace,
    rid: str,
    at_ms: float,
    *,
    prefill_ms: float = 10.0,
    decode_ms: float = 5.0,
    **step_kw: Any,
) -> None:
    """One request on its own: a prefill step, then a decode step per further token."""
    r = tr.reqs[rid]
    tr.step({rid: r.prompt}, prefill_ms, at_ms=at_ms, **step_kw)
    while r.status is None:
        tr.step({rid: 1}, decode_ms, **step_kw)


def serial_run(n: int = 12, **req_kw: Any) -> Trace:
    tr = Trace()
    for i in range(n):
        tr.request(f"r{i}", i * 100.0, **req_kw)
        serve_alone(tr, f"r{i}", i * 100.0 + 2)
    return tr


def long_prefill_run() -> Trace:
    """Four decoders, and a 2,047-token prompt whose one-step prefill (600 ms) stalls them."""
    tr = Trace()
    for i in range(4):
        tr.request(f"d{i}", 0.0, output=30)
    tr.request("long-1", 30.0, prompt=2047, output=4)
    tr.step({f"d{i}": 32 for i in range(4)}, 10.0)
    for _ in range(5):
        tr.step({f"d{i}": 1 for i in range(4)}, 5.0)
    tr.step({**{f"d{i}": 1 for i in range(4)}, "long-1": 2047}, 600.0)
    while tr.reqs["long-1"].status is None:
        tr.step({r: 1 for r in tr.reqs if tr.reqs[r].status is None}, 5.0)
    while tr.reqs["d0"].status is None:
        tr.step({f"d{i}": 1 for i in range(4)}, 5.0)
    return tr
