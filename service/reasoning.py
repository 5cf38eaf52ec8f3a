"""Reasoning parsers: a reply's ``<think>`` block comes back as ``reasoning_content``, apart from
its ``content``, as vLLM's ``--reasoning-parser`` returns it.

- ``qwen3``: the model opens the block itself (Qwen3, QwQ). A reply that does not start with
  ``<think>`` is all content (Qwen3 with ``enable_thinking: false``: its template closed an
  empty block in the prompt).
- ``deepseek_r1``: the template opens the block in the prompt (DeepSeek-R1 and its distills),
  so a reply is reasoning up to ``</think>`` whether or not it repeats ``<think>``.

A block the reply never closes (cut by ``max_tokens``) is all reasoning. The content after
``</think>`` is returned as generated, as vLLM does.
"""

from __future__ import annotations

from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek_r1")


def check_parser(name: str | None) -> None:
    if name is not None and name not in PARSERS:
        raise ValueError(f"reasoning_parser must be one of {', '.join(PARSERS)}, not {name!r}")


def split(text: str, parser: str) -> tuple[str | None, str | None]:
    """(reasoning_content, content) of a whole reply."""
    if text.startswith(OPEN):
        text = text[len(OPEN) :]
    elif parser == "qwen3":
        return None, text or None
    reasoning, closed, content = text.partition(CLOSE)
    if not closed:
        return reasoning, None
    return reasoning, content or None


def think_block_end(text: str) -> int | None:
    """Where a complete ``<think>`` block that opens ``text`` ends, with the whitespace after
    it: -1 while ``text`` could still become one, None if it does not open with one. (Tool
    calls may follow a think block: service/tools.py reads past it.)"""
    if not text.startswith(OPEN):
        return -1 if OPEN.startswith(text) else None
    end = text.find(CLOSE)
    if end < 0:
        return -1
    end += len(CLOSE)
    rest = text[end:]
    stripped = rest.lstrip()
    if not stripped:
        return -1  # more whitespace may follow
    return end + len(rest) - len(stripped)


@dataclass
class ReasoningStream:
    """Streamed text deltas in, ("reasoning" | "content", text) pieces out, holding back only
    what could still be a tag."""

    parser: str
    state: str = "start"  # start | thinking | answer
    held: str = ""
    thought: bool = False  # a block was closed: the answer follows it

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.held += text
        out: list[tuple[str, str]] = []
        if self.state == "start":
            if OPEN.startswith(self.held):
                return out
            if self.held.startswith(OPEN):
                self.state, self.held = "thinking", self.held[len(OPEN) :]
            else:  # deepseek_r1: the template opened the block
                self.state = "thinking" if self.parser == "deepseek_r1" else "answer"
        if self.state == "thinking":
            end = self.held.find(CLOSE)
            if end < 0:
                cut = len(self.held) - partial_tail(self.held, CLOSE)
                piece, self.held = self.held[:cut], self.held[cut:]
                return [("reasoning", piece)] if piece else []
            if end:
                out.append(("reasoning", self.held[:end]))
            self.state, self.held = "answer", self.held[end + len(CLOSE) :]
            self.thought = True
        if self.held:
            out.append(("content", self.held))
            self.held = ""
        return out

    def finish(self) -> list[tuple[str, str]]:
        """What is held at the end: a partial tag is text after all."""
        if not self.held:
            return []
        thinking = self.state == "thinking" or (
            self.state == "start" and self.parser == "deepseek_r1"
        )
        kind = "reasoning" if thinking else "content"
        piece, self.held = self.held, ""
        return [(kind, piece)]


def partial_tail(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
