"""Server options, declared once: the fields are the `lumen serve` flags and their defaults."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine import chat_templates, envs, lora
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
    shutdown_timeout: float = field(
        default=30.0,
        metadata={
            "help": "on SIGTERM or SIGINT (Ctrl-C): seconds in-flight requests get to finish "
            "before the rest are aborted (0: abort at once); a second signal aborts at once"
        },
    )
    max_restarts: int = field(
        default=5,
        metadata={
            "help": "engine core restarts (after a crash or a hang) allowed within "
            "--restart-window; one more and the server exits with code 1"
        },
    )
    restart_window: float = field(
        default=600.0, metadata={"help": "seconds over which --max-restarts is counted"}
    )
    engine_hang_timeout: float | None = field(
        default=None,
        metadata={
            "help": "seconds the engine core may go without finishing a step before /health "
            "answers 503 (twice as long: it is restarted); default: 20x the warm-up's price "
            "of the largest step the token budget allows, at least 10"
        },
    )
    exit_grace_period: float = field(
        default=2.0,
        metadata={"help": "seconds /health answers 503 before a crash loop's exit (code 1)"},
    )
    enable_per_request_metrics: bool = field(
        default=False,
        metadata={
            "help": "every response carries the server's timing as a top-level `metrics` "
            "object (a stream: in its last chunk), as vLLM's flag: TTFT and the parts it is "
            "made of; a request can ask for it alone with `include_metrics`"
        },
    )
    per_request_spec_decode_metrics: str | None = field(
        default=None,
        metadata={
            "help": "summary or detailed: a response of one prompt and one sample whose request "
            "verified drafts (--speculative-config) carries `metrics.speculative_decoding` (a "
            "stream: in its last chunk, with the usage), as vLLM's flag: steps, drafts, kept, "
            "draft_acceptance_rate, mean_acceptance_length and acceptance_histogram; detailed "
            "adds the kept drafts by position"
        },
    )
    chat_template: str | None = field(
        default=None,
        metadata={
            "help": "the chat template, over the model's own (which a base model or a GGUF "
            "file may lack): a file, a built-in name (chatml, gemma, llama3, phi3, qwen) or "
            "a Jinja string, as vLLM's flag (and llama.cpp's names)"
        },
    )
    trust_request_chat_template: bool = field(
        default=False,
        metadata={
            "help": "accept a chat request's own `chat_template` (a built-in name or Jinja; "
            "never a file), as vLLM's flag; without it such a request gets a 400"
        },
    )
    lora_modules: tuple[str, ...] | None = field(
        default=None,
        metadata={
            "help": "LoRA adapters served at start (with --enable-lora), as vLLM's flag: "
            "name=path or JSON with name, path and base_model_name, one or more; a request "
            "names one by its model field, and /v1/models lists them with their parent"
        },
    )
    allow_runtime_lora_updating: bool = field(
        default=False,
        metadata={
            "help": "serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (bodies: "
            "lora_name, lora_path), as vLLM does under VLLM_ALLOW_RUNTIME_LORA_UPDATING, "
            "which is honoured too"
        },
    )
    data_parallel_size: int = field(
        default=1,
        metadata={
            "help": "engines, as vLLM's flag: each its own core process with its own KV cache "
            "and workers, pinned to its share of the CPUs; each request goes to the one with "
            "the lowest 4 x waiting + running, and one engine's failure leaves the others "
            "serving"
        },
    )
    data_parallel_prefix_affinity: int = field(
        default=0,
        metadata={
            "help": "with --data-parallel-size: among the engines whose 4 x waiting + running "
            "is within this of the least loaded engine's, send a request to the one that was "
            "sent the longest run of its prompt's leading KV blocks, where that run is at "
            "least half of them; else the load rule (0: off, the load rule alone)"
        },
    )

    def __post_init__(self) -> None:
        if self.chat_template is not None:  # a bad one fails here, before the core starts
            chat_templates.resolve(self.chat_template)
        for module in self.lora_modules or ():
            lora.parse_module(module)  # likewise, in one line
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        for name in ("max_concurrent_requests", "max_request_body_bytes", "data_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("max_queue_wait", "stream_stall_timeout", "exit_grace_period",
                     "shutdown_timeout", "restart_window", "max_restarts",
                     "data_parallel_prefix_affinity"):  # fmt: skip
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")
        if self.engine_hang_timeout is not None and self.engine_hang_timeout <= 0:
            raise ValueError(
                f"engine_hang_timeout must be positive, got {self.engine_hang_timeout}"
            )
        if self.api_key is None and (key := envs.LUMEN_API_KEY.get()):
            object.__setattr__(self, "api_key", key)
        reasoning.check_parser(self.reasoning_parser)
        if self.per_request_spec_decode_metrics not in (None, "summary", "detailed"):
            raise ValueError("per_request_spec_decode_metrics must be summary or detailed, not "
                             f"{self.per_request_spec_decode_metrics!r}")  # fmt: skip
        if self.api_key == "":
            raise ValueError("api_key must not be empty")
