"""One provocation per symptom class (DESIGN §7), through a real server: the report and
`lumen trace why` must name the cause, and name none for a healthy run.

Each scenario records a run of `lumen serve` on the tiny model, then reads it back as an
operator would: `replay report` (``diagnose_run``) and `lumen trace why ID`.
"""

from __future__ import annotations

import contextlib
import io
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from service.cli import main as lumen
from tests.helpers.load import SlowReader, server_idle, stream_chat, wait_until
from tests.helpers.server import LumenServer, metric
from tracing.diagnose import RunDiagnosis, diagnose_run, render_run
from tracing.store import open_db

# Each scenario provokes latency and reads what the diagnosis says of it: a busy neighbour
# would add latency of its own.
pytestmark = pytest.mark.serial

FAST_FLUSH = ("--trace-flush-interval", "0.2")


def _record(
    tmp: Path, model: Path, provoke: Callable[[LumenServer], list[str]], *args: str, env=None
) -> tuple[Path, list[str]]:
    """Run ``provoke`` against a fresh server; returns the trace db once every request is in
    it, and the request ids ``provoke`` says to explain."""
    db = tmp / "trace.db"
    with LumenServer(
        model, *FAST_FLUSH, "--num-kv-blocks", "512", *args, log_path=tmp / "serve.log",
        trace_db=db, env=env,
    ) as server:  # fmt: skip
        victims = provoke(server)
        sent = server.metrics()
        total = sum(v for k, v in sent.items() if k.startswith("lumen:request_success_total"))
        wait_until(lambda: _num_requests(db) >= total, 30)
    return db, victims


def _num_requests(db: Path) -> int:
    if not db.exists():
        return 0
    with open_db(db, timeout=10) as con:
        return con.execute("SELECT count(*) FROM requests").fetchone()[0]


def _num_idle_records(db: Path) -> int:
    """Idle records after the last busy step: an earlier one (every request then running was
    cancelled before a late one arrived) does not hold the state after the last abort."""
    if not db.exists():
        return 0
    with open_db(db, timeout=10) as con:
        return con.execute(
            "SELECT count(*) FROM steps WHERE idle AND step_id > "
            "(SELECT coalesce(max(step_id), -1) FROM steps WHERE NOT idle)"
        ).fetchone()[0]


def _why(db: Path, request_id: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert lumen(["trace", "why", request_id, "--db", str(db)]) == 0
    return out.getvalue()


def _causes(diag: RunDiagnosis) -> list[str]:
    """What the verdict names: causes of the tail, costs every request paid, and steps."""
    return [f.part or f.text for f in diag.findings if f.kind in ("cause", "paid", "step")]


def _report(db: Path) -> tuple[RunDiagnosis, str]:
    diag = diagnose_run(db)
    text = render_run(diag)
    print(text)
    return diag, text


def _post(server: LumenServer, body: dict, path: str = "/v1/completions") -> httpx.Response:
    r = httpx.post(server.url(path), json=body, headers=server.headers(), timeout=120)
    assert r.status_code == 200, r.text
    return r


def _wait_running(server: LumenServer, num_requests: int) -> None:
    """Until the engine runs ``num_requests`` (a poll, not a fixed sleep that a slow start
    could outlast)."""
    wait_until(lambda: metric(server.metrics(), "lumen:num_requests_running") >= num_requests, 30)


def _concurrently(n: int, fn: Callable[[int], str]) -> list[str]:
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(fn, range(n)))


def test_healthy_run_names_no_cause(tmp_path: Path, tiny_model_path: Path) -> None:
    def provoke(server: LumenServer) -> list[str]:
        ids = []
        for i in range(24):
            r = _post(server, {"prompt": f"Question {i}", "max_tokens": 12, "ignore_eos": True})
            ids.append(r.headers["x-request-id"])
            time.sleep(0.05)
        return ids

    db, ids = _record(tmp_path, tiny_model_path, provoke)
    diag, text = _report(db)
    assert _causes(diag) == [], text
    assert "nothing stands out" in text.lower()
    assert "nothing stands out" in _why(db, ids[-1]).lower()


def test_http_parse_is_named_while_the_model_idles(tmp_path: Path, tiny_model_path: Path) -> None:
    """Bodies that are costly to parse (an unknown field holding 300,000 numbers, which the
    server must still read and decode) keep the API process busy; the model has almost
    nothing to do."""
    padding = list(range(300_000))

    def provoke(server: LumenServer) -> list[str]:
        def one(i: int) -> str:
            body = {"prompt": f"Hi {i}", "max_tokens": 4, "padding": padding}
            return _post(server, body).headers["x-request-id"]

        return _concurrently(12, one)

    db, ids = _record(tmp_path, tiny_model_path, provoke)
    diag, text = _report(db)
    causes = _causes(diag)
    assert causes and set(causes) & {"parse", "loop_lag"}, text
    assert not set(causes) & {"queue", "neighbour_prefill", "schedule"}, text
    # The work is named, with the bodies' size: the lag is the decoding, not "a tokenization".
    assert "decod" in text and "KB" in text, text
    with open_db(db, timeout=10) as con:
        sizes = [n for (n,) in con.execute("SELECT body_bytes FROM requests").fetchall()]
    assert min(sizes) > 1_000_000, sizes  # 300,000 numbers: about 2 MB each
    why = _why(db, ids[0])
    assert "JSON" in why or "event-loop" in why, why


def test_queue_names_the_limit_that_held_it(tmp_path: Path, tiny_model_path: Path) -> None:
    def provoke(server: LumenServer) -> list[str]:
        def one(i: int) -> str:
            body = {"prompt": f"Tell me {i}", "max_tokens": 40, "ignore_eos": True}
            return _post(server, body).headers["x-request-id"]

        return _concurrently(10, one)

    db, _ = _record(tmp_path, tiny_model_path, provoke, "--max-num-seqs", "2")
    diag, text = _report(db)
    assert "queue" in _causes(diag), text
    assert "max_num_seqs" in text or "--max-num-seqs" in text
    slowest = max(diag.requests, key=lambda r: r.ttft_ns or 0).request_id
    assert "max_num_seqs" in _why(db, slowest) or "--max-num-seqs" in _why(db, slowest)


def test_slow_scheduler_is_named(tmp_path: Path, tiny_model_path: Path) -> None:

    def provoke(server: LumenServer) -> list[str]:
        def one(i: int) -> str:
            body = {"prompt": f"Step {i}", "max_tokens": 16, "ignore_eos": True}
            return _post(server, body).headers["x-request-id"]

        return _concurrently(4, one)

    env = {"LUMEN_DEBUG_DELAY": "schedule=0.03"}
    db, ids = _record(tmp_path, tiny_model_path, provoke, env=env)
    diag, text = _report(db)
    assert "schedule" in _causes(diag) or "scheduler" in text.lower(), text
    assert not set(_causes(diag)) & {"queue", "http", "frontend"}, text
    assert "scheduler" in _why(db, ids[0]).lower()


def test_long_prefill_names_the_noisy_neighbour(tmp_path: Path, tiny_model_path: Path) -> None:
    """Decoding streams share steps with two long prompts' prefill: their token gaps grow,
    and the verdict names the long requests, not queueing."""

    def provoke(server: LumenServer) -> list[str]:
        victims: list[str] = []

        def decoder(i: int) -> None:
            r = _post(server, {"prompt": f"Go {i}", "max_tokens": 200, "ignore_eos": True})
            victims.append(r.headers["x-request-id"])

        threads = [threading.Thread(target=decoder, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        _wait_running(server, 4)  # the neighbours arrive while all four decode
        neighbours = _concurrently(
            4, lambda i: _post(server, {"prompt": [100 + i] * 1900, "max_tokens": 2}).headers[
                "x-request-id"]
        )  # fmt: skip
        for t in threads:
            t.join()
        return victims + neighbours

    # Four long prompts in one step: on a fast CPU two of them cost the tiny model only ~20 ms,
    # too close to the verdict's bar to name them every time. KV room for all, no preemption.
    db, ids = _record(tmp_path, tiny_model_path, provoke, "--max-num-batched-tokens", "8192",
                      "--num-kv-blocks", "1024")  # fmt: skip
    diag, text = _report(db)
    neighbours = ids[-4:]
    assert "neighbour_prefill" in _causes(diag) or "prefill chunk" in text, text
    assert "queue" not in _causes(diag), text
    assert any(n in text for n in neighbours), text
    why = _why(db, ids[0])
    assert any(n in why for n in neighbours), why


def test_slow_reader_is_named_as_delivery(tmp_path: Path, tiny_model_path: Path) -> None:
    """Two clients stop reading until every request has finished generating, and a second
    more; two read normally. The slow ones' last bytes are accepted long after their last
    token, however fast the machine generates."""
    body = {"prompt": ["a", "b", "c", "d", "e", "f", "g", "h"], "max_tokens": 150,
            "temperature": 0, "ignore_eos": True}  # fmt: skip

    total = 2 * len(body["prompt"]) * body["max_tokens"] + 2 * 150

    def provoke(server: LumenServer) -> list[str]:
        def generated() -> bool:
            # Every token generated, counted as the API process takes them from the core (the
            # running gauge reads 0 too before the requests are scheduled: a stall that ends
            # early lets the slow readers catch up before the end).
            return metric(server.metrics(), "lumen:generation_tokens_total") >= total

        slow = [SlowReader(server, body, stall_s=1.0, until=generated) for _ in range(2)]
        threads = [threading.Thread(target=s.run) for s in slow]
        for t in threads:
            t.start()
        for _ in range(2):
            stream_chat(server, {"messages": [{"role": "user", "content": "hi"}],
                                 "max_tokens": 150, "ignore_eos": True})  # fmt: skip
        for t in threads:
            t.join()
        return [s.request_id for s in slow]

    db, slow_ids = _record(tmp_path, tiny_model_path, provoke)
    diag, text = _report(db)
    assert "delivery" in _causes(diag), text
    why = _why(db, slow_ids[0] + "-0")
    assert "read" in why.lower() and "deliver" in why.lower(), why


def test_cancelled_run_reports_kv_freed(tmp_path: Path, tiny_model_path: Path) -> None:
    def provoke(server: LumenServer) -> list[str]:
        body = {"messages": [{"role": "user", "content": "Talk"}], "max_tokens": 500,
                "ignore_eos": True}  # fmt: skip
        _concurrently(12, lambda i: str(stream_chat(server, body, stop_after=5).num_chunks))
        wait_until(lambda: server_idle(server), 20)
        # No step follows the aborts, yet the KV state after them is recorded (an idle row).
        wait_until(lambda: _num_idle_records(server.trace_db) > 0, 20)
        return []

    db, _ = _record(tmp_path, tiny_model_path, provoke)
    diag, text = _report(db)
    assert diag.num_aborted == 12 and diag.num_ok == 0
    assert "cancel" in text.lower()
    # Every block back once the aborts were processed (recorded though no step followed).
    assert "0 of 512" in " ".join(text.split()), text


def _schema(i: int) -> dict:
    """A bounded JSON schema of its own per i (each one compiles: the cache has none)."""
    return {
        "type": "object",
        "properties": {f"field{i}": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": [f"field{i}"],
        "additionalProperties": False,
    }


def test_slow_grammar_compile_is_named(tmp_path: Path, tiny_model_path: Path) -> None:
    """Four requests with schemas of their own queue on the one grammar thread (slowed to 0.25 s
    a compile): their TTFT is the grammar's, and the verdict and `trace why` say so."""

    def provoke(server: LumenServer) -> list[str]:
        def one(i: int) -> str:
            rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": _schema(i)}}
            body = {"messages": [{"role": "user", "content": f"Item {i}"}], "max_tokens": 20,
                    "response_format": rf}  # fmt: skip
            return _post(server, body, "/v1/chat/completions").headers["x-request-id"]

        return _concurrently(4, one)

    env = {"LUMEN_DEBUG_DELAY": "grammar_compile=0.25"}
    db, _ = _record(tmp_path, tiny_model_path, provoke, env=env)
    diag, text = _report(db)
    assert "grammar_compile" in _causes(diag), text
    assert not set(_causes(diag)) & {"queue", "schedule", "http", "frontend"}, text
    slowest = max(diag.requests, key=lambda r: r.ttft_ns or 0).request_id
    assert "grammar to compile" in _why(db, slowest)


def test_slow_grammar_masks_are_named_for_the_plain_requests_beside_them(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    """Two grammar streams (their masks slowed to 30 ms a step) beside four plain ones: every
    row waits for the masks, and the plain requests' `trace why` names them."""

    def provoke(server: LumenServer) -> list[str]:
        plain: list[str] = []

        def grammar(i: int) -> None:
            so = {"regex": "[a-z]{40}"}
            body = {"prompt": f"Word {i}", "max_tokens": 40, "structured_outputs": so}
            _post(server, body)

        threads = [threading.Thread(target=grammar, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        _wait_running(server, 2)  # the plain requests arrive while both grammar streams run
        plain = _concurrently(
            4, lambda i: _post(server, {"prompt": f"Plain {i}", "max_tokens": 24,
                                        "ignore_eos": True}).headers["x-request-id"]
        )  # fmt: skip
        for t in threads:
            t.join()
        return plain

    env = {"LUMEN_DEBUG_DELAY": "grammar_mask=0.03"}
    db, ids = _record(tmp_path, tiny_model_path, provoke, env=env)
    diag, text = _report(db)
    assert "grammar_mask" in _causes(diag), text
    assert "schedule" not in _causes(diag), text
    assert "token masks" in _why(db, ids[0])


def test_logprobs_are_named_apart_from_the_model(tmp_path: Path, tiny_model_path: Path) -> None:
    """48 streams asking for 25 top logprobs a token (allowed by --max-logprobs 25): the
    sampler's log-softmax and top-k over the vocabulary for every row, every step. The step's
    record splits it from the forward; the verdict names logprobs with the knob, and expected
    compute is the forward's alone."""
    body = {"prompt": "Tell me", "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "logprobs": 25}  # fmt: skip

    def provoke(server: LumenServer) -> list[str]:
        refused = httpx.post(server.url("/v1/completions"), headers=server.headers(),
                             json={**body, "logprobs": 26})  # fmt: skip
        assert refused.status_code == 400 and "--max-logprobs 25" in refused.text, refused.text
        return _concurrently(48, lambda i: _post(server, body).headers["x-request-id"])

    db, ids = _record(tmp_path, tiny_model_path, provoke, "--max-logprobs", "25")
    diag, text = _report(db)
    assert "logprobs" in _causes(diag), text
    assert "top-25 logprobs for" in text and "--max-logprobs" in text, text
    why = _why(db, ids[0])
    assert "logprobs" in why, why


def test_a_step_of_prefills_alone_is_prefill_in_every_part(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    """Eight prompts of one completion reach the core together and prefill in steps with no
    decode row: each request's share of such a step is its own prefill and its neighbours',
    never "the batch's other rows (decode)"."""
    prompts = [" ".join(f"w{i}{j}" for j in range(60)) for i in range(8)]

    def provoke(server: LumenServer) -> list[str]:
        body = {"prompt": prompts, "max_tokens": 1, "temperature": 0}  # no decode rows at all
        return [_post(server, body).headers["x-request-id"]]

    db, _ = _record(tmp_path, tiny_model_path, provoke)
    diag, _ = _report(db)
    with open_db(db, timeout=10) as con:
        steps = con.execute(
            "SELECT request_ids FROM steps WHERE num_prefill_tokens > 0 "
            "AND num_decode_tokens = 0 AND len(request_ids) > 1"
        ).fetchall()
    alone = {rid for (ids,) in steps for rid in ids}
    assert len(alone) >= 4, steps  # the shape under test: prefills with no decode row
    for r in diag.requests:
        if r.request_id in alone:
            assert r.ttft.get("decode", 0) < 0.5e6, (r.request_id, r.ttft)
            assert r.ttft["neighbour_prefill"] > r.ttft.get("decode", 0), r.ttft
    why = _why(db, sorted(alone)[-1])
    assert "Other requests' prefill shared its steps" in why, why
