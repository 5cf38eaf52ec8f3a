"""schemathesis against the server's own OpenAPI schema: no input gives a 5xx, and the
server stays healthy. A bounded number of examples keeps CI time fixed."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.helpers.server import LumenServer

# Most of the test's time is drawing the cases (schemathesis, in the test's own process), and
# it grows several-fold beside another worker: 200 took 6 s alone and 11-51 s in full runs on a
# 2-core AMD EPYC. Each run draws new cases (no example database), so runs add up.
MAX_EXAMPLES = 100


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path):
    # A short context bounds how long any generated request can run.
    log = tmp_path_factory.mktemp("fuzz") / "serve.log"
    args = ["--max-model-len", "128", "--num-kv-blocks", "512"]
    with LumenServer(tiny_model_path, *args, log_path=log, api_key="fuzz-key") as s:
        yield s


def test_no_generated_request_gets_a_server_error(fuzz_server: LumenServer) -> None:
    schema = schemathesis.openapi.from_url(fuzz_server.url("/openapi.json"))
    seen: Counter[int] = Counter()
    failures: list[str] = []
    slowest: list[tuple[float, str]] = []

    # Valid bodies (which must generate or be refused with a 4xx) and invalid ones.
    modes = schemathesis.GenerationMode
    strategy = schema.as_strategy(modes.POSITIVE) | schema.as_strategy(modes.NEGATIVE)

    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy)
    def check(case: schemathesis.Case) -> None:
        start = time.monotonic()
        response = case.call(
            base_url=fuzz_server.base_url, headers=fuzz_server.headers(), timeout=120
        )
        took = time.monotonic() - start
        slowest.append((took, f"{case.path} {str(case.body)[:200]}"))
        seen[response.status_code] += 1
        if response.status_code >= 500:
            failures.append(f"{case.method} {case.path} {case.body!r} -> {response.text[:300]}")
        assert "x-request-id" in response.headers

    check()
    slowest.sort(reverse=True)
    print("\nslowest: " + "\n".join(f"{t:.1f} s {what}" for t, what in slowest[:3]))
    print(f"\nstatus codes over {sum(seen.values())} generated requests: {dict(seen)}")
    assert failures == [], "\n".join(failures[:5]) + "\n" + fuzz_server.log()
    assert httpx.get(fuzz_server.url("/health")).status_code == 200
    assert fuzz_server.proc.poll() is None
