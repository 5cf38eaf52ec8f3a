"""The model's building blocks below its layers: this rank's shard of a tensor-parallel model,
the matrix product on whichever CPU kernel the load chose (``Linear``: aten, oneDNN's packed
weight, Lumen's panels, int8 or int4), and the RMS norm."""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.model_config import ModelConfig
from engine.worker import cpu_gguf, cpu_int4, cpu_int8, cpu_matmul

Grid = tuple[torch.Tensor, torch.Tensor]  # int4's (scale, minimum) per group (cpu_int4)


@dataclass(frozen=True)
class Shard:
    """This rank's part of a tensor-parallel model; rank 0 of 1 is the whole model.

    Megatron layout: q/k/v heads and gate/up rows are split across ranks
    (column-parallel), o_proj and down_proj columns too (row-parallel, their
    partial sums all-reduced); embeddings, norms and lm_head are replicated.
    """

    rank: int = 0
    size: int = 1

    def part(self, total: int) -> slice:
        n = total // self.size
        return slice(self.rank * n, (self.rank + 1) * n)


def check_tensor_parallel(cfg: ModelConfig, tp: int) -> None:
    """Raise ValueError unless every sharded dimension splits evenly over ``tp`` ranks."""
    if cfg.num_heads % tp or cfg.num_kv_heads % tp:
        raise ValueError(
            f"tensor_parallel_size {tp} must divide the number of attention heads "
            f"({cfg.num_heads}) and of KV heads ({cfg.num_kv_heads})"
        )
    if cfg.intermediate_size % tp:
        raise ValueError(
            f"tensor_parallel_size {tp} must divide the MLP size ({cfg.intermediate_size})"
        )


class Linear(nn.Module):
    """``x @ weight`` with the weight stored [in, out], unlike nn.Linear's [out, in].

    On CPU the product in this layout is up to 3x faster at decode batch
    sizes (measured per layer at batch 16: 0.65 ms against 1.41 ms) and as
    fast for prefill chunks.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed: torch.Tensor | None = None  # set: oneDNN's copy (cpu_matmul) replaces weight
        # Set: Lumen's panels (cpu_matmul.NativePanels) replace weight, and their description.
        self.panels: tuple[torch.Tensor, cpu_matmul.Panels] | None = None
        # Set by quantize: int8 [out, in] and its per-channel scales, or 4-bit groups (q4),
        # replace weight.
        self.qweight: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None
        self.int8 = cpu_int8.WIDEN_ONLY
        self.q4: cpu_int4.Q4Weight | None = None
        self.int4 = cpu_int4.WIDEN_ONLY
        # Set by use_blocks: a GGUF file's own blocks (--quantization gguf) replace weight.
        self.qg: cpu_gguf.GGUFWeight | None = None
        self.gguf: cpu_gguf.Plan | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            y = cpu_matmul.onednn_linear(x, self.packed)
        elif self.panels is not None:
            y = cpu_matmul.panels().linear(x, self.panels[1])
        elif self.qweight is not None:
            # quantize sets scale with qweight; a cast, not a check, on the hot path.
            y = self.int8.linear(x, self.qweight, cast("torch.Tensor", self.scale))
        elif self.q4 is not None:
            y = self.int4.linear(x, self.q4)
        elif self.qg is not None:
            y = cast("cpu_gguf.Plan", self.gguf).linear(x, self.qg)
        else:
            y = x @ self.weight
        return y if self.bias is None else y + self.bias

    def pack(self) -> None:
        """Hand the weight to oneDNN in its blocked layout; the plain copy is freed."""
        if self.qweight is not None or self.q4 is not None or self.qg is not None:
            return
        self.packed = cpu_matmul.pack(self.weight.detach().t())
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def pack_panels(self) -> None:
        """Hand the weight to Lumen's panels kernel in its layout; the plain copy is freed."""
        if self.qweight is not None or self.q4 is not None or self.qg is not None:
            return
        self.panels = cpu_matmul.panels().pack(self.weight.detach())
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def quantize(self, quantization: str = "int8", grid: Grid | None = None) -> bool:
        """Weight-only int8 (cpu_int8.quantize) or 4-bit groups (cpu_int4.quantize); the plain
        copy is freed. ``grid``: int4's (scale, minimum) from a GGUF file, kept where the
        weight's values lie on it exactly (returns whether it was)."""
        kept = False
        if quantization == "int4":
            w = self.weight.detach().t()
            on_grid = cpu_int4.quantize_on_grid(w, *grid) if grid is not None else None
            self.q4, kept = on_grid or cpu_int4.quantize(w), on_grid is not None
        else:
            self.qweight, self.scale = cpu_int8.quantize(self.weight.detach().t())
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)
        return kept

    def use_blocks(self, blocks: cpu_gguf.GGUFWeight, plan: cpu_gguf.Plan) -> None:
        """Run on a GGUF file's own blocks (cpu_gguf), the same weight as the plain copy,
        which is freed."""
        if (blocks.out_features, blocks.in_features) != (self.out_features, self.in_features):
            raise ValueError(f"blocks of [{blocks.out_features}, {blocks.in_features}] for a "
                             f"[{self.out_features}, {self.in_features}] product")  # fmt: skip
        self.qg, self.gguf = blocks, plan
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)


class RMSNorm(nn.Module):
    """``gemma``: Gemma 3's order in low precision (the weight applied in fp32, then cast);
    its checkpoint's (1 + w) is added at load."""

    def __init__(self, size: int, eps: float, gemma: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.gemma = gemma

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # One fused kernel; in fp32 its results equal the op-by-op form below.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Same op order as Hugging Face's LlamaRMSNorm (variance in fp32).
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.gemma:
            return (x32 * self.weight.float()).to(dtype)
        return self.weight * x32.to(dtype)
