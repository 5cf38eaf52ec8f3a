"""Llama 3.x's own tool-call format, for a chat template that renders tools and writes calls
as Meta's Llama 3.1-3.3 templates do (vLLM's ``llama3_json`` parser reads the same)::

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "now", "parameters": {}}

The reply is the calls, one JSON object each, separated by ``; `` (an optional
``<|python_tag|>`` before them is read too). Under the grammar (service/tools.py) a reply is
either calls or text that does not start with ``{``; a stream sends each call whole once its
object closes.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from service.tool_calls import CallStream, call_delta, call_from_json

NAME = "llama3_json"
PYTHON_TAG = "<|python_tag|>"
SEP = "; "
_HEAD = re.compile(r'\{"name": ("(?:[^"\\]|\\.)*"), "(?:parameters|arguments)": ')
_DECODER = json.JSONDecoder()


def starts_calls(text: str) -> bool:
    return text.lstrip().removeprefix(PYTHON_TAG).lstrip().startswith("{")


def parse_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """The calls at the start of ``text`` (starts_calls holds) and what follows them; what
    is not a whole call (cut by max_tokens) stays content."""
    lead = text[: len(text) - len(text.lstrip())]  # whitespace before the calls: content
    body = text.lstrip().removeprefix(PYTHON_TAG).lstrip()
    calls, pos = [], 0
    while True:
        try:
            _, end = _DECODER.raw_decode(body, pos)
        except ValueError:
            break
        call = _call(body[pos:end])
        if call is None:
            break
        calls.append(call)
        pos = end
        after = body[pos:].lstrip()
        if not after.startswith(";"):
            break
        pos = len(body) - len(after[1:].lstrip())
    if not calls:
        return text or None, []
    return (lead + body[pos:]) or None, calls


def _call(raw: str) -> dict[str, Any] | None:
    return call_from_json(raw, _HEAD, "parameters")


@dataclass
class Llama3Stream(CallStream):
    """Streamed calls in Llama 3's format, as ToolStream streams Hermes blocks: text deltas in,
    OpenAI delta objects out. A call goes out whole (id, name and arguments in one delta) when
    its object closes; a reply that does not open with one is content as it comes."""

    _between: bool = False  # a call closed: a "; " and another call, or the end, follow

    def after_think(self) -> None:
        """A think block opened the reply (whitespace before the calls is read anyway)."""

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self.mode == "content":
            return [{"content": text}] if text else []
        self.buffer += text
        out: list[dict[str, Any]] = []
        if self.mode == "undecided":
            rest = self.buffer.lstrip()
            if not rest or PYTHON_TAG.startswith(rest):
                return out  # still undecided
            body = rest.removeprefix(PYTHON_TAG).lstrip()
            if not body and rest.startswith(PYTHON_TAG):
                return out
            if not body.startswith("{"):
                self.mode, text, self.buffer = "content", self.buffer, ""
                return [{"content": text}]
            if len(rest) < len(self.buffer):  # whitespace before the calls stays content
                out.append({"content": self.buffer[: len(self.buffer) - len(rest)]})
            self.buffer, self.mode = body, "calls"
        return out + self._calls()

    def _calls(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while True:
            if self._between:
                rest = self.buffer.lstrip()
                if not rest:
                    return out
                if not rest.startswith(";"):
                    return out + self._to_content()
                self.buffer, self._between = rest[1:], False
            self.buffer = self.buffer.lstrip()  # the space of "; " may come in a later piece
            if not self.buffer:
                return out
            if not self.buffer.startswith("{"):
                return out + self._to_content()
            try:
                _, end = _DECODER.raw_decode(self.buffer)
            except ValueError:
                return out  # the object is still open
            call = _call(self.buffer[:end])
            if call is None:
                return out + self._to_content()
            out.append({"tool_calls": [call_delta(len(self.calls), call)]})
            self.calls.append(call)
            self.buffer, self._between = self.buffer[end:], True

    def _to_content(self) -> list[dict[str, Any]]:
        text, self.buffer, self.mode = self.buffer, "", "content"
        return [{"content": text}] if text else []
