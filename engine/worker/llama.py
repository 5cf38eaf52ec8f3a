"""Our own Llama forward over Hugging Face weights, on a flat batch with a paged KV cache."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from engine.config import ModelConfig
from engine.worker.attention import AttentionMetadata, paged_attention


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same op order as Hugging Face's LlamaRMSNorm (variance in fp32).
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Rotary:
    """cos/sin tables for every position up to max_len, built once."""

    def __init__(self, cfg: ModelConfig, max_len: int, device: torch.device) -> None:
        dim = cfg.head_dim
        inv_freq = 1.0 / (
            cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
        )
        inv_freq = _scale_inv_freq(inv_freq, cfg.rope_scaling)
        pos = torch.arange(max_len, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device)
        self.sin = emb.sin().to(device)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> RotaryTables:
        """The step's cos/sin rows, gathered once and shared by every layer."""
        return (
            self.cos[positions].unsqueeze(1).to(dtype),
            self.sin[positions].unsqueeze(1).to(dtype),
        )


RotaryTables = tuple[torch.Tensor, torch.Tensor]


def apply_rotary(x: torch.Tensor, tables: RotaryTables) -> torch.Tensor:
    """x: [T, heads, D], rotated by each token's position (Hugging Face's rotate_half form)."""
    cos, sin = tables
    half = x.shape[-1] // 2
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


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=False)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=False)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.scale = cfg.head_dim**-0.5

    def forward(
        self,
        h: torch.Tensor,
        rotary: RotaryTables,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = h.shape[0]
        x = self.input_layernorm(h)
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = apply_rotary(q.view(num_tokens, self.num_heads, self.head_dim), rotary)
        k = apply_rotary(k.view(num_tokens, self.num_kv_heads, self.head_dim), rotary)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        attn = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        h = h + self.o_proj(attn.reshape(num_tokens, -1))
        x = self.post_attention_layernorm(h)
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return h + self.down_proj(F.silu(gate) * up)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        rotary: Rotary,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Flat batch of tokens in; logits of the rows in ``logits_indices`` out."""
        h = self.embed_tokens(input_ids)
        tables = rotary.lookup(positions, h.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            h = layer(h, tables, kv_cache, meta)
        h = self.norm(h[logits_indices])
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(h, weight).float()

    @torch.no_grad()
    def load_weights(self, folder: str | Path) -> None:
        """Copy Hugging Face tensors in, fusing q/k/v and gate/up projections."""
        tensors: dict[str, torch.Tensor] = {}
        files = sorted(Path(folder).glob("*.safetensors"))
        if not files:
            raise ValueError(f"no .safetensors weights in {folder}")
        for f in files:
            tensors.update(load_file(str(f)))
        take = _Taker(tensors)
        self.embed_tokens.weight.copy_(take("model.embed_tokens.weight"))
        self.norm.weight.copy_(take("model.norm.weight"))
        if self.lm_head is not None:
            self.lm_head.weight.copy_(take("lm_head.weight"))
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            layer.qkv_proj.weight.copy_(
                torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
            )
            layer.o_proj.weight.copy_(take(p + "self_attn.o_proj.weight"))
            layer.gate_up_proj.weight.copy_(
                torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
            )
            layer.down_proj.weight.copy_(take(p + "mlp.down_proj.weight"))
            layer.input_layernorm.weight.copy_(take(p + "input_layernorm.weight"))
            layer.post_attention_layernorm.weight.copy_(take(p + "post_attention_layernorm.weight"))


class _Taker:
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise ValueError(f"the checkpoint has no tensor {name!r}")
        return self.tensors[name]
