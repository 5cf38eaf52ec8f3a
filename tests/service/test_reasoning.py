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
