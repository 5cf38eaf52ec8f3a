"""Engine configuration: frozen dataclasses whose fields are also the CLI defaults."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine import envs, kv_events_config, spec_config
from engine.lora import LoraSettings

if TYPE_CHECKING:
    import torch
# torch is imported where a dtype or device is resolved, not here: `lumen` parses its arguments
# and spawns the core before the API process pays for torch.

GiB = 1 << 30


DTYPES = ("float32", "bfloat16", "float16")  # torch dtypes by name
# A KV cache's dtypes beside DTYPES: 8-bit codes with a scale a row (engine/worker/kv_quant.py),
# by name -> torch's dtype name. fp8 is e4m3, as vLLM's fp8 on CPU.
KV_8BIT = {"int8": "int8", "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn"}

# The generation_config.json keys that become defaults of a request (vLLM's list).
GENERATION_DEFAULTS = (
    "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens",
)  # fmt: skip

# weight-only: engine.worker.cpu_int8, cpu_int4; gguf: a GGUF file's own blocks (cpu_gguf)
QUANTIZATIONS = ("int8", "int4", "gguf")


def check_quantization(value: str | None) -> None:
    if value is not None and value not in QUANTIZATIONS:
        raise ValueError(
            f"quantization must be one of {', '.join(QUANTIZATIONS)} or unset, not {value!r}"
            " (weight-only int8 and int4, and gguf for a GGUF file's own formats, are built; "
            "checkpoints already quantized, such as AWQ "
            "or GPTQ, are not read)"
        )


@dataclass(frozen=True)
class EngineConfig:
    """Every engine option, declared once. Field defaults are the CLI defaults."""

    model: str | None = field(
        default=None, metadata={"help": "model folder or name (default: SmolLM2-135M-Instruct)"}
    )
    dtype: str = field(
        default="auto",
        metadata={
            "help": "auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16, float16; on CPU "
            "`lumen bench precision` measures what each costs in accuracy and buys in speed"
        },
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata={
            "help": "auto (the model's dtype), float32, bfloat16, float16, int8 or fp8 (e4m3; "
            "also fp8_e4m3): the KV cache's dtype. bfloat16 halves the KV's memory and what "
            "decode attention reads; int8 and fp8 store 8-bit codes with a scale per "
            "position and head (0.27 of fp32's bytes at head_dim 64). "
            "`lumen bench precision --kv-cache-dtypes bfloat16,int8,fp8` measures their accuracy"
        },
    )
    quantization: str | None = field(
        default=None,
        metadata={
            "help": "int8: the decoder layers' weights in int8 with a scale per output channel "
            "(weight-only; the embedding and LM head stay in the model's dtype). A quarter of "
            "fp32's weight bytes: faster decode at small batches on CPU, slower at 16 rows and "
            "more. int4: the decoder layers' weights in groups of 32 with a scale and a minimum "
            "each (GGUF's Q4_1 layout, 6 bits a weight), and the LM head in int8: about a fifth "
            "of fp32's bytes, for one stream. gguf (a model served from a .gguf file, on CPU): "
            "every product and the LM head in the file's own formats, as they are (Q4_0, Q4_1, "
            "Q5_0, Q8_0, Q4_K, Q5_K, Q6_K), so the weights are the file's and a step reads the "
            "bytes llama.cpp reads. `lumen bench precision --quantizations int8,int4,gguf` "
            "measures their accuracy"
        },
    )
    device: str = field(default="auto", metadata={"help": "auto, cpu or cuda"})
    max_model_len: int | None = field(
        default=None, metadata={"help": "context length (default: the model's)"}
    )
    block_size: int = field(default=16, metadata={"help": "tokens per KV cache block"})
    kv_cache_memory_bytes: int | None = field(
        default=None,
        metadata={"help": "bytes for the KV cache (default: 4 GiB on CPU, 80%% of free on CUDA)"},
    )
    num_kv_blocks: int | None = field(
        default=None, metadata={"help": "exact number of KV blocks (overrides the memory budget)"}
    )
    enable_prefix_caching: bool = field(
        default=True, metadata={"help": "reuse KV blocks of shared prompt prefixes"}
    )
    disable_hybrid_kv_cache_manager: bool = field(
        default=False,
        metadata={
            "help": "keep every layer's KV for the whole context, sliding-window layers too "
            "(by default their blocks behind the window are freed: engine/kv_layout.py)"
        },
    )
    prefix_caching_hash_algo: str = field(
        default="sha256_cbor",
        metadata={
            "help": "the prefix cache's block hash, as vLLM's flag: sha256_cbor (SHA-256 over "
            "canonical CBOR, the one Lumen computes; engine/core/block_hashes.py), so a "
            "router that hashes prompts finds the blocks the KV events announce"
        },
    )
    kv_events_config: str | None = field(
        default=None,
        metadata={
            "help": "KV cache events for routers, as vLLM's flag: JSON with "
            "enable_kv_cache_events, publisher (zmq), endpoint (default tcp://*:5557), "
            "replay_endpoint, buffer_steps, hwm, max_queue_size, topic. Published as vLLM 0.32 "
            "publishes them, block hashes vLLM's sha256_cbor (engine/core/kv_events.py)"
        },
    )
    speculative_config: str | None = field(
        default=None,
        metadata={
            "help": "speculative decoding, as vLLM's flag: JSON with method (ngram: prompt "
            "lookup over the prompt and the output; draft_model: a second checkpoint in "
            "model, or the target's own with quantization int8 or int4), "
            "num_speculative_tokens (k, required), prompt_lookup_min and prompt_lookup_max "
            "(default 5 both; one given, the other equal), disable_by_batch_size and "
            "num_speculative_tokens_per_batch_size ([[start, end, k], ...]). The target "
            "verifies the k drafts in one pass: greedy output is exactly that of decoding "
            "without them, sampled output is distributed as it (rejection sampling). Requests "
            "under a grammar speculate, their drafts cut where the grammar refuses them "
            "(docs/speculative-decoding.md)"
        },
    )
    enable_lora: bool = field(
        default=False,
        metadata={
            "help": "serve LoRA adapters (PEFT folders) on the base model, as vLLM's flag: a "
            "request names one by its model field; one batch mixes adapters and the base "
            "model (engine/lora.py)"
        },
    )
    max_loras: int = field(
        default=1,
        metadata={
            "help": "most adapters in one batch; a request whose adapter finds no slot waits "
            "(its wait reason: lora_slots)"
        },
    )
    max_lora_rank: int = field(
        default=16, metadata={"help": "the largest LoRA rank served (an adapter over it: refused)"}
    )
    max_cpu_loras: int | None = field(
        default=None,
        metadata={
            "help": "adapters kept read in memory, least recently used out (read from disk again "
            "when next named); default: --max-loras"
        },
    )
    max_num_batched_tokens: int = field(
        default=2048, metadata={"help": "token budget of one engine step"}
    )
    max_num_seqs: int = field(default=128, metadata={"help": "most requests running at once"})
    max_logprobs: int = field(
        default=20,
        metadata={
            "help": "most log probabilities a request may ask for per token (top_logprobs, "
            "logprobs), as vLLM's; -1: the whole vocabulary"
        },
    )
    scheduling_policy: str = field(default="fcfs", metadata={"help": "fcfs or priority"})
    tensor_parallel_size: int = field(
        default=1, metadata={"help": "workers that shard each layer (a process per rank when > 1)"}
    )
    seed: int = field(default=0, metadata={"help": "seed for requests that set none"})
    core_process: bool = field(
        default=False,
        metadata={"help": "run the EngineCore in its own process (LLM; the server always does)"},
    )
    transport: str = field(
        default="ipc", metadata={"help": "frontend <-> core sockets: ipc (private folder) or tcp"}
    )
    tokenizer: str | None = field(
        default=None,
        metadata={
            "help": "the tokenizer, where not the model's: a folder with a tokenizer.json, a "
            "GGUF file or a packaged model's name (vLLM's --tokenizer)"
        },
    )
    generation_config: str = field(
        default="auto",
        metadata={
            "help": "auto: the model's generation_config.json sampling defaults (temperature, "
            "top_p, top_k, min_p, repetition_penalty, max_new_tokens) apply where a request "
            "leaves them out, as vLLM's; none: ignore them; or a folder holding a "
            "generation_config.json"
        },
    )
    stream_interval: int = field(
        default=1,
        metadata={
            "help": "tokens a stream gathers before the server sends them, as vLLM's: 1 sends "
            "every token as it comes; N sends the first token at once, then every N tokens "
            "and the last at once. Fewer, larger writes cost the API process less CPU per "
            "token; a client sees the text in steps of N tokens"
        },
    )
    warmup: bool = field(
        default=True,
        metadata={
            "help": "run one short prefill and decode before reporting ready, so the first "
            "requests do not pay the first step's start-up (--no-warmup: a cold start)"
        },
    )

    def __post_init__(self) -> None:
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(
                f"scheduling_policy must be fcfs or priority, not {self.scheduling_policy!r}"
            )
        for name in (
            "block_size",
            "max_num_batched_tokens",
            "max_num_seqs",
            "tensor_parallel_size",
            "stream_interval",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 (no cap) or more, got {self.max_logprobs}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError("kv_cache_memory_bytes must be positive")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be at least 1")
        if self.transport not in ("ipc", "tcp"):
            raise ValueError(f"transport must be ipc or tcp, not {self.transport!r}")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in (*DTYPES, *KV_8BIT):
            self.resolve_kv_cache_dtype(None)  # raises, saying what is accepted
        check_quantization(self.quantization)
        kv_events_config.parse(self.kv_events_config)  # raises, in one line, on bad JSON
        spec_config.parse(self.speculative_config)  # likewise
        if self.max_loras < 1 or not 1 <= self.max_lora_rank <= 512:
            raise ValueError("max_loras must be at least 1, and max_lora_rank from 1 to 512 "
                             "(vLLM's largest)")  # fmt: skip
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras "
                             f"({self.max_loras})")  # fmt: skip
        if self.enable_lora and self.speculative_config:
            raise ValueError("--enable-lora with --speculative-config is not built: a draft "
                             "must run with each request's adapter")  # fmt: skip
        if self.prefix_caching_hash_algo != "sha256_cbor":
            raise ValueError(
                "prefix_caching_hash_algo must be sha256_cbor (vLLM's sha256, xxhash and "
                f"xxhash_cbor are not built), not {self.prefix_caching_hash_algo!r}"
            )
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, not {self.device!r}")
        if (
            self.generation_config not in ("auto", "none")
            and not Path(self.generation_config).is_dir()
        ):
            raise ValueError(
                "generation_config must be auto, none or a folder holding a "
                f"generation_config.json, not {self.generation_config!r}"
            )

    def lora_settings(self) -> LoraSettings | None:
        """What the workers need of the LoRA options; None when LoRA is off."""
        if not self.enable_lora:
            return None
        return LoraSettings(self.max_cpu_loras or self.max_loras, self.max_lora_rank)

    def sampling_defaults(self, model_path: str | Path) -> dict[str, Any]:
        """SamplingParams fields a request leaves out take these (generation_config)."""
        if self.generation_config == "none":
            return {}
        folder = Path(model_path if self.generation_config == "auto" else self.generation_config)
        file = folder / "generation_config.json"
        if not file.is_file():
            if self.generation_config == "auto":
                return {}
            raise ValueError(f"generation_config: {folder} holds no generation_config.json")
        try:
            found = json.loads(file.read_text())
        except ValueError as e:
            raise ValueError(f"generation_config: {file} is not JSON ({e})") from None
        return {
            ("max_tokens" if key == "max_new_tokens" else key): found[key]
            for key in GENERATION_DEFAULTS
            if isinstance(found, dict) and found.get(key) is not None
        }

    def resolve_device(self) -> torch.device:
        import torch

        choice = envs.LUMEN_DEVICE.get() or self.device
        if choice == "auto":
            choice = "cuda" if torch.cuda.is_available() else "cpu"
        if choice == "cuda" and not torch.cuda.is_available():
            raise ValueError("device cuda was asked for but CUDA is not available")
        return torch.device(choice)

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        import torch

        if self.dtype == "auto":
            # bf16 is emulated (slow) on most CPUs.
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        if self.dtype not in DTYPES:
            raise ValueError(
                f"dtype must be auto or one of {', '.join(DTYPES)}, not {self.dtype!r}"
            )
        return getattr(torch, self.dtype)

    def resolve_kv_cache_dtype(self, model_dtype: torch.dtype | None) -> torch.dtype:
        if self.kv_cache_dtype == "auto":
            assert model_dtype is not None
            return model_dtype
        if self.kv_cache_dtype not in (*DTYPES, *KV_8BIT):
            raise ValueError(
                f"kv_cache_dtype must be auto or one of {', '.join((*DTYPES, *KV_8BIT))}, not "
                f"{self.kv_cache_dtype!r}" + (" (fp8 is e4m3 here; e5m2 is not supported)"
                                              if "fp8" in self.kv_cache_dtype else "")
            )  # fmt: skip
        import torch

        return getattr(torch, KV_8BIT.get(self.kv_cache_dtype, self.kv_cache_dtype))

    def resolve_kv_cache_bytes(self, device: torch.device) -> int:
        if self.kv_cache_memory_bytes is not None:
            return self.kv_cache_memory_bytes
        if device.type == "cuda":
            import torch

            free, _ = torch.cuda.mem_get_info(device)
            return int(free * 0.8)
        return 4 * GiB
