"""The one registry of environment variables Lumen reads, all prefixed LUMEN_."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str
    help: str

    def get(self) -> str:
        return os.environ.get(self.name, self.default)


LUMEN_HOME = EnvVar(
    "LUMEN_HOME", str(Path.home() / ".cache" / "lumen"), "cache folder for converted models"
)
LUMEN_DEVICE = EnvVar("LUMEN_DEVICE", "", "force the device (cpu or cuda); empty = automatic")

LUMEN_API_KEY = EnvVar("LUMEN_API_KEY", "", "bearer key `lumen serve` requires (--api-key)")

LUMEN_DEBUG_DELAY = EnvVar(
    "LUMEN_DEBUG_DELAY",
    "",
    "testing only (engine/faults.py): SITE=SECONDS[,SITE=SECONDS] sleeps injected once per step "
    "at a site: schedule (the scheduler's schedule()), output (the core's output path, after "
    "update_from_output), emit (the frontend's processing of each step's outputs), "
    "grammar_compile (each grammar compile, on the grammar thread), grammar_mask (a step's "
    "token masks, when it has any); they prove the regression gate and the diagnosis catch a "
    "slower path; an unknown site is an error",
)
LUMEN_DEBUG_GC = EnvVar(
    "LUMEN_DEBUG_GC",
    "",
    "testing only (engine/faults.py): PROCESS=SECONDS[,PROCESS=SECONDS] (api, core): once its "
    "heap is settled, the process keeps an object graph whose collection takes a share of "
    "SECONDS and, on SIGUSR2, collects it until SECONDS have passed: a garbage-collection pause "
    "on demand (lumen bench diagnose provokes them)",
)
LUMEN_CPU_MATMUL = EnvVar(
    "LUMEN_CPU_MATMUL",
    "auto",
    "CPU kernel of the model's matrix products: auto (the fastest, timed at load), onednn "
    "(weights packed for oneDNN), aten (torch's BLAS) or panels (fp32 weights packed for "
    "Lumen's own kernel, native/f32_panels.c)",
)

LUMEN_CPU_ATTENTION = EnvVar(
    "LUMEN_CPU_ATTENTION",
    "auto",
    "CPU kernel of decode attention: auto (the native kernel, compiled once into LUMEN_HOME, "
    "where it builds and times faster at start), native (fail if it does not build) or torch",
)

LUMEN_CPU_GREEDY_HEAD = EnvVar(
    "LUMEN_CPU_GREEDY_HEAD",
    "auto",
    "CPU path of greedy decoding's LM head and argmax: auto (for each batch size the fastest "
    "of the native kernels and torch's, timed at start), fused (fp32, in registers), "
    "screened (bf16 logits pick the candidates, fp32 decides) or torch (logits, then argmax)",
)

LUMEN_CPU_THREADS = EnvVar(
    "LUMEN_CPU_THREADS",
    "auto",
    "torch threads of the engine's process on CPU: auto (the machine's cores, or 1 where more "
    "do not make a 16-row step 1.25x faster, timed at start) or a number",
)

LUMEN_CPU_INT8 = EnvVar(
    "LUMEN_CPU_INT8",
    "auto",
    "CPU kernel of --quantization int8's products: auto (the native kernel up to the row count "
    "where it times faster than widening the weight, at start), native (every row count; fail "
    "if it does not build) or widen (the weight widened, then torch's product)",
)

LUMEN_CPU_INT4 = EnvVar(
    "LUMEN_CPU_INT4",
    "auto",
    "CPU kernel of --quantization int4's products: auto (the native kernel up to the row count "
    "where it times faster than widening the weight, at start), native (every row count; fail "
    "if it does not build) or widen (the weight widened, then torch's product)",
)

LUMEN_CPU_GGUF = EnvVar(
    "LUMEN_CPU_GGUF",
    "auto",
    "CPU kernel of --quantization gguf's products (the GGUF file's own blocks): auto (the "
    "native kernel up to the row count where it times faster than widening the weight, at "
    "start), native (every row count) or widen (the weight widened, then torch's product)",
)

LUMEN_CPU_INT4_LAYER = EnvVar(
    "LUMEN_CPU_INT4_LAYER",
    "auto",
    "--quantization int4's and gguf's decode steps on CPU: auto (each decoder layer in one "
    "native call, its products included, up to 16 rows where the model and the step allow; "
    "engine/worker/cpu_decode_layer.py) or off (the products from Python)",
)
LUMEN_CPU_F32_LAYER = EnvVar(
    "LUMEN_CPU_F32_LAYER",
    "auto",
    "fp32 decode steps on CPU: auto (each decoder layer in one native call, its products "
    "through the sgemm aten calls, where torch runs on MKL and the model and the step allow; "
    "engine/worker/cpu_decode_layer.py) or off (the products from Python)",
)
LUMEN_CPU_DECODE_LAYER = EnvVar(
    "LUMEN_CPU_DECODE_LAYER",
    "auto",
    "decode steps on CPU: auto (the work between each decoder layer's products in native "
    "calls, where the model and the step allow; engine/worker/cpu_decode_layer.py) or off "
    "(op by op, int4's one-call layers included)",
)
LUMEN_VERIFY_AS_DECODE = EnvVar(
    "LUMEN_VERIFY_AS_DECODE",
    "auto",
    "speculative decoding on CPU: auto (a request verifying k drafts runs as k + 1 decode rows "
    "of its slot in the decode mirror, where its native attention serves every KV group and "
    "no layer has a sliding window) or off (as a prefill chunk, op by op)",
)

LUMEN_AUTOTUNE = EnvVar(
    "LUMEN_AUTOTUNE",
    "cache",
    "the CPU kernel choices timed at start (matrix products, attention, greedy head, int8, "
    "int4, threads): cache (reuse those an earlier start on this machine, model shape and versions "
    "made) or retune (time them again and overwrite the cache)",
)
LUMEN_AUTOTUNE_DIR = EnvVar(
    "LUMEN_AUTOTUNE_DIR", "", "folder of the cached CPU kernel choices; empty = LUMEN_HOME/autotune"
)
LUMEN_TOKENIZER_DIR = EnvVar(
    "LUMEN_TOKENIZER_DIR",
    "",
    "folder of the recorded tokenizer classes (a server's API process loads its tokenizer "
    "without importing torch); empty = LUMEN_HOME/tokenizers",
)
LUMEN_GC = EnvVar(
    "LUMEN_GC",
    "serving",
    "garbage collector of the server's processes once started: serving (gc.freeze() of the "
    "start-up heap, a young generation of 20,000) or default (Python's settings)",
)

ALL = (
    LUMEN_HOME, LUMEN_DEVICE, LUMEN_API_KEY, LUMEN_DEBUG_DELAY, LUMEN_DEBUG_GC, LUMEN_CPU_MATMUL,
    LUMEN_CPU_ATTENTION, LUMEN_CPU_GREEDY_HEAD, LUMEN_CPU_THREADS, LUMEN_CPU_INT8,
    LUMEN_CPU_INT4, LUMEN_CPU_GGUF, LUMEN_CPU_INT4_LAYER, LUMEN_CPU_F32_LAYER,
    LUMEN_CPU_DECODE_LAYER, LUMEN_VERIFY_AS_DECODE, LUMEN_AUTOTUNE, LUMEN_AUTOTUNE_DIR,
    LUMEN_TOKENIZER_DIR, LUMEN_GC,
)  # fmt: skip


def lumen_home() -> Path:
    return Path(LUMEN_HOME.get()).expanduser()


def tokenizer_dir() -> Path:
    folder = LUMEN_TOKENIZER_DIR.get().strip()
    return Path(folder).expanduser() if folder else lumen_home() / "tokenizers"
