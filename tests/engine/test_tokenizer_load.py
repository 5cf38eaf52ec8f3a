"""load_tokenizer gives what AutoTokenizer gives, without importing the model's config module,
and once AutoTokenizer's choice of class is recorded, without importing torch."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine import processor
from engine.processor import load_tokenizer
from tests.helpers.encoding import MESSAGES, TEXTS, check_plain_encoder
from tests.helpers.server import ROOT


def _same(ours, theirs) -> None:  # type: ignore[no-untyped-def]
    assert type(ours) is type(theirs)
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text)
        ids = ours.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == theirs.decode(ids)
    assert ours.apply_chat_template(MESSAGES, add_generation_prompt=True) == (
        theirs.apply_chat_template(MESSAGES, add_generation_prompt=True)
    )
    assert ours.all_special_ids == theirs.all_special_ids
    assert (ours.eos_token_id, ours.bos_token_id) == (theirs.eos_token_id, theirs.bos_token_id)


def test_the_same_tokenizer_as_autotokenizer(default_model_path: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    _same(
        load_tokenizer(str(default_model_path)), AutoTokenizer.from_pretrained(default_model_path)
    )
    # A folder whose tokenizer_config.json names no class: AutoTokenizer maps the config's type.
    folder = tmp_path / "unnamed"
    shutil.copytree(default_model_path, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["tokenizer_class"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    _same(load_tokenizer(str(folder)), AutoTokenizer.from_pretrained(folder))


def _imports_after_loading(folder: Path, records: Path) -> tuple[str, list[str]]:
    """In a fresh process: the loaded tokenizer's class, and which of torch,
    torch.distributed.tensor and the Llama model code the load imported."""
    probe = (
        "import sys; from engine.processor import load_tokenizer; "
        f"t = load_tokenizer({str(folder)!r}); print(type(t).__name__); "
        "print(sorted(m for m in sys.modules if m.startswith('transformers.models.llama')"
        " or m in ('torch', 'torch.distributed.tensor')))"
    )
    env = {**os.environ, "LUMEN_TOKENIZER_DIR": str(records)}
    r = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120,
        env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    name, modules = r.stdout.strip().splitlines()
    return name, json.loads(modules.replace("'", '"'))


def test_loading_it_imports_no_model_code_then_no_torch(
    default_model_path: Path, tmp_path: Path
) -> None:
    """AutoConfig would import the architecture's config module, and through it
    torch.distributed.tensor: about a second of every server's start on 2 cores. AutoTokenizer
    itself imports torch (transformers' configuration code): once its class is recorded, the
    next load (the next server's API process) imports neither."""
    records = tmp_path / "records"
    name, modules = _imports_after_loading(default_model_path, records)
    assert modules == ["torch"], modules  # the first load asks AutoTokenizer, recording it
    assert len(list(records.glob("*.json"))) == 1
    assert _imports_after_loading(default_model_path, records) == (name, [])


def test_a_recorded_class_is_used_only_for_the_folder_as_it_was(
    default_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoTokenizer

    records = tmp_path / "records"
    monkeypatch.setenv("LUMEN_TOKENIZER_DIR", str(records))
    folder = tmp_path / "model"
    shutil.copytree(default_model_path, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    first = load_tokenizer(str(folder))
    (record,) = records.glob("*.json")
    assert load_tokenizer(str(folder)) is first  # this process loaded it already
    _same(_fresh_load(folder), AutoTokenizer.from_pretrained(folder))  # from the record

    # An edited folder is another key: AutoTokenizer chooses again, and is recorded again.
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["model_max_length"] = 1234
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    edited = load_tokenizer(str(folder))
    assert edited is not first and edited.model_max_length == 1234
    assert len(list(records.glob("*.json"))) == 2

    # A record that names code outside transformers, or that others may write, is not used:
    # AutoTokenizer chooses, and the record is written again.
    (current,) = set(records.glob("*.json")) - {record}
    entry = json.loads(current.read_text())
    current.write_text(json.dumps({**entry, "module": "os", "class": "PathLike"}))
    _same(_fresh_load(folder), AutoTokenizer.from_pretrained(folder))
    assert json.loads(current.read_text()) == entry
    os.chmod(current, 0o666)
    _same(_fresh_load(folder), AutoTokenizer.from_pretrained(folder))
    assert current.stat().st_mode & 0o777 == 0o644


def _fresh_load(folder: Path):  # type: ignore[no-untyped-def]
    """load_tokenizer as a fresh process runs it: nothing loaded before."""
    processor._load_unchanged.cache_clear()
    return load_tokenizer(str(folder))


def test_the_processor_encodes_as_transformers_does(default_model_path: Path) -> None:
    """The served path encodes with a plain copy of the Rust tokenizer (plain_encoder): the
    same ids as transformers' encode and tokenizing apply_chat_template. Gemma's is held to the
    same in tests/engine/test_real_gemma.py."""
    check_plain_encoder(load_tokenizer(str(default_model_path)))
