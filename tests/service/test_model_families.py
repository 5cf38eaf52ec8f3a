"""A family beside Llama through a real `lumen serve` and the official client: Qwen3 (tiny,
random) answers, a request's chat_template_kwargs reach its template, its generation config's
sampling defaults apply where a request leaves a field out, and with --reasoning-parser qwen3 a
reply's think block comes back as reasoning_content, whole or streamed."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.helpers.server import LumenServer

MESSAGES = [{"role": "user", "content": "Is it raining?"}]


@pytest.fixture(scope="module")
def qwen3_server(
    tmp_path_factory: pytest.TempPathFactory, tiny_family_path: Callable[[str], Path]
) -> Iterator[LumenServer]:
    log = tmp_path_factory.mktemp("qwen3") / "serve.log"
    args = ("--num-kv-blocks", "256", "--reasoning-parser", "qwen3")
    with LumenServer(tiny_family_path("qwen3"), *args, log_path=log) as s:
        yield s


def test_qwen3_answers_and_its_template_takes_the_request_variables(
    qwen3_server: LumenServer,
) -> None:
    client = qwen3_server.client()
    model = client.models.list().data[0].id

    def prompt_tokens(**extra: object) -> int:
        reply = client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=4, temperature=0, extra_body=extra
        )  # type: ignore[call-overload]
        assert reply.choices[0].finish_reason == "length" and reply.usage is not None
        return reply.usage.prompt_tokens

    plain = prompt_tokens()
    # enable_thinking false closes an empty think block after the prompt: more prompt tokens.
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": False}) > plain
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": True}) == plain


def test_bad_chat_template_kwargs_are_a_400_and_the_server_serves_on(
    qwen3_server: LumenServer,
) -> None:
    url = qwen3_server.url("/v1/chat/completions")
    for kwargs, says in (({"tokenize": False}, "cannot set tokenize"),
                         ({"add_generation_prompt": False}, "cannot set add_generation_prompt"),
                         ("thinking", "chat_template_kwargs")):  # fmt: skip
        r = httpx.post(url, json={"messages": MESSAGES, "chat_template_kwargs": kwargs})
        assert r.status_code == 400 and says in r.text, r.text
    client = qwen3_server.client()
    with pytest.raises(openai.BadRequestError, match="cannot set tools"):
        client.chat.completions.create(
            model=client.models.list().data[0].id, messages=MESSAGES,
            extra_body={"chat_template_kwargs": {"tools": []}},
        )  # type: ignore[call-overload]  # fmt: skip
    ok = httpx.post(url, json={"messages": MESSAGES, "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def test_the_generation_config_fills_what_a_request_leaves_out(qwen3_server: LumenServer) -> None:
    """The tiny Qwen3's generation_config.json sets max_new_tokens 3 (and Qwen3's sampling)."""
    url = qwen3_server.url("/v1/chat/completions")
    left_out = httpx.post(url, json={"messages": MESSAGES, "ignore_eos": True}, timeout=60).json()
    assert left_out["usage"]["completion_tokens"] == 3, left_out
    given = httpx.post(url, json={"messages": MESSAGES, "max_tokens": 5, "ignore_eos": True},
                       timeout=60).json()  # fmt: skip
    assert given["usage"]["completion_tokens"] == 5, given
    assert "sampling defaults from the model's generation config" in qwen3_server.log()


# The tiny model thinks only when told to: a regex makes its reply a think block, then text.
THINKS = {"guided_regex": "<think>\n[a-z]{2,6}( [a-z]{2,6}){0,3}\n</think>\n\nParis\\."}


def test_a_think_block_comes_back_as_reasoning_content(qwen3_server: LumenServer) -> None:
    client = qwen3_server.client()
    model = client.models.list().data[0].id
    whole = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=40, temperature=0, extra_body=THINKS
    )  # type: ignore[call-overload]
    message = whole.choices[0].message
    reasoning = (message.model_extra or {})["reasoning_content"]
    assert reasoning.startswith("\n") and reasoning.endswith("\n") and "<" not in reasoning
    assert message.content == "\n\nParis."
    # Streamed: the same split, delta by delta, and no tag in either part.
    stream = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=40, temperature=0, extra_body=THINKS,
        stream=True,
    )  # type: ignore[call-overload]  # fmt: skip
    parts = {"reasoning_content": "", "content": ""}
    for chunk in stream:
        if chunk.choices:
            delta = chunk.choices[0].delta
            parts["content"] += delta.content or ""
            parts["reasoning_content"] += (delta.model_extra or {}).get("reasoning_content") or ""
    assert parts == {"reasoning_content": reasoning, "content": "\n\nParis."}
    # Without a think block the reply is all content.
    plain = httpx.post(qwen3_server.url("/v1/chat/completions"), timeout=60, json={
        "messages": MESSAGES, "max_tokens": 3, "guided_regex": "[a-z]{3}"}).json()  # fmt: skip
    assert plain["choices"][0]["message"]["reasoning_content"] is None
    assert len(plain["choices"][0]["message"]["content"]) == 3


@pytest.fixture(scope="module")
def llama3_server(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path):
    """The tiny Llama with Llama 3.1's tool template (tests.helpers.models)."""
    from tests.helpers.models import LLAMA3_TOOL_TEMPLATE

    folder = tmp_path_factory.mktemp("llama3-tools") / "tiny-llama3"
    folder.mkdir()
    for f in tiny_model_path.iterdir():
        if f.is_file() and f.name != "chat_template.jinja":
            (folder / f.name).symlink_to(f)
    (folder / "chat_template.jinja").write_text(LLAMA3_TOOL_TEMPLATE)
    log = folder.parent / "serve.log"
    with LumenServer(folder, "--num-kv-blocks", "256", log_path=log) as s:
        yield s


WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"]}}}]  # fmt: skip


def test_llama3_template_gets_its_own_tool_call_format(llama3_server: LumenServer) -> None:
    """A template that writes Llama 3's calls: the reply is JSON objects with parameters,
    returned as tool_calls whole and streamed; the history's calls and results go back
    through the template as it writes them."""
    client = llama3_server.client()
    model = client.models.list().data[0].id
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    whole = client.chat.completions.create(
        model=model, messages=ask, tools=WEATHER, tool_choice="required", max_tokens=60,
        temperature=0, parallel_tool_calls=False,
    )  # type: ignore[call-overload]  # fmt: skip
    (call,) = whole.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
    assert whole.choices[0].finish_reason == "tool_calls" and not whole.choices[0].message.content
    stream = client.chat.completions.create(
        model=model, messages=ask, tools=WEATHER, tool_choice="required", max_tokens=60,
        temperature=0, parallel_tool_calls=False, stream=True,
    )  # type: ignore[call-overload]  # fmt: skip
    streamed = [t for c in stream if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert [(t.function.name, t.function.arguments) for t in streamed] == [
        (call.function.name, call.function.arguments)
    ]
    # The call and its result, sent back (test_tools: how the template writes them).
    history = [*ask, whole.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "18 C"}]  # fmt: skip
    again = httpx.post(llama3_server.url("/v1/chat/completions"), timeout=60,
                       json={"messages": history, "tools": WEATHER, "max_tokens": 4})  # fmt: skip
    assert again.status_code == 200, again.text
