"""Our own Llama forward over Hugging Face weights, on a flat batch with a paged KV cache."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from engine import gguf_blocks, gguf_q4
from engine.config import check_quantization
from engine.model_config import ModelConfig
from engine.worker import cpu_gguf, cpu_int8, cpu_matmul
from engine.worker.attention import AttentionMetadata, paged_attention
from engine.worker.cpu_kernels import CpuKernels
from engine.worker.layers import Grid, Linear, RMSNorm, Shard, check_tensor_parallel
from engine.worker.lora import LoraBatch
from engine.worker.rotary import Rotary, RotaryTables, apply_rotary
from engine.worker.sampler import argmax

logger = logging.getLogger(__name__)
# Prefill rows go through the MLP in tiles of this many: its [rows, 2 x intermediate]
# activations then stay in cache. Measured (SmolLM2, EPYC, fp32, 2048-token chunks): a
# 512-token prompt 0.51 -> 0.35 s; 128 and 512-row tiles were slower than 256.
MLP_TILE_ROWS = 256


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: Shard, index: int) -> None:
        super().__init__()
        self.index = index
        tp = shard.size
        self.sharded = tp > 1
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads // tp,
            cfg.num_kv_heads // tp,
            cfg.head_dim,
        )
        q_size, kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        inter = cfg.intermediate_size // tp
        self.intermediate = inter
        self.split = (q_size, kv_size, kv_size)
        # A row-parallel product's bias is added once, on rank 0, before the all-reduce.
        first = shard.rank == 0
        self.qkv_proj = Linear(cfg.hidden_size, q_size + 2 * kv_size, cfg.qkv_bias)
        self.o_proj = Linear(q_size, cfg.hidden_size, cfg.o_bias and first)
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * inter, cfg.mlp_bias)
        self.down_proj = Linear(inter, cfg.hidden_size, cfg.mlp_bias and first)
        eps, gemma = cfg.rms_norm_eps, cfg.gemma
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, gemma)
        # Llama's norm before the MLP; Gemma's after attention (pre_feedforward_layernorm
        # then leads the MLP, and post_feedforward_layernorm follows it).
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, gemma)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, gemma) if gemma else None
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, gemma) if gemma else None
        # Qwen3, Gemma 3: each q and k head normalised over head_dim before RoPE.
        self.q_norm = RMSNorm(cfg.head_dim, eps, gemma) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, eps, gemma) if cfg.qk_norm else None
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        self.local = index in cfg.local_layers  # its own RoPE base and window, where set
        self.gelu = gemma  # GeGLU (tanh GELU) for Gemma, else SwiGLU
        # LoRA (--enable-lora): the step's rows by adapter, shared by every layer; each
        # product adds its groups' deltas (engine/worker/lora.py).
        self.lora: LoraBatch | None = None

    def forward(
        self,
        h: torch.Tensor,
        rotary: RotaryTables,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = h.shape[0]
        x = self.input_layernorm(h)
        qkv = self.qkv_proj(x)
        lora = self.lora if self.lora is not None and self.lora.runs else None
        if lora is not None:
            qkv = lora.add(self.index, "qkv", x, qkv)
        # q and k heads side by side, rotated in one pass.
        num_qk = self.num_heads + self.num_kv_heads
        qk = qkv[:, : num_qk * self.head_dim].view(num_tokens, num_qk, -1)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        qk = apply_rotary(qk, rotary)
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        v = qkv[:, num_qk * self.head_dim :].view(num_tokens, self.num_kv_heads, self.head_dim)
        attn = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.index)
        attn = attn.reshape(num_tokens, -1)
        out = self.o_proj(attn)
        if lora is not None:  # a row-parallel delta is a partial sum too
            out = lora.add(self.index, "o", attn, out)
        if self.sharded:
            dist.all_reduce(out)  # each rank holds a partial sum over its heads
        if self.pre_feedforward_layernorm is not None:  # Gemma: a norm on each branch's output
            out = self.post_attention_layernorm(out)
        h = h + out
        if num_tokens <= MLP_TILE_ROWS or lora is not None:  # LoRA's groups index all rows
            out = self._mlp(h, lora)
        else:
            out = torch.cat([self._mlp(t) for t in h.split(MLP_TILE_ROWS)])
        if self.sharded:
            dist.all_reduce(out)
        if self.post_feedforward_layernorm is not None:
            out = self.post_feedforward_layernorm(out)
        return h + out

    def _mlp(self, h: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        norm = self.pre_feedforward_layernorm or self.post_attention_layernorm
        x = norm(h)
        gate_up = self.gate_up_proj(x)
        if lora is not None:
            gate_up = lora.add(self.index, "gate_up", x, gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        if lora is None:
            return self.down_proj(act * up)
        x = act * up
        return lora.add(self.index, "down", x, self.down_proj(x))


class LlamaForCausalLM(nn.Module):
    """``kernels``: the CPU kernels its runner chose (torch's paths until chosen)."""

    def __init__(
        self, cfg: ModelConfig, shard: Shard | None = None, kernels: CpuKernels | None = None
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.shard = shard or Shard()
        self.kernels = kernels or CpuKernels()
        check_tensor_parallel(cfg, self.shard.size)
        # An uninitialised weight (load_weights fills it): nn.Embedding's own random init on
        # the meta device goes through torch._refs, whose first use imports torch._dynamo
        # (1.7 s of every engine start).
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg, self.shard, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.gemma)
        self.lora: LoraBatch | None = None  # set by use_lora
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
        head: bool = True,
    ) -> torch.Tensor:
        """Flat batch of tokens in; logits of the rows in ``logits_indices`` out (with
        ``head=False``, their final hidden states, for ``logits`` or ``greedy_tokens``)."""
        h = self.embed_tokens(input_ids)
        if self.cfg.gemma:  # sqrt(hidden) in fp32, cast to the weights' dtype, as HF does
            h = h * torch.tensor(self.cfg.hidden_size**0.5).to(h.dtype)
        tables = rotary.lookup(positions, h.dtype)
        fused = self.kernels.decode_layers
        lora = self.lora if self.lora is not None and self.lora.runs else None
        if (
            fused is not None
            and (out := fused.forward(h, tables, kv_caches, meta, lora)) is not None
        ):
            return self.final(out[logits_indices], head)
        # The local layers' RoPE (Gemma 3) and sliding window, where the model has them.
        local = rotary.local.lookup(positions, h.dtype) if rotary.local is not None else tables
        local_meta = meta.local or meta
        by_layer = meta.by_layer
        for layer, kv_cache in zip(self.decoder_layers, kv_caches):
            if by_layer is not None:  # its KV group's blocks (and window)
                h = layer(h, local if layer.local else tables, kv_cache, by_layer[layer.index])
            elif layer.local:
                h = layer(h, local, kv_cache, local_meta)
            else:
                h = layer(h, tables, kv_cache, meta)
        return self.final(h[logits_indices], head)

    def use_lora(self, batch: LoraBatch) -> None:
        """Every layer adds the deltas of ``batch``'s groups (set each step by the runner)."""
        self.lora = batch
        for layer in self.decoder_layers:
            layer.lora = batch

    def final(self, h: torch.Tensor, logits: bool = True) -> torch.Tensor:
        """The final norm over ``h``, then the logits (or, with ``logits=False``, the normed
        hidden states, for ``logits`` or ``greedy_tokens``)."""
        h = self.norm(h)
        return self.logits(h) if logits else h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        if self.kernels.head_gguf is not None:
            return cast("cpu_gguf.Plan", self.kernels.gguf).linear(
                h.float(), self.kernels.head_gguf
            )
        if self.kernels.head_q8 is not None:
            return self.kernels.int8.linear(h.float(), *self.kernels.head_q8)
        if self.kernels.packed_head is not None:
            return cpu_matmul.onednn_linear(h, self.kernels.packed_head).float()
        return F.linear(h, self.head_weight()).float()

    def greedy_tokens(self, h: torch.Tensor) -> torch.Tensor:
        """Each row's most likely next token: the native head where it was timed faster
        for this many rows (cpu_greedy_head), else the logits' argmax."""
        path = self.kernels.greedy.path(h.shape[0])
        if path is not None and h.dtype == torch.float32:
            return path(h)
        return argmax(self.logits(h))

    def head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @property
    def decoder_layers(self) -> Sequence[DecoderLayer]:
        """``layers`` as typed: indexing a ModuleList gives a plain Module."""
        return cast("Sequence[DecoderLayer]", self.layers)

    @torch.no_grad()
    def pack_weights(self) -> None:
        """On CPU, move every matrix product to the faster kernel, measured here
        (CpuKernels.choose_matmul): the layers' kernel timed on their first weight, the LM
        head's on its own. Then decode steps' layers get their native glue, where they fit
        (CpuKernels.plan_decode_layers)."""
        first = self.decoder_layers[0].gate_up_proj.weight
        # Quantized (an emptied weight): the layers' products are int8 or int4; an int8 head
        # (under int4) is not timed against the fp32 one.
        quantized_head = self.kernels.head_q8 is not None or self.kernels.head_gguf is not None
        head = None if quantized_head else self.head_weight()
        kernel = self.kernels.choose_matmul(first if first.numel() else None, head)
        if kernel in ("onednn", "panels"):
            for module in self.modules():
                if isinstance(module, Linear) and kernel == "onednn":
                    module.pack()
                elif isinstance(module, Linear):
                    module.pack_panels()
        self.kernels.plan_decode_layers(self.decoder_layers)

    @torch.no_grad()
    def plan_greedy_head(self) -> None:
        """On CPU, after pack_weights: time the greedy head's paths (cpu_greedy_head) on the
        rank that samples (an int8 head, or the GGUF file's, takes its logits' argmax)."""
        if self.kernels.head_q8 is not None or self.kernels.head_gguf is not None:
            return
        self.kernels.plan_greedy_head(self.head_weight(), lambda h: argmax(self.logits(h)))

    @torch.no_grad()
    def quantize_weights(self, quantization: str) -> None:
        """Every decoder layer's products in weight-only int8 (cpu_int8) or int4 (cpu_int4);
        the embedding stays in the model's dtype, and so does the LM head under int8. Under
        int4 the LM head gets an int8 copy (at one stream it is a fifth of SmolLM2's weights;
        in 4 bits it cost the most accuracy, and llama.cpp's Q4 files keep it in 8 bits too).
        On CPU the kernels are timed here."""
        check_quantization(quantization)
        if quantization == "gguf":
            self._use_gguf_blocks()
            return
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        grids = self._gguf_grids() if quantization == "int4" else {}
        kept = sum(module.quantize(quantization, grids.get(module)) for module in linears)
        if grids:
            logger.info("int4: %d of %d products keep the GGUF file's own 4-bit values (%s); "
                        "the rest are fitted", kept, len(linears), gguf_q4.GRIDS_FILE)  # fmt: skip
        first = self.decoder_layers[0].gate_up_proj
        if quantization == "int4":
            assert first.q4 is not None  # quantize set it
            q, scale = cpu_int8.quantize(self.head_weight())
            self.kernels.head_q8 = (q, scale)
            if first.q4.codes.device.type != "cpu":
                return
            dtype = self.embed_tokens.weight.dtype
            plan4 = self.kernels.plan_int4(first.q4, dtype)
            for module in linears:
                module.int4 = plan4
            self.kernels.plan_int8("int4's LM head, int8", q, scale, dtype, q8=True)
            return
        assert first.qweight is not None and first.scale is not None  # quantize set them
        if first.qweight.device.type != "cpu":
            return
        plan = self.kernels.plan_int8(
            quantization, first.qweight, first.scale, self.embed_tokens.weight.dtype
        )
        for module in linears:
            assert module.qweight is not None  # quantize set it
            fits = plan.kernel is not None and plan.kernel.fits(module.qweight)
            module.int8 = plan if fits else cpu_int8.WIDEN_ONLY

    def _use_gguf_blocks(self) -> None:
        """--quantization gguf: each product, and the LM head, on the GGUF file's own blocks
        (engine/gguf_blocks.py, cpu_gguf) where the file holds it in a format the kernel reads;
        the rest stay in the model's dtype, and the log says how many."""
        if self.shard.size != 1 or self.embed_tokens.weight.device.type != "cpu":
            raise ValueError("--quantization gguf runs on CPU, on one rank (no tensor "
                             "parallelism)")  # fmt: skip
        saved = gguf_blocks.load_blocks(self.cfg.path)
        if not saved:
            raise ValueError(
                f"--quantization gguf runs a GGUF file's own blocks, and {self.cfg.path} has "
                f"none ({gguf_blocks.BLOCKS_FILE}): serve the .gguf file itself (a packaged "
                "model's folder converted before blocks were kept gets them once removed and "
                "fetched again), or use int8 or int4, which quantize any checkpoint"
            )
        chosen: dict[Linear, cpu_gguf.GGUFWeight] = {}
        sources = self._product_sources()
        for module, keys in sources:
            if all(key in saved for key in keys):
                parts = [saved[key] for key in keys]
                chosen[module] = cpu_gguf.GGUFWeight(parts, module.in_features)
        products = len(sources)
        head = saved.get("lm_head.weight")
        head_blocks = cpu_gguf.GGUFWeight([head], self.cfg.hidden_size) if head else None
        first = next(iter(chosen.values()), head_blocks)
        if first is None:
            readable = ", ".join(gguf_blocks.TYPES)
            raise ValueError(f"{self.cfg.path}: no product of the GGUF file is in a format "
                             f"--quantization gguf reads ({readable})")  # fmt: skip
        plan = self.kernels.plan_gguf(first, self.embed_tokens.weight.dtype)
        for module, blocks in chosen.items():
            module.use_blocks(blocks, plan)
        self.kernels.head_gguf = head_blocks
        formats = sorted({kind for w in chosen.values() for kind, _ in w.parts})
        type_names = {v: k for k, v in gguf_blocks.TYPES.items()}
        kinds, dtype = ", ".join(type_names[f] for f in formats), self.embed_tokens.weight.dtype
        logger.info("gguf: %d of %d products%s run on the file's own blocks (%s); the rest in "
                    "%s", len(chosen), products, " and the LM head" if head_blocks else "",
                    kinds, dtype)  # fmt: skip

    def _gguf_grids(self) -> dict[nn.Module, Grid]:
        """Each product's 4-bit grid from the GGUF file the model was converted from
        (engine/gguf_q4.py), where it has one; a sharded model fits its own."""
        saved = gguf_q4.load_grids(self.cfg.path) if self.shard.size == 1 else {}
        grids: dict[nn.Module, Grid] = {}
        for module, keys in self._product_sources() if saved else ():
            if all(f"{key}.scale" in saved for key in keys):
                scale, minimum = ([saved[f"{key}.{part}"] for key in keys]
                                  for part in ("scale", "minimum"))  # fmt: skip
                grids[module] = (torch.cat(scale), torch.cat(minimum))
        return grids

    def _product_sources(self) -> list[tuple[Linear, list[str]]]:
        """Each layer product and the checkpoint weights it fuses, in their order (q, k, v;
        gate, up), by Hugging Face name."""
        fused, sources = self.cfg.fused_checkpoint, []
        for i, layer in enumerate(self.decoder_layers):
            names = {
                layer.qkv_proj: ["self_attn.qkv_proj"] if fused
                else [f"self_attn.{n}_proj" for n in "qkv"],
                layer.o_proj: ["self_attn.o_proj"],
                layer.gate_up_proj: ["mlp.gate_up_proj"] if fused
                else ["mlp.gate_proj", "mlp.up_proj"],
                layer.down_proj: ["mlp.down_proj"],
            }  # fmt: skip
            for module, parts in names.items():
                sources.append((module, [f"model.layers.{i}.{part}.weight" for part in parts]))
        return sources

    @torch.no_grad()
    def load_weights(self, folder: str | Path) -> None:
        """Copy Hugging Face tensors in, fusing q/k/v and gate/up; a shard reads only its slices."""
        files = sorted(Path(folder).glob("*.safetensors"))
        if not files:
            raise ValueError(f"no .safetensors weights in {folder}")
        with ExitStack() as stack:
            handles = [stack.enter_context(safe_open(str(f), framework="pt")) for f in files]
            self._copy_weights(_Taker(handles, self.shard, 1.0 if self.cfg.gemma else 0.0))

    def _copy_weights(self, take: _Taker) -> None:
        cfg, d = self.cfg, self.cfg.head_dim
        self.embed_tokens.weight.copy_(take("model.embed_tokens.weight"))
        self.norm.weight.copy_(take.norm("model.norm.weight"))
        if self.lm_head is not None:
            self.lm_head.weight.copy_(take("lm_head.weight"))
        # Full (unsharded) sizes of the dimensions each rank takes a slice of.
        rows = {"q": cfg.num_heads * d, "k": cfg.num_kv_heads * d, "v": cfg.num_kv_heads * d}
        inter = cfg.intermediate_size
        for i, layer in enumerate(self.decoder_layers):
            p = f"model.layers.{i}."
            # Hugging Face stores [out, in]; our Linear holds [in, out].
            if cfg.fused_checkpoint:  # Phi-3: one tensor each; a shard cuts its part of each
                qkv = take.fused(p + "self_attn.qkv_proj.weight", [rows[n] for n in "qkv"])
                gate_up = take.fused(p + "mlp.gate_up_proj.weight", [inter, inter])
            else:
                qkv = [take(p + f"self_attn.{n}_proj.weight", rows=rows[n]) for n in "qkv"]
                gate_up = [take(p + f"mlp.{n}_proj.weight", rows=inter) for n in ("gate", "up")]
            layer.qkv_proj.weight.copy_(torch.cat(qkv).t())
            layer.o_proj.weight.copy_(take(p + "self_attn.o_proj.weight", cols=rows["q"]).t())
            layer.gate_up_proj.weight.copy_(torch.cat(gate_up).t())
            layer.down_proj.weight.copy_(take(p + "mlp.down_proj.weight", cols=inter).t())
            layer.input_layernorm.weight.copy_(take.norm(p + "input_layernorm.weight"))
            layer.post_attention_layernorm.weight.copy_(
                take.norm(p + "post_attention_layernorm.weight")
            )
            self._copy_optional(layer, p, take)

    def _copy_optional(self, layer: DecoderLayer, p: str, take: _Taker) -> None:
        """What a family's flags add: biases (column-parallel ones sliced like their weight's
        rows, row-parallel ones whole, on rank 0 only) and the q/k norms."""
        cfg, d = self.cfg, self.cfg.head_dim
        rows = {"q": cfg.num_heads * d, "k": cfg.num_kv_heads * d, "v": cfg.num_kv_heads * d}
        if layer.qkv_proj.bias is not None:
            qkv = [take(p + f"self_attn.{n}_proj.bias", rows=rows[n]) for n in "qkv"]
            layer.qkv_proj.bias.copy_(torch.cat(qkv))
        if layer.o_proj.bias is not None:
            layer.o_proj.bias.copy_(take(p + "self_attn.o_proj.bias"))
        if layer.gate_up_proj.bias is not None:
            gate_up = [take(p + f"mlp.{n}_proj.bias", rows=cfg.intermediate_size)
                       for n in ("gate", "up")]  # fmt: skip
            layer.gate_up_proj.bias.copy_(torch.cat(gate_up))
        if layer.down_proj.bias is not None:
            layer.down_proj.bias.copy_(take(p + "mlp.down_proj.bias"))
        if layer.q_norm is not None and layer.k_norm is not None:
            layer.q_norm.weight.copy_(take.norm(p + "self_attn.q_norm.weight"))
            layer.k_norm.weight.copy_(take.norm(p + "self_attn.k_norm.weight"))
        if layer.pre_feedforward_layernorm is not None:
            layer.pre_feedforward_layernorm.weight.copy_(
                take.norm(p + "pre_feedforward_layernorm.weight")
            )
        if layer.post_feedforward_layernorm is not None:
            layer.post_feedforward_layernorm.weight.copy_(
                take.norm(p + "post_feedforward_layernorm.weight")
            )


class _Taker:
    """Reads named tensors, or this shard's rows or columns of them, from open safetensors files."""

    def __init__(self, handles: list[Any], shard: Shard, norm_offset: float = 0.0) -> None:
        self.where = {name: h for h in handles for name in h.keys()}  # noqa: SIM118
        self.shard = shard
        self.norm_offset = norm_offset  # Gemma's norms hold w and scale by (1 + w)

    def norm(self, name: str) -> torch.Tensor:
        """An RMSNorm's weight as it multiplies (in fp32, as HF adds Gemma's 1)."""
        weight = self(name)
        return weight.float() + self.norm_offset if self.norm_offset else weight

    def __call__(
        self, name: str, *, rows: int | None = None, cols: int | None = None
    ) -> torch.Tensor:
        handle = self.where.get(name)
        if handle is None:
            raise ValueError(f"the checkpoint has no tensor {name!r}")
        if self.shard.size == 1 or (rows is None and cols is None):
            return handle.get_tensor(name)
        dim, total = (0, rows) if rows is not None else (1, cols)
        assert total is not None  # rows or cols was given (the return above)
        full = handle.get_slice(name)  # lazy: only the sliced bytes are read
        shape = full.get_shape()
        if shape[dim] != total:
            raise ValueError(f"the checkpoint's {name!r} has shape {shape}, unlike the config")
        part = self.shard.part(total)
        return full[part] if dim == 0 else full[:, part]

    def fused(self, name: str, sizes: list[int]) -> list[torch.Tensor]:
        """A tensor of parts stacked by rows (Phi-3's qkv_proj, gate_up_proj): this shard's
        rows of each part."""
        whole = self(name)
        if whole.shape[0] != sum(sizes):
            raise ValueError(f"the checkpoint's {name!r} has shape {list(whole.shape)}, "
                             f"unlike the config's {sum(sizes)} rows")  # fmt: skip
        return [part[self.shard.part(n)] for part, n in zip(whole.split(sizes), sizes)]
