"""Server options, declared once: the fields are the `lumen serve` flags and their defaults."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine import envs
from service import reasoning


@dataclass(frozen=True)
class ServerConfig:
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=8000, metadata={"help": "port to listen on"})
    api_key: str | None = field(
        default=None,
        metadata={"help": "require this bearer key on /v1 routes (default: $LUMEN_API_KEY)"},
    )
    protect_probes: bool = field(
        default=False,
        metadata={"help": "require the API key on /health and /metrics too (default: open)"},
    )
    served_model_name: str | None = field(
        default=None,
        metadata={"help": "model name in the API (default: the model's name)"},
    )
    max_concurrent_requests: int = field(
        default=256,
        metadata={"help": "requests in flight at once; more wait for a slot (up to as many)"},
    )
    max_queue_wait: float = field(
        default=10.0,
        metadata={"help": "seconds a request may wait for a slot before a 503 (0: refuse at once)"},
    )
    max_request_body_bytes: int = field(
        default=8 << 20, metadata={"help": "larger request bodies get a 413"}
    )
    stream_stall_timeout: float = field(
        default=60.0,
        metadata={"help": "seconds a stream may go unread before its request is aborted"},
    )
    reasoning_parser: str | None = field(
        default=None,
        metadata={
            "help": "qwen3 or deepseek_r1: a chat reply's <think> block comes back as "
            "reasoning_content, apart from content, as vLLM's --reasoning-parser"
        },
    )
    exit_grace_period: float = field(
        default=2.0,
        metadata={"help": "seconds between the engine's death and the server's exit (code 1)"},
    )

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        for name in ("max_concurrent_requests", "max_request_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("max_queue_wait", "stream_stall_timeout", "exit_grace_period"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")
        if self.api_key is None and (key := envs.LUMEN_API_KEY.get()):
            object.__setattr__(self, "api_key", key)
        reasoning.check_parser(self.reasoning_parser)
        if self.api_key == "":
            raise ValueError("api_key must not be empty")
