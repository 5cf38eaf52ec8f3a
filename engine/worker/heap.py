"""glibc's heap in an engine process on CPU: a fixed mmap threshold, and memory given back.

glibc serves an allocation of ``M_MMAP_THRESHOLD`` bytes or more with a mapping of its own,
unmapped when freed, and by default it raises that threshold (from 128 KiB, up to 32 MiB) to
the size of each such block freed. So whether a decode step's temporaries (the logits of 64
rows over SmolLM2's vocabulary are 12.6 MB) were mapped afresh and unmapped at every step
depended on which blocks the process happened to have freed before. Each fresh mapping is
faulted in page by page, and unmapping memory that the process's other threads have touched
interrupts them to flush their TLBs (an inter-processor interrupt: on a VM, an exit each).

Measured behind the server (48 completions of 400 tokens at once, SmolLM2, fp32, a 2-vCPU
Xeon VM), with the decode mirror in chunks (which frees no large block as it grows): 54.5-59.4 s
and 10% of the engine core's samples in the kernel's MSR writes (the interrupts), against
46.6 s with the threshold fixed. The threshold is set once, at glibc's own ceiling for it, so a
step's temporaries up to 32 MiB come from the heap, always; ``trim`` gives the heap's free
pages back to the OS (the decode mirror calls it when it lets go of its memory).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

logger = logging.getLogger(__name__)

MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for the threshold it raises by itself
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # malloc.h


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return None
    except (ValueError, OSError):  # not glibc (musl, macOS)
        return None
    return ctypes.CDLL(None)  # the process's own symbols: glibc's malloc functions


@functools.cache  # once a process
def fix_mmap_threshold() -> bool:
    """Fix glibc's mmap threshold (and its trim threshold, as glibc pairs them) for this
    process; False where the C library is not glibc. An engine process's own: a user's
    process that runs the engine in-process keeps its own settings."""
    libc = _glibc()
    if libc is None:
        return False
    done = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    done &= libc.mallopt(_M_TRIM_THRESHOLD, 2 * MMAP_THRESHOLD) == 1
    if done:
        logger.info("blocks under %d MiB come from glibc's heap, not a mapping each "
                    "(M_MMAP_THRESHOLD fixed)", MMAP_THRESHOLD >> 20)  # fmt: skip
    return done


def trim() -> None:
    """Give the heap's free pages back to the OS (glibc's malloc_trim; a no-op elsewhere)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
