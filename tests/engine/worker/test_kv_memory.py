"""The KV's memory: zeroed, aligned, mapped lazily, and asked for in huge pages, where
decode attention streams it (the paged pool and the decode mirror alike)."""

from __future__ import annotations

import sys

import pytest
import torch

from engine.worker import kv_memory
from engine.worker.decode_cache import DecodeCache

linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads /proc/self/smaps"
)


def mapping_of(tensor: torch.Tensor) -> dict[str, str]:
    """The /proc/self/smaps entry of the mapping that holds the middle of ``tensor``, by field
    (its first and last page may share a mapping with other memory, unadvised)."""
    address = tensor.data_ptr() + tensor.numel() * tensor.element_size() // 2
    found: dict[str, str] | None = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                if found is not None:
                    break
                if start <= address < end:
                    found = {}
            elif found is not None:
                name, _, value = line.partition(":")
                found[name] = value.strip()
    assert found is not None, f"no mapping holds {address:#x}"
    return found


def test_kv_memory_is_zeroed_aligned_and_shaped() -> None:
    t = kv_memory.zeros((3, 5, 7), torch.bfloat16, torch.device("cpu"))
    assert t.shape == (3, 5, 7) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % kv_memory.ALIGN == 0
    assert not t.any()


@linux_only
def test_kv_memory_is_mapped_lazily_and_asked_for_in_huge_pages() -> None:
    t = kv_memory.zeros((64, 1024, 1024), torch.float32, torch.device("cpu"))  # 256 MiB
    mapping = mapping_of(t)
    assert int(mapping["Rss"].split()[0]) < 64 * 1024, "the zeroed pool was written at once"
    assert "hg" in mapping["VmFlags"].split(), f"not advised for huge pages: {mapping['VmFlags']}"


@linux_only
def test_the_decode_mirror_is_asked_for_in_huge_pages() -> None:
    """The mirror is what decode attention reads each step (the paged pool is only copied
    from): it must come from the same memory."""
    cache = DecodeCache(2, 3, 64, 16, torch.float32, torch.device("cpu"), 1 << 30)
    assert cache.plan(["a"], [1000], [list(range(63))]) is not None
    assert cache.k[0].numel() * 4 >= 2 * kv_memory.HUGE_PAGE
    for tensor in (cache.k[0], cache.v[1]):
        assert "hg" in mapping_of(tensor)["VmFlags"].split()
