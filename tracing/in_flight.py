"""The step in flight: what a request sent to the core waited for, the step that was running
when it arrived (its expected time, and the shares of it that were other requests' prefill, a
recompute, the sampler, or the API process's CPU beside its forward), and when its way in began
to cost it nothing (``tracing.diagnose`` cuts a request's TTFT with it)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tracing.shares import StepTimes, full_rows, out_end
from tracing.step_fit import FloatArray, StepWeights, outlier


class InFlight:
    """How long a request sent to the core waited for the step in flight: all of it, unless
    that step was itself an outlier for its shape; then up to what it was expected to take.
    The step in flight is the last to begin before the core took the request: one that began
    a moment after the send holds it too (the core had read its input just before).

    The core takes new requests between steps, so a request sent while a step runs waits for
    it: expected, in every step-based server, but for what its forward's prefill tokens take
    (``held``: other requests' prefill, which a smaller token budget cuts; a long step is also
    named for itself, as a prefill stall or by its shape), and for the sampler at the end of
    its execute (the settings of its rows: named as the sampler, logprobs, speculation). A
    step's expected execute time is the fit's a + b * prefill tokens + c * rows, or without a
    fit the median busy step's. An outlier step (``outlier``) is expected to end at its start
    plus its own schedule and output time plus that expected execute time; the wait beyond stays
    IPC, and the verdict names the step in flight."""

    def __init__(
        self, steps: StepTimes, weights: StepWeights, contended: FloatArray | None = None
    ) -> None:
        busy = (steps.prefill_tokens + steps.decode_tokens) > 0
        self.contended = contended
        # Named on their own, not an outlier: the sampler, logprobs, speculation.
        sampler = steps.sample_ns + steps.logprobs_ns + steps.spec_ns
        executed = np.maximum(steps.execute_end_ns - steps.execute_start_ns - sampler, 0)
        if weights.fitted:
            expected = weights.a + weights.b * steps.prefill_tokens + weights.c * steps.rows
            expected = expected + weights.full_extra(full_rows(steps))
        else:
            typical = float(np.median(executed[busy])) if busy.any() else 0.0
            expected = np.full(len(executed), typical)
        # The share of its expected execute time that its prefill tokens take (the fit's b a
        # token): a request that waited for a step carrying another's long prompt waited for
        # that prefill, which a smaller token budget would have cut.
        prefill = weights.b * steps.prefill_tokens if weights.fitted else np.zeros_like(expected)
        self.prefill_share = np.clip(prefill / np.maximum(expected, 1), 0.0, 1.0)
        # ... of which the recompute of rows a preemption sent back (recompute_tokens).
        self.recompute_share = (
            steps.recompute_tokens / np.maximum(steps.prefill_tokens, 1)
            if len(steps.recompute_tokens) else np.zeros(len(steps.step_id))
        )  # fmt: skip
        # Inside execute, the forward comes first and the sampler's parts last.
        self.forward_start = steps.execute_start_ns
        self.sampler_start = steps.execute_end_ns - sampler
        self.sampler_end = steps.execute_end_ns
        self.sampler_parts = {
            "sampling": steps.sample_ns, "logprobs": steps.logprobs_ns, "speculation": steps.spec_ns
        }  # fmt: skip
        self.sampler = sampler
        self.step_id = steps.step_id
        self.start = steps.schedule_start_ns
        self.end = out_end(steps) if len(steps.step_id) else steps.output_ns
        cpu = (steps.execute_start_ns - steps.schedule_start_ns) + (self.end - steps.execute_end_ns)
        capped = self.start + np.maximum(cpu, 0) + sampler + expected.astype(np.int64)
        self.expected_end = np.where(busy & outlier(executed, expected), capped, self.end)

    def next_start(self, at: int) -> int | None:
        """When the first step at or after ``at`` began (None: none did)."""
        i = int(np.searchsorted(self.start, at, side="left"))
        return int(self.start[i]) if i < len(self.start) else None

    def began_under(self, sent: int, received: int) -> int | None:
        """When the step in flight at ``sent`` began, where the request then waited for it at
        the core (it was the last step to begin before ``received``, and ran to its expected
        end past ``sent``); else None. Had the request been sent any time after that start,
        it would have waited for the same step's end: its time on the way in since then cost
        it nothing, and is that step's wait."""
        i = int(np.searchsorted(self.start, received, side="left")) - 1
        if i < 0 or not self.start[i] < sent < min(self.end[i], self.expected_end[i]):
            return None
        return int(self.start[i])

    def held(self, sent: int, received: int) -> Held:
        """The wait inside [sent, received] for the last step that began before the core took
        the request (it began just after the send, too: the core had read its input already),
        up to that step's expected end; the part of it the step's prefill took (the prefill's
        share of the step's expected forward, over the wait inside the forward); what its
        sampler took of the wait, and the API process's CPU or GC of the wait inside a forward
        they slowed (``contended``: stalls.api_contention), by part; and the step's id (None:
        no step held it)."""
        i = int(np.searchsorted(self.start, received, side="left")) - 1
        if i < 0 or self.end[i] <= sent:
            return Held(0, 0, {}, None)
        lo = max(sent, int(self.start[i]))
        hi = min(received, int(self.end[i]), int(self.expected_end[i]))
        if hi <= lo:
            return Held(0, 0, {}, int(self.step_id[i]))
        forward = _overlap(lo, hi, int(self.forward_start[i]), int(self.sampler_start[i]))
        prefill = round(forward * float(self.prefill_share[i]))
        again = round(prefill * float(self.recompute_share[i]))
        prefill -= again
        sampled = _overlap(lo, hi, int(self.sampler_start[i]), int(self.sampler_end[i]))
        parts: dict[str, int] = {"recompute": again} if again else {}
        if sampled:
            whole = int(self.sampler[i])
            for part, ns in self.sampler_parts.items():
                if ns[i]:
                    parts[part] = sampled * int(ns[i]) // whole
        if self.contended is not None and forward:
            for row, part in enumerate(("api_cpu", "gc")):
                if share := float(self.contended[row, i]):
                    parts[part] = parts.get(part, 0) + round(forward * share)
        return Held(hi - lo, prefill, parts, int(self.step_id[i]))


@dataclass(frozen=True)
class Held:
    """What a request waited for the step in flight (``InFlight.held``): in all, what of it
    the step's prefill took, what its sampler's parts and the API process's CPU or GC beside
    its forward took (by part), and the step."""

    waited: int
    prefill: int
    parts: dict[str, int]
    step: int | None


def _overlap(a: int, b: int, c: int, d: int) -> int:
    return max(0, min(b, d) - max(a, c))
