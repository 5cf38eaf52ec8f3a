"""Engine configuration: frozen dataclasses whose fields are also the CLI defaults."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine import envs, kv_events_config

if TYPE_CHECKING:
    import torch
# torch is imported where a dtype or device is resolved, not here: `lumen` parses its arguments
# and spawns the core before the API process pays for torch.

GiB = 1 << 30


def _llama_flags(cfg: dict[str, Any]) -> dict[str, Any]:
    """Llama and Mistral: biases only where the config asks (attention_bias, mlp_bias)."""
    bias = bool(cfg.get("attention_bias", False))
    return {"qkv_bias": bias, "o_bias": bias, "mlp_bias": bool(cfg.get("mlp_bias", False)),
            "qk_norm": False, "window": cfg.get("sliding_window")}  # fmt: skip


def _qwen2_flags(cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen2 / Qwen2.5: biases on q, k and v (not o); a window only with use_sliding_window."""
    return {"qkv_bias": True, "o_bias": False, "mlp_bias": False, "qk_norm": False,
            "window": _qwen_window(cfg), "layer_types": _qwen_layer_types(cfg)}  # fmt: skip


def _qwen3_flags(cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen3: an RMSNorm over each q and k head before RoPE; biases where attention_bias."""
    bias = bool(cfg.get("attention_bias", False))
    return {"qkv_bias": bias, "o_bias": bias, "mlp_bias": False, "qk_norm": True,
            "window": _qwen_window(cfg), "layer_types": _qwen_layer_types(cfg)}  # fmt: skip


def _phi3_flags(cfg: dict[str, Any]) -> dict[str, Any]:
    """Phi-3, Phi-3.5, Phi-4-mini: q/k/v and gate/up fused in the checkpoint, RoPE over the
    first partial_rotary_factor of each head (longrope: the rope type, read below)."""
    return {"qkv_bias": False, "o_bias": False, "mlp_bias": False, "qk_norm": False,
            "fused_checkpoint": True, "window": cfg.get("sliding_window")}  # fmt: skip


def _gemma3_flags(cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3 (text): RMSNorm as (1 + w), norms before and after attention and the MLP,
    embeddings scaled by sqrt(hidden), GeGLU (tanh GELU), q/k norms, attention scaled by
    query_pre_attn_scalar, sliding layers interleaved with global ones (layer_types, or every
    sliding_window_pattern-th layer global), each kind with its own RoPE base."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if cfg.get(key) is not None:
            raise ValueError(f"Gemma 3 with {key} {cfg[key]} is not supported (Lumen runs it null)")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("Gemma 3 with use_bidirectional_attention is not supported")
    bias = bool(cfg.get("attention_bias", False))
    pattern = cfg.get("sliding_window_pattern", 6)
    types = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
        for i in range(cfg["num_hidden_layers"])
    ]
    return {"qkv_bias": bias, "o_bias": bias, "mlp_bias": False, "qk_norm": True,
            "gemma": True, "window": cfg.get("sliding_window"), "layer_types": types}  # fmt: skip


def _qwen_window(cfg: dict[str, Any]) -> int | None:
    """Qwen configs carry sliding_window beside use_sliding_window: false, which turns it off."""
    sliding = "sliding_attention" in (cfg.get("layer_types") or [])
    return cfg.get("sliding_window") if cfg.get("use_sliding_window") or sliding else None


def _qwen_layer_types(cfg: dict[str, Any]) -> list[str] | None:
    """Qwen2/Qwen3 window only the layers from max_window_layers on (transformers' rule)."""
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    first = cfg.get("max_window_layers", cfg["num_hidden_layers"])
    return ["sliding_attention" if i >= first else "full_attention"
            for i in range(cfg["num_hidden_layers"])]  # fmt: skip


# The one registry of families: each architecture's config translated into the switches the
# shared decoder (engine/worker/llama.py) takes. They differ from Llama only by these flags,
# so they share one module.
ARCHITECTURES = {
    "LlamaForCausalLM": _llama_flags,
    "MistralForCausalLM": _llama_flags,
    "Qwen2ForCausalLM": _qwen2_flags,
    "Qwen3ForCausalLM": _qwen3_flags,
    "Phi3ForCausalLM": _phi3_flags,
    "Gemma3ForCausalLM": _gemma3_flags,
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)


@dataclass(frozen=True)
class ModelConfig:
    """What the engine needs to know about the model, read from its config.json."""

    path: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    qkv_bias: bool = False  # biases on the q, k and v projections (Qwen2)
    o_bias: bool = False  # ... and on the output projection
    mlp_bias: bool = False  # ... and on gate, up and down
    qk_norm: bool = False  # an RMSNorm over each q and k head before RoPE (Qwen3)
    fused_checkpoint: bool = False  # the checkpoint holds qkv_proj and gate_up_proj (Phi-3)
    rotary_dim: int = 0  # RoPE rotates a head's first rotary_dim dims (0: all of head_dim)
    # Sliding-window attention: a local layer's query at position p reads the keys at
    # (p - sliding_window, p] (transformers' rule); 0 is no window. One window per model.
    sliding_window: int = 0
    local_layers: tuple[int, ...] = ()  # the sliding_attention layers
    local_rope_theta: float = 0.0  # the local layers' own RoPE base (0: rope_theta)
    gemma: bool = False  # Gemma 3's layer (see _gemma3_flags); query_pre_attn_scalar below
    query_pre_attn_scalar: float = 0.0  # attention scaled by its -1/2 power (0: head_dim's)

    @classmethod
    def from_path(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ValueError(f"{path} is not a model folder: it has no config.json")
        cfg = json.loads(cfg_file.read_text())
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or cfg.get('model_type')!r} in {path}: "
                f"Lumen runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        flags = ARCHITECTURES[arch](cfg)
        max_positions = cfg.get("max_position_embeddings", 2048)
        flags.update(_windows(cfg, flags.pop("window"), flags.pop("layer_types", None)))
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        # transformers 5 moved rope_theta (and the scaling dict) into rope_parameters; Gemma 3
        # keeps one dict per layer type there (older configs: rope_local_base_freq).
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        if "full_attention" in rope:
            local = rope.get("sliding_attention") or {}
            rope = dict(rope["full_attention"])
            flags["local_rope_theta"] = float(local.get("rope_theta", 10000.0))
        elif flags.get("gemma"):
            flags["local_rope_theta"] = float(cfg.get("rope_local_base_freq", 10000.0))
        if flags.get("gemma"):
            flags["query_pre_attn_scalar"] = float(cfg.get("query_pre_attn_scalar", head_dim))
        rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "linear", "llama3", "longrope"):
            raise ValueError(f"unsupported rope type {rope_type!r} in {path}")
        # Partial RoPE (Phi-3): at the top level, or among transformers 5's rope_parameters.
        partial = float(
            rope.pop("partial_rotary_factor", None) or cfg.get("partial_rotary_factor") or 1.0
        )
        flags["rotary_dim"] = int(head_dim * partial) if partial != 1.0 else 0
        if rope_type == "longrope":
            original = rope.get("original_max_position_embeddings") or cfg.get(
                "original_max_position_embeddings", max_positions
            )
            rope = {**rope, "original_max_position_embeddings": original,
                    "factor": rope.get("factor") or max_positions / original}  # fmt: skip
        return cls(
            path=str(path),
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads", num_heads),
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
            max_position_embeddings=max_positions,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            eos_token_ids=_eos_token_ids(path, cfg, flags.get("gemma", False)),
            **flags,
        )

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        # An 8-bit cache's row: head_dim codes and a 4-byte scale (engine/worker/kv_quant.py).
        row = self.head_dim * dtype.itemsize + (4 if dtype.itemsize == 1 else 0)
        return 2 * self.num_layers * self.num_kv_heads * row


def _windows(cfg: dict[str, Any], window: int | None, types: list[str] | None) -> dict[str, Any]:
    """The sliding window and the layers of the local kind: those layer_types names
    sliding_attention, or every layer where the family has no layer_types (Mistral, Phi-3).
    A window as long as the context is none (its layers keep their own RoPE base)."""
    if not window:
        return {}
    if types is not None and len(types) != cfg["num_hidden_layers"]:
        raise ValueError(f"layer_types names {len(types)} layers, the model has "
                         f"{cfg['num_hidden_layers']}")  # fmt: skip
    layers = tuple(
        i for i in range(cfg["num_hidden_layers"])
        if types is None or types[i] == "sliding_attention"
    )  # fmt: skip
    within = window < cfg.get("max_position_embeddings", 2048)
    return {"sliding_window": int(window) if within and layers else 0, "local_layers": layers}


def _eos_token_ids(path: Path, cfg: dict[str, Any], gemma: bool = False) -> tuple[int, ...]:
    """generation_config.json's eos_token_id, else config.json's; for Gemma, its end-of-turn
    token too (a GGUF file's config names only <eos>, the hub's generation config both)."""
    gen_file = path / "generation_config.json"
    eos = json.loads(gen_file.read_text()).get("eos_token_id") if gen_file.is_file() else None
    if eos is None:
        eos = cfg.get("eos_token_id")
    ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
    end_of_turn = _added_token(path, "<end_of_turn>") if gemma else None
    return (*ids, end_of_turn) if end_of_turn is not None and end_of_turn not in ids else ids


def _added_token(path: Path, content: str) -> int | None:
    """The id of an added token of tokenizer.json, found in the added_tokens list at its
    head without parsing the whole file (Gemma's is 33 MB)."""
    try:
        with open(path / "tokenizer.json", "rb") as fh:
            head = fh.read(1 << 20)
    except OSError:
        return None
    pattern = rb'"id":\s*(\d+),\s*"content":\s*"' + re.escape(content.encode()) + rb'"'
    found = re.search(pattern, head)
    return int(found.group(1)) if found else None


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
