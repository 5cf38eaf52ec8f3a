"""LoRA adapters through a real server and the `openai` client: /v1/models with parents, a
batch mixing adapters and the base model, loading and unloading at run time, the routers'
gauge, the trace store's rows, and each bad input with vLLM's status codes."""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import duckdb
import httpx
import openai
import pytest

from tests.helpers.lora import build_adapter
from tests.helpers.models import hf_greedy
from tests.helpers.server import ROOT, LumenServer, free_port, parse_metrics

PROMPTS = [[1, 3681, 338, 263, 4996], [1, 20, 30, 40, 50, 60], [1, 450, 4996, 17354]]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-server")
    return {
        "a1": build_adapter(tiny_model_path, root / "a1", rank=8, seed=11),
        "a2": build_adapter(
            tiny_model_path, root / "a2", rank=4, seed=12, targets=("q_proj", "v_proj", "gate_proj")
        ),
        "big": build_adapter(tiny_model_path, root / "big", rank=32, seed=13),
    }


def _text(client: openai.OpenAI, model: str, prompt: list[int]) -> str:
    done = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                     temperature=0)  # fmt: skip
    assert done.model == model
    return done.choices[0].text


def test_adapters_are_served_loaded_and_unloaded_by_name(
    tiny_model_path: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tiny_model_path / "tokenizer.json"))
    base = tiny_model_path.name  # the name the server serves it by
    want = {}  # model -> PEFT's (or transformers') text of each prompt, alone
    for model in (base, "a1", "a2"):
        adapter = None if model == base else adapters[model]
        ids = hf_greedy(tiny_model_path, PROMPTS, MAX_TOKENS, adapter)
        want[model] = [tokenizer.decode(t) for t in ids]
    db = tmp_path / "trace.db"
    with LumenServer(
        tiny_model_path, "--enable-lora", "--max-loras", "2", "--lora-modules",
        f"a1={adapters['a1']}", "--allow-runtime-lora-updating", "--max-lora-rank", "16",
        log_path=tmp_path / "lora.log", trace_db=db,
    ) as server:  # fmt: skip
        client = server.client()
        cards = {m.id: m for m in client.models.list().data}
        assert set(cards) == {base, "a1"} and cards["a1"].model_extra["parent"] == base
        assert client.models.retrieve("a1").id == "a1"

        tok = server.http.post  # the load and unload routes answer plain text, as vLLM's
        said = tok(server.url("/v1/load_lora_adapter"),
                   json={"lora_name": "a2", "lora_path": str(adapters["a2"])})  # fmt: skip
        assert (
            said.status_code == 200
            and said.text == "Success: LoRA adapter 'a2' added successfully."
        )
        refused = {
            "again": tok(server.url("/v1/load_lora_adapter"),
                         json={"lora_name": "a2", "lora_path": str(adapters["a2"])}),
            "missing": tok(server.url("/v1/load_lora_adapter"),
                           json={"lora_name": "gone", "lora_path": str(tmp_path / "none")}),
            "rank": tok(server.url("/v1/load_lora_adapter"),
                        json={"lora_name": "big", "lora_path": str(adapters["big"])}),
            "no path": tok(server.url("/v1/load_lora_adapter"), json={"lora_name": "x"}),
        }  # fmt: skip
        codes = {k: (r.status_code, r.json()["error"]["message"]) for k, r in refused.items()}
        print(codes)
        assert codes["again"][0] == 400 and "has already been loaded" in codes["again"][1]
        assert codes["missing"][0] == 404 and "No adapter found" in codes["missing"][1]
        assert codes["rank"][0] == 400 and "--max-lora-rank 16" in codes["rank"][1]
        assert codes["no path"][0] == 400

        # One batch: every prompt on the base model and both adapters at once.
        jobs = [(m, i) for m in (base, "a1", "a2") for i in range(len(PROMPTS))]
        with ThreadPoolExecutor(len(jobs)) as pool:
            got = list(pool.map(lambda j: _text(client, j[0], PROMPTS[j[1]]), jobs))
        assert got == [want[m][i] for m, i in jobs]
        assert len({tuple(w) for w in want.values()}) == 3  # each adapter answers its own

        with pytest.raises(openai.NotFoundError, match="The model `zz` does not exist"):
            client.completions.create(model="zz", prompt="hi", max_tokens=2)
        samples = parse_metrics(server.http.get(server.url("/metrics")).text)
        info = {k: v for k, v in samples.items() if k.startswith("vllm:lora_requests_info{")}
        assert len(info) == 1 and 'max_lora="2"' in next(iter(info)), info
        assert next(iter(info.values())) > time.time() - 60  # its value: when it was updated

        # Unloaded while a request on it streams: that request finishes, new ones get a 404.
        stream = client.completions.create(model="a2", prompt=PROMPTS[0], max_tokens=300,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})  # fmt: skip
        chunks = iter(stream)
        next(chunks)
        said = tok(server.url("/v1/unload_lora_adapter"), json={"lora_name": "a2"})
        assert said.status_code == 200 and "removed successfully" in said.text
        rest = list(chunks)
        assert rest[-1].choices[0].finish_reason == "length", rest[-1]
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="a2", prompt="hi", max_tokens=2)
        again = tok(server.url("/v1/unload_lora_adapter"), json={"lora_name": "a2"})
        assert again.status_code == 404 and "cannot be found" in again.json()["error"]["message"]
    with duckdb.connect(str(db), read_only=True) as con:
        rows = con.execute("SELECT model, lora_name, count(*) FROM requests WHERE status = 'ok' "
                           "GROUP BY ALL ORDER BY ALL").fetchall()  # fmt: skip
        loras = con.execute("SELECT DISTINCT unnest(loras) FROM steps ORDER BY 1").fetchall()
    print(rows, loras)
    assert [(m, lora) for m, lora, _ in rows] == [("a1", "a1"), ("a2", "a2"), (base, None)]
    assert loras == [("a1",), ("a2",)]


def test_without_lora_the_routes_and_names_are_not_there(tiny_server: LumenServer) -> None:
    """A server without --enable-lora: no load route (404, as vLLM without its variable),
    and an adapter's name is an unknown model."""
    said = httpx.post(tiny_server.url("/v1/load_lora_adapter"), json={"lora_name": "a"},
                      headers={"Authorization": f"Bearer {tiny_server.api_key}"})  # fmt: skip
    assert said.status_code == 404
    with pytest.raises(openai.NotFoundError):
        tiny_server.client().completions.create(model="a1", prompt="hi", max_tokens=2)


@pytest.mark.parametrize(
    "flags, said",
    [
        (["--lora-modules", "a=/nowhere"], "--lora-modules needs --enable-lora"),
        (["--enable-lora", "--lora-modules", "a=/nowhere"], "--lora-modules a: No adapter found"),
        (["--enable-lora", "--lora-modules", "nameonly"], "is not name=path or JSON"),
        (["--enable-lora", "--max-lora-rank", "1024"], "max_lora_rank from 1 to 512"),
    ],
)
def test_a_bad_lora_option_is_one_line_and_exit_2(
    tiny_model_path: Path, flags: list[str], said: str
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "service.cli", "serve", str(tiny_model_path), "--port",
         str(free_port()), *flags],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert said in last, last


def test_a_restarted_core_reads_the_adapters_again(
    tiny_model_path: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """kill -9 of the core: the new core knows no adapter, and reads each again when a request
    names it (each request carries its adapter's folder); the answer is the same."""
    import os
    import signal

    log = tmp_path / "restart.log"
    with LumenServer(tiny_model_path, "--enable-lora", "--lora-modules", f"a1={adapters['a1']}",
                     log_path=log) as server:  # fmt: skip
        client = server.client(timeout=60)
        before = _text(client, "a1", PROMPTS[1])
        os.kill(server.core_pid(), signal.SIGKILL)
        deadline = time.monotonic() + 60
        while True:  # a request sent during the restart waits for the new core, or gets a 503
            try:
                after = _text(client, "a1", PROMPTS[1])
                break
            except openai.APIStatusError:
                assert time.monotonic() < deadline, "the restarted core never served"
                time.sleep(0.5)
    said = log.read_text()
    assert after == before
    assert said.count("LoRA adapter a1 read in") == 2, said[-2000:]
