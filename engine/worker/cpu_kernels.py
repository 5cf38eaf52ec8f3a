"""CpuKernels: the CPU kernels one ModelRunner chose at load, which its model reads.

The runner creates one and hands it to its model; each ``choose_*`` / ``plan_*`` method asks
one chooser (cpu_matmul, cpu_greedy_head, cpu_int8, cpu_attention, cpu_threads: each goes
through autotune), keeps what it chose and logs it. Until a choice is made the model runs
torch's paths, as it does on CUDA, where none is made.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.worker import (
    autotune,
    cpu_attention,
    cpu_decode_layer,
    cpu_gguf,
    cpu_greedy_head,
    cpu_int4,
    cpu_int8,
    cpu_matmul,
    cpu_threads,
)
from engine.worker.decode_cache import torch_attention


@dataclass
class CpuKernels:
    """What the model's CPU products, greedy head and decode attention run on."""

    matmul: str = "aten"  # the decoder layers' products: aten, onednn or int8
    packed_head: torch.Tensor | None = None  # the LM head in oneDNN's layout, where faster
    greedy: cpu_greedy_head.Plan = cpu_greedy_head.TORCH_ONLY
    int8: cpu_int8.Plan = cpu_int8.WIDEN_ONLY
    int4: cpu_int4.Plan = cpu_int4.WIDEN_ONLY
    # --quantization int4: the LM head in int8 (int8 [vocab, hidden] and its scales)
    head_q8: tuple[torch.Tensor, torch.Tensor] | None = None
    # --quantization gguf: the products' plan, and the LM head on the file's blocks (or None)
    gguf: cpu_gguf.Plan | None = None
    head_gguf: cpu_gguf.GGUFWeight | None = None
    # decode steps' layers with the work between their products native, where they can run so
    decode_layers: cpu_decode_layer.NativeLayers | None = None
    attention: cpu_attention.Choice | None = None  # None: not chosen yet (set once)
    threads_chosen: bool = False

    def choose_matmul(
        self, layer_weight: torch.Tensor | None, head_weight: torch.Tensor | None
    ) -> str:
        """The layers' kernel, timed on ``layer_weight`` ([in, out]; None where the layers are
        quantized), and the LM head's, timed on its own ``head_weight`` ([vocab, hidden]; None
        where it is quantized: int8 under int4, the file's blocks under gguf): its shape is far
        from theirs (for a small model the layers' choice was the wrong one for it, 2.9 ms
        against 2.2 at 64 rows). Packed, the LM head is a copy."""
        if layer_weight is None:
            layers = cpu_matmul.Choice("quantized", "see the quantized weights' line")
        else:
            edge = cpu_decode_layer.ATEN_EDGE if cpu_decode_layer.f32_one_call(layer_weight) else 0
            layers = cpu_matmul.choose(layer_weight, aten_edge=edge)
        said = "LM head quantized: see its weights' line"
        if head_weight is not None:
            head = cpu_matmul.choose(head_weight.t(), rows=cpu_matmul.HEAD_ROWS, with_panels=False)
            if head.kernel == "onednn":
                self.packed_head = cpu_matmul.pack(head_weight)
            said = f"LM head {head.kernel}: {head.why}"
        self.matmul = layers.kernel
        autotune.log("CPU matrix products", f"{layers.kernel} ({layers.why}; {said})")
        return layers.kernel

    def plan_greedy_head(
        self, head_weight: torch.Tensor, torch_path: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        """Time the greedy head's paths (after choose_matmul: torch's path is the LM head as
        chosen there)."""
        kernel = "onednn" if self.packed_head is not None else "aten"
        self.greedy = cpu_greedy_head.plan(head_weight, torch_path, kernel)
        autotune.log("greedy LM head", self.greedy.why)

    def plan_int8(
        self, quantization: str, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
        q8: bool = False,
    ) -> cpu_int8.Plan:  # fmt: skip
        """``q8``: the native kernel rounds the activations to 8 bits (int4's LM head)."""
        self.int8 = cpu_int8.plan(q, scale, dtype, q8)
        autotune.log(f"{quantization} weights", self.int8.why)
        return self.int8

    def plan_int4(self, q: cpu_int4.Q4Weight, dtype: torch.dtype) -> cpu_int4.Plan:
        self.int4 = cpu_int4.plan(q, dtype)
        autotune.log("int4 weights", self.int4.why)
        return self.int4

    def plan_gguf(self, w: cpu_gguf.GGUFWeight, dtype: torch.dtype) -> cpu_gguf.Plan:
        self.gguf = cpu_gguf.plan(w, dtype)
        autotune.log("gguf weights", self.gguf.why)
        return self.gguf

    def plan_decode_layers(self, layers: Sequence[Any]) -> None:
        """Decode steps' layers with native glue (cpu_decode_layer), where they can; under
        int4 (after plan_int4), each layer in one call up to the plan's rows; in fp32 on
        aten's products or the panels', each layer in one call."""
        why = cpu_decode_layer.unfit(layers)
        if why is None:
            try:
                library = cpu_decode_layer.build()
            except autotune.BUILD_ERRORS as e:
                why = f"the native glue did not build: {e}"
        if why is not None:
            autotune.log("decode layers", f"op by op: {why}")
            return
        self.decode_layers = cpu_decode_layer.NativeLayers(layers, library)
        if self.gguf is not None:
            gguf_why = cpu_decode_layer.gguf_unfit(layers, self.gguf)
            if gguf_why is None:
                rows = self.decode_layers.use_gguf(self.gguf.kernel, self.gguf.max_rows)
                autotune.log("gguf decode layers", f"one native call each, up to {rows} rows")
            else:
                autotune.log("gguf decode layers", f"products from Python: {gguf_why}")
        elif layers[0].qkv_proj.q4 is not None:
            int4_why = cpu_decode_layer.int4_unfit(layers, self.int4)
            if int4_why is None:
                assert self.int4.kernel is not None  # int4_unfit checked
                rows = self.decode_layers.use_int4(self.int4.kernel, self.int4.max_rows)
                autotune.log("int4 decode layers", f"one native call each, up to {rows} rows")
            else:
                autotune.log("int4 decode layers", f"products from Python: {int4_why}")
        elif layers[0].qkv_proj.panels is not None:
            panels_why = cpu_decode_layer.panels_unfit(layers)
            if panels_why is None:
                rows = self.decode_layers.use_panels(cpu_matmul.panels().address)
                said = f"one native call each, products on the panels, up to {rows} rows"
                autotune.log("fp32 decode layers", said)
            else:
                autotune.log("fp32 decode layers", f"products from Python: {panels_why}")
        else:
            f32_why = cpu_decode_layer.f32_unfit(layers)
            if f32_why is None:
                sgemm = cpu_decode_layer.blas_sgemm()
                assert sgemm is not None  # f32_unfit checked
                rows = self.decode_layers.use_f32(sgemm)
                autotune.log(
                    "fp32 decode layers",
                    f"one native call each, products by sgemm, up to {rows} rows (steps of 1-2 "
                    "rows: a native pass over the weights)",
                )
            else:
                autotune.log("fp32 decode layers", f"products from Python: {f32_why}")
        autotune.log("decode layers", "the work between the products in 3 native calls each")

    def choose_attention(
        self, group: int, head_dim: int, kv_dtype: torch.dtype
    ) -> cpu_attention.Choice:
        """Decode attention's kernel, chosen once (a wake-up reuses it)."""
        if self.attention is None:
            self.attention = cpu_attention.choose(group, head_dim, kv_dtype, torch_attention)
            native = self.attention.kernel is not None
            autotune.log(
                "CPU decode attention", f"{'native' if native else 'torch'} ({self.attention.why})"
            )
        return self.attention

    def choose_threads(
        self, step: Callable[[], object], owns_process: bool, shape: Mapping[str, Any]
    ) -> None:
        """The process's torch threads (cpu_threads), chosen once."""
        if self.threads_chosen:
            return
        self.threads_chosen = True
        if why := cpu_threads.choose(step, owns_process, shape):
            autotune.log("CPU threads", why)
