"""A contiguous mirror of the KV of decoding requests, so decode attention reads it in place.

Paged decode attention on CPU first gathers every decoding request's blocks
into one [B, KVH, L, D] tensor, in every layer of every step: it reads and
writes the whole context once more than attention itself does. Here each
decoding request instead owns a slot of per-layer tensors
``[slots, KVH, width, D]``: its context is copied in once, when it starts
decoding (or again if its slot fell behind), then each step appends one token.
Attention runs over the slots as they lie.

Each layer's K (and V) lies in chunks of ``CHUNK`` positions, ``[slots, KVH, CHUNK, D]``
each: a context that outgrows the width adds a chunk, and nothing is copied. (One tensor
``[slots, KVH, width, D]`` had to be reallocated and copied to grow: at 72 slots, from 512
positions to 1,024, a 4-second decode step on a VM whose first write to fresh memory costs
1.2 ms a MB.) More slots still copy every chunk.

A sliding-window group's cache (engine/kv_layout.py) is a ring: a slot holds the
last ``ring`` positions (the window, rounded up to chunks), position p at
``p % ring``, so its memory is the window's, however long the context. Attention
over a ring reads it as it lies: a key's place in the ring does not matter, its
mask does (RoPE is in the cached keys).

The paged cache stays the source of truth (prefix caching, preemption); a
slot is only a copy of its blocks. A request's slot is dropped when it
finishes or is preempted. The mirror is bounded by ``max_bytes``; a step that
would need more runs with the gather path instead.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, replace

import torch

from engine.worker import heap
from engine.worker.attention import additive_mask
from engine.worker.cpu_attention import CHUNK, Chunks, NativeDecodeAttention
from engine.worker.kv_quant import SCALE_BYTES, is_packed, pack, unpack

logger = logging.getLogger(__name__)

SLOT_STEP = 8

Move = tuple[int, int, int]  # (from slot, to slot, valid tokens)


@dataclass
class DecodePlan:
    """What one step's decode rows do with the mirror (tensors on the device)."""

    cache: DecodeCache
    slot_idx: torch.Tensor  # [nd] the slot of each decode row
    positions: torch.Tensor  # [nd] where each row's new token goes
    used: int  # slots [0, used) take part in attention
    width: int  # positions [0, width) take part
    mask: torch.Tensor | None  # [used, 1, 1, width] 0 / -inf (torch's path only)
    moves: list[Move]  # (from slot, to slot, tokens) copied first
    # (slot, tokens, block ids, first position they hold) copied in next
    fills: list[tuple[int, int, torch.Tensor, int]]
    in_order: bool  # decode row i is slot i (so used == rows): q and the output stay as they are
    # A sliding window's mask (the cache's window set), for the local layers: they run
    # torch's path, the native kernel having no window.
    window_mask: torch.Tensor | None = None
    native: bool = True  # the cache's native kernel, where it has one
    first_chunk: int = 0  # torch's path reads chunks from this one on
    window_first_chunk: int = 0  # the first chunk a local layer's window reaches

    def windowed(self) -> DecodePlan:
        if self.cache.ring:  # a ring's own mask is its window's
            return self
        assert self.window_mask is not None  # the cache has a window
        return replace(self, mask=self.window_mask, native=False,
                       first_chunk=self.window_first_chunk)  # fmt: skip

    def mirror(
        self, layer: int, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> tuple[Chunks, Chunks]:
        """The layer's mirror (K and V in chunks), its moves and fills done (``k_cache``,
        ``v_cache``: the layer's paged cache they fill from)."""
        cache = self.cache
        at = cache.index_of[layer]
        kb, vb = cache.k[at], cache.v[at]
        ring = cache.ring
        for src, dst, n in self.moves:
            n = min(n, ring) if ring else n
            kb.write(dst, 0, kb.read(src, n))
            vb.write(dst, 0, vb.read(src, n))
        for slot, n, blocks, first in self.fills:
            for buf, paged in ((kb, k_cache), (vb, v_cache)):
                values = _blocks(paged, blocks)[first % cache.block_size :][: n - first]
                cache.put(buf, slot, first, values.transpose(0, 1))
        return kb, vb

    def attention(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Attention of the decode rows (q, k, v: [nd, heads, D]) over their slots."""
        kb, vb = self.mirror(layer, k_cache, v_cache)
        if self.cache.native is not None and self.native:  # it writes the rows' K and V
            return self.cache.native(q, k, v, kb, vb, self.slot_idx, self.positions, scale,
                                     self.cache.ring)  # fmt: skip
        at = self.positions % self.cache.ring if self.cache.ring else self.positions
        kb.set_rows(self.slot_idx, at, pack(k, kb.dtype))
        vb.set_rows(self.slot_idx, at, pack(v, vb.dtype))
        assert self.mask is not None
        if self.in_order:
            qs = q
        else:
            qs = q.new_zeros(self.used, q.shape[1], q.shape[2])
            qs[self.slot_idx] = q
        # torch's path reads one tensor: the chunks it needs, joined (a window needs the last)
        first, chunk = self.first_chunk, kb.chunk
        k_all = kb.joined(self.used, first, self.width)
        v_all = vb.joined(self.used, first, self.width)
        if is_packed(k_all.dtype):  # 8-bit rows: their values, for torch's path
            k_all, v_all = unpack(k_all, q.dtype), unpack(v_all, q.dtype)
        mask = self.mask[..., first * chunk :] if first else self.mask
        out = torch_attention(qs, k_all, v_all, self.width - first * chunk, mask, scale)
        return out if self.in_order else out[self.slot_idx]


def torch_attention(
    qs: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, width: int, mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:  # fmt: skip
    """Attention of slots [0, used) (qs: [used, heads, D]) over positions [0, width)."""
    used, heads, dim = qs.shape
    k, v = kb[:used, :, :width], vb[:used, :, :width]
    if k.dtype != qs.dtype:  # a KV stored in a narrower dtype
        k, v = k.to(qs.dtype), v.to(qs.dtype)
    # The query heads that share a KV head are rows of one product with it
    # ([slots, KVH, group, D] x [slots, KVH, D, width]): K and V are read once per
    # KV head, in two batched matrix products. Measured against SDPA's CPU kernel
    # (q_len 1, enable_gqa) at 16-64 rows and 128-512 positions, cache cold:
    # 9-17% faster.
    qs = qs.view(used, kb.shape[1], -1, dim)
    scores = torch.matmul(qs, k.transpose(-1, -2))
    probs = torch.softmax(scores.mul_(scale).add_(mask), dim=-1)
    return torch.matmul(probs, v).view(used, heads, dim)


class DecodeCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        max_bytes: int,
        kv_dtype: torch.dtype | None = None,
        native: NativeDecodeAttention | None = None,
        window: int = 0,
        chunk: int = CHUNK,
        layers: list[int] | None = None,
        ring: bool = False,
    ) -> None:
        """``chunk``: positions a chunk of the mirror holds (the native kernel's, if set).
        ``layers``: the model's layers this cache holds (default: ``range(num_layers)``).
        ``ring``: every layer here has the sliding ``window``, and a slot keeps only that."""
        layers = list(range(num_layers)) if layers is None else layers
        num_layers = len(layers)
        self.index_of = {layer: i for i, layer in enumerate(layers)}
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.dtype = dtype  # the model's: queries and masks
        self.kv_dtype = kv_dtype or dtype  # the mirror's, the paged cache's (storage dtype)
        # Elements of a stored row: head_dim, and an 8-bit cache's scale (kv_quant.py).
        self.row = head_dim + SCALE_BYTES if is_packed(self.kv_dtype) else head_dim
        self.window = window  # the local layers' sliding window (0: none)
        chunk = native.chunk if native is not None else chunk
        ring_width = -(-window // chunk) * chunk if ring and window else 0
        if ring_width and ring_width != window:
            native = None  # a ring longer than its window masks its oldest places: torch's path
        self.native = native  # the compiled CPU kernel, else torch's path
        if native is not None and window and not ring_width:
            logger.info("native decode attention has no sliding window: the local layers "
                        "run torch's path")  # fmt: skip
        self.device = device
        self.max_bytes = max_bytes
        # Chunks of CHUNK positions; the native kernel's own (tests build it smaller).
        self.chunk = chunk
        # A ring's positions per slot (0: not a ring): the window, in whole chunks.
        self.ring = ring_width
        self.k: list[Chunks] = []
        self.v: list[Chunks] = []
        self.num_slots = 0
        self.width = 0
        self.slot_of: dict[str, int] = {}
        self.length: list[int] = []  # valid positions of each slot

    def bytes_for(self, slots: int, width: int) -> int:
        per = self.num_kv_heads * self.row * self.kv_dtype.itemsize
        return 2 * self.num_layers * slots * width * per

    def drop(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            slot = self.slot_of.pop(req_id, None)
            if slot is not None:
                self.length[slot] = 0
        if not self.slot_of and self.num_slots:
            self.release()

    def release(self) -> None:
        had = bool(self.k)
        self.k, self.v = [], []
        self.num_slots = self.width = 0
        self.slot_of.clear()
        self.length = []
        if had:  # its chunks came from the heap (heap.py): their pages go back to the OS
            heap.trim()

    def plan(
        self, req_ids: list[str], starts: list[int], tables: list[list[int]]
    ) -> DecodePlan | None:
        """Slots for this step's decode rows, or None (use the gather path) when over budget.
        The step's forward runs the plan's moves and fills (``mirror``, every layer) before the
        next plan: a slot's ``length`` positions are then its request's, and a later plan fills
        only past them. Rows of one request at consecutive positions (a request verifying
        drafts) share its slot."""
        slots, moves = self._assign(req_ids, starts)
        used = max(slots) + 1
        # Attention reads positions [0, span) only; the mirror grows a chunk at a time (a
        # ring: up to its width).
        span = max(starts) + 1
        width = -(-span // self.chunk) * self.chunk
        if self.ring:
            width = min(width, self.ring)
            span = min(span, self.ring)
        if not self._fit(used, width):
            for req_id in req_ids:  # these rows' slots fall behind this step
                slot = self.slot_of.get(req_id)
                if slot is not None:
                    self.length[slot] = 0
            return None
        for _, dst, n in moves:
            self.length[dst] = n  # the source is freed below, with the row's old slot
        fills = []
        bs = self.block_size
        prev = None
        for req_id, slot, start, table in zip(req_ids, slots, starts, tables):
            if req_id == prev:  # a request verifying drafts: its next row, one position on
                self.length[slot] = start + 1
                continue
            prev = req_id
            old = self.slot_of.get(req_id)
            if old is not None and old != slot:
                self.length[old] = 0  # left behind: free
            self.slot_of[req_id] = slot
            # A slot past the row (drafts its last step refused, outside a ring) holds the
            # request's own keys before it: the row writes over the rest.
            if self.length[slot] != start and not (self.length[slot] > start and not self.ring):
                # A ring needs only the window's keys before this one; another slot, those past
                # what it holds (its own keys, valid: a request's tokens never change).
                first = max(0, start - self.window + 1) if self.ring else self.length[slot]
                blocks = table[first // bs : -(-start // bs)]
                ids = torch.tensor(blocks, dtype=torch.long, device=self.device)
                fills.append((slot, start, ids, first))
            self.length[slot] = start + 1
        dev = self.device
        mask = window_mask = None
        window_first = 0
        if self.ring:
            mask = self._ring_mask(used, span) if self.native is None else None
        elif self.native is None or self.window:
            # A slot no row uses this step shows its first position: finite, never NaN.
            lens = torch.tensor([max(n, 1) for n in self.length[:used]], device=dev).unsqueeze(1)
            keys = torch.arange(span, device=dev).unsqueeze(0)
            visible = keys < lens
            mask = additive_mask(visible, self.dtype).view(used, 1, 1, span)
            if self.window:
                visible &= keys >= lens - self.window
                window_mask = additive_mask(visible, self.dtype).view(used, 1, 1, span)
                # The chunk of the earliest position a row's window reaches: torch's path
                # joins the chunks from there. A slot no row uses may then show no position
                # at all: its output (NaN) is never read.
                window_first = max(min(starts) + 1 - self.window, 0) // self.chunk
        return DecodePlan(
            cache=self,
            slot_idx=torch.tensor(slots, dtype=torch.long, device=dev),
            positions=torch.tensor(starts, dtype=torch.long, device=dev),
            used=used,
            width=span,
            mask=mask,
            moves=moves,
            fills=fills,
            in_order=slots == list(range(len(slots))),
            window_mask=window_mask,
            window_first_chunk=window_first,
        )

    def _ring_mask(self, used: int, width: int) -> torch.Tensor:
        """Slots [0, used) of a ring over places [0, width): place r holds position
        cur - (cur - r) % ring, seen where that is in the window and not before 0."""
        dev = self.device
        cur = torch.tensor([max(n, 1) - 1 for n in self.length[:used]], device=dev).unsqueeze(1)
        back = (cur - torch.arange(width, device=dev).unsqueeze(0)) % self.ring
        visible = back < torch.clamp(cur + 1, max=self.window)
        return additive_mask(visible, self.dtype).view(used, 1, 1, width)

    def put(self, buf: Chunks, slot: int, first: int, values: torch.Tensor) -> None:
        """Positions [first, first + n) of ``slot`` = values [KVH, n, D]: in place, or in a
        ring at their places (in two pieces where they wrap)."""
        if not self.ring:
            buf.write(slot, first, values)
            return
        n, ring = values.shape[1], self.ring
        values = values[:, max(0, n - ring) :]  # more than a ring holds: the last ring of them
        first += max(0, n - ring)
        at = first % ring
        head = min(values.shape[1], ring - at)
        buf.write(slot, at, values[:, :head])
        if head < values.shape[1]:
            buf.write(slot, 0, values[:, head:])

    def _assign(self, req_ids: list[str], starts: list[int]) -> tuple[list[int], list[Move]]:
        """A slot per row, packed into [0, rows) where possible, so attention reads no
        finished request's slot; a row above that moves down (its valid part copied)."""
        nd = len(dict.fromkeys(req_ids))  # a request verifying drafts has a row a position
        taken = set(self.slot_of.values())
        low_free = [s for s in range(nd) if s not in taken]
        low_free.reverse()  # pop() gives the lowest
        slots, moves = [], []
        prev = None
        for req_id, start in zip(req_ids, starts):
            if req_id == prev:  # the same request's next row: its slot
                slots.append(slots[-1])
                continue
            prev = req_id
            old = self.slot_of.get(req_id)
            if old is not None and (old < nd or not low_free):
                slot = old
            elif low_free:
                slot = low_free.pop()
                valid = self.length[old] if old is not None else -1
                if old is not None and (valid == start or (valid > start and not self.ring)):
                    moves.append((old, slot, start))
            else:
                slot = next(s for s in itertools.count(nd) if s not in taken)
            taken.add(slot)
            slots.append(slot)
        return slots, moves

    def _part(self, slots: int) -> torch.Tensor:
        shape = (slots, self.num_kv_heads, self.chunk, self.row)
        if self.native is not None and not self.window:  # it reads only what rows wrote
            return torch.empty(shape, dtype=self.kv_dtype, device=self.device)
        # Zeroed for torch's path: slots outside a row's length are masked, but a masked NaN
        # would poison P @ V.
        return torch.zeros(shape, dtype=self.kv_dtype, device=self.device)

    def _fit(self, slots: int, width: int) -> bool:
        """Grow the mirror to hold ``slots`` x ``width``; False if that is over budget. More
        width adds chunks (nothing copied); more slots reallocates every chunk (copied), twice
        the slots at a time so that stays rare."""
        if slots <= self.num_slots and width <= self.width:
            return True
        new_slots = (
            max(slots, 2 * self.num_slots, SLOT_STEP) if slots > self.num_slots else self.num_slots
        )
        new_width = max(width, self.width)
        if self.bytes_for(new_slots, new_width) > self.max_bytes:
            new_slots = max(self.num_slots, slots)
            if self.bytes_for(new_slots, new_width) > self.max_bytes:
                return False
        old = self.k + self.v or [Chunks.of([], self.chunk)] * (2 * self.num_layers)
        chunks = new_width // self.chunk
        grown = []
        for layer in old:
            if new_slots == self.num_slots:  # wider: chunks added, none copied
                parts = layer.parts + [
                    self._part(new_slots) for _ in range(chunks - len(layer.parts))
                ]
            else:  # more slots: every chunk anew, what each slot held copied in
                parts = [self._part(new_slots) for _ in range(chunks)]
                for new, part in zip(parts, layer.parts):
                    new[: self.num_slots] = part
            grown.append(Chunks.of(parts, self.chunk))
        self.k, self.v = grown[: self.num_layers], grown[self.num_layers :]
        self.length += [0] * (new_slots - self.num_slots)
        self.num_slots, self.width = new_slots, new_width
        return True


def _blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """[n] block ids -> [n * block_size, KVH, D] (a copy)."""
    return cache.index_select(0, block_ids).flatten(0, 1)
