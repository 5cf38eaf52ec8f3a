"""KVCacheManager: which blocks each request holds, and the prefix cache over full blocks.

A request's tokens fill its blocks in order; block i holds tokens
[i * block_size, (i + 1) * block_size)::

    tokens   | t0 .. t15 | t16 .. t31 | t32 .. t40 _ _ _ |
    blocks   |  block 7  |  block 2   |    block 9       |
    hashes   |    h0     | h1=H(h0,..)|   (not full)     |

Only full blocks are hashed. Each hash chains over the parent's hash, so equal
hashes mean equal prefixes (checked against the stored (parent, token ids)
before a hit is used).
"""

from __future__ import annotations

import hashlib

from engine.core.block_pool import BlockPool, KVCacheBlock
from engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def root_hash(cache_salt: str | None) -> int:
    """The parent hash of a request's first block; a salt isolates its cache entries."""
    if cache_salt is None:
        return 0
    return int.from_bytes(hashlib.sha256(cache_salt.encode()).digest()[:8], "little")


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of the request, in whole blocks, and its token count.

        At least one token is always left to compute, since the model must run
        on the last token to sample the next one.
        """
        if not self.enable_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        self._hash_blocks(request, max_blocks)
        hits: list[KVCacheBlock] = []
        tokens, bs = request.all_token_ids, self.block_size
        parent = root_hash(request.cache_salt)
        for i in range(max_blocks):
            block_hash = request.block_hashes[i]
            block = self.pool.lookup(block_hash, (parent, tuple(tokens[i * bs : (i + 1) * bs])))
            if block is None:
                break
            hits.append(block)
            parent = block_hash
        return hits, len(hits) * bs

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: list[KVCacheBlock] | None = None,
    ) -> bool:
        """Give the request blocks for ``num_new_tokens`` more tokens; False if too few are free.

        ``computed_blocks`` are prefix-cache hits (from ``get_computed_blocks``)
        for a request that holds no blocks yet. On False nothing has changed.
        """
        computed_blocks = computed_blocks or []
        blocks = self.req_blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        num_total = num_computed + num_new_tokens
        num_required = cdiv(num_total, self.block_size) - len(blocks) - len(computed_blocks)
        # Hits with no reference sit in the free queue; taking them shrinks it.
        num_free_hits = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if num_required > self.pool.num_free_blocks - num_free_hits:
            return False
        if request.request_id not in self.req_blocks:
            self.req_blocks[request.request_id] = blocks
            self._num_cached_blocks[request.request_id] = 0
        if computed_blocks:
            self.pool.touch(computed_blocks)
            blocks.extend(computed_blocks)
            self._num_cached_blocks[request.request_id] = len(computed_blocks)
        if num_required > 0:
            blocks.extend(self.pool.allocate(num_required))
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, num_total // self.block_size)
        return True

    def free(self, request: Request) -> int:
        """Release the request's blocks (returns how many it held); tail blocks go first in the
        eviction order.

        Blocks are indexed when slots are allocated, before the step computes
        them. A request preempted after being scheduled in the same step never
        computes those tokens, so a block it alone holds that is not fully
        computed leaves the index here instead of becoming a false hit.
        """
        blocks = self.req_blocks.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        if not blocks:
            return 0
        for block in blocks[request.num_computed_tokens // self.block_size :]:
            if block.ref_cnt == 1:
                self.pool.uncache(block)
        self.pool.free(blocks[::-1])
        return len(blocks)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> int:
        return self.pool.reset_prefix_cache()

    def _hash_blocks(self, request: Request, num_blocks: int) -> None:
        """Extend ``request.block_hashes`` to cover its first ``num_blocks`` full blocks."""
        hashes, tokens, bs = request.block_hashes, request.all_token_ids, self.block_size
        parent = hashes[-1] if hashes else root_hash(request.cache_salt)
        for i in range(len(hashes), num_blocks):
            parent = hash((parent, tuple(tokens[i * bs : (i + 1) * bs])))
            hashes.append(parent)

    def _cache_full_blocks(
        self, request: Request, blocks: list[KVCacheBlock], num_full: int
    ) -> None:
        start = self._num_cached_blocks[request.request_id]
        if num_full <= start:
            return
        self._hash_blocks(request, num_full)
        tokens, bs, hashes = request.all_token_ids, self.block_size, request.block_hashes
        for i in range(start, num_full):
            parent = hashes[i - 1] if i else root_hash(request.cache_salt)
            key = (parent, tuple(tokens[i * bs : (i + 1) * bs]))
            self.pool.cache(blocks[i], hashes[i], key)
        self._num_cached_blocks[request.request_id] = num_full
