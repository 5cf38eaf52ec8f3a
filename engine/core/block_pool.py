"""BlockPool: the KV blocks, their reference counts, the free queue and the prefix-cache index."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

# What a cached block holds: (parent hash, token ids), and its KV group where not the first.
BlockKey = tuple[Any, ...]


class KVCacheBlock:
    """Metadata of one KV cache block; the tensors live in the model runner."""

    __slots__ = ("block_hash", "block_id", "key", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Set while the block holds a full, cached block of tokens. ``key`` is
        # (parent hash, token ids, extra keys): a hash hit is only trusted when it matches.
        self.block_hash: bytes | None = None
        self.key: BlockKey | None = None

    def __repr__(self) -> str:
        digest = self.block_hash.hex()[:16] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={digest})"


class BlockPool:
    """Owns every block. A block is either in use (ref_cnt > 0) or in the free queue.

    The free queue is in eviction order (least recently freed first). A freed
    block keeps its hash, so a later request can still hit it until it is
    evicted, that is, handed out again by ``allocate``.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks
        )
        self._cached: dict[bytes, KVCacheBlock] = {}
        # Where KV events are on (KVCacheManager.enable_events): the hashes evicted since the
        # manager last took them.
        self.removed: list[bytes] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the head of the free queue, evicting their hashes."""
        if num_blocks > len(self._free):
            raise ValueError(f"cannot allocate {num_blocks} blocks, {len(self._free)} free")
        out = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits, pulling free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: list[KVCacheBlock]) -> None:
        """Drop one reference on each block; the order given is the eviction order."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"{block} freed twice")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def lookup(self, block_hash: bytes, key: BlockKey) -> KVCacheBlock | None:
        block = self._cached.get(block_hash)
        if block is None or block.key != key:
            return None
        return block

    def cache(self, block: KVCacheBlock, block_hash: bytes, key: BlockKey) -> bool:
        """Index a full block; whether it was newly indexed (a block already cached, or a
        duplicate of one, is left as is)."""
        if block.block_hash is not None or block_hash in self._cached:
            return False
        block.block_hash = block_hash
        block.key = key
        self._cached[block_hash] = block
        return True

    def uncache(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            self._evict(block)

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash; blocks in use stay allocated. Returns how many were dropped."""
        num = len(self._cached)
        for block in list(self._cached.values()):
            self._evict(block)
        return num

    def _evict(self, block: KVCacheBlock) -> None:
        assert block.block_hash is not None
        if self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
            if self.removed is not None:
                self.removed.append(block.block_hash)
        block.block_hash = None
        block.key = None
