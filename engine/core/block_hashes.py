"""Block hashes as vLLM computes them with ``--prefix-caching-hash-algo sha256_cbor``, so a
router that hashes prompts itself (llm-d's KV-cache indexer, vLLM's own tools) finds the blocks
Lumen's KV events announce, and every process of a server agrees on them.

A block's hash is SHA-256 over the canonical CBOR (RFC 8949) of the triple
(parent hash, the block's token ids, its extra keys or None); the first block's parent is
NONE_HASH, SHA-256 over the CBOR of a seed string: PYTHONHASHSEED where it is set, else vLLM's
fixed default for cryptographic hashes, "vllm-none-hash". A request's cache salt is its first
block's extra keys, ``(("cache_salt", salt),)``, as vLLM's. Hashes are 32 bytes; KV events
carry their low 64 bits as an integer (vLLM's ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, what
llm-d reads). The hashes of the tests' known values were computed by vLLM 0.32 itself.

Only what a block hash holds is encoded here (bytes, non-negative ints, tuples, strings and
None), by hand: the encoding of 16 token ids is a join of memoized byte strings.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence

DEFAULT_SEED = "vllm-none-hash"
_UINT: dict[int, bytes] = {}  # token id -> its CBOR bytes, memoized


def _head(major: int, n: int) -> bytes:
    """A CBOR item's head: its major type and argument, in the fewest bytes (canonical)."""
    m = major << 5
    if n < 24:
        return bytes((m | n,))
    if n < 1 << 8:
        return bytes((m | 24, n))
    if n < 1 << 16:
        return bytes((m | 25,)) + n.to_bytes(2, "big")
    if n < 1 << 32:
        return bytes((m | 26,)) + n.to_bytes(4, "big")
    return bytes((m | 27,)) + n.to_bytes(8, "big")


def _uint(n: int) -> bytes:
    b = _UINT.get(n)
    if b is None:
        if n < 0 or n >= 1 << 64:
            raise ValueError(f"a token id out of range for a block hash: {n}")
        b = _UINT[n] = _head(0, n)
    return b


def cbor(value: object) -> bytes:
    """The canonical CBOR of a block hash's inputs."""
    if value is None:
        return b"\xf6"
    if isinstance(value, bool):
        return b"\xf5" if value else b"\xf4"
    if isinstance(value, int):
        return _uint(value) if value >= 0 else _head(1, -1 - value)
    if isinstance(value, bytes):
        return _head(2, len(value)) + value
    if isinstance(value, str):
        raw = value.encode()
        return _head(3, len(raw)) + raw
    if isinstance(value, (tuple, list)):
        return _head(4, len(value)) + b"".join(cbor(v) for v in value)
    raise TypeError(f"a block hash does not encode {type(value).__name__}")


def none_hash(seed: str | None = None) -> bytes:
    """The first block's parent: SHA-256 of the seed (PYTHONHASHSEED, else vLLM's default)."""
    if seed is None:
        seed = os.environ.get("PYTHONHASHSEED", DEFAULT_SEED)
    return hashlib.sha256(cbor(seed)).digest()


def block_hash(parent: bytes, tokens: Sequence[int], extra: tuple[object, ...] | None) -> bytes:
    """One block's hash, chained on its parent's."""
    uint = _uint
    body = b"".join([uint(t) for t in tokens])
    encoded = b"\x83" + _head(2, len(parent)) + parent + _head(4, len(tokens)) + body
    encoded += b"\xf6" if extra is None else cbor(extra)
    return hashlib.sha256(encoded).digest()


def external(h: bytes) -> int:
    """The hash as KV events carry it: its low 64 bits, big-endian (vLLM's int form)."""
    return int.from_bytes(h[-8:], "big")
