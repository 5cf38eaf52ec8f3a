"""What ended a request that did not finish, in words: its end code (requests.end_code; the
error message in a db recorded before end codes) and the server's lifecycle rows around its end
(a crash, a hang, a drain).

The kinds, in the order a run's verdict counts them: ``crash`` and ``hang`` (its engine core
failed: died, or hung until the supervisor killed it), ``crash_loop`` (the server gave up),
``drain`` (a stop signal's drain ended it at --shutdown-timeout), ``stalled`` (its reader left it
unread for --stream-stall-timeout), ``refused`` (admission or a stopping server turned it away),
``invalid`` (its own request failed), ``client`` (its client hung up or cancelled it) and
``unknown``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from tracing.words import ms

KINDS = ("crash", "hang", "crash_loop", "drain", "stalled", "refused", "invalid", "client",
         "unknown")  # fmt: skip
SERVER_KINDS = frozenset(KINDS) - {"client"}  # failures of the server's making
REFUSALS = ("queue_full", "queue_timeout", "engine_restarting", "shutting_down")
NEAR_NS = 2_000_000_000  # a failure this close to a lifecycle row's span belongs to it


class LifecycleRow(NamedTuple):
    """A row of the lifecycle table: a drain, an engine restart or a crash loop."""

    kind: str  # drain | restart | crash_loop
    cause: str
    start_ns: int
    end_ns: int
    epoch: int
    num_finished: int
    num_failed: int
    engine: int | None = None  # restart, crash loop: the data-parallel engine (migration 10)


@dataclass(frozen=True)
class Failure:
    kind: str  # one of KINDS
    words: str  # "failed with the engine core's crash (...)", as a sentence goes on
    row: LifecycleRow | None = None  # the crash, hang or drain it belongs to


def classify(
    status: str,
    end_code: str | None,
    error: str | None,
    end_ns: int,
    lifecycle: Sequence[LifecycleRow],
) -> Failure | None:
    """The failure of a request that ended ``status`` (ok: None) at ``end_ns``."""
    if status == "ok":
        return None
    code = end_code or _code_of(status, error)
    if code in ("engine_restarted", "engine_dead"):
        row = _nearest(lifecycle, end_ns, ("restart", "crash_loop"))
        return _engine(row, error)
    if code == "shutdown" or (code is None and status == "aborted"):
        row = _nearest(lifecycle, end_ns, ("drain",))
        if row is not None or code == "shutdown":
            cause = f" on {row.cause}" if row is not None else ""
            return Failure("drain", f"aborted by the drain{cause} at the shutdown timeout "
                                    "(--shutdown-timeout)", row)  # fmt: skip
    if code == "stalled":
        return Failure("stalled", "aborted: its reader left it unread for the stall timeout "
                                  "(--stream-stall-timeout)")  # fmt: skip
    if code in REFUSALS:
        return Failure("refused", f"refused before the engine saw it ({code}: "
                                  f"{error or 'no slot'})")  # fmt: skip
    if code == "request_error":
        return Failure("invalid", f"failed on its own request ({error or 'invalid'})")
    if code == "client" or status == "aborted":
        return Failure("client", "cancelled by its client (it hung up or stopped the stream)")
    return Failure("unknown", f"failed ({error or 'no error recorded'})")


def _code_of(status: str, error: str | None) -> str | None:
    """An end code from an older db's error message."""
    text = (error or "").lower()
    if "engine core failed" in text or "engine died" in text or "restarting" in text:
        return "engine_restarted"
    if "not read in time" in text:
        return "stalled"
    return None


def _nearest(
    rows: Sequence[LifecycleRow], at_ns: int, kinds: tuple[str, ...]
) -> LifecycleRow | None:
    """The lifecycle row of ``kinds`` whose span, widened by NEAR_NS, holds ``at_ns``."""
    near = [r for r in rows
            if r.kind in kinds and r.start_ns - NEAR_NS <= at_ns <= r.end_ns + NEAR_NS]  # fmt: skip
    return min(near, key=lambda r: abs(r.start_ns - at_ns), default=None)


def _engine(row: LifecycleRow | None, error: str | None) -> Failure:
    if row is None:
        return Failure("crash", f"failed with the engine core ({error or 'it died'})")
    if row.kind == "crash_loop":
        return Failure("crash_loop", f"failed with the engine core, which failed once too often "
                                     f"({row.cause}): the server gave up", row)  # fmt: skip
    kind = "hang" if row.cause.startswith("hung") else "crash"
    what = "hang" if kind == "hang" else "crash"
    took = ms(row.end_ns - row.start_ns)
    return Failure(kind, f"failed with the engine core's {what} ({row.cause}; a new core was "
                         f"ready {took} later)", row)  # fmt: skip


def count_words(failures: Sequence[Failure], total: int) -> str:
    """'3 of 10 requests did not finish: 2 failed with the engine core's crash (...); 1
    cancelled by its client (...).' (each kind in KINDS' order, in its first one's words)"""
    by_kind: dict[str, list[Failure]] = {}
    for f in failures:
        by_kind.setdefault(f.kind, []).append(f)
    said = [f"{len(by_kind[k])} {by_kind[k][0].words}" for k in KINDS if k in by_kind]
    return f"{len(failures)} of {total} requests did not finish: " + "; ".join(said) + "."
