"""Session fixtures: the default model (fetched once per machine) and a tiny random Llama."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    from engine.model_files import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory, default_model_path: Path) -> Path:
    from tests.helpers.models import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), default_model_path)


@pytest.fixture(scope="session")
def tiny_llm(tiny_model_path: Path):
    """One engine on the tiny model, shared by tests that only send requests."""
    from engine import LLM

    return LLM(str(tiny_model_path), num_kv_blocks=512)
