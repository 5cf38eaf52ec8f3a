"""GGUF files read by Lumen's own reader and converted without transformers' model round trip:
what the gguf package reads, and exactly the folder transformers would save from the file."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from engine import gguf_files, gguf_read
from tests.helpers.gguf_files import write_tiny_llama_gguf


def test_the_reader_reads_what_the_gguf_package_reads(
    tmp_path: Path, default_model_path: Path
) -> None:
    from gguf import GGUFReader

    path = write_tiny_llama_gguf(tmp_path / "tiny.gguf", default_model_path, layers="Q4_1")
    ours, theirs = gguf_read.read(path), GGUFReader(path)
    # The gguf package adds its own entries (GGUF.version and the counts).
    assert set(ours.fields) == {k for k in theirs.fields if not k.startswith("GGUF.")}
    for key, field in theirs.fields.items():
        if key.startswith("GGUF."):
            continue
        assert ours.fields[key].contents() == field.contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.tensor_type == b.tensor_type and a.data.shape == b.data.shape, a.name
        assert np.asarray(a.data).tobytes() == np.asarray(b.data).tobytes(), a.name


def _transformers_folder(gguf: Path, out: Path) -> None:
    """The folder transformers saves from the file (the conversion before this reader)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32)  # fmt: skip
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)


def assert_same_folder(ours: Path, theirs: Path) -> None:
    from safetensors.numpy import load_file

    assert json.loads((ours / "config.json").read_text()) == json.loads(
        (theirs / "config.json").read_text()
    )
    a, b = load_file(ours / "model.safetensors"), load_file(theirs / "model.safetensors")
    assert set(a) == set(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert a[name].tobytes() == b[name].tobytes(), name


@pytest.mark.parametrize("layers", ["Q8_0", "Q4_1"])
def test_a_conversion_is_the_folder_transformers_saves(
    layers: str, tmp_path: Path, default_model_path: Path
) -> None:
    """Config and every weight bit for bit (llama's q and k rows un-permuted as transformers
    does), without building the model from the file."""
    path = write_tiny_llama_gguf(tmp_path / "tiny.gguf", default_model_path, layers=layers)
    gguf_files.convert(path, tmp_path / "ours")
    _transformers_folder(path, tmp_path / "theirs")
    assert_same_folder(tmp_path / "ours", tmp_path / "theirs")


@pytest.mark.e2e
@pytest.mark.real_model
def test_the_gemma_file_converts_as_transformers_reads_it_and_faster(tmp_path: Path) -> None:
    """The packaged Gemma 3 270M (Q4_K_M, a 262,144-token vocabulary): the same folder, and the
    time without the tokenizer's conversion, printed beside transformers' (no assertion on
    speed: the figures are in docs/benchmarks.md)."""
    from transformers import AutoTokenizer

    from engine.model_files import packaged_gguf

    path = packaged_gguf("gemma-3-270m")
    t0 = time.perf_counter()
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    t1 = time.perf_counter()
    gguf_files.convert(path, tmp_path / "ours")
    t2 = time.perf_counter()
    _transformers_folder(path, tmp_path / "theirs")
    t3 = time.perf_counter()
    print(f"tokenizer {t1 - t0:.1f} s; Lumen's conversion {t2 - t1:.1f} s (with the tokenizer); "
          f"transformers' weights and config {t3 - t2:.1f} s")  # fmt: skip
    assert_same_folder(tmp_path / "ours", tmp_path / "theirs")
