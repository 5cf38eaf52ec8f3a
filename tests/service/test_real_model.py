"""End to end on the default model: `lumen serve` with SmolLM2, the openai client, streaming."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.server import LumenServer

pytestmark = [pytest.mark.real_model, pytest.mark.e2e]


def test_smollm2_answers_over_http(tmp_path: Path, default_model_path: Path) -> None:
    with LumenServer(default_model_path, log_path=tmp_path / "serve.log") as server:
        client = server.client()
        [model] = client.models.list().data
        assert model.id == "SmolLM2-135M-Instruct"
        question = [{"role": "user", "content": "What is the capital of France?"}]
        stream = client.chat.completions.create(
            model=model.id,
            messages=question,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        print(f"\n{text!r}")
        assert "Paris" in text
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 20
        whole = client.chat.completions.create(
            model=model.id, messages=question, max_tokens=20, temperature=0
        )
        assert whole.choices[0].message.content == text
