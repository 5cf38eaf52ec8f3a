"""LoRA adapters in the worker: each adapter's weights per layer, in the shapes of Lumen's fused
products, and one step's rows grouped by adapter.

A layer's products are qkv_proj (q, k, v side by side), o_proj, gate_up_proj and down_proj
(engine/worker/llama.py). An adapter's modules on one product become one pair ``(A, B)``:
``A`` [in, R] the modules' A^T side by side, ``B`` [R, out] each module's ``s B^T`` in its
rows and its part's columns, zero elsewhere. So a product's delta for a group of rows is two
small products, ``(x[rows] A) B``, whatever modules the adapter has (the punica idea: gather
each adapter's rows, one product per group; the base weights are never merged). Under tensor
parallelism each rank keeps its shard: the column-parallel products' B columns, the
row-parallel products' A rows (their partial deltas are summed by the layer's all-reduce).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import torch

from engine.lora import MODULES, WEIGHTS_FILE, AdapterSpec, LoRARequest
from engine.model_config import ModelConfig
from engine.worker.layers import Shard
from engine.worker.messages import NewRequestData

logger = logging.getLogger(__name__)

Pair = tuple[torch.Tensor, torch.Tensor]  # (A [in, R], B [R, out]) of one product


def _parts(cfg: ModelConfig, site: str) -> list[int]:
    """The full model's output sizes of a product's parts (qkv: q, k, v; gate_up: gate, up)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"qkv": [q, kv, kv], "gate_up": [cfg.intermediate_size] * 2,
            "o": [cfg.hidden_size], "down": [cfg.hidden_size]}[site]  # fmt: skip


def load_adapter(
    spec: AdapterSpec, cfg: ModelConfig, shard: Shard, dtype: torch.dtype, device: torch.device
) -> list[dict[str, Pair]]:
    """An adapter's pairs, one dict (product -> pair) per layer, this rank's shard of each."""
    from safetensors.torch import load_file

    tensors = load_file(str(Path(spec.path) / WEIGHTS_FILE))
    by_module: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        name = key.split(".lora_")[0].rsplit(".", 1)[1]
        layer = int(key.split("layers.")[1].split(".")[0])
        by_module.setdefault((layer, name), {})["A" if ".lora_A" in key else "B"] = t
    layers: list[dict[str, Pair]] = [{} for _ in range(cfg.num_layers)]
    pieces: dict[tuple[int, str], list[tuple[torch.Tensor, torch.Tensor, int | None]]] = {}
    for m in spec.modules:
        pair = by_module[(m.layer, m.name)]
        site, part = MODULES[m.name]
        a = pair["A"].to(torch.float32).t()  # [in, r]
        b = pair["B"].to(torch.float32).t() * m.scale  # [r, out]
        pieces.setdefault((m.layer, site), []).append((a, b, part))
    for (layer, site), found in pieces.items():
        layers[layer][site] = _pair(cfg, shard, site, found, dtype, device)
    return layers


def _pair(
    cfg: ModelConfig, shard: Shard, site: str,
    found: list[tuple[torch.Tensor, torch.Tensor, int | None]],
    dtype: torch.dtype, device: torch.device,
) -> Pair:  # fmt: skip
    sizes = _parts(cfg, site)
    if site in ("o", "down"):  # row-parallel: this rank's input rows of A, the whole B
        ((a, b, _),) = found
        a = a[shard.part(a.shape[0])]
        return a.to(device, dtype).contiguous(), b.to(device, dtype).contiguous()
    # Column-parallel: each part's columns of this rank, the parts side by side.
    local = [n // shard.size for n in sizes]
    offsets = [sum(local[:i]) for i in range(len(local))]
    rank = sum(a.shape[1] for a, _, _ in found)
    a_all = torch.cat([a for a, _, _ in found], dim=1)
    b_all = torch.zeros(rank, sum(local))
    row = 0
    for a, b, part in found:
        r = a.shape[1]
        # A fused module (part None) spans every part, side by side in its B; q/k/v or
        # gate/up one each.
        spans = range(len(sizes)) if part is None else [part]
        col = 0
        for p in spans:
            mine = b[:, col : col + sizes[p]][:, shard.part(sizes[p])]
            b_all[row : row + r, offsets[p] : offsets[p] + local[p]] = mine
            col += sizes[p]
        row += r
    return a_all.to(device, dtype).contiguous(), b_all.to(device, dtype).contiguous()


class LoraBatch:
    """One step's rows grouped by adapter: ``groups`` holds (the adapter's layers, its rows as
    a slice where contiguous, else an index tensor). Empty: the step runs the base model
    alone (and the fused decode layers may run it)."""

    def __init__(self) -> None:
        self.groups: list[tuple[list[dict[str, Pair]], slice | torch.Tensor]] = []

    def add(self, layer: int, site: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the product of ``x``) with each group's delta added, in place."""
        for layers, rows in self.groups:
            pair = layers[layer].get(site)
            if pair is None:
                continue
            a, b = pair
            if isinstance(rows, slice):
                y[rows] += (x[rows] @ a) @ b
            else:
                y.index_add_(0, rows, (x.index_select(0, rows) @ a) @ b)
        return y


class LoraAdapters:
    """The worker's adapters: read when a request first names one, kept up to
    ``max_cpu_loras`` (least recently used out, read again when named again)."""

    def __init__(
        self, cfg: ModelConfig, shard: Shard, dtype: torch.dtype, device: torch.device,
        max_cpu_loras: int, max_rank: int,
    ) -> None:  # fmt: skip
        self.cfg, self.shard, self.dtype, self.device = cfg, shard, dtype, device
        self.max_cpu_loras, self.max_rank = max_cpu_loras, max_rank
        self.loaded: OrderedDict[int, list[dict[str, Pair]]] = OrderedDict()
        self.of: dict[str, LoRARequest] = {}  # request id -> its adapter
        self.batch = LoraBatch()
        self.num_reads = 0

    def add(self, new: Sequence[NewRequestData]) -> None:
        for request in new:
            if request.lora_request is not None:
                self.of[request.request_id] = request.lora_request

    def drop(self, req_ids: Sequence[str]) -> None:
        for r in req_ids:
            self.of.pop(r, None)

    def weights(self, lora: LoRARequest) -> list[dict[str, Pair]]:
        found = self.loaded.get(lora.lora_int_id)
        if found is not None:
            self.loaded.move_to_end(lora.lora_int_id)
            return found
        from engine.lora import read_spec

        spec = read_spec(lora.lora_path, self.cfg, self.max_rank)
        found = load_adapter(spec, self.cfg, self.shard, self.dtype, self.device)
        self.num_reads += 1
        self.loaded[lora.lora_int_id] = found
        while len(self.loaded) > self.max_cpu_loras:
            self.loaded.popitem(last=False)
        logger.info("LoRA adapter %s read (%d modules, rank %d)", lora.lora_name,
                    len(spec.modules), spec.rank)  # fmt: skip
        return found

    def set_batch(self, req_ids: Sequence[str], num_tokens: Sequence[int]) -> None:
        """Group this step's flat rows (``req_ids[i]``'s ``num_tokens[i]`` rows, in order) by
        adapter; a step without adapters leaves no group."""
        groups = self.batch.groups
        groups.clear()
        if not self.of:
            return
        spans: dict[int, list[tuple[int, int]]] = {}
        adapters: dict[int, LoRARequest] = {}
        row = 0
        for rid, n in zip(req_ids, num_tokens):
            lora = self.of.get(rid)
            if lora is not None:
                adapters[lora.lora_int_id] = lora
                runs = spans.setdefault(lora.lora_int_id, [])
                if runs and runs[-1][1] == row:
                    runs[-1] = (runs[-1][0], row + n)
                else:
                    runs.append((row, row + n))
            row += n
        for lora_id, runs in spans.items():
            layers = self.weights(adapters[lora_id])
            if len(runs) == 1:
                rows: slice | torch.Tensor = slice(*runs[0])
            else:
                rows = torch.cat([torch.arange(a, b) for a, b in runs]).to(self.device)
            groups.append((layers, rows))
