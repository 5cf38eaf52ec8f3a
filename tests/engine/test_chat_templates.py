"""Chat templates for a checkpoint that carries none: the built-ins render each family's
published format, --chat-template takes a file, a name or Jinja, and a server with none says
so at start and answers chat requests with a 400 that names the flag."""

from __future__ import annotations

import os
from pathlib import Path

import openai
import pytest
from transformers import AutoTokenizer

from engine import chat_templates
from tests.helpers.server import LumenServer

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Name a colour."},
]


def _expected(name: str, bos: str, eos: str) -> str:
    if name in ("chatml", "qwen"):
        turns = [("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello!"),
                 ("user", "Name a colour.")]  # fmt: skip
        return "".join(f"<|im_start|>{r}\n{c}<|im_end|>\n" for r, c in turns) + (
            "<|im_start|>assistant\n"
        )
    if name == "gemma":
        return (f"{bos}<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
                "<start_of_turn>model\nHello!<end_of_turn>\n"
                "<start_of_turn>user\nName a colour.<end_of_turn>\n"
                "<start_of_turn>model\n")  # fmt: skip
    if name == "llama3":
        turns = [("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello!"),
                 ("user", "Name a colour.")]  # fmt: skip
        return (
            bos
            + "".join(f"<|start_header_id|>{r}<|end_header_id|>\n\n{c}<|eot_id|>" for r, c in turns)
            + "<|start_header_id|>assistant<|end_header_id|>\n\n"
        )
    assert name == "phi3"
    return ("<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\nHello!<|end|>\n"
            "<|user|>\nName a colour.<|end|>\n<|assistant|>\n")  # fmt: skip


@pytest.mark.parametrize("name", sorted(chat_templates.BUILTIN))
def test_each_built_in_renders_its_familys_format(name: str, tiny_model_path: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    text = tok.apply_chat_template(
        CONVERSATION, chat_template=chat_templates.resolve(name), tokenize=False,
        add_generation_prompt=True,
    )  # fmt: skip
    assert text == _expected(name, tok.bos_token or "", tok.eos_token or "")


def test_qwen_adds_its_default_system_turn_where_there_is_none(tiny_model_path: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                   chat_template=chat_templates.resolve("qwen"))  # fmt: skip
    assert text.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n")


def test_a_value_is_a_file_then_a_name_then_jinja(tmp_path: Path) -> None:
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert chat_templates.resolve(str(f)) == f.read_text()
    assert chat_templates.resolve("gemma") == chat_templates.GEMMA
    assert chat_templates.resolve("{{ messages[0]['content'] }}") == "{{ messages[0]['content'] }}"
    # An inline template longer than a file name may be (the OS says "name too long").
    assert chat_templates.resolve(chat_templates.GEMMA) == chat_templates.GEMMA
    assert chat_templates.describe(chat_templates.GEMMA) == "an inline Jinja template"
    with pytest.raises(ValueError, match="chatml, gemma, llama3, phi3, qwen"):
        chat_templates.resolve("gemma4")
    with pytest.raises(ValueError, match="is not a file, a built-in name"):
        chat_templates.resolve(str(f), files=False)  # a request's value never reads a file


@pytest.fixture
def no_template_model(tiny_model_path: Path, tmp_path: Path) -> Path:
    """The tiny model as a base model ships: no chat template."""
    out = tmp_path / "base"
    out.mkdir()
    for f in tiny_model_path.iterdir():
        if f.name != "chat_template.jinja":
            os.symlink(f, out / f.name)
    return out


def _chat(server: LumenServer, **extra: object) -> openai.types.chat.ChatCompletion:
    return server.client().chat.completions.create(
        model=server.client().models.list().data[0].id, messages=CONVERSATION[1:2],
        max_tokens=2, temperature=0, extra_body=extra or None,
    )  # fmt: skip


def test_a_model_without_a_template_says_so_and_chats_with_one_given(
    no_template_model: Path, tmp_path: Path
) -> None:
    """No template: the start-up log and a chat's 400 name --chat-template, completions work.
    With --chat-template FILE and --trust-request-chat-template: chats render with the file,
    and a request's own template (a built-in name) replaces it for that request only."""
    log = tmp_path / "bare.log"
    with LumenServer(no_template_model, log_path=log) as server:
        with pytest.raises(openai.BadRequestError) as refused:
            _chat(server)
        assert "--chat-template" in str(refused.value), refused.value
        done = server.client().completions.create(
            model=server.client().models.list().data[0].id, prompt="Hi", max_tokens=2
        )
        assert done.usage.completion_tokens == 2
    said = log.read_text()
    assert "the model has no chat template" in said and "--chat-template" in said
    template = tmp_path / "mine.jinja"
    template.write_text(
        "{% for m in messages %}<<{{ m['role'] }}: {{ m['content'] }}>>{% endfor %}"
        "{% if add_generation_prompt %}<<assistant:{% endif %}"
    )
    log = tmp_path / "given.log"
    with LumenServer(no_template_model, "--chat-template", str(template),
                     "--trust-request-chat-template", log_path=log) as server:  # fmt: skip
        mine = _chat(server)
        named = _chat(server, chat_template="llama3")
        assert mine.usage.prompt_tokens != named.usage.prompt_tokens
        with pytest.raises(openai.BadRequestError, match="chat template 'nope' is not"):
            _chat(server, chat_template="nope")
    assert f"chat template: the file {template}" in log.read_text()
    with LumenServer(no_template_model, "--chat-template", "chatml", log_path=log) as server:
        assert _chat(server).usage.prompt_tokens > 0
        with pytest.raises(openai.BadRequestError, match="--trust-request-chat-template"):
            _chat(server, chat_template="gemma")
