"""LoRA adapters in PEFT's folder format: what a request names, and what is checked before any
weight is read.

A folder holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``,
``use_rslora``, ``alpha_pattern``, ...) and ``adapter_model.safetensors``, whose tensors are
named ``base_model.model.model.layers.<i>.<self_attn|mlp>.<module>.lora_<A|B>.weight`` (A is
[r, in], B is [out, r]). A layer's product becomes ``x W + s (x A^T) B^T``, ``s`` being
``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA).

``read_spec`` checks a folder against the model from the safetensors header alone (no torch:
the API process checks an adapter when it is named); the worker reads the tensors
(``engine/worker/lora.py``).
"""

from __future__ import annotations

import io
import json
import math
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import msgspec

from engine.model_config import ModelConfig

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"

# PEFT's module name -> Lumen's product of the layer ("site") and the part of it the module
# is: q, k and v are the three parts of qkv_proj, gate and up the two of gate_up_proj (a fused
# checkpoint's qkv_proj and gate_up_proj are the whole product, part None).
MODULES: dict[str, tuple[str, int | None]] = {
    "q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "qkv_proj": ("qkv", None),
    "o_proj": ("o", None), "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1),
    "gate_up_proj": ("gate_up", None), "down_proj": ("down", None),
}  # fmt: skip
SITES = ("qkv", "o", "gate_up", "down")

_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?(?:language_model\.)?(?:model\.)?layers\.(\d+)\."
    r"(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$"
)
_SAFETENSORS_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}
_NUMPY = {"F32": "<f4", "F16": "<f2", "BF16": "<u2", "F64": "<f8"}


class LoraError(ValueError):
    """An adapter that cannot be served, in one line that says why."""


class LoRARequest(msgspec.Struct, array_like=True, frozen=True):
    """The adapter a request runs with, as vLLM's: its name, an id unique to one load of it
    (a name loaded again gets another, so no KV of the old weights is reused), its folder."""

    lora_name: str
    lora_int_id: int
    lora_path: str


@dataclass(frozen=True)
class Module:
    """One adapted product of one layer: PEFT's module name, its rank and its scale."""

    layer: int
    name: str
    rank: int
    scale: float


@dataclass(frozen=True)
class AdapterSpec:
    """An adapter as checked against the model: every module it adapts, with rank and scale."""

    path: str
    rank: int  # its largest
    modules: tuple[Module, ...]

    @property
    def num_layers(self) -> int:
        return len({m.layer for m in self.modules})


def module_shape(cfg: ModelConfig, name: str) -> tuple[int, int]:
    """(in, out) of a PEFT module of one layer of ``cfg``'s model."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, inter = cfg.hidden_size, cfg.intermediate_size
    return {
        "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "qkv_proj": (h, q + 2 * kv),
        "o_proj": (q, h), "gate_proj": (h, inter), "up_proj": (h, inter),
        "gate_up_proj": (h, 2 * inter), "down_proj": (inter, h),
    }[name]  # fmt: skip


def read_header(file: Path) -> dict[str, dict[str, object]]:
    """A safetensors file's tensor table (name -> dtype, shape, offsets), read without torch."""
    with file.open("rb") as f:
        return _table(f.read, file)


def _table(read: Callable[[int], bytes], file: Path) -> dict[str, dict[str, object]]:
    """The tensor table at the start of a safetensors file, read through ``read``."""
    head = read(8)
    if len(head) < 8:
        raise LoraError(f"{file} is not a safetensors file (it is {len(head)} bytes)")
    (size,) = struct.unpack("<Q", head)
    if size > 100 << 20:
        raise LoraError(f"{file} is not a safetensors file (a header of {size} bytes)")
    try:
        table = json.loads(read(size))
    except ValueError:
        raise LoraError(f"{file} is not a safetensors file (its header is not JSON)") from None
    table.pop("__metadata__", None)
    return table


def read_tensors(file: Path) -> dict[str, Any]:
    """A safetensors file's matrices as fp32 numpy arrays (bf16 and fp16 widened), read with
    numpy alone: the worker reads adapters in a background thread, where torch's ops would
    start a second OpenMP team beside the step's (measured: the steps after such a read ran
    1.4x slower on a 2-core machine)."""
    import numpy as np

    data = file.read_bytes()
    view = io.BytesIO(data)
    table = _table(view.read, file)
    start = view.tell()  # the tensors' bytes follow the table
    out = {}
    for key, entry in table.items():
        kind = str(entry["dtype"])
        lo, hi = cast("list[int]", entry["data_offsets"])
        size = _SAFETENSORS_BYTES[kind]
        raw = np.frombuffer(data, dtype=_NUMPY[kind], count=(hi - lo) // size, offset=start + lo)
        if kind == "BF16":  # the top half of an fp32
            raw = (raw.astype(np.uint32) << 16).view(np.float32)
        out[key] = raw.astype(np.float32).reshape(cast("list[int]", entry["shape"]))
    return out


def read_spec(path: str | Path, cfg: ModelConfig, max_rank: int) -> AdapterSpec:
    """Check a PEFT LoRA folder against the model; raise LoraError saying what does not fit."""
    folder = Path(path)
    if not folder.is_dir():
        raise LoraError(f"No adapter found at {path}: not a folder")
    conf_file, weights = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not conf_file.is_file():
        raise LoraError(f"No adapter found at {path}: it has no {CONFIG_FILE}")
    if not weights.is_file():
        other = " (adapter_model.bin is not read: save it with safetensors)" if (
            folder / "adapter_model.bin").is_file() else ""  # fmt: skip
        raise LoraError(f"No adapter found at {path}: it has no {WEIGHTS_FILE}{other}")
    try:
        conf = json.loads(conf_file.read_text())
    except ValueError as e:
        raise LoraError(f"{conf_file} is not JSON ({e})") from None
    if not isinstance(conf, dict):
        raise LoraError(f"{conf_file} is not a JSON object")
    _check_config(conf, conf_file)
    alpha = float(conf.get("lora_alpha") or conf.get("r") or 8)
    patterns = conf.get("alpha_pattern") or {}
    rslora = bool(conf.get("use_rslora"))
    found: dict[tuple[int, str], dict[str, list[int]]] = {}
    stems: dict[tuple[int, str], str] = {}  # PEFT's module name (model.layers.0.self_attn.q_proj)
    for key, entry in read_header(weights).items():
        m = _KEY.match(key)
        if m is None or m.group(2) not in MODULES:
            raise LoraError(
                f"{weights}: the tensor {key} is not a LoRA weight of a layer's q, k, v, o, "
                "gate, up or down product (LoRA on embeddings, the head or other modules is "
                "not served)"
            )
        layer, name, ab = int(m.group(1)), m.group(2), m.group(3)
        if layer >= cfg.num_layers:
            raise LoraError(f"{weights}: {key} is for layer {layer}; the model has "
                            f"{cfg.num_layers}")  # fmt: skip
        dtype = entry.get("dtype") if isinstance(entry, dict) else None
        if dtype not in _SAFETENSORS_BYTES:
            raise LoraError(f"{weights}: {key} is {dtype}; LoRA weights are read in "
                            f"{', '.join(_SAFETENSORS_BYTES)}")  # fmt: skip
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if not (isinstance(shape, list) and len(shape) == 2):
            raise LoraError(f"{weights}: {key} is not a matrix")
        found.setdefault((layer, name), {})[ab] = shape
        stems[(layer, name)] = key.split(".lora_")[0].removeprefix("base_model.model.")
    if not found:
        raise LoraError(f"{weights} holds no LoRA weights")
    modules = []
    for (layer, name), pair in sorted(found.items()):
        if set(pair) != {"A", "B"}:
            raise LoraError(f"{weights}: layer {layer}'s {name} has lora_{''.join(pair)} alone")
        (r, fan_in), (fan_out, r_b) = pair["A"], pair["B"]
        want_in, want_out = module_shape(cfg, name)
        if (fan_in, fan_out) != (want_in, want_out) or r != r_b:
            raise LoraError(
                f"{path}: layer {layer}'s {name} is [{fan_in} -> {fan_out}] of rank {r} "
                f"(B's {r_b}), the model's {name} is [{want_in} -> {want_out}]: the adapter is "
                "for another base model"
            )
        if r > max_rank:
            raise LoraError(f"{path}: rank {r} (layer {layer}'s {name}) is over --max-lora-rank "
                            f"{max_rank}")  # fmt: skip
        a = _pattern(patterns, stems[(layer, name)], alpha)
        modules.append(Module(layer, name, r, a / (math.sqrt(r) if rslora else r)))
    return AdapterSpec(str(folder), max(m.rank for m in modules), tuple(modules))


def _check_config(conf: dict[str, object], file: Path) -> None:
    peft_type = conf.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoraError(f"{file}: peft_type {peft_type!r}; only LORA adapters are served")
    if conf.get("use_dora"):
        raise LoraError(f"{file}: DoRA (use_dora) is not served")
    if conf.get("bias", "none") not in ("none", None):
        raise LoraError(f"{file}: bias {conf.get('bias')!r}; adapters with biases are not served")
    if conf.get("modules_to_save"):
        raise LoraError(f"{file}: modules_to_save {conf.get('modules_to_save')} (whole modules "
                        "saved beside the LoRA weights) are not served")  # fmt: skip
    if conf.get("fan_in_fan_out"):
        raise LoraError(f"{file}: fan_in_fan_out (Conv1D layouts) is not served")


def _pattern(patterns: object, module: str, default: float) -> float:
    """PEFT's alpha_pattern: a key (a regex) matches a module whose full name ends with it."""
    if isinstance(patterns, dict):
        for key, value in patterns.items():
            if re.fullmatch(rf"(.*\.)?{key}", module):
                return float(value)
    return default


def parse_module(text: str) -> tuple[str, str, str | None]:
    """One --lora-modules entry, as vLLM takes it: ``name=path`` or JSON with name, path and
    base_model_name. Returns (name, path, base_model_name)."""
    text = text.strip()
    if text.startswith("{"):
        try:
            d = json.loads(text)
        except ValueError as e:
            raise LoraError(f"--lora-modules: {text!r} is not JSON ({e})") from None
        if not isinstance(d, dict) or not d.get("name") or not d.get("path"):
            raise LoraError(f"--lora-modules: {text!r} needs name and path")
        unknown = set(d) - {"name", "path", "base_model_name"}
        if unknown:
            raise LoraError(f"--lora-modules: unknown field {sorted(unknown)[0]!r} in {text!r}")
        return str(d["name"]), str(d["path"]), d.get("base_model_name")
    name, eq, path = text.partition("=")
    if not eq or not name or not path:
        raise LoraError(f"--lora-modules: {text!r} is not name=path or JSON")
    return name, path, None


class LoraCheck:
    """The core's check of each adapter a request names, once per load (its id): the worker
    reads it when it is first scheduled, so a folder that does not fit fails its request
    here, not the step."""

    def __init__(self, cfg: ModelConfig, max_rank: int) -> None:
        self.cfg, self.max_rank = cfg, max_rank
        self.checked: dict[int, str] = {}  # id -> its path

    def check(self, lora: LoRARequest) -> None:
        if self.checked.get(lora.lora_int_id) == lora.lora_path:
            return
        read_spec(lora.lora_path, self.cfg, self.max_rank)
        self.checked[lora.lora_int_id] = lora.lora_path


@dataclass(frozen=True)
class LoraSettings:
    """What a worker needs of --enable-lora: adapters it keeps read, and the largest rank."""

    max_cpu_loras: int
    max_rank: int
