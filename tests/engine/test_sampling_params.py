"""SamplingParams validation names the field at fault."""

from __future__ import annotations

import pytest

from engine import SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 0}, "n"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 9, "max_tokens": 3}, "min_tokens"),
        ({"stop": [""]}, "stop"),
        ({"stop": [3]}, "stop"),
        ({"stop_token_ids": [-4]}, "stop_token_ids"),
        ({"logprobs": -1}, "logprobs"),  # the upper cap is the server's: --max-logprobs
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"seed": "x"}, "seed"),
        ({"n": True}, "n"),
    ],
)
def test_invalid_values_raise_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        SamplingParams(**kwargs)


def test_greedy_normalises_truncation_and_stop_string() -> None:
    p = SamplingParams(temperature=0, top_k=5, top_p=0.5, min_p=0.2, stop="END")
    assert p.greedy and (p.top_k, p.top_p, p.min_p) == (0, 1.0, 0.0)
    assert p.stop == ["END"]


def test_structured_outputs_take_exactly_one_constraint() -> None:
    from engine.sampling_params import StructuredOutputsParams

    p = SamplingParams(structured_outputs={"regex": "[0-9]+"})
    assert p.structured_outputs == StructuredOutputsParams(regex="[0-9]+")
    for bad in ({}, {"regex": "a", "choice": ["b"]}, {"choice": []}, {"regex": 3}):
        with pytest.raises(ValueError, match=r"structured_outputs|exactly one|choice"):
            SamplingParams(structured_outputs=bad)
