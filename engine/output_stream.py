"""One request's outputs on their way to the caller who reads them (AsyncLLM's streams), and
what it was sent with, to send it again to a new core."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.outputs import CompletionOutput, RequestOutput
from engine.processor import PreparedPrompt


@dataclass(frozen=True, slots=True)
class Submission:
    """What ``Frontend.add`` took for a request: enough to send it again to a new core."""

    prompt: PreparedPrompt
    priority: int
    arrival_ns: int
    stream: bool
    routed: str | None = None  # why a data-parallel group sent it here (engine.data_parallel)


class OutputStream:
    """Holds at most one pending output per request: new deltas merge into it.

    The output loop never waits on a reader, so a caller that stops reading
    slows no one; its memory is bounded by its own text.

    ``direct``: the reader's own delivery of an output, offered each output while the reader
    waits with nothing pending (``generate_prepared``). ``sent``: the caller has taken output
    (a stream's delta, directly or from ``get``); until then the request can be sent again to
    another core, and ``attempt`` counts how often it was.
    """

    __slots__ = (
        "attempt", "direct", "error", "orphaned_at", "pending", "pending_since", "ready", "sent",
        "submission", "waiting",
    )  # fmt: skip

    def __init__(
        self,
        direct: Callable[[RequestOutput], bool] | None = None,
        submission: Submission | None = None,
    ) -> None:
        self.pending: RequestOutput | None = None
        self.error: BaseException | None = None
        self.ready = asyncio.Event()
        # Since when an output has waited for the reader (0: nothing waits).
        self.pending_since = 0.0
        self.waiting = False  # the reader waits in get()
        self.direct = direct
        self.submission = submission
        self.sent = False
        self.attempt = 0
        self.orphaned_at = 0.0  # monotonic: its core failed and it waits for the next one

    def put(self, out: RequestOutput) -> None:
        if self.pending is None:
            self.pending_since = time.monotonic()
            self.pending = out
        else:
            self.pending = merge_outputs(self.pending, out)
        self.ready.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.ready.set()

    def deliver_directly(self, out: RequestOutput) -> bool:
        """Whether ``direct`` delivered ``out``: only while the reader waits with nothing
        pending (so nothing it has not written yet comes before), and never the last output
        (the reader's loop ends on that one)."""
        if (
            self.waiting
            and self.pending is None
            and self.direct is not None
            and not out.finished
            and self.direct(out)
        ):
            self.sent = True
            return True
        return False

    def orphan(self) -> None:
        """Its core failed before it sent anything: what the core gave it is dropped, and it
        waits for the next core."""
        self.pending, self.pending_since = None, 0.0
        self.ready.clear()
        self.orphaned_at = time.monotonic()

    async def get(self) -> RequestOutput:
        self.waiting = True
        try:
            await self.ready.wait()
        finally:
            self.waiting = False
        out, self.pending = self.pending, None
        if out is None:
            assert self.error is not None
            raise self.error
        if self.error is None:
            self.ready.clear()
        return out


def merge_outputs(old: RequestOutput, new: RequestOutput) -> RequestOutput:
    by_index: dict[int, CompletionOutput] = {c.index: c for c in old.outputs}
    for c in new.outputs:
        prev = by_index.get(c.index)
        if prev is None:
            by_index[c.index] = c
            continue
        prev.text += c.text
        prev.token_ids = prev.token_ids + c.token_ids
        if prev.logprobs is not None and c.logprobs is not None:
            prev.logprobs = prev.logprobs + c.logprobs
        prev.cumulative_logprob = c.cumulative_logprob
        prev.finish_reason, prev.stop_reason = c.finish_reason, c.stop_reason
    new.outputs = [by_index[i] for i in sorted(by_index)]
    return new
