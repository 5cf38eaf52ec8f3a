"""KVCacheManager and BlockPool: block accounting, prefix caching, LRU eviction."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from engine.core.block_pool import BlockPool
from engine.core.kv_cache_manager import KVCacheManager
from engine.request import Request
from tests.helpers.factories import make_request

BS = 4


def req(tokens: list[int], salt: str | None = None) -> Request:
    r = make_request(list(tokens), max_tokens=8)
    r.cache_salt = salt
    return r


def admit(mgr: KVCacheManager, r: Request) -> int:
    """Admit like the scheduler does and compute the whole prompt; returns the hit tokens."""
    hits, num_hit = mgr.get_computed_blocks(r)
    assert mgr.allocate_slots(r, r.num_tokens - num_hit, hits)
    r.num_computed_tokens = r.num_tokens
    return num_hit


def state(mgr: KVCacheManager) -> tuple[object, ...]:
    pool = mgr.pool
    return (
        list(pool._free),
        [(b.ref_cnt, b.block_hash, b.key) for b in pool.blocks],
        {rid: [[b.block_id for b in row] for row in g] for rid, g in mgr.req_blocks.items()},
        dict(mgr._num_cached_blocks),
        dict(pool._cached),
    )


def test_allocate_and_free_balance() -> None:
    mgr = KVCacheManager(10, BS)
    r = req(list(range(10)))
    assert admit(mgr, r) == 0
    assert len(mgr.block_ids(r.request_id)) == 3
    assert (mgr.pool.num_free_blocks, mgr.pool.num_used_blocks) == (7, 3)
    r.all_token_ids += [50, 51, 52]
    assert mgr.allocate_slots(r, 3)  # 13 tokens: one more block
    assert len(mgr.block_ids(r.request_id)) == 4
    assert mgr.allocate_slots(r, 0)
    assert mgr.pool.num_free_blocks == 6
    mgr.free(r)
    assert mgr.pool.num_free_blocks == 10 and mgr.req_blocks == {}
    assert all(b.ref_cnt == 0 for b in mgr.pool.blocks)
    mgr.free(r)  # freeing a request that holds nothing is a no-op
    assert mgr.pool.num_free_blocks == 10


def test_block_pool_double_free_raises() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(2)
    pool.free(blocks)
    assert pool.num_free_blocks == 3
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free(blocks[:1])
    with pytest.raises(ValueError):
        pool.allocate(4)


@pytest.mark.parametrize(
    ("first", "second", "expected"),
    [
        (list(range(10)), [*range(10), 90, 91], 8),  # A's third block is not full
        (list(range(12)), list(range(12)), 8),  # one token is always left to compute
        (list(range(12)), list(range(13)), 12),
        (list(range(12)), [0, 1, 2, 3, 4, 99, 6, 7, 8, 9, 10, 11, 12], 4),  # diverges in block 1
        (list(range(12)), [99, *range(1, 13)], 0),
    ],
)
def test_prefix_hits_are_whole_blocks(first: list[int], second: list[int], expected: int) -> None:
    mgr = KVCacheManager(16, BS)
    a, b = req(first), req(second)
    admit(mgr, a)
    assert admit(mgr, b) == expected
    shared = expected // BS
    assert mgr.block_ids(b.request_id)[:shared] == mgr.block_ids(a.request_id)[:shared]
    assert set(mgr.block_ids(b.request_id)[shared:]).isdisjoint(mgr.block_ids(a.request_id))


def test_hit_needs_matching_parent_and_tokens() -> None:
    mgr = KVCacheManager(4, BS)
    b = req([5, 6, 7, 8, 9])
    mgr._hash_blocks(b, 1)
    h0 = b.block_hashes[0]
    block = mgr.pool.blocks[0]
    # A colliding hash whose stored tokens differ is not a hit...
    root = mgr.none_hash
    mgr.pool.cache(block, h0, (root, (1, 1, 1, 1), None))
    assert mgr.get_computed_blocks(b) == ([[]], 0)
    # ...nor one whose parent differs...
    mgr.reset_prefix_cache()
    mgr.pool.cache(block, h0, (b"other", (5, 6, 7, 8), None))
    assert mgr.get_computed_blocks(b) == ([[]], 0)
    # ...but the matching (parent, tokens, extra keys) is.
    mgr.reset_prefix_cache()
    mgr.pool.cache(block, h0, (root, (5, 6, 7, 8), None))
    assert mgr.get_computed_blocks(b) == ([[block]], 4)


def test_shared_blocks_are_ref_counted() -> None:
    mgr = KVCacheManager(8, BS)
    a, b = req(list(range(9))), req([*range(8), 77, 78])
    admit(mgr, a)
    assert admit(mgr, b) == 8
    ids_a, ids_b = mgr.block_ids(a.request_id), mgr.block_ids(b.request_id)
    blocks = mgr.pool.blocks
    assert [blocks[i].ref_cnt for i in ids_a] == [2, 2, 1]
    assert [blocks[i].ref_cnt for i in ids_b] == [2, 2, 1]
    assert mgr.pool.num_free_blocks == 4
    mgr.free(a)
    assert [blocks[i].ref_cnt for i in ids_b] == [1, 1, 1]
    assert mgr.pool.num_free_blocks == 5  # only A's own tail block came back
    mgr.free(b)
    assert mgr.pool.num_free_blocks == 8


def test_freed_cached_blocks_are_reused_until_evicted() -> None:
    mgr = KVCacheManager(4, BS)
    a = req(list(range(9)))
    admit(mgr, a)
    ids = mgr.block_ids(a.request_id)
    mgr.free(a)
    b = req(list(range(9)))
    assert admit(mgr, b) == 8
    assert mgr.block_ids(b.request_id)[:2] == ids[:2]
    assert mgr.pool.num_free_blocks == 1  # hits came out of the free queue, one new block
    mgr.free(b)
    filler = req([500 + i for i in range(16)])
    admit(mgr, filler)  # takes every block: the cached ones are evicted
    mgr.free(filler)
    assert admit(mgr, req(list(range(9)))) == 0


def test_eviction_takes_tail_blocks_before_head() -> None:
    mgr = KVCacheManager(4, BS)
    a = req(list(range(16)))
    admit(mgr, a)  # four full, cached blocks
    ids = mgr.block_ids(a.request_id)
    mgr.free(a)
    filler = req([900, 901, 902])
    admit(mgr, filler)  # needs one block: evicts A's last block
    assert mgr.block_ids(filler.request_id) == ids[3:]
    hits, num_hit = mgr.get_computed_blocks(req(list(range(17))))
    assert num_hit == 12
    assert [b.block_id for b in hits[0]] == ids[:3]


def _a_then_b_freed() -> KVCacheManager:
    """Six blocks; A (tokens 0..8) and B (100..108) admitted, then freed A first."""
    mgr = KVCacheManager(6, BS)
    a, b = req(list(range(9))), req([100 + i for i in range(9)])
    admit(mgr, a)
    admit(mgr, b)
    mgr.free(a)
    mgr.free(b)
    return mgr


def test_eviction_is_least_recently_freed_first() -> None:
    mgr = _a_then_b_freed()
    admit(mgr, req([700 + i for i in range(12)]))  # three blocks: all of A's
    assert mgr.get_computed_blocks(req(list(range(9))))[1] == 0
    assert mgr.get_computed_blocks(req([100 + i for i in range(9)]))[1] == 8


def test_hit_on_free_block_moves_it_to_the_back_of_the_queue() -> None:
    mgr = _a_then_b_freed()
    again = req(list(range(9)))  # touches A's two cached blocks, then frees them last
    assert admit(mgr, again) == 8
    mgr.free(again)
    admit(mgr, req([700 + i for i in range(12)]))
    assert mgr.get_computed_blocks(req([100 + i for i in range(9)]))[1] == 0
    assert mgr.get_computed_blocks(req(list(range(9))))[1] == 8


def test_allocate_slots_false_changes_nothing() -> None:
    mgr = KVCacheManager(4, BS)
    a = req(list(range(9)))
    admit(mgr, a)
    b = req([300 + i for i in range(8)])
    before = state(mgr)
    assert not mgr.allocate_slots(b, 8)
    assert state(mgr) == before and b.request_id not in mgr.req_blocks
    a.all_token_ids += list(range(9, 17))
    assert not mgr.allocate_slots(a, 8)  # 17 tokens need five blocks
    assert state(mgr) == before
    mgr.free(a)
    # C hits A's two cached free blocks but needs three more: only 4 - 2 are left.
    c = req([*range(8), *range(40, 49)])
    hits, num_hit = mgr.get_computed_blocks(c)
    assert num_hit == 8
    before = state(mgr)
    assert not mgr.allocate_slots(c, c.num_tokens - num_hit, hits)
    assert state(mgr) == before
    assert all(b.ref_cnt == 0 for b in hits[0])


def test_reset_prefix_cache() -> None:
    mgr = KVCacheManager(8, BS)
    a, b = req(list(range(9))), req([50 + i for i in range(13)])
    admit(mgr, a)
    admit(mgr, b)
    mgr.free(a)
    held = mgr.block_ids(b.request_id)
    assert mgr.reset_prefix_cache() == 5
    assert mgr.block_ids(b.request_id) == held and mgr.pool.num_free_blocks == 4
    assert all(blk.block_hash is None for blk in mgr.pool.blocks)
    assert mgr.get_computed_blocks(req(list(range(9)))) == ([[]], 0)
    assert mgr.get_computed_blocks(req([50 + i for i in range(13)])) == ([[]], 0)


def test_cache_salt_isolates() -> None:
    mgr = KVCacheManager(16, BS)
    admit(mgr, req(list(range(9)), salt="alice"))
    assert admit(mgr, req(list(range(9)), salt="bob")) == 0
    assert admit(mgr, req(list(range(9)))) == 0
    assert admit(mgr, req(list(range(9)), salt="alice")) == 8


def test_caching_disabled_never_hits() -> None:
    mgr = KVCacheManager(8, BS, enable_caching=False)
    admit(mgr, req(list(range(9))))
    assert admit(mgr, req(list(range(9)))) == 0
    assert all(b.block_hash is None for b in mgr.pool.blocks)


# -- property test -------------------------------------------------------------

PREFIXES = [list(range(1, 13)), [1, 2, 3, 4, 9, 9, 9, 9, 20, 21, 22, 23], [0] * 12]

OPS = st.one_of(
    st.tuples(
        st.just("add"),
        st.integers(0, len(PREFIXES) - 1),
        st.integers(0, 12),
        st.lists(st.integers(0, 2), max_size=6),
        st.sampled_from([None, None, "s"]),
    ),
    st.tuples(st.just("dup"), st.integers(0, 63), st.integers(1, 20), st.sampled_from([None, "s"])),
    st.tuples(st.just("admit"), st.integers(0, 63), st.integers(1, 12)),
    st.tuples(st.just("grow"), st.integers(0, 63), st.integers(1, 6)),
    st.tuples(st.just("free"), st.integers(0, 63)),
    st.tuples(st.just("reset")),
)


class Model:
    """Drives a KVCacheManager and mirrors what the model would write into each block: every
    group writes each computed token into its own block (``windows``: the groups')."""

    def __init__(self, num_blocks: int, block_size: int, windows: tuple[int, ...] = (0,)) -> None:
        self.mgr = KVCacheManager(num_blocks, block_size, windows=windows)
        self.bs = block_size
        self.windows = windows
        self.idle: list[Request] = []  # added or freed (preempted): holds no blocks
        self.held: list[Request] = []
        self.kv: dict[int, list[int | None]] = {}
        self.kv_salt: dict[int, str | None] = {}
        self.kv_group: dict[int, int] = {}

    def compute(self, r: Request, start: int, n: int) -> None:
        for g, blocks in enumerate(self.mgr.req_blocks[r.request_id]):
            for pos in range(start, start + n):
                bid = blocks[pos // self.bs].block_id
                assert bid != 0 or self.mgr.null_block is None  # never the null block
                self.kv.setdefault(bid, [None] * self.bs)[pos % self.bs] = r.all_token_ids[pos]
                self.kv_salt[bid] = r.cache_salt
                self.kv_group[bid] = g
        r.num_computed_tokens = start + n

    def admit(self, pick: int, chunk: int) -> None:
        r = self.idle[pick % len(self.idle)]
        hits, num_hit = self.mgr.get_computed_blocks(r)
        assert num_hit == len(hits[0]) * self.bs < r.num_tokens
        for g, row in enumerate(hits):  # a hit holds exactly this request's tokens
            assert len(row) == len(hits[0])
            for i, blk in enumerate(row):
                if blk is self.mgr.null_block:  # behind the window of the first token to compute
                    assert (i + 1) * self.bs <= num_hit - self.windows[g] + 1
                    continue
                assert self.kv[blk.block_id] == r.all_token_ids[i * self.bs : (i + 1) * self.bs]
                assert self.kv_salt[blk.block_id] == r.cache_salt
                assert self.kv_group[blk.block_id] == g
        n = min(chunk, r.num_tokens - num_hit)
        before = state(self.mgr)
        if self.mgr.allocate_slots(r, n, hits):
            self.idle.remove(r)
            self.held.append(r)
            self.compute(r, num_hit, n)
        else:
            assert state(self.mgr) == before

    def grow(self, pick: int, chunk: int) -> None:
        r = self.held[pick % len(self.held)]
        if r.num_computed_tokens == r.num_tokens:
            r.all_token_ids.append(pick % 3)  # a sampled token
        n = min(chunk, r.num_tokens - r.num_computed_tokens)
        before = state(self.mgr)
        if self.mgr.allocate_slots(r, n):
            self.compute(r, r.num_computed_tokens, n)
        elif self.mgr.null_block is None:  # (a window's blocks behind it are freed first)
            assert state(self.mgr) == before

    def free(self, pick: int) -> None:
        r = self.held.pop(pick % len(self.held))
        self.mgr.free(r)  # BlockPool.free raises on a double free
        r.num_computed_tokens = 0
        self.idle.append(r)

    def check(self) -> None:
        mgr, pool, bs = self.mgr, self.mgr.pool, self.bs
        null = mgr.null_block
        assert set(mgr.req_blocks) == {r.request_id for r in self.held}
        holders: Counter[int] = Counter()
        for r in self.held:
            for g, ids in enumerate(mgr.block_tables(r.request_id)):
                real = [i for i in ids if null is None or i != null.block_id]
                assert len(set(real)) == len(real)
                assert len(ids) == -(-r.num_computed_tokens // bs)
                # Freed behind the window: at most what the next query cannot see. The query at
                # position p reads the keys (p - window, p]: from p - window + 1.
                w = self.windows[g]
                first = max(0, r.num_computed_tokens - w + 1) // bs if w else 0
                assert all(i != 0 or null is None for i in ids[first:])
                holders.update(real)
        for blk in pool.blocks:
            if blk is null:
                continue
            assert blk.ref_cnt == holders[blk.block_id]
            assert (blk.block_id in pool._free) == (blk.ref_cnt == 0)
            if blk.block_hash is not None:
                assert pool._cached[blk.block_hash] is blk
                assert blk.key is not None
                assert self.kv[blk.block_id] == list(blk.key[1])  # holds what it claims
        assert all(blk.block_hash == h for h, blk in pool._cached.items())
        assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks
        assert pool.num_free_blocks == sum(1 for b in pool.blocks if b.ref_cnt == 0)


@settings(max_examples=200, deadline=None)
@given(
    num_blocks=st.integers(2, 24),
    block_size=st.integers(1, 4),
    windows=st.sampled_from([(0,), (0,), (0, 3), (5,), (0, 6, 6)]),
    ops=st.lists(OPS, max_size=60),
)
# A failed growth has already freed the window's first block: the next query (4) reads 2-4.
@example(5, 2, (0, 3), [("add", 0, 4, [], None), ("admit", 0, 4), ("grow", 0, 1)])
def test_random_operations_keep_the_pool_consistent(
    num_blocks: int, block_size: int, windows: tuple[int, ...], ops: list[tuple[object, ...]]
) -> None:
    """Any admissions, growth, frees and resets, with one KV group or several (sliding
    windows free blocks behind them): blocks are counted right, a hit holds what it claims,
    and a window's blocks go back once no query can see them."""
    m = Model(num_blocks, block_size, windows)
    for op in ops:
        kind = op[0]
        if kind == "add":
            _, p, k, tail, salt = op
            prompt = PREFIXES[p][:k] + tail or [7]
            m.idle.append(req(prompt, salt=salt))
        elif kind == "dup" and m.idle + m.held:  # a prompt seen before, salted or not
            _, pick, k, salt = op
            seen = m.idle + m.held
            m.idle.append(req(seen[pick % len(seen)].all_token_ids[:k], salt=salt))
        elif kind == "admit" and m.idle:
            m.admit(op[1], op[2])
        elif kind == "grow" and m.held:
            m.grow(op[1], op[2])
        elif kind == "free" and m.held:
            m.free(op[1])
        elif kind == "reset":
            m.mgr.reset_prefix_cache()
            assert m.mgr.pool._cached == {}
        m.check()
    while m.held:
        m.free(0)
    m.check()
    assert m.mgr.num_used_blocks == 0 and m.mgr.req_blocks == {}


# -- KV groups with sliding windows ---------------------------------------------


def test_a_window_gives_back_the_blocks_behind_it() -> None:
    """A full group keeps a block per 4 tokens; a window of 8 keeps at most the 3 blocks its
    next query can see (its first key's block to its own), the rest back in the pool."""
    mgr = KVCacheManager(64, BS, windows=(0, 8))
    r = req(list(range(10)))
    admit(mgr, r)
    for _ in range(30):  # decode, a token a step
        r.all_token_ids.append(1)
        assert mgr.allocate_slots(r, 1)
        r.num_computed_tokens += 1
        full, local = mgr.req_blocks[r.request_id]
        assert len(full) == len(local) == -(-r.num_computed_tokens // BS)
        held = [b for b in local if b is not mgr.null_block]
        assert len(held) <= 3 and held == local[-len(held) :]
    # 40 computed: the full group's 10 blocks; the next query (40) reads keys (32, 40]: 2.
    assert mgr.num_used_blocks == 10 + 2 == mgr.num_held_blocks(r.request_id)
    assert mgr.free(r) == 12 and mgr.num_used_blocks == 0


def test_a_prefix_hit_after_the_window_was_freed_and_evicted() -> None:
    """A prefix is served where the full group has all its blocks and the window group the
    blocks its window sees at the hit's end: blocks behind the window, evicted since, do not
    stop the hit, which starts the window's table with the null block."""
    mgr = KVCacheManager(1 + 22, BS, windows=(0, 8))
    a = req(list(range(40)))
    admit(mgr, a)  # one 40-token chunk: 10 blocks in each group
    a.all_token_ids.append(7)
    assert mgr.allocate_slots(a, 1)  # the next step frees the window's first 8 blocks
    a.num_computed_tokens += 1
    mgr.free(a)
    filler = req([100 + i for i in range(16)])
    filler_hits, _ = mgr.get_computed_blocks(filler)
    assert mgr.allocate_slots(filler, 16, filler_hits)  # 8 blocks: the 8 freed first, evicted
    mgr.free(filler)
    b = req([*range(40), 5, 6, 7])
    hits, num_hit = mgr.get_computed_blocks(b)
    full, local = hits
    assert num_hit == 40 and len(full) == len(local) == 10
    # The query at 40 reads keys (32, 40]: blocks 8 and 9 of the window's group, hit.
    assert local[:8] == [mgr.null_block] * 8 and mgr.null_block not in local[8:]
    assert mgr.allocate_slots(b, 3, hits)
