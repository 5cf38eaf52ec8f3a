"""A stream's text events take a fast path (ResponseHead.text_event): its bytes must be the
ones the general path builds, for chat and completions, with and without usage."""

from __future__ import annotations

import msgspec
import pytest

from engine.outputs import CompletionOutput
from service.responses import ResponseHead
from service.streaming import sse


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
@pytest.mark.parametrize("include_usage", [True, False], ids=["usage", "no-usage"])
def test_text_event_is_the_general_chunk(chat: bool, include_usage: bool) -> None:
    head = ResponseHead("chatcmpl-1", 1_700_000_000, 'a "quoted" model', chat,
                        include_usage=include_usage)  # fmt: skip
    for index, text in enumerate(["Hi", ' "q" \\ é 日本 \n\t', "\x00\u2028", " "]):
        delta = CompletionOutput(index=0, text=text, token_ids=[5], cumulative_logprob=None,
                                 logprobs=None, finish_reason=None, stop_reason=None,
                                 error=None)  # fmt: skip
        general = sse(msgspec.json.encode(head.chunk([head.delta_choice(index, delta, 0)])))
        assert head.text_event(index, text) == general
