"""A decode step's decoder layers with the work between their products in native code.

A decode step on CPU is 30 layers of small ops. Between its four products, a layer ran about
35 torch ops (two norms, RoPE, the paged KV cache write, attention's wrapper, SiLU, the residual
adds), each a few microseconds of dispatch around little work, and at 16 or 64 rows some of
them slow in themselves (an index_copy_ of 16 rows, 40 us). Measured on SmolLM2, fp32, 2 threads
(AMD EPYC), the step ran 1.18-1.32x a pass of its products over the weights (``lumen bench
mfu``). native/decode_layer.c does that work in three calls a layer: RoPE, the KV write and
attention (the kernel cpu_attention chose, called by its address); the residual add and the
next norm; SwiGLU. The products stay what the model chose (oneDNN, int8, int4, with their
biases), called from here.

Under ``--quantization int4`` with every product in whole 4-bit groups, a step of at most
``MAX_WHOLE_ROWS`` rows runs each layer in one call (``decode_layer``), the products through
the int4 kernel from C: one stream's step then runs no Python between its ops (it was 12 ms of
a 31 ms step, SmolLM2, one thread).

It runs where a step and the model allow, else the layers run op by op:

- the model: Llama-shaped decoder layers (no q/k norm, no Gemma norms or GeGLU, no sliding
  window, one rank) in fp32, with RoPE over the whole head;
- the step: decode rows only, over the CPU decode mirror's native attention, with a contiguous
  fp32 KV cache.

In fp32, where torch runs its products on MKL (x86), a decode step runs each layer in one call
too (up to the rows whose scratch fits in ``F32_SCRATCH_BYTES``), the products through the
Fortran ``sgemm`` that torch's CPU library exports and that aten's ``x @ w`` calls: the same
kernel and the same bits, without the Python around its four products and three native calls
(about 3 ms of a 64-row step of SmolLM2, 2 threads, Xeon). A step of one or two rows reads
each weight with decode_layer.c's own pass instead (``f32_product``), as fast as the memory
reads: sgemm read SmolLM2's decoder weights at 13-16 GB/s at one row, this at 29-30 (AMD
EPYC, AVX2, 2 threads), a one-row step 29-31 -> 20-22 ms. Where the load chose Lumen's
panels (cpu_matmul.NativePanels), each layer runs in one call the same way, its products
through the panels' own C function, at every step size.

``LUMEN_CPU_DECODE_LAYER=off`` runs every step op by op; ``LUMEN_CPU_INT4_LAYER=off`` keeps
int4's products in Python (the work between them still native), ``LUMEN_CPU_F32_LAYER=off``
fp32's.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import torch

from engine import envs
from engine.worker import autotune, cpu_gguf, cpu_int4
from engine.worker.attention import AttentionMetadata
from engine.worker.decode_cache import DecodePlan
from engine.worker.lora import LoraBatch
from engine.worker.rotary import RotaryTables

# The decoder layers are engine.worker.llama's DecoderLayer (not imported: llama imports this).
DecoderLayer = Any

# int4's whole layers in one call: at most this many rows (beyond, the products' own plan
# decides, and the Python between the calls is spread over the rows).
MAX_WHOLE_ROWS = 16
# fp32's whole layers in one call: up to the rows whose scratch fits in this. An engine
# process serves blocks under 32 MiB from glibc's heap (heap.py); a larger one is mapped afresh
# each call, and its pages faulted in again (SmolLM2: 32 KiB a row, so 508 rows; an 8B Llama: 62).
F32_SCRATCH_BYTES = 16 << 20
# The layers' kernel is timed on one product (cpu_matmul). Where fp32's layers can run in one call
# on aten's products, oneDNN's must time this much faster to be chosen. Measured on SmolLM2, a
# Xeon's 2 vCPUs, decode steps at 128 positions: aten's in one call against oneDNN's with the
# products from Python, 1 row 17.5-18.4 ms against 26.5-27.1, 16 rows 49.2-50.5 against 43.4-43.6,
# 64 rows 88.6-93.4 against 92.2-94.5; their single products had timed 5.66 ms against 5.63.
ATEN_EDGE = 0.10
_P = ctypes.c_void_p


class _Weight(ctypes.Structure):
    _fields_ = [("weight", _P), ("n", ctypes.c_int64), ("k", ctypes.c_int64)]


class _Q4(ctypes.Structure):  # int4_linear.c's q4_t
    _fields_ = [("codes", _P), ("d", _P), ("mn", _P), ("n", ctypes.c_int64),
                ("k", ctypes.c_int64)]  # fmt: skip


class _F32(ctypes.Structure):  # decode_layer.c's f32_weight_t
    _fields_ = [("w", _P), ("n", ctypes.c_int64), ("k", ctypes.c_int64), ("sgemm", _P)]


# The KV caches a fused step reads: fp32, and bf16 and 8-bit rows (int8; uint8 holds fp8:
# kv_quant.py), whose new rows the attention kernel writes into the mirror (rounded, or packed)
# and the layer then copies into the paged cache.
FUSED_KV = (torch.float32, torch.bfloat16, torch.int8, torch.uint8)


class _Attn(ctypes.Structure):
    _fields_ = [("heads", ctypes.c_int64), ("kv_heads", ctypes.c_int64),
                ("head_dim", ctypes.c_int64), ("scale", ctypes.c_float),
                ("attention", _P), ("row_bytes", ctypes.c_int64),
                ("elem_bytes", ctypes.c_int64)]  # fmt: skip


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Weight), ("o", _Weight), ("gate_up", _Weight), ("down", _Weight),
                ("product", _P), ("norm_in", _P), ("norm_mlp", _P), ("eps", ctypes.c_float),
                ("attn", _Attn)]  # fmt: skip


class _Step(ctypes.Structure):
    _fields_ = [("cos", _P), ("sin", _P), ("slot_mapping", _P), ("k_cache", _P),
                ("v_cache", _P), ("kb", _P), ("vb", _P), ("slots", _P), ("positions", _P),
                ("slot_stride", ctypes.c_int64), ("head_stride", ctypes.c_int64)]  # fmt: skip


def build() -> Path:
    """The glue's library (native/decode_layer.c), compiled once per machine."""
    return autotune.build("decode_layer", "decode_layer.c")


def unfit(layers: Sequence[DecoderLayer]) -> str | None:
    """Why these layers' decode steps must run op by op (None where they need not)."""
    if autotune.forced(envs.LUMEN_CPU_DECODE_LAYER, ("auto", "off")) == "off":
        return "set by LUMEN_CPU_DECODE_LAYER"
    for layer in layers:
        if layer.sharded or layer.local or layer.gelu or layer.q_norm is not None:
            return "not a Llama-shaped layer on one rank"  # gelu: Gemma, with its extra norms
        if layer.input_layernorm.weight.dtype != torch.float32:
            return "not fp32"
    return None


def int4_unfit(layers: Sequence[DecoderLayer], plan: cpu_int4.Plan) -> str | None:
    """Why int4's products cannot run inside the layer's one call (None where they can)."""
    if autotune.forced(envs.LUMEN_CPU_INT4_LAYER, ("auto", "off")) == "off":
        return "set by LUMEN_CPU_INT4_LAYER"
    if plan.kernel is None:
        return "the int4 products widen their weights here"
    for layer in layers:
        linears = (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
        if any(m.bias is not None or m.q4 is None or m.q4.padded != m.q4.in_features
               for m in linears):  # fmt: skip
            return "a bias, or a product that is not in whole 4-bit groups"
    return None


def gguf_unfit(layers: Sequence[DecoderLayer], plan: cpu_gguf.Plan) -> str | None:
    """Why the GGUF blocks' products cannot run inside the layer's one call (None where they
    can)."""
    if autotune.forced(envs.LUMEN_CPU_INT4_LAYER, ("auto", "off")) == "off":
        return "set by LUMEN_CPU_INT4_LAYER"
    if plan.max_rows < 1:
        return "the products widen their weights here"
    for layer in layers:
        linears = (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
        if any(m.bias is not None or m.qg is None for m in linears):
            return "a bias, or a product the file holds in a format the kernel does not read"
    return None


def panels_unfit(layers: Sequence[DecoderLayer]) -> str | None:
    """Why the panels' products cannot run inside the layer's one call (None where they
    can)."""
    if autotune.forced(envs.LUMEN_CPU_F32_LAYER, ("auto", "off")) == "off":
        return "set by LUMEN_CPU_F32_LAYER"
    for layer in layers:
        for m in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
            if m.panels is None or m.bias is not None:
                return "a bias, or a product the panels do not hold"
    return None


def blas_sgemm() -> int | None:
    """The address of the Fortran ``sgemm`` that aten's fp32 products call, where torch runs
    them on MKL and its CPU library exports it (None elsewhere)."""
    if not torch.backends.mkl.is_available():
        return None
    lib_dir = Path(torch.__file__).parent / "lib"
    for name in ("libtorch_cpu.so", "libtorch_cpu.dylib"):
        if (lib_dir / name).exists():
            try:
                fn = ctypes.CDLL(str(lib_dir / name)).sgemm_
            except (OSError, AttributeError):
                return None
            return ctypes.cast(fn, ctypes.c_void_p).value
    return None


def f32_one_call(weight: torch.Tensor) -> bool:
    """Whether fp32 layers on aten's products, with ``weight`` among them, could run in one
    call a layer (the layers' shape is checked later, by unfit and f32_unfit)."""
    return (weight.dtype == torch.float32 and weight.device.type == "cpu"
            and autotune.forced(envs.LUMEN_CPU_DECODE_LAYER, ("auto", "off")) != "off"
            and autotune.forced(envs.LUMEN_CPU_F32_LAYER, ("auto", "off")) != "off"
            and blas_sgemm() is not None)  # fmt: skip


def f32_unfit(layers: Sequence[DecoderLayer]) -> str | None:
    """Why fp32's products cannot run inside the layer's one call (None where they can)."""
    if autotune.forced(envs.LUMEN_CPU_F32_LAYER, ("auto", "off")) == "off":
        return "set by LUMEN_CPU_F32_LAYER"
    for layer in layers:
        for m in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
            w = m.weight
            if (m.packed is not None or m.panels is not None or m.qweight is not None
                    or m.q4 is not None or m.qg is not None or m.bias is not None
                    or w.dtype != torch.float32
                    or w.dim() != 2 or not w.is_contiguous()
                    or w.device.type != "cpu"):  # fmt: skip
                return "a bias, or a product that is not aten's fp32 (oneDNN's, or quantized)"
    if blas_sgemm() is None:
        return "torch's products do not run on MKL here"
    return None


class NativeLayers:
    """The layers' native descriptions (pointers to their norms and int4 weights, built once)
    and the calls."""

    def __init__(self, layers: Sequence[DecoderLayer], library: Path) -> None:
        self.layers = layers
        lib = ctypes.CDLL(str(library))
        i64, f32, cint = ctypes.c_int64, ctypes.c_float, ctypes.c_int
        self._norm = lib.add_rms_norm
        self._norm.argtypes = [_P, _P, _P, f32, i64, i64, _P, cint]
        self._norm.restype = None
        self._attend = lib.rope_attend
        self._attend.argtypes = [_P, _P, _P, _P, i64, cint]
        self._swiglu = lib.swiglu
        self._swiglu.argtypes = [_P, _P, i64, i64, cint]
        self._swiglu.restype = None
        self._layer = lib.decode_layer
        self._layer.argtypes = [_P, _P, _P, i64, cint]
        for fn in (self._attend, self._layer):
            fn.restype = cint
        self._whole_rows = 0  # one call a layer (int4's, fp32's), up to this many rows
        self._int4: cpu_int4.NativeInt4 | None = None
        self._q4: list[tuple[_Q4, ...]] = []  # kept alive: the descriptions point at them
        # As _q4, for fp32's products: sgemm's descriptions (_F32) or the panels' own.
        self._f32: list[tuple[ctypes.Structure, ...]] = []
        self._f32_product = ctypes.cast(lib.f32_product, _P).value or 0
        self._product = 0  # fp32's products in the one call: f32_product, or the panels'
        self._described: list[_Layer] = []
        self._attention = 0  # the attention kernel's address the descriptions hold
        self._weights = [(lay.input_layernorm.weight, lay.post_attention_layernorm.weight)
                         for lay in layers]  # fmt: skip
        # Each layer's four products as plain bound forwards: a module call (hooks, and
        # Module.__getattr__ for each submodule) cost about 0.3 ms of a one-row step of SmolLM2.
        self._products = [(lay.qkv_proj.forward, lay.o_proj.forward, lay.gate_up_proj.forward,
                           lay.down_proj.forward) for lay in layers]  # fmt: skip
        self._eps = layers[0].input_layernorm.eps
        self._attn_width = layers[0].num_heads * layers[0].head_dim

    def use_int4(self, kernel: cpu_int4.NativeInt4, rows: int) -> int:
        """Run each layer in one call, its products through ``kernel``, for steps of up to
        ``rows`` rows (at most MAX_WHOLE_ROWS); returns that limit."""
        self._int4 = kernel
        self._whole_rows = min(MAX_WHOLE_ROWS, rows)
        self._q4 = [
            tuple(_Q4(q.codes.data_ptr(), q.scale.data_ptr(), q.minimum.data_ptr(),
                      q.out_features, q.padded)
                  for q in (lay.qkv_proj.q4, lay.o_proj.q4, lay.gate_up_proj.q4,
                            lay.down_proj.q4))
            for lay in self.layers
        ]  # fmt: skip
        self._attention = 0
        return self._whole_rows

    def use_gguf(self, kernel: cpu_gguf.NativeGGUF, rows: int) -> int:
        """Run each layer in one call, its products on the GGUF file's own blocks through
        ``kernel``, for steps of up to ``rows`` rows (at most MAX_WHOLE_ROWS)."""
        self._whole_rows = min(MAX_WHOLE_ROWS, rows)
        self._f32 = [
            tuple(cast("cpu_gguf.GGUFWeight", m.qg).described
                  for m in (lay.qkv_proj, lay.o_proj, lay.gate_up_proj, lay.down_proj))
            for lay in self.layers
        ]  # fmt: skip
        self._product = kernel.product_address
        self._attention = 0
        return self._whole_rows

    def _f32_rows(self) -> int:
        """fp32's one call: up to the rows whose scratch (decode_layer's one allocation a
        call) stays within F32_SCRATCH_BYTES."""
        lay = self.layers[0]
        hidden, inter = lay.qkv_proj.in_features, lay.down_proj.in_features
        qkv = lay.qkv_proj.out_features  # RoPE's copy of q, k and v too
        per_row = 4 * (2 * hidden + 2 * qkv + self._attn_width + 3 * inter)
        return max(MAX_WHOLE_ROWS, F32_SCRATCH_BYTES // per_row)

    def use_f32(self, sgemm: int) -> int:
        """Run each layer in one call, its products through the BLAS ``sgemm`` at that
        address (blas_sgemm): the kernel aten calls, so the products run no slower than from
        Python. Up to _f32_rows rows; returns that limit."""
        self._whole_rows = self._f32_rows()
        self._f32 = [
            tuple(_F32(m.weight.data_ptr(), m.weight.shape[1], m.weight.shape[0], sgemm)
                  for m in (lay.qkv_proj, lay.o_proj, lay.gate_up_proj, lay.down_proj))
            for lay in self.layers
        ]  # fmt: skip
        self._product = self._f32_product
        self._attention = 0
        return self._whole_rows

    def use_panels(self, address: int) -> int:
        """Run each layer in one call, its products through Lumen's panels kernel (its C
        function at ``address``), up to _f32_rows rows; returns that limit."""
        self._whole_rows = self._f32_rows()
        self._f32 = [
            tuple(m.panels[1] for m in (lay.qkv_proj, lay.o_proj, lay.gate_up_proj,
                                        lay.down_proj))
            for lay in self.layers
        ]  # fmt: skip
        self._product = address
        self._attention = 0
        return self._whole_rows

    def _describe(self, attention: int, row_bytes: int = 0, elem_bytes: int = 4) -> list[_Layer]:
        if self._attention != attention:
            described = []
            for i, lay in enumerate(self.layers):
                attn = _Attn(lay.num_heads, lay.num_kv_heads, lay.head_dim, lay.scale, attention,
                             row_bytes, elem_bytes)  # fmt: skip
                norm_in, norm_mlp = self._weights[i]
                layer = _Layer(norm_in=norm_in.data_ptr(), norm_mlp=norm_mlp.data_ptr(),
                               eps=self._eps, attn=attn)  # fmt: skip
                if self._int4 is not None:
                    layer.product = self._int4.product_address
                    for name, q in zip(("qkv", "o", "gate_up", "down"), self._q4[i]):
                        setattr(layer, name, _Weight(ctypes.addressof(q), q.n, q.k))
                elif self._f32:
                    layer.product = self._product
                    for name, w in zip(("qkv", "o", "gate_up", "down"), self._f32[i]):
                        setattr(layer, name, _Weight(ctypes.addressof(w), w.n, w.k))
                described.append(layer)
            self._described, self._attention = described, attention
        return self._described

    def forward(
        self,
        h: torch.Tensor,
        tables: RotaryTables,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor | None:
        """The layers over ``h`` [rows, hidden] (updated in place and returned), or None where
        this step must run op by op. ``lora``: the step's LoRA groups, whose deltas each
        product adds (the products then run from Python, between the native calls)."""
        rows = h.shape[0]
        plan = meta.decode_plan
        if (meta.num_decodes != rows or meta.prefills or meta.local is not None
                or meta.by_layer is not None
                or not isinstance(plan, DecodePlan) or not plan.native
                or plan.cache.native is None or plan.cache.window or h.dtype != torch.float32
                or tables[0].shape[-1] != self.layers[0].head_dim
                or kv_caches[0][0].dtype not in FUSED_KV
                or not kv_caches[0][0].is_contiguous()):  # fmt: skip
            return None
        kv = kv_caches[0][0]
        row_bytes = kv.shape[-1] * kv.element_size() if kv.dtype != torch.float32 else 0
        described = self._describe(plan.cache.native.address(kv.dtype), row_bytes,
                                   kv.element_size())  # fmt: skip
        cos, sin = (t.reshape(rows, -1).contiguous() for t in tables)
        h = h.contiguous()
        threads = torch.get_num_threads()
        step = _Step(cos.data_ptr(), sin.data_ptr(), meta.slot_mapping.data_ptr())
        step.slots, step.positions = plan.slot_idx.data_ptr(), plan.positions.data_ptr()
        whole = rows <= self._whole_rows and lora is None
        if not whole:  # the step's scratch, and the first layer's norm
            xn, attn = torch.empty_like(h), h.new_empty(rows, self._attn_width)
            act = h.new_empty(rows, self.layers[0].intermediate)
            self._norm(h.data_ptr(), None, self._weights[0][0].data_ptr(), self._eps, rows,
                       h.shape[1], xn.data_ptr(), threads)  # fmt: skip
        for index, (k_cache, v_cache) in enumerate(kv_caches):
            kb, vb = plan.mirror(index, k_cache, v_cache)
            step.k_cache, step.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
            step.kb, step.vb = kb.table.data_ptr(), vb.table.data_ptr()
            step.slot_stride, step.head_stride = kb.parts[0].stride(0), kb.parts[0].stride(1)
            if not whole:
                self._glue(index, described[index], step, h, xn, attn, act, threads, lora)
            elif self._layer(ctypes.byref(described[index]), ctypes.byref(step), h.data_ptr(),
                             rows, threads):  # fmt: skip
                raise MemoryError("decode_layer: no memory for its buffers")
        return h

    def _glue(
        self, index: int, described: _Layer, step: _Step, h: torch.Tensor, xn: torch.Tensor,
        attn: torch.Tensor, act: torch.Tensor, threads: int, lora: LoraBatch | None = None,
    ) -> None:  # fmt: skip
        """Layer ``index`` with its products from Python (Linear: whichever kernel, biases
        added) and the rest in three native calls; ``xn`` holds its input norm, and leaves
        with the next layer's."""
        (rows, hidden), x = h.shape, xn.data_ptr()
        qkv_proj, o_proj, gate_up_proj, down_proj = self._products[index]
        qkv = qkv_proj(xn).contiguous()
        if lora is not None:
            lora.add(index, "qkv", xn, qkv)
        if self._attend(ctypes.byref(described.attn), ctypes.byref(step), qkv.data_ptr(),
                        attn.data_ptr(), rows, threads):  # fmt: skip
            raise MemoryError("rope_attend: no memory for its buffers")
        o = o_proj(attn).contiguous()
        if lora is not None:
            lora.add(index, "o", attn, o)
        self._norm(h.data_ptr(), o.data_ptr(), described.norm_mlp, self._eps, rows, hidden, x,
                   threads)  # fmt: skip
        gu = gate_up_proj(xn).contiguous()
        if lora is not None:
            lora.add(index, "gate_up", xn, gu)
        self._swiglu(gu.data_ptr(), act.data_ptr(), rows, act.shape[1], threads)
        down = down_proj(act).contiguous()
        if lora is not None:
            lora.add(index, "down", act, down)
        following = self._weights[index + 1][0] if index + 1 < len(self._weights) else None
        self._norm(h.data_ptr(), down.data_ptr(),
                   None if following is None else following.data_ptr(), self._eps, rows,
                   hidden, x, threads)  # fmt: skip
