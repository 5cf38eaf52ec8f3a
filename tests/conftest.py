"""Session fixtures: the default model (fetched once per machine) and a tiny random Llama."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session", autouse=True)
def autotune_cache(tmp_path_factory: pytest.TempPathFactory):
    """The CPU kernel choices cached in this session's own folder, not the user's."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LUMEN_AUTOTUNE_DIR", str(tmp_path_factory.mktemp("autotune")))
        yield


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


API_KEY = "test-key-3f9c"


@pytest.fixture(scope="session")
def tiny_server(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path):
    """One `lumen serve` process on the tiny model (API key required), for the API tests."""
    from tests.helpers.server import LumenServer

    log = tmp_path_factory.mktemp("server") / "serve.log"
    with LumenServer(tiny_model_path, "--num-kv-blocks", "256", log_path=log, api_key=API_KEY) as s:
        yield s
