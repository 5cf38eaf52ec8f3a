"""Tool calling: what a request's ``tools`` and ``tool_choice`` become (the prompt, the grammar that
keeps every call valid) and how the output becomes ``tool_calls`` again, whole or streamed.

The wire format of a call is the one Hermes-style templates and vLLM's hermes parser use, one
block per call at the start of the reply::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A template that writes calls as Llama 3's do gets that format instead: bare JSON objects with
``parameters``, separated by ``; `` (service/tool_llama3.py; ``ToolPlan.fmt``).

A chat template that knows tools (its source mentions ``tools``) renders them itself. One that
does not, like SmolLM2's, gets them from Lumen (``render_messages``): a system message listing
the functions' JSON schemas and the format above; an assistant message's ``tool_calls`` become
its blocks; ``tool`` messages become a user turn of ``<tool_response>`` blocks, as Qwen's template
writes them.

Every mode but ``none`` decodes under a grammar (engine/structured_outputs.py), so a call always
names a function of the request and its arguments always conform to that function's
``parameters``: ``required`` and a named function must call (the named one: exactly once);
``auto`` lets the reply be text (not starting with ``<``) or calls. In every mode the reply may
open with one ``<think>`` block (a thinking model's, service/reasoning.py) and whitespace: the
calls, or the text, follow it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.sampling_params import StructuredOutputsParams
from engine.structured_outputs import JSON_OPTIONS, lark_literal
from service import reasoning, tool_llama3
from service.tool_calls import CallStream, call_delta, call_from_json, new_call_id

OPEN, CLOSE = "<tool_call>\n", "\n</tool_call>"
_HEAD = re.compile(r'\{"name": ("(?:[^"\\]|\\.)*"), "arguments": ')


@dataclass
class ToolPlan:
    """The tools of one request and how it may call them."""

    functions: list[dict[str, Any]]  # OpenAI's "function" objects, in the request's order
    choice: str  # auto | required | named
    name: str | None = None  # the function a named tool_choice forces
    parallel: bool = True
    # How calls are written: hermes (<tool_call> blocks, above), or llama3_json for a
    # template that writes Llama 3's (service/tool_llama3.py)
    fmt: str = "hermes"

    @property
    def forced(self) -> bool:
        return self.choice != "auto"

    def structured_outputs(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(grammar=self.grammar(), kind="tool_call")

    def grammar(self) -> str:
        """The Lark grammar (llguidance) of the replies this plan allows."""
        functions = [f for f in self.functions if self.name is None or f["name"] == self.name]
        llama3 = self.fmt == "llama3_json"
        key = "parameters" if llama3 else "arguments"
        one_of, defs = [], {}
        for i, f in enumerate(functions):
            params, own = _hoist_defs(i, f.get("parameters") or {"type": "object"})
            defs.update(own)
            one_of.append({
                "type": "object",
                "properties": {"name": {"const": f["name"]}, key: params},
                "required": ["name", key],
                "additionalProperties": False,
            })  # fmt: skip
        schema: dict[str, Any] = {"anyOf": one_of, "x-guidance": JSON_OPTIONS}
        if defs:
            schema["$defs"] = defs
        sep = lark_literal("; " if llama3 else "\n")
        calls = f"call ({sep} call)*" if self.parallel and self.name is None else "call"
        start = "start: think? calls" if self.forced else "start: think? (TEXT | calls)"
        # Text may start with neither a call nor a think block.
        call = "body" if llama3 else f"{lark_literal(OPEN)} body {lark_literal(CLOSE)}"
        text = "/[^<{](.|\\n)*/" if llama3 else "/[^<](.|\\n)*/"
        return (
            f"{start}\nTEXT: {text}\ncalls: {calls}\n"
            f"call: {call}\n"
            f"body: %json {json.dumps(schema)}\n"
            # One <think> block (no </think> inside it), then whitespace.
            "think: THINK /[ \\t\\r\\n]*/\n"
            "THINK: /<think>(.|\\n)*<\\/think>/ & ~/<think>(.|\\n)*<\\/think>(.|\\n)+/\n"
        )

    def system_prompt(self) -> str:
        listed = "\n".join(json.dumps({"type": "function", "function": f}) for f in self.functions)
        return (
            "You can call functions (tools). Their signatures, as JSON schemas:\n"
            f"<tools>\n{listed}\n</tools>\n"
            "To call one, reply with a <tool_call></tool_call> block per call, each holding a "
            "JSON object with the function's name and its arguments:\n"
            '<tool_call>\n{"name": <function name>, "arguments": <arguments object>}\n'
            "</tool_call>"
        )


def _hoist_defs(i: int, params: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A function's parameters without their ``$defs`` / ``definitions``, which move to the
    grammar's root (their ``$ref`` paths point at the root document) as ``f{i}.NAME``."""
    own = {**params.get("$defs", {}), **params.get("definitions", {})}
    if not own:
        return params, {}

    def rewrite(node: Any) -> Any:
        if isinstance(node, dict):
            out = {k: rewrite(v) for k, v in node.items() if k not in ("$defs", "definitions")}
            ref = node.get("$ref")
            if isinstance(ref, str):
                for prefix in ("#/$defs/", "#/definitions/"):
                    if ref.startswith(prefix):
                        out["$ref"] = f"#/$defs/f{i}.{ref[len(prefix) :]}"
            return out
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node

    return rewrite(params), {f"f{i}.{k}": rewrite(v) for k, v in own.items()}


def check_alone(n: int, structured: bool) -> None:
    """What tools cannot be combined with: several samples, or a structured output."""
    if n > 1:
        raise ValueError("tools with n > 1 are not supported: send n requests")
    if structured:
        raise ValueError(
            "response_format (or structured_outputs) and tools cannot be combined "
            "unless tool_choice is none"
        )


def plan_from_request(
    tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None, parallel: bool
) -> ToolPlan | None:
    """The request's plan (None: no tools in play), or ValueError naming what is wrong."""
    if tool_choice is not None and not isinstance(tool_choice, (str, dict)):
        raise ValueError("tool_choice must be a string or an object")
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise ValueError("tool_choice needs tools")
        return None
    functions = [_function(i, t) for i, t in enumerate(tools)]
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise ValueError("tools: function names must be unique")
    if tool_choice is None or tool_choice == "auto":
        return ToolPlan(functions, "auto", parallel=parallel)
    if tool_choice == "none":
        return None
    if tool_choice == "required":
        return ToolPlan(functions, "required", parallel=parallel)
    if isinstance(tool_choice, str):
        raise ValueError(
            f"tool_choice must be none, auto, required or a function, got {tool_choice!r}"
        )
    function = tool_choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if tool_choice.get("type") != "function" or not isinstance(name, str):
        raise ValueError(
            'tool_choice must look like {"type": "function", "function": {"name": ...}}'
        )
    if name not in names:
        raise ValueError(f"tool_choice names the function {name!r}, which is not in tools")
    return ToolPlan(functions, "named", name=name, parallel=False)


def _function(i: int, tool: Any) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise ValueError(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}')
    f = tool.get("function")
    if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
        raise ValueError(f"tools[{i}].function needs a name")
    if not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", f["name"]):
        raise ValueError(f"tools[{i}].function.name must be 1-64 letters, digits, _ . or -")
    params = f.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
    return {k: v for k, v in f.items() if k in ("name", "description", "parameters")}


# -- the prompt ------------------------------------------------------------------------------


def render_messages(
    messages: list[dict[str, Any]], plan: ToolPlan | None, native: bool
) -> list[dict[str, Any]]:
    """The messages as the chat template takes them. ``native``: the template renders tools,
    tool calls and tool results itself; else Lumen writes them as text (module docstring)."""
    if native:
        return [_native(m) for m in messages]
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("_tool_turn"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_turn": True})
            continue
        msg = {"role": m["role"], "content": m.get("content") or ""}
        if m.get("tool_calls"):
            blocks = [_call_block(c) for c in m["tool_calls"]]
            msg["content"] = "\n".join([msg["content"], *blocks] if msg["content"] else blocks)
        out.append(msg)
    for m in out:
        m.pop("_tool_turn", None)
    if plan is not None:
        prompt = plan.system_prompt()
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _native(m: dict[str, Any]) -> dict[str, Any]:
    if not m.get("tool_calls"):
        return m
    calls = [
        {**c, "function": {**c["function"], "arguments": _arguments(c["function"])}}
        for c in m["tool_calls"]
    ]
    return {**m, "tool_calls": calls}


def _call_block(call: dict[str, Any]) -> str:
    f = call["function"]
    body = {"name": f["name"], "arguments": _arguments(f)}
    return OPEN + json.dumps(body, ensure_ascii=False) + CLOSE


def _arguments(function: dict[str, Any]) -> Any:
    args = function.get("arguments")
    if isinstance(args, str):
        try:
            return json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return args
    return args if args is not None else {}


# -- the output ------------------------------------------------------------------------------


def parse(
    text: str, after_think: bool = False, fmt: str = "hermes"
) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a whole reply: calls only where the reply starts with one, or
    follows the think block that opens it, or whitespace (``after_think``: a reasoning parser
    took the block out). The block and the whitespace stay content, as vLLM's parser keeps
    what comes before the first call."""
    starts: Callable[[str], bool] = _starts_calls
    parse_calls = _parse_calls
    if fmt == "llama3_json":
        starts, parse_calls = tool_llama3.starts_calls, tool_llama3.parse_calls
    end = reasoning.think_block_end(text)
    if end is not None and end > 0:
        head, calls_text = text[:end], text[end:]
    elif after_think and starts(text.lstrip()):
        gap = len(text) - len(text.lstrip())
        head, calls_text = text[:gap], text[gap:]  # the whitespace stays content, as streamed
    else:
        head, calls_text = "", text
    if not starts(calls_text):
        return text or None, []
    content, calls = parse_calls(calls_text)
    return (head + (content or "")) or None, calls


def _starts_calls(text: str) -> bool:
    return text.startswith(OPEN)


def _parse_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    calls = []
    rest = text
    while rest.startswith(OPEN):
        end = rest.find(CLOSE, len(OPEN))
        if end < 0:
            break  # cut by max_tokens: what is left stays content
        call = _call(rest[len(OPEN) : end])
        if call is None:
            break
        calls.append(call)
        rest = rest[end + len(CLOSE) :].removeprefix("\n")
    return (rest or None), calls


def _call(body: str) -> dict[str, Any] | None:
    return call_from_json(body, _HEAD, "arguments")


@dataclass
class ToolStream(CallStream):
    """Streamed tool calls: text deltas in, OpenAI delta objects out (``content`` or
    ``tool_calls`` entries). A call's header (id, name) goes out once its name is generated,
    then its arguments as they are generated, holding back only what could still be the end
    of the call (the object's ``}`` and the closing tag)."""

    # mode: also gap (the whitespace after a think block: service/responses.py ReplyStream
    # splits the block off)
    _header: bool = False  # the open call's header went out
    _sent: int = 0  # characters of the open call's arguments already sent

    def after_think(self) -> None:
        """A think block opened the reply: whitespace may come before the calls."""
        self.mode = "gap"

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self.mode == "content":
            return [{"content": text}] if text else []
        self.buffer += text
        out: list[dict[str, Any]] = []
        if self.mode == "gap":
            rest = self.buffer.lstrip()
            if not rest:
                return out  # more whitespace may follow
            if OPEN.startswith(rest) or rest.startswith(OPEN):  # calls follow: the gap is text
                out.append({"content": self.buffer[: len(self.buffer) - len(rest)]})
                self.buffer = rest
            self.mode = "undecided"
        if self.mode == "undecided":
            if OPEN.startswith(self.buffer):
                return out
            if not self.buffer.startswith(OPEN):
                self.mode, text, self.buffer = "content", self.buffer, ""
                return [*out, {"content": text}]
            self.mode = "calls"
        return out + self._calls()

    def _calls(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while self._next_call():
            body = self.buffer[len(OPEN) :]
            head = _HEAD.match(body)
            if head and not self._header:
                name = json.loads(head.group(1))
                call = {"id": new_call_id(), "type": "function",
                        "function": {"name": name, "arguments": ""}}  # fmt: skip
                out.append({"tool_calls": [call_delta(len(self.calls), call)]})
                self.calls.append(call)
                self._header = True
            end = body.find(CLOSE)
            if end < 0:
                if head:
                    held = len(body) - len(CLOSE) - 1
                    out += self._arguments(body[head.end() : max(held, head.end())])
                return out
            whole = _call(body[:end])
            if whole is None:
                return out  # not a call after all (no grammar): finish() sends it as text
            if self._header:
                out += self._arguments(whole["function"]["arguments"])
            else:
                out.append({"tool_calls": [call_delta(len(self.calls), whole)]})
                self.calls.append(whole)
            self.buffer = body[end + len(CLOSE) :]
            self._header, self._sent = False, 0
        if self.buffer and not OPEN.startswith(self.buffer.removeprefix("\n")):
            out.append({"content": self.buffer})
            self.buffer, self.mode = "", "content"
        return out

    def _next_call(self) -> bool:
        """Whether the buffer starts a call (after the newline that separates calls)."""
        if self.calls and self.buffer.startswith("\n<"):
            self.buffer = self.buffer[1:]
        return self.buffer.startswith(OPEN)

    def _arguments(self, arguments: str) -> list[dict[str, Any]]:
        if len(arguments) <= self._sent:
            return []
        piece, self._sent = arguments[self._sent :], len(arguments)
        self.calls[-1]["function"]["arguments"] += piece
        index = len(self.calls) - 1
        return [{"tool_calls": [{"index": index, "function": {"arguments": piece}}]}]
