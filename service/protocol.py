"""OpenAI request bodies (pydantic, for validation and the OpenAPI schema) and their mapping
onto SamplingParams. Responses are plain dicts built in ``service/serving.py``."""

from __future__ import annotations

from typing import Any, Literal, cast

import msgspec
from pydantic import BaseModel, ConfigDict, Field

from engine.sampling_params import SamplingParams, StructuredOutputsParams

MAX_N = 128  # OpenAI's bound; each sample is a request in the engine


class UnsupportedError(ValueError):
    """A field the server knows but does not implement; a 400 that says so."""


class _Body(BaseModel):
    # Unknown fields are ignored, as vLLM does, so newer clients keep working.
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False
    # The server's timing (service/request_metrics.py) in the last chunk; include_timing is
    # its older name.
    include_metrics: bool = False
    include_timing: bool = False


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers


class _SamplingBody(_Body):
    """The sampling fields both endpoints share, with vLLM's extras."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    # The server's timing as a top-level `metrics` object (vLLM's, per request).
    include_metrics: bool = False
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = Field(0, ge=-(1 << 63), lt=1 << 63)
    # Structured outputs: OpenAI's response_format, and vLLM's structured_outputs object and
    # its older guided_* fields.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def check_supported(self) -> None:
        if self.logit_bias:
            raise UnsupportedError("logit_bias is not supported")

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """What the output must match, from whichever field set it; ValueError if several
        did or one is malformed."""
        found: list[tuple[str, StructuredOutputsParams]] = []
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type")
            if kind == "json_object":
                found.append(("response_format", StructuredOutputsParams(json_object=True)))
            elif kind == "json_schema":
                spec = rf.get("json_schema")
                schema = spec.get("schema") if isinstance(spec, dict) else None
                if not isinstance(schema, dict):
                    raise ValueError(
                        'response_format json_schema needs {"json_schema": {"name": ..., '
                        '"schema": {...}}}'
                    )
                found.append(("response_format", StructuredOutputsParams(json=schema)))
            elif kind != "text":
                raise ValueError(
                    f"response_format type must be text, json_object or json_schema, got {kind!r}"
                )
        if self.structured_outputs is not None:
            fields = {"json", "json_object", "regex", "choice", "grammar"}
            unknown = set(self.structured_outputs) - fields
            if unknown:
                raise ValueError(f"structured_outputs: unknown field {sorted(unknown)[0]!r}")
            try:
                so = msgspec.convert(self.structured_outputs, StructuredOutputsParams)
            except msgspec.ValidationError as e:
                raise ValueError(f"structured_outputs: {e}") from None
            found.append(("structured_outputs", so))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"),
                          ("guided_choice", "choice"), ("guided_grammar", "grammar")):  # fmt: skip
            if (value := getattr(self, name)) is not None:
                found.append((name, StructuredOutputsParams(**{key: value})))
        if len(found) > 1:
            raise ValueError(
                f"set one of {', '.join(n for n, _ in found)}: they all constrain the output"
            )
        return found[0][1] if found else None

    def sampling_params(
        self, max_tokens: int, logprobs: int | None, model_defaults: dict[str, Any] | None = None
    ) -> SamplingParams:
        """Raises ValueError naming the field for any value out of range. A field the request
        leaves out takes ``model_defaults``' value (the model's generation config), else the
        library's."""
        defaults = SamplingParams(**(model_defaults or {}))  # its max_tokens: the caller's
        return SamplingParams(
            n=self.n,
            temperature=defaults.temperature if self.temperature is None else self.temperature,
            top_p=defaults.top_p if self.top_p is None else self.top_p,
            top_k=defaults.top_k if self.top_k is None else self.top_k,
            min_p=defaults.min_p if self.min_p is None else self.min_p,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=(
                defaults.repetition_penalty
                if self.repetition_penalty is None
                else self.repetition_penalty
            ),
            skip_special_tokens=self.skip_special_tokens,
            structured_outputs=self.structured_outputs_params(),
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def wants_metrics(self) -> bool:
        """The request asks for the server's timing (service/request_metrics.py)."""
        o = self.stream_options
        return self.include_metrics or (o is not None and (o.include_metrics or o.include_timing))


class ChatCompletionRequest(_SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)  # the cap: --max-logprobs (engine.processor)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    # Variables of the chat template, as vLLM takes them (Qwen3: {"enable_thinking": false}).
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # vLLM's: taken with --trust-request-chat-template only

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")

    @property
    def requested_max_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else (self.max_tokens)
        )

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def plain_messages(self) -> list[dict[str, Any]]:
        """Messages as the chat template takes them; content parts must be text."""
        out = []
        for i, m in enumerate(self.messages):
            content = m.content
            if isinstance(content, list):
                texts = []
                for part in content:
                    kind = part.get("type")
                    if kind != "text":
                        raise ValueError(
                            f"messages[{i}].content: a {kind!r} part is not supported: "
                            "this model takes text only"
                        )
                    if not isinstance(part.get("text"), str):
                        raise ValueError(f"messages[{i}].content: a text part needs a text string")
                    texts.append(part["text"])
                content = "\n".join(texts)
            msg: dict[str, Any] = {"role": m.role, "content": content or ""}
            if m.name is not None:
                msg["name"] = m.name
            if m.tool_calls:
                if m.role != "assistant":
                    raise ValueError(f"messages[{i}]: only assistant messages have tool_calls")
                msg["tool_calls"] = [_tool_call(i, c) for c in m.tool_calls]
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            out.append(msg)
        return out


class CompletionRequest(_SamplingBody):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, ge=0)  # the cap: --max-logprobs (engine.processor)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise UnsupportedError("echo is not supported")
        if self.suffix:
            raise UnsupportedError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise UnsupportedError("best_of other than n is not supported")

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt must not be empty")
        # all(isinstance(...)) does not narrow p for mypy: each cast states what its check saw.
        if all(isinstance(x, int) for x in p):
            return [list(cast("list[int]", p))]
        if all(isinstance(x, str) for x in p):
            return list(cast("list[str]", p))
        if all(isinstance(x, list) for x in p):
            return [list(x) for x in cast("list[list[int]]", p)]
        raise ValueError("prompt must be a string, a list of strings, or token ids")


def _tool_call(i: int, call: Any) -> dict[str, Any]:
    f = call.get("function") if isinstance(call, dict) else None
    if not isinstance(f, dict) or not isinstance(f.get("name"), str):
        raise ValueError(f"messages[{i}].tool_calls: each call needs a function with a name")
    return {"id": call.get("id"), "type": "function", "function": f}


class LoadLoRAAdapterRequest(_Body):
    """POST /v1/load_lora_adapter, as vLLM's (--allow-runtime-lora-updating)."""

    lora_name: str = ""
    lora_path: str = ""
    base_model_name: str | None = None


class UnloadLoRAAdapterRequest(_Body):
    """POST /v1/unload_lora_adapter, as vLLM's."""

    lora_name: str | None = None
    lora_int_id: int | None = None
