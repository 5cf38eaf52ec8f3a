"""The registry of diagnosis parts: each part's key, phases, table labels, words, knob and source.

Everything that names a part reads it from here: the TTFT and decode tables
(``tracing.diagnosis.TTFT_PARTS`` / ``DECODE_PARTS``), the sentences (``tracing.words.WHAT``),
the span `lumen trace top` points at, and the table in docs/diagnosis.md
(``python -m tracing.parts`` prints it; tests/tracing/test_parts.py checks the docs agree).
A part's order in PARTS is its order in both phases' tables.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Part:
    key: str
    ttft: str | None  # its label in the TTFT table; None: not a TTFT part
    decode: str | None  # its label in the decode table; None: not a decode part
    what: str  # what the time was, as a sentence says it ("spent 30 ms in ...")
    knob: str  # what moves it ("" where nothing does: expected compute, the queue's limit)
    source: str  # docs: the records its time comes from
    span: str | None = None  # the `lumen trace show` span its time lies in, where one does

    @property
    def phases(self) -> tuple[str, ...]:
        return tuple(p for p, label in (("ttft", self.ttft), ("decode", self.decode)) if label)


_API_LAG = "event-loop lag in the API process"
_API_CPU = "the API process's CPU beside its steps"
_GC = "garbage-collection pauses"
_OTHERS_PREFILL = "other requests' prefill in the steps it shared"
_RECOMPUTE = "other requests' recompute after a preemption in the steps it shared"
_SCHEDULER = "scheduler CPU"
_MASKS = "structured outputs' token masks in the steps it shared"
_OUTPUT = "output building and sending in the core"
_SAMPLING = "the sampler in the steps it shared (full logits)"
_LOGPROBS = "logprobs in the steps it shared"
_SPECULATION = "speculative decoding: drafts the model refused"
_EMIT = "IPC back, detokenize and emit"
_DELIVERY = "delivery to the client (its socket accepting the bytes)"
_UNEXPLAINED = "time between recorded boundaries that no record explains"

PARTS: tuple[Part, ...] = (
    Part(
        "http", "HTTP receive (the body read whole)", None,
        "receiving the HTTP request",
        "a slow client upload or a busy API process (see event-loop lag)",
        "first byte read to the body read whole (`body_read_ns`; to `handler_ns` where not "
        "recorded): receiving the request",
    ),
    Part(
        "parse", "decoding and validating the JSON body", None,
        "decoding and validating its JSON body",
        "the API process decodes and validates each body on its event loop: large bodies "
        "(long histories, unused fields) cost it, and every request waits; send smaller ones",
        "`body_read_ns` to `handler_ns`: the body read whole, then decoded and validated "
        "(`body_bytes` its size)",
    ),
    Part(
        "frontend", "frontend CPU (chat template, tokenize)", None,
        "frontend CPU (chat template, tokenize) before reaching the engine",
        "long prompts and chat histories cost template and tokenizer time in the API "
        "process; shorten or cache them, or give the API process more CPU",
        "handler to sent, minus the admission wait: chat template and tokenizer",
        "frontend.enqueue",
    ),
    Part(
        "admission", "waiting for an admission slot (--max-concurrent-requests)", None,
        "waiting for an admission slot", "raise --max-concurrent-requests if the engine has room",
        "waiting for a slot (`--max-concurrent-requests`)", "frontend.enqueue",
    ),
    Part(
        "engine_restart", "waiting for the engine core to restart (a crash or a hang)", None,
        "waiting for the engine core to restart after a crash or a hang",
        "find why the core failed (the server log; the `lifecycle` table's cause); "
        "--max-queue-wait bounds how long a request waits for the new core",
        "handler to sent, while the engine core was restarting (the `lifecycle` table's restart "
        "rows: found dead or hung to the new core ready); and for a request its failed core "
        "left before it had sent any output, its first send to its second (`resent_ns`): its "
        "time on the failed core and the wait for the new one",
        "frontend.enqueue",
    ),
    Part(
        "loop_lag", _API_LAG, _API_LAG, _API_LAG,
        "something blocks the API event loop (CPU-heavy work in a handler, a large "
        "tokenization); see the pauses table",
        "event-loop lag rows in `pauses` (api) that overlap the request's windows, less the API "
        "process's GC pauses inside them; a lag that GC pauses fill at least half of is `gc` (a "
        "storm of collections, the loop's moments between them included); and a step's forward "
        "past its time where the API process's loop lagged in it, as `gc` takes such a step",
    ),
    Part(
        "api_cpu", _API_CPU, _API_CPU, "the API process's CPU beside the core's steps",
        "the API process and the engine core share the machine's cores: its CPU-heavy work "
        "(large bodies, long chat templates and tokenization, the trace store's writes) slows "
        "the steps beside it; send smaller bodies, or give the core cores of its own (fewer "
        "torch threads)",
        "a step's forward past its fitted time (not a stall) while the API process was busy "
        "(the `cpu` rows of `pauses`: at least half a core for 20 ms), pro rata to the time "
        "it was busy in that forward (less the part of that time it spent in GC: `gc`), in its "
        "steps and in the step in flight it waited for; and a stalled step's excess where it "
        "was busy for half of it (and did not pause)",
        "worker.execute",
    ),
    Part(
        "ipc", "IPC to the core and its input queue", None,
        "reaching the core (IPC and the core's input queue)",
        "the core takes new requests between steps, so arrivals wait for the step in "
        "flight: long steps (cap them with --max-num-batched-tokens) or CPU contention "
        "lengthen this",
        "sent to received, less `step_in_flight`: the socket and the core's input queue; where "
        "that is 20 ms or more, the core had stopped reading (`core_stall`)",
        "core.receive",
    ),
    Part(
        "step_in_flight", "waiting for the step in flight (its expected time)", None,
        "waiting for the core's step in flight", "",
        "sent (or, where it was on its way in while the step in flight ran, that step's start: "
        "its way in since cost it nothing) to received, while the core finished the step in "
        "flight, up to that step's expected time (its fitted execute time, its schedule and "
        "output): expected, as in every step-based server, but for the share of its forward "
        "other requests' prefill "
        "took (`neighbour_prefill`, `recompute`), the wait through its sampler (`sampling`, "
        "`logprobs`, `speculation`) and the share the API process's CPU or GC slowed its forward "
        "by (`api_cpu`, `gc`); the rest of the wait is `ipc`, or `core_stall` from 20 ms",
        "core.receive",
    ),
    Part(
        "queue", "waiting in the core's queue", None, "waiting in the core's queue", "",
        "received (or grammar ready) to first scheduled, with the limit that held it "
        "(see below)",
        "core.queue",
    ),
    Part(
        "imbalance", "queued on one engine while another had room", None,
        "waiting in one engine's queue while another engine had room",
        "--data-parallel-size: each request goes to the engine with the lowest 4 x waiting + "
        "running; a request pinned by X-data-parallel-rank or sent by prefix affinity, or "
        "long requests piling onto one engine, wait there while another has room (drop the "
        "header; lower --data-parallel-prefix-affinity; raise --max-num-seqs)",
        "the part of the queue wait (received to first scheduled) during which another "
        "engine's last step had nobody waiting and fewer running than `--max-num-seqs` "
        "(each request's engine is `requests.engine`, a step's `step_id >> 56`; the words "
        "name the rule that sent it there, `requests.routed`)",
        "core.queue",
    ),
    Part(
        "grammar_compile", "waiting for its grammar to compile (structured outputs)", None,
        "waiting for its grammar to compile (structured outputs)",
        "compiled grammars are cached by schema: reuse the same schemas; with --no-warmup the "
        "first grammar after start also loads the tokenizer the grammar engine needs",
        "received to `grammar_ready_ns`, or to the start of the next step where the compile "
        "ended during one (it would have run in that step): structured outputs waiting for "
        "their grammar to compile (outside the queue; with `--no-warmup` the first grammar "
        "after start also loads the grammar engine's tokenizer)",
        "core.grammar",
    ),
    Part(
        "own_prefill", "its own prefill compute", None, "its own prefill", "",
        "its share of the execute time of its prefill steps", "worker.execute",
    ),
    Part(
        "neighbour_prefill", _OTHERS_PREFILL, _OTHERS_PREFILL, _OTHERS_PREFILL,
        "a smaller --max-num-batched-tokens caps how much prefill one step carries",
        "other requests' prefill in the steps it shared, and the prefill's share (at the fit's "
        "price) of the step in flight when it reached the core; each of those requests is "
        "named, with its tokens",
        "worker.execute",
    ),
    Part(
        "recompute", _RECOMPUTE, _RECOMPUTE, _RECOMPUTE,
        "more KV blocks (--num-kv-blocks or --kv-cache-memory-bytes) or a lower "
        "--max-num-seqs avoid preemption",
        "of `neighbour_prefill` as priced, the share of rows recomputing their tokens after a "
        "preemption (a row past its request's first token with several prefill tokens): the "
        "preemption's cost to the requests beside it, in its steps and in the step in flight",
        "worker.execute",
    ),
    Part(
        "decode",
        "the batch's other rows in the steps it shared (decode, per-request cost)",
        "decode compute (its own and the batch's other rows)",
        "the batch's other rows in the steps it shared", "",
        "decode rows in its steps. In TTFT these are other requests' rows; after the first "
        "token, they are its own decode compute",
        "worker.execute",
    ),
    Part(
        "chunk_wait", "its prefill split into chunks (the wait between, each step's fixed cost)",
        None, "its prefill split into chunks",
        "a larger --max-num-batched-tokens prefills a long prompt in fewer steps",
        "between its prefill chunks, in steps it sat out; and of its own prefill steps, the "
        "fixed cost (its row's share) and the batch's other rows of all but one: what the "
        "split cost beyond its tokens",
    ),
    Part(
        "schedule", _SCHEDULER, _SCHEDULER, _SCHEDULER,
        "the scheduler's cost grows with running requests and prefix-cache lookups; "
        "profile the core process",
        "scheduler CPU of its steps (without the grammar masks)", "core.schedule",
    ),
    Part(
        "grammar_mask", _MASKS, _MASKS,
        "computing structured outputs' token masks in the steps it shared",
        "every row in a step waits for the masks of the rows under a grammar: simpler "
        "schemas (fewer alternatives, bounded strings) cost less per token",
        "structured outputs' token masks in its steps (`steps.grammar_mask_ns`, between "
        "`schedule_end_ns` and `execute_start_ns`): every row waits for them, its own "
        "grammar's or its neighbours'",
        "core.schedule",
    ),
    Part(
        "sampling", _SAMPLING, _SAMPLING, "sampling on the full logits in the steps it shared",
        "rows that are not plain greedy (temperature, top-k/p, penalties, a grammar, logprobs) "
        "take the full logits and the sampler, and every row of their step waits; plain greedy "
        "batches take the fused greedy head",
        "the sampler's part of its steps' execute (`steps.sample_ns`), and of the step in "
        "flight when it reached the core, where it waited through it: penalties, grammar "
        "masks applied, temperature and top-k/p on the full logits; the LM head itself is "
        "the forward's",
        "worker.execute",
    ),
    Part(
        "logprobs", _LOGPROBS, _LOGPROBS, "computing logprobs in the steps it shared",
        "ask for fewer top_logprobs (the server caps them: --max-logprobs); every row of a "
        "step waits for the rows that asked",
        "the logprobs part of its steps' execute (`steps.logprobs_ns`, for "
        "`steps.logprobs_rows` rows, at most `steps.max_logprobs` per token)",
        "worker.execute",
    ),
    Part(
        "speculation", _SPECULATION, _SPECULATION,
        "proposing and verifying drafts the model refused, in the steps it shared",
        "a proposer closer to the model (a draft model for open text, ngram for answers that "
        "copy the prompt), a smaller num_speculative_tokens, or a lower disable_by_batch_size "
        "(--speculative-config); every row of a step waits for the proposer",
        "the refused drafts' share of its steps' forward (their tokens, `steps.num_drafted` "
        "less `steps.num_accepted`, over the step's) and of the proposer's time "
        "(`steps.propose_ns`, their count over the drafts'); kept drafts' cost is decode's",
        "worker.execute",
    ),
    Part(
        "output", _OUTPUT, _OUTPUT, "building and sending outputs in the core",
        "output building grows with the batch; a frontend slow to read the core's "
        "socket shows here too",
        "building and sending the step's outputs in the core (`update_end_ns`, then "
        "`output_ns`)",
        "core.output",
    ),
    Part(
        "between_steps", None, "the core between its steps (new requests, steps it sat out)",
        "the core between its steps",
        "the core takes new requests and aborts between steps, and a request "
        "left out of a step (token budget) waits here",
        "after its first token, the core between its steps: new requests, aborts, and steps "
        "it sat out",
    ),
    Part(
        "core_stall", "the core stalled (stopped or starved of CPU)",
        "the core stalled (no step ran, or a step ran far past its time)",
        "the core stalling",
        "the core process stopped, was starved of CPU or was stuck in a long call: look at the "
        "host (other processes, the CPU quota, swapping) and the server log",
        "the part of its steps' forward (the sampler, logprobs and core GC aside) past 3x their "
        "expected time (its prefill priced at up to 2x the fit's price: a long prompt's "
        "attention outgrows a linear price; the context of rows decoding for the first time "
        "after their prompt priced as prefill: it is copied into the decode mirror then) and "
        "20 ms over it, but where the API process "
        "paused in it for half that (`gc`, `loop_lag`) or was busy on CPU for half that "
        "(`api_cpu`); the part of a step's schedule "
        "or output phase past 3x the run's median of it and 20 ms over it (the core stops in "
        "whichever phase it was in); 20 ms or more with no step running while it had one to "
        "run (between steps, in the queue, the core's GC aside); the wait to reach the core past "
        "the step in flight, where 20 ms or more (a healthy core reads its input within a "
        "millisecond); and in a long token gap (tracing/gaps.py) such a step's excess while its "
        "token waited to leave the core",
    ),
    Part(
        "preempted", None, "waiting after a preemption (recompute)",
        "waiting after a preemption (recompute)",
        "more KV blocks (--num-kv-blocks or --kv-cache-memory-bytes) or a lower "
        "--max-num-seqs avoid preemption",
        "from a preemption until it ran again, and its share of the steps that recomputed its "
        "tokens then (at the fit's price of a prefill token)",
    ),
    Part(
        "gc", _GC, _GC, _GC,
        "fewer allocations per step (LUMEN_GC=serving, the default, freezes the start-up heap); "
        "see the pauses table",
        "garbage-collection pauses (api and core) that overlap the request's windows, and the "
        "API process's event-loop lags that its GC pauses fill at least half of; and a step's "
        "forward past its time (as `core_stall` has it) where the API process paused for GC "
        "in it for at least half that excess: the pause took the core's CPU; and of a step's "
        "forward slowed beside the API process's busy CPU (as `api_cpu` has it), the share of "
        "that time it spent collecting",
    ),
    Part(
        "emit", _EMIT, _EMIT, "getting outputs back to the frontend, detokenizing and emitting",
        "CPU contention in the API process (detokenize, stop strings; see event-loop lag)",
        "IPC back, detokenize and write", "frontend.emit",
    ),
    Part(
        "delivery", _DELIVERY, _DELIVERY, "delivery to the client", "a slow reader",
        "waiting for the client's socket to accept the bytes", "frontend.emit",
    ),
    Part(
        "unattributed", _UNEXPLAINED, _UNEXPLAINED, "time no recorded boundary explains",
        "the trace lacks a boundary there (an older trace db, or a request that "
        "never got that far)",
        "time between recorded boundaries that no record explains (an older trace db, or a "
        "request that never got that far): shown, never spread over the other parts",
    ),
)  # fmt: skip

BY_KEY: dict[str, Part] = {p.key: p for p in PARTS}
# Parts that are the model doing the request's own work: reported, never named as a cause.
EXPECTED_PARTS = frozenset({"own_prefill", "decode", "step_in_flight"})
assert len(BY_KEY) == len(PARTS), "a part key is registered twice"


def phase_labels(phase: str) -> dict[str, str]:
    """key -> table label of the phase's parts (ttft | decode), in registry order."""
    labels = {p.key: p.ttft if phase == "ttft" else p.decode for p in PARTS}
    return {k: label for k, label in labels.items() if label}


def docs_table() -> str:
    """The parts table of docs/diagnosis.md."""
    lines = ["| part | TTFT | decode | from |", "|---|---|---|---|"]
    for p in PARTS:
        ttft, decode = (" yes " if label else " " for label in (p.ttft, p.decode))
        lines.append(f"| `{p.key}` |{ttft}|{decode}| {p.source} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(docs_table() + "\n")
