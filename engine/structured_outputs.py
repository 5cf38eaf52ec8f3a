"""Structured outputs, the frontend's half: a request's StructuredOutputsParams become the one
grammar the core compiles (llguidance's TopLevelGrammar JSON), checked here so that a bad schema,
regex or grammar is a clear ValueError (a 400) before anything reaches the engine.

The core compiles the grammar off its busy loop and masks the logits of the rows that have one
(engine/core/grammar.py); this module only builds and validates, without a tokenizer.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from engine.core.grammar import JSON_OPTIONS
from engine.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["JSON_OPTIONS", "build_spec", "lark_literal", "prepare"]


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as e:  # a dependency of the project; only a broken install lacks it
        raise ValueError(f"structured outputs need the llguidance package: {e}") from None
    return llguidance


def lark_literal(text: str) -> str:
    """A Lark string literal matching exactly ``text`` (JSON string escapes)."""
    return json.dumps(text, ensure_ascii=False)


def build_spec(params: StructuredOutputsParams) -> tuple[str, str]:
    """(kind, llguidance grammar) of the request's structured outputs; ValueError if invalid."""
    matcher = _llguidance().LLMatcher
    if params.json is not None:
        schema = params.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ValueError("the JSON schema must be a JSON object")
        kind = params.kind or "json_schema"
        spec = matcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    elif params.json_object:
        kind, spec = (
            "json_object",
            matcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS),
        )
    elif params.regex is not None:
        kind, spec = "regex", matcher.grammar_from_regex(params.regex)
    elif params.choice is not None:
        lark = "start: " + " | ".join(lark_literal(c) for c in params.choice)
        kind, spec = "choice", matcher.grammar_from_lark(lark)
    else:
        assert params.grammar is not None
        kind, spec = params.kind or "grammar", matcher.grammar_from_lark(params.grammar)
    return kind, spec


@functools.lru_cache(maxsize=512)
def _check(spec: str) -> str:
    """llguidance's verdict on a grammar ("" when valid), cached: the same schema is checked
    once per process."""
    return _llguidance().LLMatcher.validate_grammar(spec)


def prepare(params: SamplingParams) -> None:
    """Fill in ``params.structured_outputs``' kind and spec, or raise ValueError saying what is
    wrong with the schema, regex or grammar."""
    so = params.structured_outputs
    if so is None or so.spec:
        return
    try:
        kind, spec = build_spec(so)
    except ValueError as e:
        raise ValueError(f"invalid structured outputs: {e}") from None
    error = _check(spec)
    if error:
        what = {"json_schema": "JSON schema", "tool_call": "tool parameters"}.get(kind, kind)
        raise ValueError(f"invalid {what}: {' '.join(error.split())[:400]}")
    so.kind, so.spec = kind, spec
