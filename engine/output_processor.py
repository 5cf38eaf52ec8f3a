"""OutputProcessor: the one loop over a step's outputs (detokenize, stop strings, logprobs)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tokenizers import Tokenizer

from engine.detokenizer import IncrementalDetokenizer
from engine.messages import EngineCoreOutput, Logprobs, StepRecord
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.request_ids import child_id as _child_id
from engine.sampling_params import SamplingParams
from engine.stats import FinishedRequest, IterationStats


@dataclass(slots=True)
class _Sequence:
    """One generated sequence (one of a request's n)."""

    index: int
    parent: _Parent
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None  # why the core refused the request (finish_reason "error")
    # What a stream has been sent so far (text chars, tokens, logprob entries).
    sent_text: int = 0
    sent_tokens: int = 0
    final_sent: bool = False

    def delta(self) -> CompletionOutput | None:
        """What is new since the last delta; None when nothing is.

        Text that could still turn out to begin a stop string is held back
        until it cannot, so a stream never shows text the final one cuts.
        """
        if self.final_sent:
            return None
        finished = self.finish_reason is not None
        text = self.detokenizer.text
        end = len(text)
        if not finished:
            held = max(self.detokenizer.max_stop_len - 1, 0)
            end = max(self.sent_text, end - held)
            if end == self.sent_text and self.sent_tokens == len(self.token_ids):
                return None
        out = CompletionOutput(
            index=self.index,
            text=text[self.sent_text : end],
            token_ids=self.token_ids[self.sent_tokens :],
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            logprobs=self.logprobs[self.sent_tokens :] if self.logprobs is not None else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            error=self.error,
        )
        self.sent_text, self.sent_tokens, self.final_sent = end, len(self.token_ids), finished
        return out

    def completion(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.detokenizer.text,
            token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            error=self.error,
        )


@dataclass(slots=True)
class _Parent:
    """The request as the caller sees it; its n sequences run as separate core requests."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: list[_Sequence] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_unfinished: int = 0
    stream: bool = False  # deltas after every step, instead of one final output
    # Timings for metrics (clock rule of engine/messages.py); 0 = not yet.
    arrival_ns: int = 0
    sent_ns: int = 0  # handed to the engine (its core requests built)
    queued_ns: int = 0
    scheduled_ns: int = 0
    first_token_ns: int = 0
    last_token_ns: int = 0
    num_generation_tokens: int = 0
    # Speculative decoding: steps that verified drafts for it, drafts, kept, the most in one
    # step; and how many steps kept 0, 1, 2, ... drafts (None: it verified none).
    spec: list[int] | None = None
    spec_histogram: list[int] | None = None

    def finished_stats(self, reason: str, now_ns: int) -> FinishedRequest:
        return FinishedRequest(
            request_id=self.request_id,
            finish_reason=reason,
            num_prompt_tokens=len(self.prompt_token_ids),
            num_generation_tokens=self.num_generation_tokens,
            arrival_ns=self.arrival_ns,
            queued_ns=self.queued_ns,
            scheduled_ns=self.scheduled_ns,
            first_token_ns=self.first_token_ns,
            finished_ns=now_ns,
        )

    def count_drafts(self, drafted: int, accepted: int) -> None:
        if self.spec is None or self.spec_histogram is None:
            self.spec, self.spec_histogram = [0, 0, 0, 0], []
        self.spec[0] += 1
        self.spec[1] += drafted
        self.spec[2] += accepted
        self.spec[3] = max(self.spec[3], drafted)
        hist = self.spec_histogram
        hist.extend([0] * (accepted + 1 - len(hist)))
        hist[accepted] += 1

    def timing(self) -> dict[str, Any]:
        """The request's instants so far (ns), as RequestOutput.metrics of its final output;
        with its drafts' counts where it verified any."""
        if self.spec is not None:
            return self._instants() | {
                "spec_steps": self.spec[0], "spec_draft_tokens": self.spec[1],
                "spec_accepted_tokens": self.spec[2], "spec_histogram": self.spec_histogram,
                "spec_max_drafts": self.spec[3],
            }  # fmt: skip
        return self._instants()

    def _instants(self) -> dict[str, Any]:
        return {
            "arrival_ns": self.arrival_ns,
            "sent_ns": self.sent_ns,
            "queued_ns": self.queued_ns,  # the core dequeued it
            "scheduled_ns": self.scheduled_ns,  # its first step began
            "first_token_ns": self.first_token_ns,
            "last_token_ns": self.last_token_ns,
            "num_generation_tokens": self.num_generation_tokens,
        }

    def due(self, interval: int) -> bool:
        """An unfinished stream's delta goes now: a sequence has sent no token yet (its first
        goes at once), or holds ``interval`` tokens it has not sent."""
        return any(
            not s.sent_tokens or len(s.token_ids) - s.sent_tokens >= interval
            for s in self.sequences
        )

    def delta_output(self) -> RequestOutput | None:
        deltas = [d for s in self.sequences if (d := s.delta()) is not None]
        if not deltas:
            return None
        finished = self.num_unfinished == 0
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=deltas,
            finished=finished,
            num_cached_tokens=self.num_cached_tokens,
            metrics=self.timing() if finished else {},
        )

    def forget_sequences(self) -> None:
        """Once its last output is taken: a sequence points at its parent and the parent at
        it, and the cycle would leave both (with their detokenizers) to the garbage collector,
        whose young-generation passes in the API process took 11-17 ms each, most of it
        freeing ~39 objects a request held in cycles like this one."""
        self.sequences = []

    def output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[s.completion() for s in self.sequences],
            finished=self.num_unfinished == 0,
            num_cached_tokens=self.num_cached_tokens,
            metrics=self.timing(),
        )


def child_request_id(index: int, request_id: str, n: int) -> str:
    """The core id of sample ``index``: the request's own id when it has one sample."""
    return request_id if n == 1 else _child_id(request_id, index)


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sampling params of sequence ``index`` of an n > 1 request (vLLM's parallel sampling).

    Distinct seeds keep the n samples distinct, yet reproducible.
    """
    if params.n == 1:
        return params
    seed = None
    if params.seed is not None:
        seed = params.seed + index
        if seed >= 1 << 64:  # wrap, so the largest seeds stay valid
            seed -= 1 << 64
    return params.clone(n=1, seed=seed)


class OutputProcessor:
    """``stream_interval`` (vLLM's --stream-interval): a streamed request's delta waits until
    it holds that many new tokens, except its first token and its last output, which go at
    once. The tokens are detokenized as they come; only the delta, and all that delivering it
    costs downstream, is held."""

    def __init__(self, tokenizer: Tokenizer, stream_interval: int = 1) -> None:
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval
        self._sequences: dict[str, _Sequence] = {}
        self._parents: dict[str, _Parent] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        stream: bool = False,
        arrival_ns: int = 0,
    ) -> list[str]:
        """Register a request; returns the core request ids of its n sequences.

        A streamed request gets a delta RequestOutput after every step that
        changed it; otherwise one RequestOutput when it finishes.
        """
        child_ids = [child_request_id(i, request_id, params.n) for i in range(params.n)]
        if request_id in self._parents or any(c in self._sequences for c in child_ids):
            raise ValueError(f"request id {request_id!r} is already in use")
        parent = _Parent(
            request_id,
            prompt,
            prompt_token_ids,
            params,
            num_unfinished=params.n,
            stream=stream,
            arrival_ns=arrival_ns,
            sent_ns=time.time_ns(),
        )
        self._parents[request_id] = parent
        for i, child_id in enumerate(child_ids):
            detok = IncrementalDetokenizer(
                self.tokenizer,
                prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
            seq = _Sequence(i, parent, detok, logprobs=[] if params.logprobs is not None else None)
            parent.sequences.append(seq)
            self._sequences[child_id] = seq
        return child_ids

    def has_unfinished(self) -> bool:
        return bool(self._parents)

    def process_outputs(
        self,
        outputs: list[EngineCoreOutput],
        step: StepRecord | None = None,
        stats: IterationStats | None = None,
    ) -> tuple[list[RequestOutput], list[str]]:
        """Returns the outputs to deliver (finished requests, and deltas of streamed ones), and
        core ids stopped by stop strings (the caller must abort those in the core).

        With ``stats``, also fills in what this batch changed (tokens, TTFTs,
        inter-token latencies, finished requests) for the metrics loggers.
        """
        finished: list[RequestOutput] = []
        to_abort: list[str] = []
        streamed: dict[str, _Parent] = {}
        if step is not None:
            if stats is not None:
                stats.step = step
            for rid in step.req_ids:
                if (s := self._sequences.get(rid)) is not None and not s.parent.scheduled_ns:
                    s.parent.scheduled_ns = step.schedule_start_ns
            if step.num_drafted:  # a step that verified drafts
                for rid, d, a in zip(step.req_ids, step.num_drafted, step.num_accepted):
                    if d and (s := self._sequences.get(rid)) is not None:
                        s.parent.count_drafts(d, a)
        for out in outputs:
            seq = self._sequences.get(out.request_id)
            if seq is None:
                continue  # a late output of an aborted request
            if seq.parent.stream:
                streamed[seq.parent.request_id] = seq.parent
            if stats is not None:
                self._count(seq.parent, out, stats)
            new_ids = out.new_token_ids
            stop_str = seq.detokenizer.update(new_ids)
            if (used := seq.detokenizer.num_used) < len(new_ids):  # a stop string before the last
                new_ids = new_ids[:used]
            seq.token_ids.extend(new_ids)
            if out.new_logprobs is not None and seq.logprobs is not None:
                self._add_logprobs(seq, out.new_logprobs, len(new_ids))
            parent = seq.parent
            parent.num_cached_tokens = max(parent.num_cached_tokens, out.num_cached_tokens)
            if stop_str is not None:
                if out.finish_reason is None:
                    to_abort.append(out.request_id)
                self._finish(out.request_id, "stop", stop_str, finished, stats)
            elif out.finish_reason is not None:
                seq.error = out.error
                reason = str(out.finish_reason)
                self._finish(out.request_id, reason, out.stop_reason, finished, stats)
        interval = self.stream_interval
        for parent in streamed.values():
            if interval > 1 and parent.num_unfinished and not parent.due(interval):
                continue
            if (delta := parent.delta_output()) is not None:
                finished.append(delta)
            if not parent.num_unfinished:
                parent.forget_sequences()
        return finished, to_abort

    def abort_request(
        self, request_id: str, stats: IterationStats | None = None, reason: str = "abort"
    ) -> list[str]:
        """Forget a request; returns its core ids (the caller aborts them in the core).
        ``reason``: its finish reason in ``stats`` ("error" where the engine failed it)."""
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return []
        if stats is not None:
            stats.finished.append(parent.finished_stats(reason, stats.now_ns))
        ids = [child_request_id(s.index, request_id, parent.params.n) for s in parent.sequences]
        for child_id in ids:
            self._sequences.pop(child_id, None)
        parent.forget_sequences()
        return ids

    def _finish(
        self,
        child_id: str,
        reason: str,
        stop_reason: int | str | None,
        finished: list[RequestOutput],
        stats: IterationStats | None,
    ) -> None:
        seq = self._sequences.pop(child_id)
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        parent = seq.parent
        parent.num_unfinished -= 1
        if parent.num_unfinished == 0:
            del self._parents[parent.request_id]
            if not parent.stream:  # a stream's last output is its delta, once every output is in
                finished.append(parent.output())
                parent.forget_sequences()
            if stats is not None:
                stats.finished.append(parent.finished_stats(reason, stats.now_ns))

    @staticmethod
    def _count(parent: _Parent, out: EngineCoreOutput, stats: IterationStats) -> None:
        if out.received_ns and not parent.queued_ns:
            parent.queued_ns = out.received_ns
        if out.grammar is not None:
            stats.grammar_compiles.append((out.grammar[1] / 1e9, out.grammar[2]))
        num_new = len(out.new_token_ids)
        if not num_new:
            return
        now = stats.now_ns
        stats.num_generation_tokens += num_new
        parent.num_generation_tokens += num_new
        if not parent.first_token_ns:
            parent.first_token_ns = now
            stats.num_prompt_tokens += len(parent.prompt_token_ids)
            if parent.arrival_ns:
                stats.ttfts_s.append((now - parent.arrival_ns) / 1e9)
        elif parent.last_token_ns != now:  # once per batch, even for n > 1
            stats.itls_s.append((now - parent.last_token_ns) / 1e9)
        parent.last_token_ns = now

    def _add_logprobs(self, seq: _Sequence, lp: Logprobs, num: int) -> None:
        """The first ``num`` tokens' logprobs (those the output keeps)."""
        assert seq.logprobs is not None
        for ids, values, rank in zip(lp.token_ids[:num], lp.logprobs[:num], lp.ranks[:num]):
            entry = {}
            for j, (tid, value) in enumerate(zip(ids, values)):
                if tid in entry:
                    continue  # the sampled token is also among the top-k
                entry[tid] = Logprob(
                    value,
                    rank if j == 0 else j,
                    self.tokenizer.decode([tid], skip_special_tokens=False),
                )
            seq.logprobs.append(entry)
            seq.cumulative_logprob += values[0]
