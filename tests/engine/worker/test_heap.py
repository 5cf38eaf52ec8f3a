"""An engine process fixes glibc's mmap threshold: a step's temporaries under 32 MiB come from
the heap, not a fresh mapping each (engine/worker/heap.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# In a fresh process: allocate a 20 MB block (a 64-row step's logits are 12.6 MB) three times,
# freeing each, and count the times glibc served it with a mapping of its own (mallinfo2).
_CODE = """
import ctypes, sys
from engine.worker import heap
if sys.argv[1] == "fixed":
    assert heap.fix_mmap_threshold()
class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = Info
mapped = 0
for _ in range(3):
    block = libc.malloc(20 << 20)
    mapped += libc.mallinfo2().hblkhd >= 20 << 20
    libc.free(block)
print(mapped)
"""


def _glibc_with_mallinfo2() -> bool:
    version = os.confstr("CS_GNU_LIBC_VERSION") if hasattr(os, "confstr") else None
    if not version:
        return False
    major, minor = (int(x) for x in version.split()[1].split(".")[:2])
    return (major, minor) >= (2, 33)


@pytest.mark.skipif(not _glibc_with_mallinfo2(), reason="glibc 2.33 or later only")
@pytest.mark.parametrize("mode", ["default", "fixed"])
def test_a_fixed_threshold_keeps_step_sized_blocks_off_mappings_of_their_own(mode: str) -> None:
    """By default glibc maps a 20 MB block on its own (its threshold starts at 128 KiB, and
    moves with what the process frees); with the threshold fixed, it never does."""
    done = subprocess.run([sys.executable, "-c", _CODE, mode], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    mapped = int(done.stdout)
    print(f"\n{mode}: 20 MB served by a mapping of its own {mapped} times of 3")
    assert mapped == 0 if mode == "fixed" else mapped >= 1
