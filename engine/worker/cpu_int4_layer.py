"""A whole decoder layer in one native call, for decode steps under ``--quantization int4``.

One stream's step is 30 layers of small ops: at one row each op is a few microseconds of
work and about as much of Python and torch's dispatch around it, and that glue was as long
as the products themselves (SmolLM2, int4, one stream: 12 ms of a 31 ms step, one thread).
``int4_decode_layer`` (native/int4_linear.c) runs DecoderLayer.forward's steps in C: the
norm, the qkv product, RoPE, the KV cache write, decode attention (the native kernel
cpu_attention chose, called by its address), the o product and residual, the norm, gate/up,
SwiGLU, down and residual, every product through the int4 kernel.

It runs where a step and the model allow, else the layers run as before:

- the model: Llama-shaped decoder layers (no q/k norm, no Gemma norms or GeGLU, no biases,
  no sliding window, one rank), fp32, every layer's products on the native int4 kernel with
  whole groups, and RoPE over the whole head;
- the step: decode rows only, at most ``MAX_ROWS`` and within the int4 plan's rows, over the
  CPU decode mirror's native kernel, with an fp32 KV cache.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import torch

from engine import envs
from engine.worker import autotune, cpu_int4
from engine.worker.attention import AttentionMetadata
from engine.worker.decode_cache import DecodePlan
from engine.worker.rotary import RotaryTables

# The decoder layers are engine.worker.llama's DecoderLayer (not imported: llama imports this).
DecoderLayer = Any

MAX_ROWS = 16  # decode rows: beyond, the products' own plan decides and the glue is amortised


class _Q4(ctypes.Structure):
    _fields_ = [("codes", ctypes.c_void_p), ("d", ctypes.c_void_p), ("mn", ctypes.c_void_p),
                ("n", ctypes.c_int64), ("k", ctypes.c_int64)]  # fmt: skip


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Q4), ("o", _Q4), ("gate_up", _Q4), ("down", _Q4),
                ("norm_in", ctypes.c_void_p), ("norm_mlp", ctypes.c_void_p),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("heads", ctypes.c_int64),
                ("kv_heads", ctypes.c_int64), ("head_dim", ctypes.c_int64),
                ("attention", ctypes.c_void_p)]  # fmt: skip


class _Step(ctypes.Structure):
    _fields_ = [("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p),
                ("slot_mapping", ctypes.c_void_p), ("k_cache", ctypes.c_void_p),
                ("v_cache", ctypes.c_void_p), ("kb", ctypes.c_void_p), ("vb", ctypes.c_void_p),
                ("slots", ctypes.c_void_p), ("positions", ctypes.c_void_p),
                ("slot_stride", ctypes.c_int64), ("head_stride", ctypes.c_int64)]  # fmt: skip


def _q4(q: cpu_int4.Q4Weight) -> _Q4:
    return _Q4(q.codes.data_ptr(), q.scale.data_ptr(), q.minimum.data_ptr(), q.out_features,
               q.padded)  # fmt: skip


def unfit(layers: Sequence[DecoderLayer], plan: cpu_int4.Plan) -> str | None:
    """Why these layers cannot run fused (None where they can)."""
    setting = autotune.forced(envs.LUMEN_CPU_INT4_LAYER, ("auto", "off"))
    if setting == "off":
        return "set by LUMEN_CPU_INT4_LAYER"
    if plan.kernel is None:
        return "the int4 products widen their weights here"
    for layer in layers:
        linears = (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
        if layer.sharded or layer.local or layer.gelu or layer.q_norm is not None:
            return "not a Llama-shaped layer on one rank"  # gelu: Gemma, with its extra norms
        if any(m.bias is not None or m.q4 is None or m.q4.padded != m.q4.in_features
               for m in linears):  # fmt: skip
            return "a bias, or a product that is not in whole 4-bit groups"
        if layer.input_layernorm.weight.dtype != torch.float32:
            return "not fp32"
    return None


class FusedLayers:
    """The layers' native descriptions (pointers to their weights, built once) and the call."""

    def __init__(self, layers: Sequence[DecoderLayer], kernel: cpu_int4.NativeInt4) -> None:
        self.layers = layers
        fn = kernel.library.int4_decode_layer
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                       ctypes.c_int]  # fmt: skip
        fn.restype = ctypes.c_int
        self._fn = fn
        self._max_rows = MAX_ROWS
        self._described: list[_Layer] = []
        self._attention = 0  # the address the descriptions hold

    def limit_rows(self, rows: int) -> int:
        """At most ``rows`` rows a step (the int4 plan's); returns the limit now."""
        self._max_rows = min(MAX_ROWS, rows)
        return self._max_rows

    def _describe(self, attention: int) -> list[_Layer]:
        if self._attention != attention:
            self._described = [
                _Layer(_q4(lay.qkv_proj.q4), _q4(lay.o_proj.q4), _q4(lay.gate_up_proj.q4),
                       _q4(lay.down_proj.q4), lay.input_layernorm.weight.data_ptr(),
                       lay.post_attention_layernorm.weight.data_ptr(), lay.input_layernorm.eps,
                       lay.scale, lay.num_heads, lay.num_kv_heads, lay.head_dim, attention)
                for lay in self.layers
            ]  # fmt: skip
            self._attention = attention
        return self._described

    def forward(
        self,
        h: torch.Tensor,
        tables: RotaryTables,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor | None:
        """The layers over ``h`` [rows, hidden] (updated in place and returned), or None where
        this step cannot run fused."""
        rows = h.shape[0]
        plan = meta.decode_plan
        if (rows > self._max_rows or meta.num_decodes != rows or meta.prefills
                or meta.local is not None or not isinstance(plan, DecodePlan)
                or not plan.native or plan.cache.native is None or plan.cache.window
                or h.dtype != torch.float32 or tables[0].shape[-1] != self.layers[0].head_dim
                or kv_caches[0][0].dtype != torch.float32
                or not kv_caches[0][0].is_contiguous()):  # fmt: skip
            return None
        described = self._describe(plan.cache.native.address(torch.float32))
        cos, sin = (t.reshape(rows, -1).contiguous() for t in tables)
        h = h.contiguous()
        threads = torch.get_num_threads()
        step = _Step(cos.data_ptr(), sin.data_ptr(), meta.slot_mapping.data_ptr())
        step.slots, step.positions = plan.slot_idx.data_ptr(), plan.positions.data_ptr()
        for index, (k_cache, v_cache) in enumerate(kv_caches):
            kb, vb = plan.mirror(index, k_cache, v_cache)
            step.k_cache, step.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
            step.kb, step.vb = kb.data_ptr(), vb.data_ptr()
            step.slot_stride, step.head_stride = kb.stride(0), kb.stride(1)
            if self._fn(ctypes.byref(described[index]), ctypes.byref(step), h.data_ptr(), rows,
                        threads):  # fmt: skip
                raise MemoryError("int4_decode_layer: no memory for its buffers")
        return h
