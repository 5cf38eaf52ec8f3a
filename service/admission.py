"""API admission: a bounded number of requests in flight, a bounded wait for a slot."""

from __future__ import annotations

import asyncio
import collections


class AdmissionRefused(Exception):
    """No slot: ``reason`` is queue_full (429) or queue_timeout (503)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class Admission:
    """At most ``max_in_flight`` requests run; as many more may wait, each up to ``max_wait`` s.

    A request past both bounds is refused at once, so a burst never queues
    without limit and a client learns early that it should back off.
    """

    def __init__(self, max_in_flight: int, max_wait: float) -> None:
        self.max_in_flight = max_in_flight
        self.max_wait = max_wait
        self.num_in_flight = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> None:
        """Take a slot, or raise AdmissionRefused; ``release`` gives it back."""
        if self.num_in_flight < self.max_in_flight and not self._waiters:
            self.num_in_flight += 1
            return
        if self.max_wait <= 0 or len(self._waiters) >= self.max_in_flight:
            raise AdmissionRefused(
                "queue_full",
                f"the server is at capacity ({self.num_in_flight} requests in flight, "
                f"{len(self._waiters)} waiting); retry later",
            )
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(granted)
        try:
            async with asyncio.timeout(self.max_wait):
                await asyncio.shield(granted)
        except (TimeoutError, asyncio.CancelledError) as e:
            if granted.done():  # the slot came just as the wait ended
                if isinstance(e, asyncio.TimeoutError):
                    return
                self.release()
            else:
                granted.cancel()
                self._waiters.remove(granted)
            if isinstance(e, asyncio.CancelledError):
                raise
            raise AdmissionRefused(
                "queue_timeout", f"no request slot freed within {self.max_wait:g} s; retry later"
            ) from None

    def release(self) -> None:
        """Give a slot back; the longest waiter, if any, gets it directly (FIFO)."""
        if self._waiters:
            self._waiters.popleft().set_result(None)
        else:
            self.num_in_flight -= 1
