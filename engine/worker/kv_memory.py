"""Zeroed memory for the KV: the paged pool and the decode mirror (decode_cache).

On CPU it comes from calloc (numpy's zeros): the kernel maps zero pages and
fills each on its first write, so the default 4 GiB pool costs neither
start-up time (torch.zeros wrote every byte: 1.3-2.1 s on 2 cores) nor memory
until it is used. A page's first write costs about 0.35 ms per MB more, once:
2 ms of a 128-token SmolLM2 prefill.

And it is asked for in huge pages (madvise; Linux's default lends them only
where asked). Decode attention streams the whole context of every row once a
step, and over 4 KiB pages it waits on the TLB: on a 2-vCPU Xeon with
AVX-512 the native kernel read the mirror at 20.3 GB/s from torch's memory
and at 23.7 from 2 MiB pages, and torch's own sum at 23.7 against 30.0.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable

import numpy as np
import torch

ALIGN = 64  # bytes: a tensor's start, as torch's own allocations are aligned
PAGE = 4096
HUGE_PAGE = 2 << 20  # x86-64's and most arm64 kernels': smaller tensors are not advised
MADV_HUGEPAGE = 14  # linux/mman.h


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor; on CPU, mapped lazily and in huge pages where the OS lends them."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.zeros(nbytes + ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGN
    _advise_huge(raw.ctypes.data, raw.nbytes)
    return torch.from_numpy(raw[start : start + nbytes]).view(dtype).view(shape)


def _advise_huge(address: int, nbytes: int) -> None:
    """Ask for huge pages over the whole pages of [address, address + nbytes). Before the first
    write: the pages it then maps are huge. A refusal (an old kernel, THP off) changes nothing."""
    madvise = _madvise()
    first = -(-address // PAGE) * PAGE
    length = (address + nbytes - first) // PAGE * PAGE
    if madvise is not None and length >= HUGE_PAGE:
        madvise(first, length, MADV_HUGEPAGE)


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise  # the process's own libc
    except (OSError, AttributeError):
        return None
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    return madvise
