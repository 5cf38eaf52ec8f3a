"""KVCacheManager: which blocks each request holds, and the prefix cache over full blocks.

A request's tokens fill its blocks in order; block i holds tokens
[i * block_size, (i + 1) * block_size)::

    tokens   | t0 .. t15 | t16 .. t31 | t32 .. t40 _ _ _ |
    blocks   |  block 7  |  block 2   |    block 9       |
    hashes   |    h0     | h1=H(h0,..)|   (not full)     |

Only full blocks are hashed. Each hash chains over the parent's hash, so equal
hashes mean equal prefixes (checked against the stored (parent, token ids)
before a hit is used). The hashes are vLLM's sha256_cbor (engine/core/block_hashes.py), so a
router reading the KV events (engine/core/kv_events.py) can hash a prompt itself.

A model with sliding-window layers has several KV groups (engine/kv_layout.py):
the request then holds one such table per group, and a sliding group's table
starts with the null block where its blocks fell behind the window::

    16 tokens a block, 42 computed: the next query (41) reads keys (21, 41]
    group 0 (full)        |  7  |  2  |  9  |   every block kept
    group 1 (window 20)   | nul |  3  |  5  |   block 0 (tokens 0-15) behind the window

A group's blocks are cached under their own key (the group in the hash), so a
prefix hit needs every group's blocks: a full group's from the start, a
sliding group's for the window before the hit's end. KV events report one group's blocks, the
first full one (its blocks decide how long a prefix hit can be).
"""

from __future__ import annotations

from typing import Any

from engine.core import block_hashes
from engine.core.block_pool import BlockKey, BlockPool, KVCacheBlock
from engine.kv_layout import cdiv
from engine.request import Request

# A KV event as vLLM encodes it (engine/core/kv_events.py): a map, its tag under "type".
Event = dict[str, Any]
MEDIUM = "GPU"  # vLLM's name for the engine's own KV cache (its other media are offloads)


def _extra(request: Request, index: int) -> tuple[object, ...] | None:
    """A block's extra keys, as vLLM's, each tagged with its source: a LoRA adapter's name on
    every block (and the id of its load: an adapter loaded again under its name shares no KV
    with the old weights), the cache salt on the first; else none."""
    keys: tuple[object, ...] = ()
    if (lora := request.lora_request) is not None:
        keys = (("lora", lora.lora_name, lora.lora_int_id),)
    if index == 0 and request.cache_salt:
        keys += (("cache_salt", request.cache_salt),)
    return keys or None


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        windows: tuple[int, ...] = (0,),
    ) -> None:
        """``windows``: one per KV group, its sliding window (0: the whole context)."""
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.windows = tuple(windows)
        self.pool = BlockPool(num_blocks)
        # Block 0 stands for a block behind a window: never written, always masked.
        self.null_block = self.pool.allocate(1)[0] if any(self.windows) else None
        # Per request, per group, its blocks in token order.
        self.req_blocks: dict[str, list[list[KVCacheBlock]]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        self.none_hash = block_hashes.none_hash()
        # KV events (enable_events): stored and removed blocks of the first full group.
        self.events: list[Event] | None = None
        self.event_group = next((g for g, w in enumerate(self.windows) if not w), 0)

    def enable_events(self) -> None:
        """Collect KV events from now on (take_events hands them over)."""
        self.events = []
        self.pool.removed = []

    def take_events(self) -> list[Event]:
        """The events since the last call, oldest first: blocks stored, then removed."""
        if self.events is None:
            return []
        out, self.events = self.events, []
        removed = self.pool.removed or []
        self.pool.removed = []
        suffix = b"" if self.event_group == 0 else self.event_group.to_bytes(4, "big")
        gone = [block_hashes.external(h[:32]) for h in removed
                if len(h) == 32 + len(suffix) and h.endswith(suffix)]  # fmt: skip
        if gone:
            out.append({"type": "BlockRemoved", "block_hashes": gone, "medium": MEDIUM})
        return out

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_usable_blocks(self) -> int:
        """The blocks requests can hold (the pool less its null block)."""
        return self.pool.num_blocks - (self.null_block is not None)

    @property
    def num_used_blocks(self) -> int:
        """The blocks requests hold (the null block not counted)."""
        return self.pool.num_used_blocks - (self.null_block is not None)

    def get_computed_blocks(self, request: Request) -> tuple[list[list[KVCacheBlock]], int]:
        """The longest cached prefix of the request, per group in whole blocks, and its
        token count (a sliding group's blocks behind the window are the null block).

        At least one token is always left to compute, since the model must run
        on the last token to sample the next one.
        """
        if not self.enable_caching:
            return [[] for _ in self.windows], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        self._hash_blocks(request, max_blocks)
        tokens, bs = request.all_token_ids, self.block_size
        parent = self.none_hash
        found: list[list[KVCacheBlock | None]] = [[] for _ in self.windows]
        for i in range(max_blocks):
            block_hash = request.block_hashes[i]
            key = (parent, tuple(tokens[i * bs : (i + 1) * bs]), _extra(request, i))
            for g, row in enumerate(found):
                row.append(self.pool.lookup(_group_hash(block_hash, g), _group_key(key, g)))
            if found[0][-1] is None and not self.windows[0]:
                break  # a full group's prefix ends here
            parent = block_hash
        # The longest prefix every group can serve: a full group its whole, a sliding group
        # the blocks of its window before the prefix's end.
        num = len(found[0])
        while num > 0 and not all(self._serves(row, num, w) for row, w in zip(found, self.windows)):
            num -= 1
        hits = [self._hit(row, num, w) for row, w in zip(found, self.windows)]
        return hits, num * bs

    def _serves(self, row: list[KVCacheBlock | None], num: int, window: int) -> bool:
        first = self._first_needed(num * self.block_size, window)
        return len(row) >= num and all(b is not None for b in row[first:num])

    def _hit(self, row: list[KVCacheBlock | None], num: int, window: int) -> list[KVCacheBlock]:
        first = self._first_needed(num * self.block_size, window)
        null = self.null_block
        return [null if i < first else row[i] for i in range(num)]  # type: ignore[misc]

    def _first_needed(self, num_computed: int, window: int) -> int:
        """The first block a group still reads when its next query is at ``num_computed``:
        that query's keys are (num_computed - window, num_computed]."""
        if not window:
            return 0
        return max(0, num_computed - window + 1) // self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: list[list[KVCacheBlock]] | None = None,
        num_lookahead: int = 0,
    ) -> bool:
        """Give the request blocks for ``num_new_tokens`` more tokens; False if too few are free.

        ``computed_blocks`` are prefix-cache hits (from ``get_computed_blocks``)
        for a request that holds no blocks yet. Blocks that fell behind a sliding
        group's window are given back first. On False nothing else has changed.
        ``num_lookahead``: how many of the new tokens are drafts (speculative decoding): they
        get slots, but no block is cached over them (the target may refuse them).
        """
        rid = request.request_id
        groups = self.req_blocks.get(rid)
        if groups is not None:
            self._free_behind_windows(request, groups)
        hits = computed_blocks if computed_blocks and computed_blocks[0] else None
        num_hit = len(hits[0]) if hits else 0
        num_computed = request.num_computed_tokens + num_hit * self.block_size
        num_total = num_computed + num_new_tokens
        want = cdiv(num_total, self.block_size)
        held = [len(b) for b in groups] if groups is not None else [num_hit] * len(self.windows)
        num_required = sum(max(0, want - n) for n in held)
        # Hits with no reference sit in the free queue; taking them shrinks it.
        num_free_hits = len({b.block_id for row in hits or () for b in row if b.ref_cnt == 0})
        if num_required > self.pool.num_free_blocks - num_free_hits:
            return False
        if groups is None:
            groups = self.req_blocks[rid] = [[] for _ in self.windows]
            self._num_cached_blocks[rid] = 0
        if hits:
            for row, hit in zip(groups, hits):
                self.pool.touch([b for b in hit if b is not self.null_block])
                row.extend(hit)
            self._num_cached_blocks[rid] = num_hit
        for row in groups:
            if want > len(row):
                row.extend(self.pool.allocate(want - len(row)))
        if self.enable_caching:
            self._cache_full_blocks(request, groups, (num_total - num_lookahead) // self.block_size)
        return True

    def _free_behind_windows(self, request: Request, groups: list[list[KVCacheBlock]]) -> None:
        null = self.null_block
        for row, window in zip(groups, self.windows):
            if not window:
                continue
            first = min(self._first_needed(request.num_computed_tokens, window), len(row))
            behind = [b for b in row[:first] if b is not null]
            if behind:
                row[:first] = [null] * first  # type: ignore[list-item]
                self.pool.free(behind[::-1])

    def free(self, request: Request) -> int:
        """Release the request's blocks (returns how many it held); tail blocks go first in the
        eviction order.

        Blocks are indexed when slots are allocated, before the step computes
        them. A request preempted after being scheduled in the same step never
        computes those tokens, so a block it alone holds that is not fully
        computed leaves the index here instead of becoming a false hit.
        """
        groups = self.req_blocks.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        if not groups:
            return 0
        num = 0
        for row in groups:
            blocks = [b for b in row if b is not self.null_block]
            for block in row[request.num_computed_tokens // self.block_size :]:
                if block.ref_cnt == 1 and block is not self.null_block:
                    self.pool.uncache(block)
            self.pool.free(blocks[::-1])
            num += len(blocks)
        return num

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block ids in the first KV group."""
        groups = self.req_blocks.get(request_id)
        return [b.block_id for b in groups[0]] if groups else []

    def block_tables(self, request_id: str) -> list[list[int]]:
        """The request's block ids, one table per group."""
        return [[b.block_id for b in row] for row in self.req_blocks.get(request_id, ())]

    def num_held_blocks(self, request_id: str) -> int:
        """The blocks the request holds, the null block not counted."""
        null = self.null_block
        return sum(b is not null for row in self.req_blocks.get(request_id, ()) for b in row)

    def reset_prefix_cache(self) -> int:
        dropped = self.pool.reset_prefix_cache()
        if self.events is not None:  # one event says it all: no BlockRemoved for each
            self.pool.removed = []
            self.events.append({"type": "AllBlocksCleared"})
        return dropped

    def _hash_blocks(self, request: Request, num_blocks: int) -> None:
        """Extend ``request.block_hashes`` to cover its first ``num_blocks`` full blocks."""
        hashes, tokens, bs = request.block_hashes, request.all_token_ids, self.block_size
        parent = hashes[-1] if hashes else self.none_hash
        for i in range(len(hashes), num_blocks):
            parent = block_hashes.block_hash(parent, tokens[i * bs : (i + 1) * bs],
                                             _extra(request, i))  # fmt: skip
            hashes.append(parent)

    def _cache_full_blocks(
        self, request: Request, groups: list[list[KVCacheBlock]], num_full: int
    ) -> None:
        start = self._num_cached_blocks[request.request_id]
        if num_full <= start:
            return
        self._hash_blocks(request, num_full)
        tokens, bs, hashes = request.all_token_ids, self.block_size, request.block_hashes
        stored: list[int] = []  # block indices the event group newly cached
        for i in range(start, num_full):
            parent = hashes[i - 1] if i else self.none_hash
            key = (parent, tuple(tokens[i * bs : (i + 1) * bs]), _extra(request, i))
            for g, row in enumerate(groups):
                if row[i] is not self.null_block:
                    new = self.pool.cache(row[i], _group_hash(hashes[i], g), _group_key(key, g))
                    if new and g == self.event_group and self.events is not None:
                        stored.append(i)
        self._num_cached_blocks[request.request_id] = num_full
        if stored:
            self._stored_events(request, stored)

    def _stored_events(self, request: Request, stored: list[int]) -> None:
        """One BlockStored per run of consecutive blocks, with vLLM's fields in its order (the
        parent hash None for a first block; its defaulted fields left out, as it leaves them)."""
        assert self.events is not None
        hashes, tokens, bs = request.block_hashes, request.all_token_ids, self.block_size
        lora = request.lora_request
        runs: list[list[int]] = []
        for i in stored:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            first, last = run[0], run[-1]
            parent = block_hashes.external(hashes[first - 1]) if first else None
            self.events.append({
                "type": "BlockStored",
                "block_hashes": [block_hashes.external(hashes[i]) for i in run],
                "parent_block_hash": parent,
                "token_ids": list(tokens[first * bs : (last + 1) * bs]),
                "block_size": bs, "lora_id": lora.lora_int_id if lora else None,
                "medium": MEDIUM, "lora_name": lora.lora_name if lora else None,
            })  # fmt: skip


def _group_hash(block_hash: bytes, group: int) -> bytes:
    """A block's hash in its group's index: the same tokens in another group are another
    block (other layers' KV). As vLLM's BlockHashWithGroupId: the group, 4 bytes big-endian,
    after the hash."""
    return block_hash if group == 0 else block_hash + group.to_bytes(4, "big")


def _group_key(key: BlockKey, group: int) -> BlockKey:
    return key if group == 0 else (*key, group)
