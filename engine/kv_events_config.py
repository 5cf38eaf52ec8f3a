"""``--kv-events-config``: vLLM's KVEventsConfig, its JSON fields and defaults, checked where
the engine's options are (the publisher itself: engine/core/kv_events.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig fields and defaults."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"; unset: zmq when enabled
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"


def parse(text: str | None) -> KVEventsConfig:
    """``--kv-events-config``'s JSON; ValueError, in one line, for anything else."""
    if not text:
        return KVEventsConfig()
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--kv-events-config is not JSON ({e.msg}): {text!r}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"--kv-events-config must be a JSON object, not {text!r}")
    known = {f.name: f for f in fields(KVEventsConfig)}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ValueError(f"--kv-events-config: unknown field(s) {', '.join(unknown)}; "
                         f"known: {', '.join(known)}")  # fmt: skip
    for name, value in raw.items():
        want = {"enable_kv_cache_events": bool, "buffer_steps": int, "hwm": int,
                "max_queue_size": int}.get(name, str)  # fmt: skip
        nullable = name in ("publisher", "replay_endpoint")
        if not (isinstance(value, want) and (want is bool or not isinstance(value, bool))) and not (
            nullable and value is None
        ):
            raise ValueError(f"--kv-events-config: {name} must be a {want.__name__}, not "
                             f"{value!r}")  # fmt: skip
    config = KVEventsConfig(**raw)
    if config.publisher not in (None, "zmq", "null"):
        raise ValueError(f"--kv-events-config: publisher must be zmq or null, not "
                         f"{config.publisher!r}")  # fmt: skip
    for name in ("buffer_steps", "hwm", "max_queue_size"):
        if getattr(config, name) < 1:
            raise ValueError(f"--kv-events-config: {name} must be at least 1")
    for endpoint in (config.endpoint, config.replay_endpoint):
        if endpoint is not None and not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"--kv-events-config: {endpoint!r} is not a ZMQ endpoint "
                             "(tcp://, ipc:// or inproc://)")  # fmt: skip
    return config


def offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    """The endpoint of data-parallel rank ``rank``, as vLLM offsets it: a TCP port plus the
    rank, an inproc or ipc name with ``_dp<rank>`` after it; rank 0's unchanged."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"
