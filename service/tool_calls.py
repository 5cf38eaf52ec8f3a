"""What the tool-call formats share (service/tools.py, service/tool_llama3.py): a call as
OpenAI's API returns it, whole in a message or as its first delta in a stream, read from the
JSON object the model generated; and the end of a stream of them."""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
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


def call_from_json(raw: str, head: re.Pattern[str], key: str) -> dict[str, Any] | None:
    """The call that the JSON object ``raw`` ({"name": ..., KEY: {...}}) makes, or None.
    Its arguments are the text as generated where ``head`` (the object up to them) matches,
    so a whole call says what its stream sent."""
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    found = head.match(raw)
    if found and raw.endswith("}"):
        arguments = raw[found.end() : -1]
    else:
        arguments = json.dumps(obj.get(key, {}), ensure_ascii=False)
    return {
        "id": new_call_id(),
        "type": "function",
        "function": {"name": obj["name"], "arguments": arguments},
    }


@dataclass
class CallStream:
    """A stream of calls in one format: text deltas in, OpenAI delta objects out (``content``
    or ``tool_calls`` entries). ``_calls`` reads what the buffer holds of them."""

    buffer: str = ""
    mode: str = "undecided"  # undecided | content | calls (and the format's own)
    calls: list[dict[str, Any]] = field(default_factory=list)

    def finish(self) -> list[dict[str, Any]]:
        """What is left at the end: a call cut short (max_tokens) is sent as text."""
        out = self._calls() if self.mode == "calls" else []
        if self.buffer:
            out.append({"content": self.buffer})
            self.buffer = ""
        return out

    def _calls(self) -> list[dict[str, Any]]:
        raise NotImplementedError
