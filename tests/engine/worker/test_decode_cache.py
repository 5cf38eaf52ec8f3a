"""The CPU decode mirror gives the same attention as gathering the paged blocks, step after step,
with torch's kernel and the native one, over an fp32 and a bf16 KV cache."""

from __future__ import annotations

import functools
import random
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.worker import cpu_attention, kv_quant
from engine.worker.attention import AttentionMetadata, paged_attention, windowed
from engine.worker.cpu_attention import Chunks
from engine.worker.decode_cache import DecodeCache
from tests.helpers.factories import make_core_request
from tests.helpers.native import built

BS, KVH, H, D, BLOCKS = 4, 2, 4, 8, 96
CHUNK = 8  # positions a chunk of the mirror holds here: contexts cross several


def reference_meta(slots: torch.Tensor, tables: list[list[int]], lens: list[int]):
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    visible = torch.arange(width * BS).unsqueeze(0) < torch.tensor(lens).unsqueeze(1)
    mask = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
    return AttentionMetadata(slots, len(tables), block_tables, mask.view(len(tables), 1, 1, -1), [])


@functools.cache
def native_kernel() -> cpu_attention.NativeDecodeAttention:
    return built(
        lambda: cpu_attention.NativeDecodeAttention(cpu_attention.build(H // KVH, D, CHUNK), CHUNK)
    )


@pytest.mark.parametrize(
    "kv_dtype",
    [torch.float32, torch.bfloat16, torch.int8, torch.uint8],
    ids=["fp32", "bf16", "int8", "fp8"],  # fp8 rows are stored as uint8 (kv_quant.py)
)
@pytest.mark.parametrize("kernel", ["torch", "native"])
@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    budget_slot_tokens=st.sampled_from([24, 200, 10_000]),
    window=st.sampled_from([0, 3, 9]),
)
def test_mirror_matches_gather(
    kernel: str, kv_dtype: torch.dtype, seed: int, budget_slot_tokens: int, window: int
) -> None:
    """Requests join, decode in shuffled order, skip steps, finish or are preempted;
    with a budget that sometimes forces the gather path and reallocations. With a sliding
    window, a local layer's view of the same step (torch's path over the mirror, whichever
    kernel the others run) matches the gather path under the window's mask."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    row = D + 4 if kv_quant.is_packed(kv_dtype) else D  # 8-bit: codes, then the row's scale
    k_cache = torch.zeros(BLOCKS, BS, KVH, row, dtype=kv_dtype)
    v_cache = torch.zeros(BLOCKS, BS, KVH, row, dtype=kv_dtype)
    per_token = 2 * KVH * row * kv_dtype.itemsize
    cache = DecodeCache(
        1, KVH, D, BS, torch.float32, torch.device("cpu"), budget_slot_tokens * per_token,
        kv_dtype=kv_dtype, native=native_kernel() if kernel == "native" else None,
        window=window, chunk=CHUNK,
    )  # fmt: skip
    free_blocks = list(range(BLOCKS))
    rng.shuffle(free_blocks)
    live: dict[str, tuple[list[int], int]] = {}  # request -> (blocks, tokens in cache)
    next_id = 0
    for _ in range(40):
        # New requests arrive already prefilled (their KV written straight into blocks).
        while len(live) < 6 and len(free_blocks) > 12 and rng.random() < 0.5:
            n = rng.randint(1, 14)
            blocks = [free_blocks.pop() for _ in range(-(-n // BS) + 1)]
            for pos in range(n):
                k_cache[blocks[pos // BS], pos % BS] = kv_quant.pack(torch.randn(KVH, D), kv_dtype)
                v_cache[blocks[pos // BS], pos % BS] = kv_quant.pack(torch.randn(KVH, D), kv_dtype)
            live[f"r{next_id}"] = (blocks, n)
            next_id += 1
        rows = [r for r in live if rng.random() < 0.8]
        rng.shuffle(rows)
        rows = [r for r in rows if live[r][1] < len(live[r][0]) * BS]  # room for one more
        if rows:
            tables = [live[r][0] for r in rows]
            starts = [live[r][1] for r in rows]
            slots = torch.tensor([t[s // BS] * BS + s % BS for t, s in zip(tables, starts)])
            q = torch.randn(len(rows), H, D)
            k = torch.randn(len(rows), KVH, D)
            v = torch.randn(len(rows), KVH, D)
            ref_k, ref_v = k_cache.clone(), v_cache.clone()
            want = paged_attention(
                q, k, v, ref_k, ref_v, reference_meta(slots, tables, [s + 1 for s in starts]), 0.3
            )
            lens = [s + 1 for s in starts]
            meta = reference_meta(slots, tables, lens)
            meta.decode_plan = cache.plan(rows, starts, tables)
            got = paged_attention(q, k, v, k_cache, v_cache, meta, 0.3)
            torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-5)
            if window:
                ref = reference_meta(slots, tables, lens)
                lens_t = torch.tensor(lens)
                want = paged_attention(
                    q, k, v, ref_k, ref_v, windowed(ref, window, lens_t, q.dtype), 0.3
                )
                got = paged_attention(
                    q, k, v, k_cache, v_cache, windowed(meta, window, lens_t, q.dtype), 0.3
                )
                torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-5)
            for r in rows:
                live[r] = (live[r][0], live[r][1] + 1)
        # Some requests finish or are preempted (their blocks go back).
        for r in [r for r in live if rng.random() < 0.15 or live[r][1] >= len(live[r][0]) * BS]:
            free_blocks.extend(live.pop(r)[0])
            cache.drop([r])
    assert cache.bytes_for(cache.num_slots, cache.width) <= cache.max_bytes


@pytest.mark.parametrize("kernel", ["torch", "native"])
@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    window=st.sampled_from([3, 8, 9, 16, 17]),
    budget_slot_tokens=st.sampled_from([40, 10_000]),
)
def test_a_ring_matches_gather_under_the_window(
    kernel: str, seed: int, window: int, budget_slot_tokens: int
) -> None:
    """A sliding-window group's mirror keeps each slot's last ``ring`` positions (the window
    in whole chunks), position p at p % ring: requests join with long contexts (several rings
    over), decode, skip steps, move slots and leave; the block tables give the null block
    (0, never written) behind each window, as the KV cache manager does. Every step matches
    the gather path under the window's mask, and a slot never holds more than a ring. The
    native kernel reads a ring as long as its window (8, 16: whole chunks) in place; a longer
    ring masks its oldest places on torch's path."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    blocks_total = 200
    k_cache = torch.zeros(blocks_total, BS, KVH, D)
    v_cache = torch.zeros(blocks_total, BS, KVH, D)
    per_token = 2 * KVH * D * 4
    cache = DecodeCache(
        1, KVH, D, BS, torch.float32, torch.device("cpu"), budget_slot_tokens * per_token,
        window=window, chunk=CHUNK, ring=True,
        native=native_kernel() if kernel == "native" else None,
    )  # fmt: skip
    assert cache.ring == -(-window // CHUNK) * CHUNK
    assert (cache.native is not None) == (kernel == "native" and window % CHUNK == 0)
    free_blocks = list(range(1, blocks_total))  # block 0: the null block
    rng.shuffle(free_blocks)
    live: dict[str, tuple[list[int], int]] = {}
    next_id = 0
    wrapped = 0  # steps the mirror served with a row past its ring

    def behind(table: list[int], start: int) -> list[int]:
        first = max(0, start - window + 1) // BS
        return [0] * first + table[first:]

    for _ in range(40):
        while len(live) < 5 and len(free_blocks) > 30 and rng.random() < 0.5:
            n = rng.randint(1, 60)
            blocks = [free_blocks.pop() for _ in range(-(-n // BS) + 3)]
            for pos in range(n):
                k_cache[blocks[pos // BS], pos % BS] = torch.randn(KVH, D)
                v_cache[blocks[pos // BS], pos % BS] = torch.randn(KVH, D)
            live[f"r{next_id}"] = (blocks, n)
            next_id += 1
        rows = [r for r in live if rng.random() < 0.8]
        rng.shuffle(rows)
        rows = [r for r in rows if live[r][1] < len(live[r][0]) * BS]
        if rows:
            starts = [live[r][1] for r in rows]
            tables = [behind(live[r][0], st_) for r, st_ in zip(rows, starts)]
            slots = torch.tensor([t[s // BS] * BS + s % BS for t, s in zip(tables, starts)])
            q, k, v = torch.randn(len(rows), H, D), torch.randn(len(rows), KVH, D), torch.randn(
                len(rows), KVH, D)  # fmt: skip
            lens = [s + 1 for s in starts]
            lens_t = torch.tensor(lens)
            ref_k, ref_v = k_cache.clone(), v_cache.clone()
            ref = windowed(reference_meta(slots, tables, lens), window, lens_t, q.dtype)
            want = paged_attention(q, k, v, ref_k, ref_v, ref, 0.3)
            meta = reference_meta(slots, tables, lens)
            meta.decode_plan = cache.plan(rows, starts, tables)
            got = paged_attention(
                q, k, v, k_cache, v_cache, windowed(meta, window, lens_t, q.dtype), 0.3
            )
            torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-5)
            assert cache.width <= cache.ring
            wrapped += meta.decode_plan is not None and max(starts) >= cache.ring
            for r in rows:
                live[r] = (live[r][0], live[r][1] + 1)
        for r in [r for r in live if rng.random() < 0.1 or live[r][1] >= len(live[r][0]) * BS]:
            free_blocks.extend(live.pop(r)[0])
            cache.drop([r])
    assert wrapped or budget_slot_tokens < 10_000  # a mirror with room did serve past a ring


def test_stale_slot_is_refilled_after_a_step_without_it() -> None:
    """A request preempted and recomputed gets its slot copied in again, not reused."""
    k_cache = torch.randn(8, BS, KVH, D)
    cache = DecodeCache(1, KVH, D, BS, torch.float32, torch.device("cpu"), 1 << 20)
    plan = cache.plan(["a"], [5], [[3, 4]])
    assert plan is not None and [f[0] for f in plan.fills] == [0]
    plan = cache.plan(["a"], [6], [[3, 4]])
    assert plan is not None and plan.fills == []  # caught up: no copy
    cache.drop(["a"])
    assert cache.num_slots == 0  # nothing decoding: memory released
    plan = cache.plan(["a"], [7], [[3, 4]])
    assert plan is not None and len(plan.fills) == 1
    assert k_cache.numel()  # (the paged cache is untouched by planning)


def test_a_longer_context_adds_a_chunk_and_moves_nothing() -> None:
    """Growing the width adds chunks: the ones there stay where they are, with what they
    hold. More slots copies every chunk, and keeps what each slot held."""
    cache = DecodeCache(2, KVH, D, BS, torch.float32, torch.device("cpu"), 1 << 24, chunk=CHUNK)
    k_cache = torch.randn(BLOCKS, BS, KVH, D)
    table = list(range(10))
    first = cache.plan(["a"], [5], [table])
    assert first is not None
    # Its fills, and its row's own key at position 5, as the step's forward writes them.
    kb, _ = first.mirror(0, k_cache, k_cache)
    kb.write(0, 5, k_cache[table].flatten(0, 1)[5:6].transpose(0, 1))
    before = [p.data_ptr() for layer in cache.k + cache.v for p in layer.parts]
    assert cache.width == CHUNK and len(before) == 2 * 2
    plan = cache.plan(["a"], [3 * CHUNK + 1], [table])  # a context past three chunks
    assert plan is not None and cache.width == 4 * CHUNK
    kb, _ = plan.mirror(0, k_cache, k_cache)
    assert [p.data_ptr() for p in kb.parts[:1]] == before[:1] and len(kb.parts) == 4
    want = k_cache[table].flatten(0, 1)[: 3 * CHUNK + 1].transpose(0, 1)
    assert torch.equal(kb.read(0, 3 * CHUNK + 1), want)
    slots = ["a"] + [f"r{i}" for i in range(20)]  # more slots than the first 8
    plan = cache.plan(slots, [3 * CHUNK + 2] + [1] * 20, [table] * 21)
    assert plan is not None and cache.num_slots >= 21
    kb, _ = plan.mirror(0, k_cache, k_cache)
    assert torch.equal(kb.read(0, 3 * CHUNK + 1), want)
    assert kb.table.tolist() == [p.data_ptr() for p in kb.parts]


@pytest.mark.parametrize("budget", [0, 1])
def test_over_budget_falls_back_to_gather(budget: int) -> None:
    cache = DecodeCache(1, KVH, D, BS, torch.float32, torch.device("cpu"), budget)
    assert cache.plan(["a", "b"], [5, 9], [[1, 2], [3, 4, 5]]) is None
    assert cache.num_slots == 0


def test_loading_the_kernel_leaves_the_processes_floating_point_alone() -> None:
    """The kernel is compiled with -ffast-math but must not set flush-to-zero for the
    whole process on load (linking with -ffast-math would): subnormals still exist after."""
    import subprocess
    import sys

    native_kernel()  # built (or skipped without a compiler) here; loaded afresh below
    code = (
        "import torch; from engine.worker import cpu_attention as c; "
        f"c.NativeDecodeAttention(c.build({H // KVH}, {D})); "
        "t = torch.tensor([1e-40], dtype=torch.float32); "
        "assert (t * 1.0).item() != 0, 'flush-to-zero is on'"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_native_kernel_at_a_model_shape_matches_torch(kv_dtype: torch.dtype) -> None:
    """SmolLM2's shape (3 query heads a KV head, head dim 64: the kernel's loops unroll into
    whole vectors, which the tests above at head dim 8 do not reach), rows in shuffled slots,
    against torch's path over the same mirror."""
    # In chunks of 128 positions: rows within the first, at its ends, and in the third.
    _model_shape_against_torch([0, 1, 15, 16, 17, 31, 32, 100, 127, 128, 129, 300], kv_dtype)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "positions", [[1000], [2047, 700], [5, 1500], [600, 0]], ids=["one", "two", "short", "last"]
)
def test_a_few_long_rows_split_their_positions_over_the_threads(
    positions: list[int], kv_dtype: torch.dtype
) -> None:
    """Too few (row, KV head) pairs for the threads: each pair's positions are split in parts
    (a row's part may hold none of its positions, or only the one it writes), merged after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        _model_shape_against_torch(positions, kv_dtype)
    finally:
        torch.set_num_threads(threads)


def _model_shape_against_torch(at: list[int], kv_dtype: torch.dtype) -> None:
    from engine.worker.decode_cache import torch_attention

    group, dim = 3, 64
    kernel = built(lambda: cpu_attention.NativeDecodeAttention(cpu_attention.build(group, dim)))
    torch.manual_seed(len(at))
    positions = torch.tensor(at)
    rows, width = len(positions), -(-(max(at) + 1) // 16) * 16
    kb = torch.randn(rows, KVH, width, dim).to(kv_dtype)
    vb = torch.randn(rows, KVH, width, dim).to(kv_dtype)
    q = torch.randn(rows, KVH * group, dim)
    k_new, v_new = torch.randn(rows, KVH, dim), torch.randn(rows, KVH, dim)
    slots = torch.arange(rows).flip(0)
    want_k, want_v = kb.clone(), vb.clone()
    got = kernel(q, k_new, v_new, Chunks.view(kb), Chunks.view(vb), slots, positions, 0.125)
    want_k[slots, :, positions] = k_new.to(kv_dtype)
    want_v[slots, :, positions] = v_new.to(kv_dtype)
    hidden = torch.arange(width).view(1, 1, 1, -1) > positions.view(-1, 1, 1, 1)
    mask = torch.zeros(rows, 1, 1, width).masked_fill_(hidden, float("-inf"))
    order = torch.argsort(slots)  # torch's path reads slot i for row i
    want = torch_attention(q[order], want_k, want_v, width, mask[order], 0.125)[slots]
    assert torch.equal(kb, want_k) and torch.equal(vb, want_v)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-5)


def test_the_mirror_is_freed_as_soon_as_the_engine_runs_out_of_work(
    tiny_model_path: Path,
) -> None:  # fmt: skip
    """Ended requests reach the runner when the engine has nothing left to run, not with the
    next request's step: an idle engine holds no decode mirror."""
    core = EngineCore(EngineConfig(num_kv_blocks=64), str(tiny_model_path))
    try:
        (cache,) = core.executor.runner.decode_caches  # type: ignore[attr-defined]
        assert cache is not None
        core.add_request(make_core_request("a", list(range(10, 40)), max_tokens=8))
        slots = []
        while core.has_work():
            core.step()
            slots.append(cache.num_slots)
        assert max(slots) > 0  # decoded through it
        assert cache.num_slots == 0 and cache.k == [] and cache.slot_of == {}
    finally:
        core.shutdown()


def test_a_small_pool_still_decodes_through_the_mirror(tiny_model_path: Path) -> None:
    """The mirror's slots are rectangles (every slot as wide as the longest context): five
    rows, one of them long, fit a 40-block pool but not a mirror bounded by the pool's bytes.
    The mirror has a floor (MIRROR_FLOOR_BYTES), so these steps do not fall back to the gather
    path (which took twice the step's time on the tiny model)."""
    core = EngineCore(EngineConfig(num_kv_blocks=40), str(tiny_model_path))
    try:
        (cache,) = core.executor.runner.decode_caches  # type: ignore[attr-defined]
        assert cache is not None
        core.add_request(make_core_request("long", list(range(10, 310)), max_tokens=8))
        for i in range(4):
            core.add_request(make_core_request(f"s{i}", list(range(20 + i, 40 + i)), max_tokens=8))
        rows = []
        while core.has_work():
            core.step()
            rows.append(sum(1 for n in cache.length if n))
        assert max(rows) == 5, rows  # all five rows decoded from their slots at once
    finally:
        core.shutdown()


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.uint8], ids=["int8", "fp8"])
def test_the_kernel_packs_a_new_row_as_torch_does(kv_dtype: torch.dtype) -> None:
    """The native kernel writes each row's new K and V into an 8-bit mirror itself: the bytes
    (codes and scale) are kv_quant.pack's, over values from 1e-4 to 1e3, so the mirror and the
    paged cache (packed by torch) hold the same KV."""
    kernel = native_kernel()
    torch.manual_seed(0)
    rows = 32
    x = torch.randn(rows, KVH, D) * 10 ** torch.empty(rows, 1, 1).uniform_(-4, 3)
    parts = [torch.zeros(rows, KVH, CHUNK, D + 4, dtype=kv_dtype) for _ in range(2)]
    kb, vb = Chunks.of(parts[:1], CHUNK), Chunks.of(parts[1:], CHUNK)
    q = torch.randn(rows, H, D)
    kernel(q, x, -x, kb, vb, torch.arange(rows), torch.zeros(rows, dtype=torch.long), 0.1)
    assert torch.equal(parts[0][:, :, 0], kv_quant.pack(x, kv_dtype))
    assert torch.equal(parts[1][:, :, 0], kv_quant.pack(-x, kv_dtype))
