"""KVLayout: which layers share KV blocks, and how many blocks a sequence holds.

A model whose layers all attend to the whole context has one KV group: a block
holds ``block_size`` tokens of every layer, and a sequence holds a block per
``block_size`` tokens. A sliding-window layer (Gemma 3's local layers, Mistral,
Qwen2 with ``use_sliding_window``) reads only the last ``window`` keys, so the
blocks behind its window can be given back. As vLLM's hybrid KV cache manager
does, the layers are split into groups of equal size, each group of one kind::

    Gemma 3 270M: 18 layers, every 6th global     group_size 3 (gcd of 3 and 15)
        group 0  layers 5 11 17   full             a block per 16 tokens, all kept
        group 1  layers 0  1  2   window 512       only the blocks the window sees
        ...
        group 5  layers 12 13 15  window 512

One pool of blocks serves every group. A block is ``block_size`` tokens of
``group_size`` layers; the worker keeps ``group_size`` KV tensors, and layer
``l`` reads and writes tensor ``layer_slot[l]`` through the block table of its
group ``layer_group[l]``. Each request has one block table per group; a
sliding group's blocks behind the window are replaced by the null block
(block 0, never written), which every reader masks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.model_config import ModelConfig


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVLayout:
    windows: tuple[int, ...]  # per group: its sliding window in tokens (0: the whole context)
    layer_group: tuple[int, ...]  # per layer: its group
    layer_slot: tuple[int, ...]  # per layer: the KV tensor it uses (its place in its group)
    group_size: int  # layers per group: the KV tensors a block spans

    @classmethod
    def single(cls, num_layers: int, window: int = 0) -> KVLayout:
        """Every layer in one group (today's cache for a model of one layer kind)."""
        return cls((window,), (0,) * num_layers, tuple(range(num_layers)), num_layers)

    @classmethod
    def of(cls, cfg: ModelConfig, hybrid: bool = True) -> KVLayout:
        """The layout of ``cfg``'s layers. ``hybrid=False`` (--disable-hybrid-kv-cache-manager)
        keeps every layer's blocks for the whole context, windowed or not."""
        n, window = cfg.num_layers, cfg.sliding_window
        local = set(cfg.local_layers) if window else set()
        if not hybrid or not local:
            return cls.single(n)
        if len(local) == n:
            return cls.single(n, window)
        full = [i for i in range(n) if i not in local]
        size = math.gcd(len(full), len(local))
        kinds = [(0, full), (window, sorted(local))]
        windows: list[int] = []
        group, slot = [0] * n, [0] * n
        for w, layers in kinds:
            for start in range(0, len(layers), size):
                for j, layer in enumerate(layers[start : start + size]):
                    group[layer], slot[layer] = len(windows), j
                windows.append(w)
        return cls(tuple(windows), tuple(group), tuple(slot), size)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def hybrid(self) -> bool:
        """Some group frees blocks behind a window (the pool then keeps a null block)."""
        return any(self.windows)

    def blocks_per_sequence(self, tokens: int, block_size: int) -> int:
        return blocks_per_sequence(self.windows, tokens, block_size)


def blocks_per_sequence(windows: tuple[int, ...] | list[int], tokens: int, block_size: int) -> int:
    """The most blocks one sequence of ``tokens`` tokens holds at once, in decode, over KV
    groups of ``windows``: a full group's for every token, a sliding group's for its window
    (and the block its window's start falls in)."""
    full = cdiv(tokens, block_size)
    return sum(min(full, cdiv(w - 1, block_size) + 1) if w else full for w in windows)


@dataclass(frozen=True)
class KVCapacity:
    """What a KV cache of ``num_blocks`` holds, as vLLM reports it."""

    tokens: int  # tokens of every layer: the blocks shared out over the groups
    max_concurrency: float  # sequences of max_model_len tokens that fit at once
    # Per layer kind (full, sliding_window_<W>): its layers, its groups, and the blocks one
    # sequence of max_model_len tokens holds of it.
    kinds: list[tuple[str, int, int, int]]


def kv_capacity(
    windows: tuple[int, ...] | list[int], group_size: int, num_blocks: int, block_size: int,
    max_model_len: int,
) -> KVCapacity:  # fmt: skip
    """``windows`` and ``group_size`` as a KVLayout's (EngineInfo carries them)."""
    usable = num_blocks - (1 if any(windows) else 0)  # less the null block
    per_seq = blocks_per_sequence(windows, max_model_len, block_size)
    kinds = []
    for window in sorted(set(windows)):
        groups = sum(w == window for w in windows)
        one = blocks_per_sequence([window], max_model_len, block_size)
        name = f"sliding_window_{window}" if window else "full"
        kinds.append((name, groups * group_size, groups, one * groups))
    return KVCapacity(usable // len(windows) * block_size, usable / max(per_seq, 1), kinds)
