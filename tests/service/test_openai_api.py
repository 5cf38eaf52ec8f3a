"""The OpenAI API of a real `lumen serve` process, through the official openai client."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import openai
import pytest

from engine import LLM, SamplingParams
from tests.conftest import API_KEY
from tests.helpers.server import LumenServer, metric

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three rivers."},
]
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


def _chat(server: LumenServer, **kwargs):
    kwargs.setdefault("model", server_model(server))
    kwargs.setdefault("messages", MESSAGES)
    return server.client().chat.completions.create(**kwargs)


def server_model(server: LumenServer) -> str:
    return server.client().models.list().data[0].id


def _sse_events(server: LumenServer, path: str, body: dict) -> list[str]:
    with httpx.stream(
        "POST", server.url(path), json=body, headers=server.headers(), timeout=60
    ) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]


def test_chat_greedy_matches_the_offline_engine_with_exact_usage(
    tiny_server: LumenServer, tiny_llm: LLM
) -> None:
    r = _chat(tiny_server, max_tokens=12, **GREEDY)
    ref = tiny_llm.chat([MESSAGES], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    ref_out = ref[0].outputs[0]
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref_out.text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(ref[0].prompt_token_ids)
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_chat_stream_is_shaped_as_openai_sends_it(tiny_server: LumenServer) -> None:
    body = {
        "messages": MESSAGES,
        "max_tokens": 10,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = _sse_events(tiny_server, "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    *content, finish, usage = chunks[1:]
    assert all(c["choices"][0]["finish_reason"] is None for c in content)
    assert finish["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 10
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in [*content, finish])
    whole = _chat(tiny_server, max_tokens=10, **GREEDY)
    assert text == whole.choices[0].message.content
    assert usage["usage"]["prompt_tokens"] == whole.usage.prompt_tokens


def test_streaming_through_the_openai_client(tiny_server: LumenServer) -> None:
    stream = _chat(tiny_server, max_tokens=8, stream=True, **GREEDY)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert text == _chat(tiny_server, max_tokens=8, **GREEDY).choices[0].message.content


def test_n_samples_and_seeds(tiny_server: LumenServer) -> None:
    kw = {
        "n": 3,
        "max_tokens": 8,
        "temperature": 1.0,
        "seed": 11,
        "extra_body": {"ignore_eos": True},
    }
    a = _chat(tiny_server, **kw)
    b = _chat(tiny_server, **kw)
    c = _chat(tiny_server, **{**kw, "seed": 12})
    texts = [ch.message.content for ch in a.choices]
    assert [ch.index for ch in a.choices] == [0, 1, 2]
    assert texts == [ch.message.content for ch in b.choices]
    assert len(set(texts)) == 3
    assert texts != [ch.message.content for ch in c.choices]
    assert a.usage.completion_tokens == 3 * 8
    # Streamed n > 1: a role delta per choice, then every choice ends.
    chunks = list(_chat(tiny_server, stream=True, **kw))
    finished = {ch.index for c in chunks for ch in c.choices if ch.finish_reason}
    assert finished == {0, 1, 2}
    streamed = ["", "", ""]
    for c in chunks:
        for ch in c.choices:
            streamed[ch.index] += ch.delta.content or ""
    assert streamed == texts


def test_stop_strings_cut_the_text(tiny_server: LumenServer) -> None:
    full = _chat(tiny_server, max_tokens=24, **GREEDY).choices[0].message.content
    cut = next(
        i
        for i in range(len(full) // 3, len(full) - 3)
        if full[i : i + 3].strip() and full.find(full[i : i + 3]) == i
    )
    stop = full[cut : cut + 3]
    r = _chat(tiny_server, max_tokens=24, stop=[stop], **GREEDY)
    assert r.choices[0].message.content == full[:cut]
    assert r.choices[0].finish_reason == "stop"
    streamed = _chat(tiny_server, max_tokens=24, stop=stop, stream=True, **GREEDY)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == full[:cut]


def test_logprobs_in_both_formats(tiny_server: LumenServer) -> None:
    r = _chat(tiny_server, max_tokens=6, logprobs=True, top_logprobs=3, **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == 6 == r.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.token == entry.top_logprobs[0].token
    c = tiny_server.client().completions.create(
        model=server_model(tiny_server), prompt="Once upon a time", max_tokens=5, logprobs=2,
        temperature=0,
    )  # fmt: skip
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == c.choices[0].text
    assert lp.text_offset[0] == 0 and all(len(t) == 2 for t in lp.top_logprobs)


def test_completions_take_text_lists_and_token_ids(tiny_server: LumenServer) -> None:
    client, model = tiny_server.client(), server_model(tiny_server)
    kw = {"model": model, "max_tokens": 4, "temperature": 0}
    one = client.completions.create(prompt="The sea", **kw)
    assert one.object == "text_completion" and one.id.startswith("cmpl-")
    many = client.completions.create(prompt=["The sea", "A river"], n=2, **kw)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.choices[0].text == many.choices[1].text == one.choices[0].text
    ids = [504, 3165, 314, 260]
    by_ids = client.completions.create(prompt=ids, **kw)
    assert by_ids.usage.prompt_tokens == 4
    batch = client.completions.create(prompt=[ids, ids[:2]], **kw)
    assert batch.usage.prompt_tokens == 6 and len(batch.choices) == 2
    assert batch.choices[0].text == by_ids.choices[0].text
    stream = client.completions.create(prompt="The sea", stream=True, **kw)
    assert "".join(c.choices[0].text for c in stream) == one.choices[0].text


@pytest.mark.parametrize(
    ("change", "status", "words"),
    [
        ({"max_tokens": 100_000}, 400, ["2048", "100000"]),
        ({"messages": [{"role": "user", "content": "x " * 3000}]}, 400, ["2048"]),
        ({"temperature": -1}, 400, ["temperature"]),
        ({"top_logprobs": 50, "logprobs": True}, 400, ["top_logprobs", "--max-logprobs 20"]),
        ({"messages": []}, 400, ["messages"]),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            400,
            ["text only"],
        ),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, ["role"]),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            400,
            ["'g'", "tools"],
        ),
        ({"model": "no-such-model"}, 404, ["no-such-model"]),
    ],
)
def test_bad_requests_get_openai_errors(
    tiny_server: LumenServer, change: dict, status: int, words: list[str]
) -> None:
    body = {"model": server_model(tiny_server), "messages": MESSAGES, "max_tokens": 4, **change}
    r = httpx.post(
        tiny_server.url("/v1/chat/completions"), json=body, headers=tiny_server.headers()
    )
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert all(w in error["message"] for w in words), error["message"]
    assert r.headers["x-request-id"].startswith("chatcmpl-")


def test_the_openai_client_raises_the_matching_errors(tiny_server: LumenServer) -> None:
    with pytest.raises(openai.NotFoundError):
        _chat(tiny_server, model="nope", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        _chat(tiny_server, max_tokens=10**6)
    bad_key = openai.OpenAI(base_url=tiny_server.url("/v1"), api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()


def test_api_key_and_transport_errors(tiny_server: LumenServer) -> None:
    url = tiny_server.url("/v1/chat/completions")
    no_key = httpx.post(url, json={"messages": MESSAGES})
    assert no_key.status_code == 401 and no_key.json()["error"]["type"] == "authentication_error"
    wrong = httpx.post(url, json={"messages": MESSAGES}, headers={"Authorization": "Bearer x"})
    assert wrong.status_code == 401
    # Health and metrics stay open for probes and scrapers.
    assert httpx.get(tiny_server.url("/health")).status_code == 200
    assert httpx.get(tiny_server.url("/metrics")).status_code == 200
    auth = tiny_server.headers()
    broken = httpx.post(
        url, content=b"{not json", headers={**auth, "content-type": "application/json"}
    )
    assert broken.status_code == 400 and "error" in broken.json()
    huge = httpx.post(url, content=b"x" * (9 << 20), headers=auth)
    assert huge.status_code == 413
    missing = httpx.get(tiny_server.url("/v1/nothing-here"), headers=auth)
    assert missing.status_code == 404 and "error" in missing.json()
    wrong_method = httpx.get(url, headers=auth)
    assert wrong_method.status_code == 405
    ids = {r.headers["x-request-id"] for r in (no_key, wrong, broken, huge, missing, wrong_method)}
    assert len(ids) == 6


def test_each_body_is_answered_as_its_route_declares(tiny_server: LumenServer) -> None:
    """The front door serves a valid JSON body of a completion route itself, and hands every
    other body to the route, whose errors it keeps (FastAPI's parsing, then the schema)."""
    auth = tiny_server.headers()
    chat = json.dumps({"messages": MESSAGES, "max_tokens": 3}).encode()
    prompt = json.dumps({"prompt": "Hi", "max_tokens": 3}).encode()

    def post(path: str, body: bytes, content_type: str | None) -> httpx.Response:
        headers = {**auth, **({"content-type": content_type} if content_type else {})}
        return httpx.post(tiny_server.url(path), content=body, headers=headers, timeout=60)

    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", prompt)):
        for content_type in ("application/json", "Application/JSON; charset=utf-8",
                             "application/vnd.example+json"):  # fmt: skip
            r = post(path, body, content_type)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    refused = {
        "not json": post("/v1/chat/completions", b"{not json", "application/json"),
        "a list": post("/v1/chat/completions", b"[1, 2]", "application/json"),
        "bad field": post("/v1/chat/completions", b'{"messages": "hi"}', "application/json"),
        "text/plain": post("/v1/completions", prompt, "text/plain"),
        "text/x+json": post("/v1/completions", prompt, "text/x+json"),
        "empty": post("/v1/completions", b"", "application/json"),
    }
    for name, r in refused.items():
        assert r.status_code == 400, (name, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error", name
    assert "JSON decode error" in refused["not json"].json()["error"]["message"]
    assert "messages" in refused["bad field"].json()["error"]["message"]
    unknown = post("/v1/chat/completions", json.dumps({"messages": MESSAGES, "model": "nope"})
                   .encode(), "application/json")  # fmt: skip
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


def test_models_health_and_metrics(tiny_server: LumenServer, tiny_model_path: Path) -> None:
    models = tiny_server.client().models.list().data
    assert [m.id for m in models] == [tiny_model_path.name]  # the folder name
    assert tiny_server.client().models.retrieve(models[0].id).id == models[0].id
    before = tiny_server.metrics()
    _chat(tiny_server, max_tokens=5, **GREEDY)
    after = tiny_server.metrics()
    for name in (
        "lumen:time_to_first_token_seconds_count",
        "lumen:e2e_request_latency_seconds_count",
        "lumen:request_queue_time_seconds_count",
    ):
        assert metric(after, name) == metric(before, name) + 1, name
    assert (
        metric(after, "lumen:generation_tokens_total")
        - metric(before, "lumen:generation_tokens_total")
        == 5
    )
    assert (
        metric(after, "lumen:inter_token_latency_seconds_count")
        >= metric(before, "lumen:inter_token_latency_seconds_count") + 4
    )
    ok = metric(after, "lumen:request_success_total", finished_reason="length")
    assert ok == metric(before, "lumen:request_success_total", finished_reason="length") + 1
    # Labelled series exist from the first scrape, zero or not.
    for reason in ("stop", "length", "abort", "error"):
        assert any(
            k.startswith("lumen:request_success_total{")
            and f'finished_reason="{reason}"' in k
            and 'engine="0"' in k
            for k in after
        )
    for reason in ("queue_full", "queue_timeout", "engine_dead"):
        assert any(f'reason="{reason}"' in k for k in after)
    for gauge in ("lumen:num_requests_running", "lumen:kv_cache_usage_perc"):
        assert metric(after, gauge) == 0.0, gauge
    # The gauges routers read, under vLLM's names and labels too.
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert metric(after, f"vllm:{name}", engine="0") == metric(after, f"lumen:{name}"), name
    assert any(k.startswith("vllm:cache_config_info{") and 'num_gpu_blocks="256"' in k
               and 'engine="0"' in k for k in after)  # fmt: skip
    assert API_KEY not in httpx.get(tiny_server.url("/metrics")).text
    # The KV cache's size as vLLM describes it (256 blocks of 16 tokens, a 2,048-token context).
    assert metric(after, "lumen:kv_cache_capacity_tokens") == 256 * 16
    assert metric(after, "lumen:kv_cache_max_concurrency") == 2.0
    info = [k for k in after if k.startswith("lumen:cache_config_info{")]
    assert len(info) == 1 and 'num_gpu_blocks="256"' in info[0] and 'block_size="16"' in info[0]
    # Per layer kind: one kind here (no window), every layer's blocks for the whole context.
    assert metric(after, "lumen:kv_cache_blocks_per_request", layer_kind="full") == 2048 / 16
    assert (
        "Maximum concurrency for 2,048 tokens per request: 2.00x"
        in tiny_server.log_path.read_text()
    )


def _server_timing(header: str) -> dict[str, float]:
    parts = (p.strip().split(";")[:2] for p in header.split(","))
    return {name: float(dur.removeprefix("dur=")) for name, dur in parts}


TTFT_PARTS = {"receive", "frontend", "step_in_flight", "queue", "prefill", "delivery"}


def test_server_timing_for_the_caller(tiny_server: LumenServer) -> None:
    """A non-streamed response carries Server-Timing and, asked, vLLM's `metrics` object: TTFT
    and its measured parts, which sum to it, for the prompt whose first token came first (named,
    of several); a stream gets the same object in its last chunk (include_metrics, or
    include_timing, the older name). Both fit inside what the client itself measured."""
    body = {"prompt": ["one", "two"], "max_tokens": 12, "ignore_eos": True, "n": 2}
    started = time.monotonic()
    r = httpx.post(tiny_server.url("/v1/completions"), json={**body, "include_metrics": True},
                   headers=tiny_server.headers())  # fmt: skip
    client_ms = (time.monotonic() - started) * 1000
    timing = _server_timing(r.headers["server-timing"])
    assert set(timing) == {"ttft", *TTFT_PARTS, "decode", "total"}
    assert 0 < timing["decode"] < timing["total"] <= client_ms
    m = r.json()["metrics"]
    print(f"\nclient {client_ms:.1f} ms, server {timing}, metrics {m}")
    assert m["request_id"].startswith(r.json()["id"] + "-") and m["request_id"] in r.headers[
        "server-timing"]  # fmt: skip
    assert m["time_to_first_token_ms"] == timing["ttft"] > 0
    assert abs(sum(m["ttft_parts_ms"].values()) - m["time_to_first_token_ms"]) < 0.01
    assert m["ttft_parts_ms"]["delivery"] == 0  # a whole response: its first token is no write
    assert m["queue_time_ms"] == m["ttft_parts_ms"]["queue"]
    assert m["generation_time_ms"] > 0 and m["mean_itl_ms"] > 0 and m["tokens_per_second"] > 0
    plain = httpx.post(tiny_server.url("/v1/completions"), json=body, headers=tiny_server.headers())
    assert "metrics" not in plain.json()  # only where asked (or --enable-per-request-metrics)

    for options in ({"include_metrics": True}, {"include_timing": True}):
        one = {"prompt": "one", "max_tokens": 12, "ignore_eos": True, "stream": True,
               "stream_options": options}  # fmt: skip
        started = time.monotonic()
        events = _sse_events(tiny_server, "/v1/completions", one)
        chunks = [json.loads(e) for e in events[:-1]]
        last = chunks[-1]
        assert last["choices"] == [] and "usage" not in last
        m = last["metrics"]
        assert set(m["ttft_parts_ms"]) == TTFT_PARTS and "request_id" not in m
        assert abs(sum(m["ttft_parts_ms"].values()) - m["time_to_first_token_ms"]) < 0.01
        assert m["ttft_parts_ms"]["delivery"] > 0  # a stream's first chunk is a write
        assert m["time_to_first_token_ms"] <= (time.monotonic() - started) * 1000
        assert all("metrics" not in c for c in chunks[:-1])


def _raw_stream(server: LumenServer, version: str) -> tuple[bytes, bytes]:
    """A greedy streamed completion over a raw socket: the response's head and its body bytes
    as they came off the wire (read to the chunked terminator, or to the close)."""
    import socket

    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()  # fmt: skip
    request = (f"POST /v1/completions {version}\r\nHost: x\r\n"
               f"Content-Type: application/json\r\nAuthorization: Bearer {API_KEY}\r\n"
               f"Content-Length: {len(body)}\r\n\r\n")  # fmt: skip
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as conn:
        conn.sendall(request.encode() + body)
        data = b""
        while not data.endswith(b"\r\n0\r\n\r\n") and (more := conn.recv(65536)):
            data += more
    head, _, rest = data.partition(b"\r\n\r\n")
    return head, rest


def _dechunk(body: bytes) -> bytes:
    out = b""
    while True:
        size, _, body = body.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            return out
        assert body[n : n + 2] == b"\r\n", "a chunk ends with CRLF"
        out, body = out + body[:n], body[n + 2 :]


def test_a_stream_is_framed_for_each_http_version(tiny_server: LumenServer) -> None:
    """HTTP/1.1 gets its events in chunks (written straight to the connection, framed as h11
    frames them), HTTP/1.0 as a plain body up to the close: the same text either way."""
    head11, body11 = _raw_stream(tiny_server, "HTTP/1.1")
    head10, body10 = _raw_stream(tiny_server, "HTTP/1.0")
    assert b"transfer-encoding: chunked" in head11.lower()
    assert b"transfer-encoding" not in head10.lower()
    events11, events10 = _dechunk(body11).split(b"\n\n"), body10.split(b"\n\n")
    texts = [[json.loads(e[6:])["choices"][0]["text"] for e in events if e.startswith(b"data: {")]
             for events in (events11, events10)]  # fmt: skip
    # Greedy: the same text (a stream may merge tokens that wait into one event).
    assert "".join(texts[0]) == "".join(texts[1]) and texts[0], texts
    assert events11[-2:] == events10[-2:] == [b"data: [DONE]", b""]
