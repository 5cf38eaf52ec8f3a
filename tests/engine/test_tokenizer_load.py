"""load_tokenizer gives what AutoTokenizer gives, without importing the model's config module."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from engine.processor import load_tokenizer
from tests.helpers.server import ROOT

TEXTS = ["Hello, world!", "naïve café — “quotes”", "日本語のテキスト", "  two  spaces\n"]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the capital of France?"},
]


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


def test_loading_it_imports_no_model_code(default_model_path: Path) -> None:
    """AutoConfig would import the architecture's config module, and through it
    torch.distributed.tensor: about a second of every server's start on 2 cores."""
    probe = (
        "import sys; from engine.processor import load_tokenizer; "
        f"load_tokenizer({str(default_model_path)!r}); "
        "print(sorted(m for m in sys.modules if m.startswith('transformers.models.llama')"
        " or m == 'torch.distributed.tensor'))"
    )
    r = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout
