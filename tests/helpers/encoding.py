"""The served path's encoder held to transformers' (engine.processor.plain_encoder), for the
tokenizer tests and the Gemma test: that one has Gemma's 33 MB tokenizer loaded already (a
second load in another worker cost 5 s of CPU)."""

from __future__ import annotations

from typing import Any

TEXTS = ["Hello, world!", "naïve café — “quotes”", "日本語のテキスト", "  two  spaces\n"]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the capital of France?"},
]
ENCODED = [
    *TEXTS,
    "<|im_start|>user\nhi<|im_end|>",
    "<bos><start_of_turn> in a text",
    "",
    "x" * 4000,
]


def check_plain_encoder(tokenizer: Any) -> None:
    """plain_encoder's ids equal transformers' encode and tokenizing apply_chat_template, special
    tokens written in a user's text included, on a tokenizer configured to truncate (the
    tokenizer is shared in the process: its truncation is undone after)."""
    from engine.processor import plain_encoder

    encoder = plain_encoder(tokenizer)
    tokenizer.backend_tokenizer.enable_truncation(8)  # transformers' call turns this off
    try:
        for text in ENCODED:
            for special in (True, False):
                assert encoder.encode(text, add_special_tokens=special).ids == tokenizer.encode(
                    text, add_special_tokens=special
                ), (text, special)
        for content in ENCODED[1:] if tokenizer.chat_template else []:
            messages = [*MESSAGES, {"role": "user", "content": content}]
            rendered = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
            ids = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
            assert encoder.encode(rendered, add_special_tokens=False).ids == list(ids)
    finally:
        tokenizer.backend_tokenizer.no_truncation()
