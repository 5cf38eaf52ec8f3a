"""Incremental detokenization is exact for multi-byte text; stop strings straddling tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from engine.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello, world! This is plain ASCII.",
    "naïve café, Zürich — “quotes” and ½ fractions",
    "日本語のテキストと中文字符，还有한국어",
    "emoji 🎉🚀👩‍👩‍👧 and flags 🇫🇷 mixed in",
    "  leading spaces\n\tand tabs\r\nand newlines  ",
]


@pytest.fixture(scope="module")
def tokenizer(default_model_path: Path) -> Tokenizer:
    return Tokenizer.from_file(str(default_model_path / "tokenizer.json"))


def _detok(tokenizer: Tokenizer, **kw) -> IncrementalDetokenizer:
    prompt = tokenizer.encode("User says:", add_special_tokens=False).ids
    opts = {"skip_special_tokens": True, "stop": [], "include_stop_str_in_output": False}
    return IncrementalDetokenizer(tokenizer, prompt, **(opts | kw))


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_text_equals_full_decode(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    detok = _detok(tokenizer)
    for tid in ids:
        detok.update([tid])
        assert "\ufffd" not in detok.text  # never a half character
    assert detok.text == tokenizer.decode(ids) == text


def test_multibyte_characters_split_across_tokens_exist_in_the_corpus(tokenizer: Tokenizer) -> None:
    # Guard for the test above: at least one emoji takes several byte-level tokens.
    ids = tokenizer.encode("🎉", add_special_tokens=False).ids
    assert len(ids) > 1


def test_stop_string_straddling_tokens(tokenizer: Tokenizer) -> None:
    text = "The answer is forty-two, of course."
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    stop = "ty-tw"  # spans the tokens of "forty", "-", "two"
    pieces = [tokenizer.decode([i]) for i in ids]
    assert not any(stop in p for p in pieces)
    for include, expected in ((False, "The answer is for"), (True, "The answer is forty-tw")):
        detok = _detok(tokenizer, stop=[stop, "never"], include_stop_str_in_output=include)
        matched = None
        for tid in ids:
            matched = detok.update([tid])
            if matched:
                break
        assert matched == stop
        assert detok.text == expected


def test_earliest_stop_string_wins(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("alpha beta gamma", add_special_tokens=False).ids
    detok = _detok(tokenizer, stop=["gamma", "beta"])
    assert detok.update(ids) == "beta"
    assert detok.text == "alpha "
