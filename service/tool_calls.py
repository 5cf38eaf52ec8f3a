"""A tool call as OpenAI's API returns it: whole in a message, or its first delta in a stream."""

from __future__ import annotations

import secrets
from typing import Any


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def call_delta(index: int, call: dict[str, Any]) -> dict[str, Any]:
    """A call's first delta (a copy: the call's arguments keep growing)."""
    return {
        "index": index,
        "id": call["id"],
        "type": "function",
        "function": dict(call["function"]),
    }
