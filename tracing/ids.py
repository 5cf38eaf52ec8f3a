"""Trace and span ids (W3C sizes, lowercase hex) and the `traceparent` header."""

from __future__ import annotations

import random
import re

_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
_rng = random.Random()


def new_trace_id() -> str:
    return f"{_rng.getrandbits(128) or 1:032x}"


def new_span_id() -> str:
    return f"{_rng.getrandbits(64) or 1:016x}"


def parse_traceparent(header: str | None) -> tuple[str, str] | None:
    """(trace id, parent span id) of a valid W3C traceparent, else None."""
    if not header:
        return None
    m = _TRACEPARENT.match(header.strip().lower())
    if m is None or m.group(1) == "ff":
        return None
    trace_id, span_id = m.group(2), m.group(3)
    if trace_id == "0" * 32 or span_id == "0" * 16:
        return None
    return trace_id, span_id
