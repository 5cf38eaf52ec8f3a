"""SamplingParams: how one request samples and when it stops, validated like vLLM's."""

from __future__ import annotations

import math
from typing import Any

import msgspec

_GREEDY_EPS = 1e-5
# Counts and token ids must fit the wire format and the tensors they end up in.
MAX_INT32 = (1 << 31) - 1


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What the output must match (vLLM's StructuredOutputsParams): set exactly one of
    ``json`` (a JSON schema, as a dict or its JSON text), ``json_object`` (any JSON object),
    ``regex``, ``choice`` (one of these strings) or ``grammar`` (a Lark grammar, as
    llguidance reads it). ``kind`` and ``spec`` are filled in by the input processor: the
    one grammar the engine compiles (engine/structured_outputs.py)."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    kind: str = ""  # json_schema | json_object | regex | choice | grammar | tool_call
    spec: str = ""  # the llguidance grammar (TopLevelGrammar JSON) the core compiles

    def __post_init__(self) -> None:
        given = [
            name
            for name, value in (
                ("json", self.json),
                ("json_object", self.json_object or None),
                ("regex", self.regex),
                ("choice", self.choice),
                ("grammar", self.grammar),
            )
            if value is not None
        ]
        if len(given) != 1 and not self.spec:
            what = ", ".join(given) if given else "none"
            raise ValueError(
                "structured outputs take exactly one of json, json_object, regex, choice or "
                f"grammar (got {what})"
            )
        if self.choice is not None and (
            not isinstance(self.choice, list)
            or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError("choice must be a non-empty list of non-empty strings")


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Sampling and stopping parameters of one request.

    The field names and defaults follow vLLM. ``temperature=0`` is greedy;
    ``top_k`` of 0 or -1 disables top-k. ``max_tokens=None`` generates up to
    the context length. Invalid values raise ValueError naming the field.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):  # as vLLM accepts it from Python callers
            try:
                self.structured_outputs = msgspec.convert(
                    self.structured_outputs, StructuredOutputsParams
                )
            except msgspec.ValidationError as e:
                raise ValueError(f"structured_outputs: {e}") from None
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        _check_int("n", self.n, low=1, high=MAX_INT32)
        _check_float("temperature", self.temperature, low=0.0)
        _check_float("top_p", self.top_p, low=0.0, high=1.0)
        if self.top_p == 0.0:
            raise ValueError("top_p must be in (0, 1], got 0")
        _check_int("top_k", self.top_k, low=-1, high=MAX_INT32)
        _check_float("min_p", self.min_p, low=0.0, high=1.0)
        if self.seed is not None:
            _check_int("seed", self.seed, low=-(1 << 63), high=(1 << 64) - 1)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, low=1, high=MAX_INT32)
        _check_int("min_tokens", self.min_tokens, low=0, high=MAX_INT32)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError("stop must be a string or a list of strings")
        if any(s == "" for s in self.stop):
            raise ValueError("stop must not contain an empty string")
        if not isinstance(self.stop_token_ids, list):
            raise ValueError("stop_token_ids must be a list of token ids")
        for tid in self.stop_token_ids:
            _check_int("stop_token_ids", tid, low=0, high=MAX_INT32)
        if self.logprobs is not None:
            # The cap is the server's (--max-logprobs, engine.processor checks it).
            _check_int("logprobs", self.logprobs, low=0, high=MAX_INT32)
        _check_float("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _check_float("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        _check_float("repetition_penalty", self.repetition_penalty, low=0.0)
        if self.repetition_penalty == 0.0:
            raise ValueError("repetition_penalty must be positive, got 0")
        if self.temperature < _GREEDY_EPS:
            # Greedy: the truncation knobs are meaningless, drop them.
            self.temperature = 0.0
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def clone(self, **changes: Any) -> SamplingParams:
        return msgspec.structs.replace(self, **changes)


def _check_int(name: str, value: Any, *, low: int | None = None, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    _check_range(name, value, low, high)


def _check_float(
    name: str, value: Any, *, low: float | None = None, high: float | None = None
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    _check_range(name, value, low, high)


def _check_range(name: str, value: float, low: float | None, high: float | None) -> None:
    if low is not None and value < low:
        bound = f"in [{low}, {high}]" if high is not None else f"at least {low}"
        raise ValueError(f"{name} must be {bound}, got {value!r}")
    if high is not None and value > high:
        bound = f"in [{low}, {high}]" if low is not None else f"at most {high}"
        raise ValueError(f"{name} must be {bound}, got {value!r}")
