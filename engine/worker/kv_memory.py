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
HUGE_PAGE = 2 << 20  # x86-64's and most arm64 kernels': smaller tensors are not advised
MADV_HUGEPAGE = 14  # linux/mman.h


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor; on CPU, mapped lazily and in huge pages where the OS lends them.

    A tensor of a huge page or more starts on a huge page's boundary and its memory runs to
    the next, so that all of it can lie in huge pages: at 16 rows a layer's mirror is 7.5 MiB,
    and a quarter of it lay in the 4 KiB pages at either end. The slack: under a huge page of
    address space before it, never written, and the rest of its last huge page, mapped with
    that page."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    madvise = _madvise() if nbytes >= HUGE_PAGE else None
    align, span = (HUGE_PAGE, -(-nbytes // HUGE_PAGE) * HUGE_PAGE) if madvise else (ALIGN, nbytes)
    raw = np.zeros(span + align, dtype=np.uint8)
    start = -raw.ctypes.data % align
    if madvise is not None:  # before the first write: the pages it then maps are huge
        madvise(raw.ctypes.data + start, span, MADV_HUGEPAGE)
    return torch.from_numpy(raw[start : start + nbytes]).view(dtype).view(shape)


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
