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
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.lora import MODULES, SITES, WEIGHTS_FILE, AdapterSpec, LoRARequest, read_tensors
from engine.model_config import ModelConfig
from engine.worker.layers import Shard
from engine.worker.messages import NewRequestData, SchedulerOutput

logger = logging.getLogger(__name__)

Pair = tuple[torch.Tensor, torch.Tensor]  # (A [in, R], B [R, out]) of one product
# Runs of up to this many rows take lora.c's kernel (one call a product for all of them);
# longer runs torch's products. Measured (SmolLM2, rank 16, AMD EPYC, 2 threads): 32 decode
# rows over 8 adapters, 70 -> 15 ms of LoRA a step; a 480-row prefill, 250 ms in lora.c.
NATIVE_ROWS = 8


def _parts(cfg: ModelConfig, site: str) -> list[int]:
    """The full model's output sizes of a product's parts (qkv: q, k, v; gate_up: gate, up)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"qkv": [q, kv, kv], "gate_up": [cfg.intermediate_size] * 2,
            "o": [cfg.hidden_size], "down": [cfg.hidden_size]}[site]  # fmt: skip


def load_adapter(
    spec: AdapterSpec, cfg: ModelConfig, shard: Shard, dtype: torch.dtype, device: torch.device
) -> list[dict[str, Pair]]:
    """An adapter's pairs, one dict (product -> pair) per layer, this rank's shard of each.
    Built in numpy (engine.lora.read_tensors says why); fp32 on CPU shares numpy's memory."""
    tensors = read_tensors(Path(spec.path) / WEIGHTS_FILE)
    by_module: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, t in tensors.items():
        name = key.split(".lora_")[0].rsplit(".", 1)[1]
        layer = int(key.split("layers.")[1].split(".")[0])
        by_module.setdefault((layer, name), {})["A" if ".lora_A" in key else "B"] = t
    layers: list[dict[str, Pair]] = [{} for _ in range(cfg.num_layers)]
    pieces: dict[tuple[int, str], list[tuple[np.ndarray, np.ndarray, int | None]]] = {}
    for m in spec.modules:
        pair = by_module[(m.layer, m.name)]
        site, part = MODULES[m.name]
        a = pair["A"].T  # [in, r]
        b = pair["B"].T * np.float32(m.scale)  # [r, out]
        pieces.setdefault((m.layer, site), []).append((a, b, part))
    for (layer, site), found in pieces.items():
        a, b = _pair(cfg, shard, site, found)
        layers[layer][site] = (_tensor(a, dtype, device), _tensor(b, dtype, device))
    return layers


def _tensor(x: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    return t if (dtype, device.type) == (torch.float32, "cpu") else t.to(device, dtype)


def _pair(
    cfg: ModelConfig, shard: Shard, site: str,
    found: list[tuple[np.ndarray, np.ndarray, int | None]],
) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    sizes = _parts(cfg, site)
    if site in ("o", "down"):  # row-parallel: this rank's input rows of A, the whole B
        ((a, b, _),) = found
        return a[shard.part(a.shape[0])], b
    # Column-parallel: each part's columns of this rank, the parts side by side.
    local = [n // shard.size for n in sizes]
    offsets = [sum(local[:i]) for i in range(len(local))]
    rank = sum(a.shape[1] for a, _, _ in found)
    a_all = np.concatenate([a for a, _, _ in found], axis=1)
    b_all = np.zeros((rank, sum(local)), dtype=np.float32)
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
    return a_all, b_all


class Adapter:
    """One adapter's pairs (``layers``: product -> pair, per layer) and, for the native kernel,
    ``table`` [layers, 4, 3]: each product's A and B addresses and rank (0: not adapted)."""

    __slots__ = ("layers", "table")

    def __init__(self, layers: list[dict[str, Pair]]) -> None:
        self.layers = layers
        self.table = np.zeros((len(layers), len(SITES), 3), dtype=np.int64)
        for i, pairs in enumerate(layers):
            for j, site in enumerate(SITES):
                if (pair := pairs.get(site)) is not None:
                    a, b = pair
                    self.table[i, j] = (a.data_ptr(), b.data_ptr(), a.shape[1])


class LoraBatch:
    """One step's rows by adapter: ``runs`` holds (adapter, first row, end) for each run of
    consecutive rows of one adapter (the runner orders rows by adapter). Empty: the step runs
    the base model alone (and the fused decode layers may run it whole).

    Runs of at most ``NATIVE_ROWS`` rows (decode rows) go to lora.c in one call a product;
    longer ones (prefill chunks) to torch's products, which block their rows."""

    def __init__(self) -> None:
        self.runs: list[tuple[Adapter, int, int]] = []
        self._native: Any = None  # lora.c's lora_add, where it built (CPU)
        self._segs = np.zeros((0, len(SITES), 0, 5), dtype=np.int64)
        self._long: list[tuple[Adapter, int, int]] = []  # the runs torch's products take
        self._threads = 1

    def use_native(self, function: Any) -> None:
        self._native = function

    def plan(self, runs: list[tuple[Adapter, int, int]]) -> None:
        """This step's runs, and the native kernel's segments of each (layer, product)."""
        self.runs = self._long = runs
        if self._native is None or not runs:
            return
        short = [run for run in runs if run[2] - run[1] <= NATIVE_ROWS]
        self._long = [run for run in runs if run[2] - run[1] > NATIVE_ROWS]
        segs = np.empty((len(runs[0][0].layers), len(SITES), len(short), 5), dtype=np.int64)
        for g, (adapter, first, end) in enumerate(short):
            segs[:, :, g, :3] = adapter.table
            segs[:, :, g, 3], segs[:, :, g, 4] = first, end
        self._segs = segs
        self._threads = torch.get_num_threads()

    def add(self, layer: int, site: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the product of ``x``) with each run's delta added, in place."""
        runs = self.runs
        if self._native is not None:
            segs = self._segs[layer, _SITE[site]]
            if len(segs) and x.is_contiguous() and y.is_contiguous():
                self._native(segs.ctypes.data, len(segs), x.data_ptr(), y.data_ptr(),
                             x.shape[1], y.shape[1], self._threads)  # fmt: skip
                runs = self._long
        for adapter, first, end in runs:
            pair = adapter.layers[layer].get(site)
            if pair is not None:
                a, b = pair
                y[first:end] += (x[first:end] @ a) @ b
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
        self.loaded: OrderedDict[int, Adapter] = OrderedDict()
        self.of: dict[str, LoRARequest] = {}  # request id -> its adapter
        self.batch = LoraBatch()
        self.num_reads = 0
        # Adapters being read in the background since their request arrived (prefetch).
        self.pending: dict[int, Future[Adapter]] = {}
        self._reader: ThreadPoolExecutor | None = None
        if device.type == "cpu" and dtype == torch.float32:
            self.batch.use_native(_native_kernel())

    def add(self, new: Sequence[NewRequestData]) -> None:
        for request in new:
            if request.lora_request is not None:
                self.of[request.request_id] = request.lora_request

    def key(self, req_id: str) -> int:
        """The id of the request's adapter (0: the base model), to order rows by."""
        lora = self.of.get(req_id)
        return 0 if lora is None else lora.lora_int_id

    def drop(self, req_ids: Sequence[str]) -> None:
        for r in req_ids:
            self.of.pop(r, None)

    def prefetch(self, lora: LoRARequest) -> None:
        """Start reading ``lora`` in a background thread, unless it is read or being read: a
        read is tens of milliseconds (SmolLM2, rank 16: 40 ms) that the step which first
        schedules its request would otherwise stall every stream for."""
        if lora.lora_int_id in self.loaded or lora.lora_int_id in self.pending:
            return
        if self._reader is None:
            self._reader = ThreadPoolExecutor(1, thread_name_prefix="lumen-lora-read")
        self.pending[lora.lora_int_id] = self._reader.submit(self._read, lora)

    def weights(self, lora: LoRARequest) -> Adapter:
        found = self.loaded.get(lora.lora_int_id)
        if found is not None:
            self.loaded.move_to_end(lora.lora_int_id)
            return found
        reading = self.pending.pop(lora.lora_int_id, None)
        found = reading.result() if reading is not None else self._read(lora)
        self.num_reads += 1
        self.loaded[lora.lora_int_id] = found
        while len(self.loaded) > self.max_cpu_loras:
            self.loaded.popitem(last=False)
        return found

    def _read(self, lora: LoRARequest) -> Adapter:
        from engine.lora import read_spec

        started = time.perf_counter()
        spec = read_spec(lora.lora_path, self.cfg, self.max_rank)
        found = Adapter(load_adapter(spec, self.cfg, self.shard, self.dtype, self.device))
        logger.info("LoRA adapter %s read in %.1f ms (%d modules, rank %d)", lora.lora_name,
                    (time.perf_counter() - started) * 1e3, len(spec.modules),
                    spec.rank)  # fmt: skip
        return found

    def set_batch(self, sched: SchedulerOutput, order: Sequence[int]) -> None:
        """This step's runs of rows by adapter, over the flat batch's rows (``order``: the
        scheduled rows in its order); a step without adapters has none."""
        runs: list[tuple[Adapter, int, int]] = []
        if self.of:
            row, last = 0, 0  # last: the adapter id of the row before (0: the base model)
            for i in order:
                n = len(sched.token_ids[i])
                lora = self.of.get(sched.req_ids[i])
                if lora is None:
                    last = 0
                elif lora.lora_int_id == last:  # its run goes on
                    runs[-1] = (runs[-1][0], runs[-1][1], row + n)
                else:
                    runs.append((self.weights(lora), row, row + n))
                    last = lora.lora_int_id
                row += n
        self.batch.plan(runs)


def _native_kernel() -> Any:
    """lora.c's lora_add, or None where it does not build (torch's products then)."""
    import ctypes

    from engine.worker import autotune, native_build

    try:
        library = ctypes.CDLL(str(native_build.compile_library("lora", "lora.c")))
    except (*autotune.BUILD_ERRORS, OSError) as e:
        logger.warning("LoRA's native kernel did not build (%s): torch's products", e)
        return None
    function = library.lora_add
    i64 = ctypes.c_int64
    function.argtypes = [ctypes.c_void_p, i64, ctypes.c_void_p, ctypes.c_void_p, i64, i64,
                         ctypes.c_int]  # fmt: skip
    function.restype = None
    return function


_SITE = {site: i for i, site in enumerate(SITES)}
