"""OpenAI response bodies (chat and text completions), built as plain dicts from engine outputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from engine.outputs import CompletionOutput, Logprob
from service import reasoning
from service.reasoning import ReasoningStream
from service.tool_llama3 import Llama3Stream
from service.tools import ToolPlan, ToolStream, parse


@dataclass
class Choice:
    """One choice accumulated from a request's deltas (non-streamed responses)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, delta: CompletionOutput) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        if delta.logprobs:
            self.logprobs += delta.logprobs
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
    }


def _top(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    # The sampled token keeps its true rank; the alternatives are ranks 1..k.
    return sorted(entry.items(), key=lambda kv: kv[1].rank or 0)[:k]


def _token(lp: Logprob, tid: int) -> str:
    return lp.decoded_token if lp.decoded_token is not None else str(tid)


def chat_logprobs(
    token_ids: list[int], logprobs: list[dict[int, Logprob]] | None, k: int
) -> dict[str, Any] | None:
    if logprobs is None:
        return None
    content = []
    for tid, entry in zip(token_ids, logprobs):
        lp = entry[tid]
        tok = _token(lp, tid)
        content.append(
            {
                "token": tok,
                "logprob": lp.logprob,
                "bytes": list(tok.encode()),
                "top_logprobs": [_chat_top(alt, aid) for aid, alt in _top(entry, k)],
            }
        )
    return {"content": content}


def _chat_top(lp: Logprob, tid: int) -> dict[str, Any]:
    tok = _token(lp, tid)
    return {"token": tok, "logprob": lp.logprob, "bytes": list(tok.encode())}


def completion_logprobs(
    token_ids: list[int], logprobs: list[dict[int, Logprob]] | None, k: int, offset: int
) -> dict[str, Any] | None:
    """The legacy completions format; ``offset`` is where this piece starts in the text."""
    if logprobs is None:
        return None
    tokens, values, tops, offsets = [], [], [], []
    for tid, entry in zip(token_ids, logprobs):
        lp = entry[tid]
        tok = _token(lp, tid)
        tokens.append(tok)
        values.append(lp.logprob)
        tops.append({_token(alt, aid): alt.logprob for aid, alt in _top(entry, k)})
        offsets.append(offset)
        offset += len(tok)
    return {
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


@dataclass
class ResponseHead:
    """What every body and chunk of one response repeats."""

    id: str
    created: int
    model: str
    chat: bool
    num_logprobs: int = 0
    include_usage: bool = False
    tools: ToolPlan | None = None  # chat with tools in play: the text becomes tool_calls
    reasoning: str | None = None  # chat with a reasoning parser: <think> -> reasoning_content
    _text_parts: tuple[bytes, bytes, bytes] | None = field(default=None, repr=False)

    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            body["usage"] = None
        return body

    def text_event(self, index: int, text: str) -> bytes:
        """The SSE event of a delta that is only text (no logprobs, not the last): the bytes
        ``sse(encode(self.chunk([self.delta_choice(...)])))`` gives, without building and
        encoding the dicts: most events of a stream are this one."""
        if self._text_parts is None:
            head = self.chunk([])
            del head["choices"]
            prefix = msgspec.json.encode(head)[:-1]  # {"id":...,"model":"..."  (no "}")
            if self.include_usage:
                prefix = prefix[: -len(b',"usage":null')]
            key = b'"delta":{"content":' if self.chat else b'"text":'
            close = b"}" if self.chat else b""
            tail = b',"usage":null}' if self.include_usage else b"}"
            self._text_parts = (
                b"data: " + prefix + b',"choices":[{"index":',
                b"," + key,
                close + b',"logprobs":null,"finish_reason":null}]' + tail + b"\n\n",
            )
        start, middle, end = self._text_parts
        return b"".join((start, str(index).encode(), middle, msgspec.json.encode(text), end))

    def usage_chunk(self, num_prompt_tokens: int, num_completion_tokens: int) -> dict[str, Any]:
        body = self.chunk([])
        body["usage"] = usage(num_prompt_tokens, num_completion_tokens)
        return body

    def role_choice(self, index: int) -> dict[str, Any]:
        return {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }

    def delta_choice(self, index: int, delta: CompletionOutput, offset: int) -> dict[str, Any]:
        if self.chat:
            return {
                "index": index,
                "delta": {"content": delta.text} if delta.text else {},
                "logprobs": chat_logprobs(delta.token_ids, delta.logprobs, self.num_logprobs),
                "finish_reason": delta.finish_reason,
            }
        return {
            "index": index,
            "text": delta.text,
            "logprobs": completion_logprobs(
                delta.token_ids, delta.logprobs, self.num_logprobs, offset
            ),
            "finish_reason": delta.finish_reason,
        }

    def parsed_chunks(
        self, index: int, delta: CompletionOutput, streams: dict[int, ReplyStream]
    ) -> list[dict[str, Any]]:
        """The chunks of one output of a choice when tools or a reasoning parser are in play:
        reasoning, content and tool-call deltas in OpenAI's shape, the finish reason on the
        last."""
        stream = streams.get(index)
        if stream is None:
            fmt = self.tools.fmt if self.tools is not None else "hermes"
            stream = streams[index] = ReplyStream.of(self.reasoning, self.tools is not None, fmt)
        deltas = stream.feed(delta.text) if delta.text else []
        finish = delta.finish_reason
        if finish is not None:
            deltas += stream.finish()
            finish = self._finish_reason(finish, stream.called)
        logprobs = chat_logprobs(delta.token_ids, delta.logprobs, self.num_logprobs)
        if not deltas and (finish is not None or logprobs is not None):
            deltas = [{}]
        chunks = []
        for i, d in enumerate(deltas):
            last = i == len(deltas) - 1
            chunks.append(self.chunk([{
                "index": index, "delta": d, "logprobs": logprobs if i == 0 else None,
                "finish_reason": finish if last else None,
            }]))  # fmt: skip
        return chunks

    def _finish_reason(self, finish: str, called: bool) -> str:
        """OpenAI's: tool_calls when the model chose to call, stop when a named function was
        forced."""
        if called and finish == "stop" and self.tools is not None and self.tools.choice != "named":
            return "tool_calls"
        return finish

    def final_choice(self, index: int, choice: Choice, has_logprobs: bool) -> dict[str, Any]:
        lps = choice.logprobs if has_logprobs else None
        if self.chat:
            text: str | None = choice.text
            message: dict[str, Any] = {"role": "assistant"}
            if self.reasoning is not None:
                message["reasoning_content"], text = reasoning.split(choice.text, self.reasoning)
            calls: list[dict[str, Any]] = []
            if self.tools is not None:
                after_think = message.get("reasoning_content") is not None
                text, calls = parse(text or "", after_think=after_think, fmt=self.tools.fmt)
            message["content"] = text
            if calls:
                message["tool_calls"] = calls
            finish = choice.finish_reason
            return {
                "index": index,
                "message": message,
                "logprobs": chat_logprobs(choice.token_ids, lps, self.num_logprobs),
                "finish_reason": self._finish_reason(finish, bool(calls)) if finish else finish,
            }
        return {
            "index": index,
            "text": choice.text,
            "logprobs": completion_logprobs(choice.token_ids, lps, self.num_logprobs, 0),
            "finish_reason": choice.finish_reason,
        }

    def body(
        self, choices: list[dict[str, Any]], num_prompt_tokens: int, num_completion_tokens: int
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage(num_prompt_tokens, num_completion_tokens),
        }


@dataclass
class ReplyStream:
    """One streamed chat choice's text, split as its final message would be: reasoning, then
    content or tool calls. A think block opening the reply is split off by a ReasoningStream
    (the server's --reasoning-parser, or qwen3's rule where tools are in play without one):
    with a parser it goes out as reasoning_content, without one as content, tags and all."""

    reasoning: ReasoningStream | None
    tools: ToolStream | Llama3Stream | None
    parsed: bool = True  # the block is reasoning_content (else content again)
    _opened: bool = False  # the block's open tag went out as content (parsed False)
    _closed: bool = False  # the block was closed and what follows it routed

    @classmethod
    def of(cls, parser: str | None, tools: bool, fmt: str = "hermes") -> ReplyStream:
        """``fmt``: the tool calls' format (ToolPlan.fmt)."""
        if parser is None and not tools:
            return cls(None, None)
        splitter = ReasoningStream(parser or "qwen3")
        calls = (Llama3Stream() if fmt == "llama3_json" else ToolStream()) if tools else None
        return cls(splitter, calls, parsed=parser is not None)

    @property
    def called(self) -> bool:
        return self.tools is not None and bool(self.tools.calls)

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self.reasoning is None:
            return [{"content": text}]
        return self._route(self.reasoning.feed(text))

    def finish(self) -> list[dict[str, Any]]:
        out = self._route(self.reasoning.finish()) if self.reasoning is not None else []
        return out + (self.tools.finish() if self.tools is not None else [])

    def _route(self, pieces: list[tuple[str, str]]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        r = self.reasoning
        assert r is not None  # feed and finish route only what it split
        if not self.parsed and not self._opened and (r.state == "thinking" or r.thought):
            self._opened = True
            out.append({"content": reasoning.OPEN})
        for kind, text in pieces:
            if kind == "reasoning":
                out.append({"reasoning_content" if self.parsed else "content": text})
                continue
            self._close(out)
            out += self.tools.feed(text) if self.tools is not None else [{"content": text}]
        self._close(out)  # a block closed with nothing after it yet
        return out

    def _close(self, out: list[dict[str, Any]]) -> None:
        """Once, when the block has closed: its close tag (as content, unparsed), and the
        tool calls may then follow the whitespace after it."""
        if self._closed or self.reasoning is None or not self.reasoning.thought:
            return
        self._closed = True
        if not self.parsed:
            out.append({"content": reasoning.CLOSE})
        if self.tools is not None:
            self.tools.after_think()
