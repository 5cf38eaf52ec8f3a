"""Rotary position embeddings: the cos/sin tables of each RoPE variant Lumen runs (default,
linear, llama3, longrope, partial, and Gemma 3's second base for its local layers)."""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from engine.model_config import ModelConfig


class Rotary:
    """cos/sin tables for every position up to max_len, built once, over a head's first
    ``rotary_dim`` dims (all of them but for partial RoPE, as Phi-3's).

    longrope (Phi-3) has two tables: short factors while every position of a step is within
    original_max_position_embeddings, long ones for a whole step once any is past it. That is
    transformers' rule for one sequence's forward (it chooses from its longest position), and
    vLLM's per batch: a short request batched with a long one gets the long factors then.
    """

    def __init__(
        self, cfg: ModelConfig, max_len: int, device: torch.device, local: bool = False
    ) -> None:
        dim = cfg.rotary_dim or cfg.head_dim
        shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        # Gemma 3's local layers: their own base, no scaling.
        self.local = (
            Rotary(cfg, max_len, device, local=True) if cfg.local_rope_theta and not local else None
        )
        if local:
            cfg = replace(cfg, rope_theta=cfg.local_rope_theta, rope_scaling=None)
        scaling = cfg.rope_scaling or {}
        self.long_from = 0  # longrope: the first position that needs the long factors
        if scaling.get("rope_type") == "longrope":
            original = scaling["original_max_position_embeddings"]
            factor = scaling["factor"]
            attention = scaling.get("attention_factor") or (
                1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
            )
            tables = [
                self._table(1.0 / (torch.tensor(f, dtype=torch.float32) * cfg.rope_theta**shape),
                            max_len, attention)
                for f in (scaling["short_factor"], scaling["long_factor"])
            ]  # fmt: skip
            (self.cos, self.sin), (self.long_cos, self.long_sin) = (
                (c.to(device), s.to(device)) for c, s in tables
            )
            self.long_from = original
            return
        inv_freq = _scale_inv_freq(1.0 / (cfg.rope_theta**shape), cfg.rope_scaling)
        cos, sin = self._table(inv_freq, max_len, 1.0)
        self.cos, self.sin = cos.to(device), sin.to(device)

    @staticmethod
    def _table(inv_freq: torch.Tensor, max_len: int, scale: float) -> RotaryTables:
        freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * scale, emb.sin() * scale

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> RotaryTables:
        """The step's cos/sin rows, gathered once and shared by every layer."""
        cos, sin = self.cos, self.sin
        if self.long_from and int(positions.max()) >= self.long_from:
            cos, sin = self.long_cos, self.long_sin
        return cos[positions].unsqueeze(1).to(dtype), sin[positions].unsqueeze(1).to(dtype)


RotaryTables = tuple[torch.Tensor, torch.Tensor]


def apply_rotary(x: torch.Tensor, tables: RotaryTables) -> torch.Tensor:
    """x: [T, heads, D], rotated by each token's position (Hugging Face's rotate_half form);
    with tables narrower than D (partial RoPE), only the first dims rotate."""
    cos, sin = tables
    dim = cos.shape[-1]
    if dim < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :dim], tables), x[..., dim:]), dim=-1)
    half = dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _scale_inv_freq(inv_freq: torch.Tensor, scaling: dict | None) -> torch.Tensor:
    if not scaling:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    # llama3: long wavelengths scaled down, short ones kept, smooth in between.
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
