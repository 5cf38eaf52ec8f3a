"""Paged attention in plain torch: write new K/V through a slot mapping, read by block table.

KV cache layout, one pair of tensors per layer::

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot = block_id * block_size + offset

A step's tokens are flattened: decode rows (one token each) first, batched
into one SDPA call over their gathered blocks; then each prefill chunk,
attending causally to its cached context plus itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, cast

import torch
import torch.nn.functional as F

from engine.worker.kv_quant import is_packed, pack, unpack


class DecodeAttention(Protocol):
    """Attention of a step's decode rows read from elsewhere than the paged cache
    (decode_cache.DecodePlan: a contiguous mirror)."""

    def windowed(self) -> DecodeAttention:
        """The same rows for a sliding-window layer: its mask hides keys past the window."""
        ...

    def attention(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
    ) -> torch.Tensor: ...


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as 0 / -inf, built once a step: SDPA would otherwise
    convert a boolean mask again in every layer."""
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return mask.masked_fill_(~visible, float("-inf"))


@dataclass
class PrefillChunk:
    start: int  # first row in the flat batch
    end: int
    num_computed: int  # tokens of this sequence already in the cache
    block_table: torch.Tensor | None  # set only when num_computed > 0
    # [chunk, context] 0 / -inf: set when num_computed > 0, or for a chunk longer than a
    # sliding window (else the chunk is causal over itself)
    mask: torch.Tensor | None


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] long
    num_decodes: int
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] long
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks * block_size] 0 / -inf
    prefills: list[PrefillChunk]
    decode_plan: DecodeAttention | None = None  # set: decode rows read the contiguous mirror
    # The sliding-window layers' view of the step (windowed): the same rows and slots, masks
    # that hide keys older than the window. None when no row reaches past the window.
    local: AttentionMetadata | None = None
    # Per layer, the metadata of its KV group (engine/kv_layout.py), where the model's layers
    # are in several groups: each group has its own slots and block tables.
    by_layer: list[AttentionMetadata] | None = None


def windowed(
    meta: AttentionMetadata, window: int, decode_lens: torch.Tensor, dtype: torch.dtype,
    masks: dict[tuple[int, ...], torch.Tensor] | None = None, block_size: int = 0,
) -> AttentionMetadata:  # fmt: skip
    """``meta`` for a layer whose query at position p reads only the keys at (p - window, p]
    (``decode_lens``: each decode row's context, its new token included). ``masks``: the
    step's prefill masks by (context, rows, window), shared by the KV groups of a step. With
    ``block_size``, a chunk over cached context reads its blocks from the first its window
    reaches (not from position 0: at 8K context and a 512 window, a sixth of them)."""
    masks = {} if masks is None else masks
    local = AttentionMetadata(
        slot_mapping=meta.slot_mapping,
        num_decodes=meta.num_decodes,
        decode_block_tables=meta.decode_block_tables,
        decode_mask=None,
        prefills=[
            _windowed_chunk(p, window, dtype, decode_lens.device, masks, block_size)
            for p in meta.prefills
        ],
    )
    if meta.decode_plan is not None:
        local.decode_plan = meta.decode_plan.windowed()
    elif meta.decode_mask is not None:
        keys = torch.arange(meta.decode_mask.shape[-1], device=decode_lens.device).unsqueeze(0)
        lens = decode_lens.unsqueeze(1)
        visible = (keys < lens) & (keys >= lens - window)
        local.decode_mask = additive_mask(visible, dtype).view(meta.decode_mask.shape)
    return local


def _windowed_chunk(
    p: PrefillChunk, window: int, dtype: torch.dtype, device: torch.device,
    masks: dict[tuple[int, ...], torch.Tensor], block_size: int,
) -> PrefillChunk:  # fmt: skip
    end = p.num_computed + p.end - p.start  # the chunk's context, itself included
    if end <= window:
        return p  # no key of it is older than the window
    # With cached context, keys from the block of the first one the window reaches.
    first = 0
    if p.block_table is not None and block_size:
        first = max(0, p.num_computed - window + 1) // block_size
    key = (p.num_computed, p.end - p.start, window, first * block_size)
    mask = masks.get(key)
    if mask is None:
        q_pos = torch.arange(p.num_computed, end, device=device).unsqueeze(1)
        # The keys read: the cached context (from its first block read), then the chunk.
        keys = torch.arange(first * block_size, end, device=device).unsqueeze(0)
        visible = (keys <= q_pos) & (keys > q_pos - window)
        mask = masks[key] = additive_mask(visible, dtype)
    table = p.block_table[first:] if p.block_table is not None else None
    return PrefillChunk(p.start, p.end, p.num_computed, table, mask)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    layer: int = 0,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D] for the step's tokens. Returns [T, H, D]."""
    num_kv_heads, row = k.shape[1], k_cache.shape[-1]
    # Every token's K/V is written before any read, so a request can use
    # blocks another request of the same step fills (a prefix-cache hit).
    # A KV cache in a narrower dtype (--kv-cache-dtype) stores the rounded values (8-bit: codes
    # and a scale a row, kv_quant.py); what is read back is widened to the queries' dtype.
    k_rows, v_rows = pack(k, k_cache.dtype), pack(v, v_cache.dtype)
    k_cache.view(-1, num_kv_heads, row).index_copy_(0, meta.slot_mapping, k_rows)
    v_cache.view(-1, num_kv_heads, row).index_copy_(0, meta.slot_mapping, v_rows)
    if meta.prefills and is_packed(k_cache.dtype):
        # A prefill chunk attends to its own keys as stored, as every later read does: the
        # same tokens whether a sequence was prefilled, decoded or recomputed after preemption.
        k_new, v_new = unpack(k_rows, q.dtype), unpack(v_rows, q.dtype)
    else:
        k_new, v_new = k, v
    gqa = q.shape[1] != num_kv_heads
    nd = meta.num_decodes
    if nd and meta.decode_plan is not None:
        od = meta.decode_plan.attention(layer, q[:nd], k[:nd], v[:nd], k_cache, v_cache, scale)
        if not meta.prefills:
            return od
    elif nd:
        tables = cast("torch.Tensor", meta.decode_block_tables)  # set when decodes have no plan
        kd = unpack(_gather(k_cache, tables, nd), q.dtype)
        vd = unpack(_gather(v_cache, tables, nd), q.dtype)
        od = F.scaled_dot_product_attention(
            q[:nd].unsqueeze(2), kd, vd, attn_mask=meta.decode_mask, scale=scale, enable_gqa=gqa
        ).squeeze(2)
        if not meta.prefills:
            return od  # a decode-only step: no copy
    out = torch.empty_like(q)
    if nd:
        out[:nd] = od
    for p in meta.prefills:
        qp = q[p.start : p.end].transpose(0, 1).unsqueeze(0)
        if p.num_computed == 0:
            kp = k_new[p.start : p.end].transpose(0, 1).unsqueeze(0)
            vp = v_new[p.start : p.end].transpose(0, 1).unsqueeze(0)
            causal = p.mask is None  # else a sliding window's mask
            op = F.scaled_dot_product_attention(
                qp, kp, vp, attn_mask=p.mask, is_causal=causal, scale=scale, enable_gqa=gqa
            )
        else:
            assert p.block_table is not None and p.mask is not None
            ctx = p.mask.shape[1]
            kp = unpack(_gather(k_cache, p.block_table.unsqueeze(0), 1)[:, :, :ctx], q.dtype)
            vp = unpack(_gather(v_cache, p.block_table.unsqueeze(0), 1)[:, :, :ctx], q.dtype)
            op = F.scaled_dot_product_attention(
                qp, kp, vp, attn_mask=p.mask, scale=scale, enable_gqa=gqa
            )
        out[p.start : p.end] = op.squeeze(0).transpose(0, 1)
    return out


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, batch: int) -> torch.Tensor:
    """[B, max_blocks] block ids -> [B, KVH, max_blocks * block_size, D]."""
    # index_select on the block dimension copies whole blocks; advanced
    # indexing (cache[block_tables]) was 4x slower on CPU.
    blocks = cache.index_select(0, block_tables.view(-1))  # [B * max_blocks, bs, KVH, D]
    return blocks.view(batch, -1, cache.shape[2], cache.shape[3]).transpose(1, 2)


def chunk_with_context(
    row0: int, n: int, start: int, table: list[int],
    masks: dict[tuple[int, ...], torch.Tensor] | None, block_size: int, dtype: torch.dtype,
    device: torch.device,
) -> PrefillChunk:  # fmt: skip
    """A prefill chunk of ``n`` tokens (flat rows from ``row0``) over ``start`` cached tokens
    in the blocks of ``table``, its causal mask from the step's ``masks`` (built once a step,
    keyed by (start, n)); None: no mask (a window's replaces it)."""
    ctx = start + n
    num_blocks = -(-ctx // block_size)
    mask = None
    if masks is not None:
        mask = masks.get((start, n))
        if mask is None:
            q_pos = torch.arange(start, ctx, device=device).unsqueeze(1)
            visible = torch.arange(ctx, device=device).unsqueeze(0) <= q_pos
            mask = masks[(start, n)] = additive_mask(visible, dtype)
    block_table = torch.tensor(table[:num_blocks], dtype=torch.long, device=device)
    return PrefillChunk(row0, row0 + n, start, block_table, mask)
