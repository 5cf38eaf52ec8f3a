"""Reasoning parsers (service/reasoning.py): a reply's think block apart from its content,
whole and streamed in any pieces alike."""

from __future__ import annotations

import random

import pytest

from service.reasoning import ReasoningStream, check_parser, split

REPLIES = [
    "<think>\nParis is </b> the capital.\n</think>\n\nParis.",
    "<think>cut short by max_tokens",
    "Paris.",
    "<think></think>Paris.",
    "</think>Paris.",  # deepseek_r1: its template opened the block
    "<thi",
    "An answer that mentions <think> later </think> on.",
]


def test_whole_replies() -> None:
    assert split(REPLIES[0], "qwen3") == ("\nParis is </b> the capital.\n", "\n\nParis.")
    assert split(REPLIES[1], "qwen3") == ("cut short by max_tokens", None)  # unclosed: reasoning
    assert split("Paris.", "qwen3") == (None, "Paris.")  # enable_thinking false: no block
    assert split("</think>Paris.", "deepseek_r1") == ("", "Paris.")
    assert split("Paris.", "deepseek_r1") == ("Paris.", None)  # never closed: all reasoning
    assert split(REPLIES[-1], "qwen3") == (None, REPLIES[-1])  # a block only opens a reply
    with pytest.raises(ValueError, match="qwen3, deepseek_r1"):
        check_parser("granite")


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
@pytest.mark.parametrize("seed", range(4))
def test_a_stream_in_any_pieces_gives_what_split_gives(parser: str, seed: int) -> None:
    rng = random.Random(seed)
    for text in REPLIES:
        stream, parts, i = ReasoningStream(parser), {"reasoning": "", "content": ""}, 0
        while i < len(text):
            n = rng.randint(1, 6)
            for kind, piece in stream.feed(text[i : i + n]):
                parts[kind] += piece
            i += n
        for kind, piece in stream.finish():
            parts[kind] += piece
        reasoning, content = split(text, parser)
        assert (parts["reasoning"] or None, parts["content"] or None) == (
            reasoning or None, content
        ), text  # fmt: skip


@pytest.mark.parametrize("seed", range(3))
def test_reasoning_and_tools_stream_as_the_final_message_reads(seed: int) -> None:
    """With a parser and tools both in play (a thinking model calling functions), each
    streamed choice splits into reasoning_content, content and tool calls as its final
    message does."""
    from service.responses import Choice, ReplyStream, ResponseHead
    from service.tools import ToolPlan

    call = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    head = ResponseHead("id", 0, "m", True, tools=ToolPlan([{"name": "f"}], "auto"),
                        reasoning="qwen3")  # fmt: skip
    rng = random.Random(seed)
    for text in ("<think>\nCall f.\n</think>\n\n" + call, "<think>x</think>\n\nSunny.", call,
                 "Sunny.", "<think>cut short"):  # fmt: skip
        choice = Choice(text=text, finish_reason="stop")
        message = head.final_choice(0, choice, False)["message"]
        stream, deltas, i = ReplyStream.of("qwen3", True), [], 0
        while i < len(text):
            n = rng.randint(1, 6)
            deltas += stream.feed(text[i : i + n])
            i += n
        deltas += stream.finish()
        streamed = {key: "".join(d.get(key, "") for d in deltas) or None
                    for key in ("reasoning_content", "content")}  # fmt: skip
        assert streamed == {"reasoning_content": message["reasoning_content"] or None,
                            "content": message["content"]}, text  # fmt: skip
        assert len(stream.tools.calls if stream.tools else []) == len(message.get("tool_calls", []))
