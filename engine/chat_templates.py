"""Chat templates for checkpoints that carry none (a base model, a GGUF file without one) or
that a user wants to override: vLLM's ``--chat-template`` (a file, or a Jinja string), and
llama.cpp's named built-ins for the families Lumen serves.

``resolve`` reads a value as: an existing file, else a built-in name, else an inline Jinja
template (it must contain ``{{`` or ``{%``); anything else is an error that lists the names.
The built-ins are written from each family's published prompt format: each renders the
conversation's turns and, with ``add_generation_prompt``, the opening of the assistant's.
"""

from __future__ import annotations

from pathlib import Path

# ChatML: SmolLM2, Qwen, many fine-tunes.
CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Qwen2.5's: ChatML with its default system turn where the conversation has none.
QWEN = (
    "{%- if not messages or messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}"
    "{%- endif %}" + CHATML
)
# Gemma (2 and 3): user and model turns; a system message opens the first user turn.
GEMMA = (
    "{{- bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{%- set prefix = messages[0]['content'] + '\\n\\n' %}{%- set turns = messages[1:] %}"
    "{%- else %}{%- set prefix = '' %}{%- set turns = messages %}{%- endif %}"
    "{%- for message in turns %}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{- '<start_of_turn>' + role + '\\n' + (prefix if loop.first else '')"
    " + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"
)
# Llama 3 (3.0 to 3.3): header-delimited turns.
LLAMA3 = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
# Phi-3, 3.5 and 4-mini: <|role|> turns closed by <|end|>.
PHI3 = (
    "{%- for message in messages %}"
    "{{- '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- else %}{{- eos_token }}"
    "{%- endif %}"
)
BUILTIN = {"chatml": CHATML, "gemma": GEMMA, "llama3": LLAMA3, "phi3": PHI3, "qwen": QWEN}
HOW = "a file, a built-in name (" + ", ".join(BUILTIN) + ") or a Jinja template"


def resolve(value: str, *, files: bool = True) -> str:
    """The template ``value`` names: a file's text (``files``; a request's template is never
    read from the server's disk), a built-in's, or ``value`` itself where it is Jinja."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"a chat template must be {HOW}")
    if files and _is_file(value):
        try:
            return Path(value).expanduser().read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"the chat template file {value} cannot be read: {e}") from None
    if value in BUILTIN:
        return BUILTIN[value]
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"chat template {value!r} is not {HOW}")


def describe(value: str) -> str:
    """What ``value`` names, for the start-up log: a built-in, a file, or an inline template."""
    if value in BUILTIN:
        return f"the built-in {value!r}"
    if _is_file(value):
        return f"the file {value}"
    return "an inline Jinja template"


def _is_file(value: str) -> bool:
    """Whether ``value`` names an existing file (an inline template longer than a file name
    may be is an OSError to the OS: not a file)."""
    try:
        return "\n" not in value and Path(value).expanduser().is_file()
    except (OSError, ValueError):
        return False


def for_request(template: str | None, trusted: bool) -> str | None:
    """A request's own chat template (vLLM's field): a built-in name or Jinja, never a file,
    where the server trusts requests' templates (--trust-request-chat-template)."""
    if template is None:
        return None
    if not trusted:
        raise ValueError(
            "chat_template in a request is accepted only by a server started with "
            "--trust-request-chat-template (--chat-template sets the server's)"
        )
    return resolve(template, files=False)
