"""The 8-bit KV cache's rows (engine/worker/kv_quant.py) and the native decode attention over
them, against float64 references."""

from __future__ import annotations

import pytest
import torch

from engine.worker import cpu_attention, kv_quant
from engine.worker.cpu_attention import Chunks
from tests.helpers.native import built

CHUNK = 8  # the tests' kernels hold 8 positions a chunk: contexts cross several
KINDS = [torch.int8, torch.uint8]  # int8, and fp8 (e4m3) stored as bytes
IDS = ["int8", "fp8"]


@pytest.mark.parametrize("dtype", KINDS, ids=IDS)
def test_a_row_keeps_its_values_within_its_codes_resolution(dtype: torch.dtype) -> None:
    """Rows of every magnitude (1e-6 to 1e4, and all zero) round trip within half a code: int8
    within half its scale (max |x| / 127), e4m3 within 1/16 of each value (3 mantissa bits)
    or half its smallest step; a zero row stays zero."""
    torch.manual_seed(0)
    x = torch.randn(64, 3, 64) * 10 ** torch.empty(64, 1, 1).uniform_(-6, 4)
    x[5] = 0
    rows = kv_quant.pack(x, dtype)
    assert rows.shape == (64, 3, 68) and rows.dtype == dtype
    back = kv_quant.unpack(rows, torch.float64)
    scale = x.abs().amax(-1, keepdim=True).double() / (127 if dtype == torch.int8 else 448)
    err = (back - x.double()).abs()
    if dtype == torch.int8:
        assert (err <= scale / 2 * (1 + 1e-6)).all()
    else:
        assert (err <= torch.maximum(x.double().abs() / 16, scale * 2.0**-10) * (1 + 1e-6)).all()
    assert (back[5] == 0).all()


# (query heads per KV head, head_dim): SmolLM2's, Gemma 3's, Llama 3's and a single head
SHAPES = [(3, 64), (4, 256), (4, 128), (1, 64)]


@pytest.mark.parametrize("dtype", KINDS, ids=IDS)
@pytest.mark.parametrize(("group", "dim"), SHAPES)
def test_the_kernel_matches_a_float64_reference(group: int, dim: int, dtype: torch.dtype) -> None:
    """The native decode attention over 8-bit rows (codes widened, scales applied in place)
    against float64 attention over the same rows' values, for rows whose contexts cross
    chunks, including the rows' own new K and V that the kernel packs first."""
    kernel = built(
        lambda: cpu_attention.NativeDecodeAttention(cpu_attention.build(group, dim, CHUNK), CHUNK)
    )
    torch.manual_seed(group * 1000 + dim)
    rows, kvh, width = 5, 2, 4 * CHUNK
    positions = torch.tensor([0, 3, CHUNK, 2 * CHUNK + 5, 4 * CHUNK - 1])
    k_all = torch.randn(rows, kvh, width, dim)
    v_all = torch.randn(rows, kvh, width, dim)
    k_new, v_new = torch.randn(rows, kvh, dim), torch.randn(rows, kvh, dim)
    q = torch.randn(rows, kvh * group, dim)
    kb = Chunks.view(kv_quant.pack(k_all, dtype), CHUNK)
    vb = Chunks.view(kv_quant.pack(v_all, dtype), CHUNK)
    scale = dim**-0.5
    out = kernel(q, k_new, v_new, kb, vb, torch.arange(rows), positions, scale)

    # The reference: the stored rows' values, each row's own new K and V at its position.
    keys = kv_quant.unpack(kv_quant.pack(k_all, dtype), torch.float64)
    values = kv_quant.unpack(kv_quant.pack(v_all, dtype), torch.float64)
    for r, p in enumerate(positions.tolist()):
        keys[r, :, p] = kv_quant.unpack(kv_quant.pack(k_new[r], dtype), torch.float64)
        values[r, :, p] = kv_quant.unpack(kv_quant.pack(v_new[r], dtype), torch.float64)
        qr = q[r].double().view(kvh, group, dim)
        scores = qr @ keys[r, :, : p + 1].transpose(-1, -2) * scale
        want = (scores.softmax(-1) @ values[r, :, : p + 1]).view(kvh * group, dim)
        torch.testing.assert_close(out[r].double(), want, atol=2e-5, rtol=1e-4)
