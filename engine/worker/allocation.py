"""Allocating on the device: a model's parameters from the meta device, and the KV pool
(zeroed pages the kernel maps on first write, refused where memory cannot hold it)."""

from __future__ import annotations

from typing import Any, TypeVar

import numpy as np
import torch

from engine.config import GiB

M = TypeVar("M", bound=torch.nn.Module)


def materialize(model: M, device: torch.device, dtype: torch.dtype) -> M:
    """``model.to_empty(device=device).to(dtype)`` for a model built on the meta device,
    without torch's Python decompositions: ``empty_like`` of a meta tensor runs them, and
    their first use imports sympy (0.8 s of every engine start on 2 cores). Floating-point
    parameters and buffers take ``dtype``, the others keep theirs; a tensor two modules
    share stays shared."""
    fresh: dict[int, torch.Tensor] = {}
    for module in model.modules():
        tables: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
        for table in tables:
            for name, old in table.items():
                if old is None:
                    continue
                if id(old) not in fresh:
                    kind = dtype if old.is_floating_point() else old.dtype
                    new = torch.empty(old.shape, dtype=kind, device=device)
                    if isinstance(old, torch.nn.Parameter):
                        new = torch.nn.Parameter(new, requires_grad=old.requires_grad)
                    fresh[id(old)] = new
                table[name] = fresh[id(old)]
    return model


ALIGN = 64  # bytes: the KV pool's start, as torch's own allocations are aligned


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed KV tensor. On CPU, from calloc (numpy's zeros): the kernel maps zero pages and
    fills each on its first write, so the default 4 GiB pool costs neither start-up time
    (torch.zeros wrote every byte: 1.3-2.1 s on 2 cores) nor memory until it is used. A page's
    first write costs about 0.35 ms per MB more, once: 2 ms of a 128-token SmolLM2 prefill."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.zeros(nbytes + ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGN
    return torch.from_numpy(raw[start : start + nbytes]).view(dtype).view(shape)


def check_fits_in_memory(nbytes: int) -> None:
    """Refuse a KV pool larger than the memory available now (Linux's MemAvailable): its pages
    are taken as it fills, and a pool that cannot fit would end the engine mid-serving."""
    try:
        with open("/proc/meminfo") as f:
            line = next(ln for ln in f if ln.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return  # not Linux: nothing to check against
    available = int(line.split()[1]) * 1024
    if nbytes > available:
        raise ValueError(
            f"the KV cache needs {nbytes / GiB:.1f} GiB, more than the {available / GiB:.1f} GiB "
            "of memory available: lower --kv-cache-memory-bytes or --num-kv-blocks"
        )
