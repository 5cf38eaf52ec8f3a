"""lumen bench one-stream: one user's decode speed, Lumen in each precision beside llama.cpp.

One chat prompt, ``--max-tokens`` greedy tokens (``ignore_eos``), the best of ``--repeats``
runs after a warm-up, through the offline LLM for each ``--quantizations`` setting (none: the
model's dtype). llama.cpp (llama-cpp-python, when it is installed; the line says so when it is
not) runs the model's own GGUF file, the one Lumen's default model is converted from (Q4_1 for
SmolLM2), with every core, the same number of tokens, greedy, in a process of its own (a build
that faults on this CPU says so in its line and leaves Lumen's rows).

Each is also stated against its floor: a single stream reads every weight once per token, so
tokens per second cannot pass (read bandwidth) / (bytes read per token). The bandwidth is
measured here (a sum over a 512 MiB buffer, every core), the bytes per token are the weights as
each system stores them (plus the KV it reads at the mean context).
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import check_json_path, gguf_file, machine, print_table, write_json

PROMPT = "Write a long story about a lighthouse keeper and the sea."
# Bytes per weight of a decoder layer's [out, in] matrix, by quantization (int8: one fp32 scale
# per output row; int4: a 32-weight group's fp32 scale and minimum beside 16 bytes of codes).
BYTES_PER_WEIGHT = {None: 4.0, "int8": 1.0, "int4": 0.75}


def add_parser(verbs: argparse._SubParsersAction) -> None:
    p = verbs.add_parser("one-stream", help="one stream's tok/s: Lumen fp32, int8, int4 and "
                         "llama.cpp on the same model, each against its memory floor")  # fmt: skip
    p.add_argument("--model", default=None, help="model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--quantizations", default="none,int8,int4",
                   help="Lumen settings: none (the model's dtype), int8, int4, gguf (the GGUF "
                   "file llama.cpp runs, in its own formats)")  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=128, help="greedy tokens per run")
    p.add_argument("--repeats", type=int, default=3, help="runs per system (the best counts)")
    p.add_argument(
        "--gguf",
        default=None,
        metavar="PATH",
        help="llama.cpp's model (default: the default model's own GGUF, fetched once)",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        help="the prompt's chat template, for a model that has none (a file, a built-in name "
        "or Jinja, as lumen serve's; e.g. gemma for the packaged Gemma 3 270M)",
    )
    p.add_argument("--json", default=None, metavar="PATH", help="write the figures as JSON")
    p.set_defaults(func=run)


def read_bandwidth() -> float:
    """Bytes per second a sum over a 512 MiB fp32 buffer reads, every core (best of 5)."""
    buf = torch.ones(128 << 20)
    buf.sum()
    best = min(_timed(buf.sum) for _ in range(5))
    return buf.numel() * 4 / best


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def lumen_bytes_per_token(path: str, quantization: str | None, context: int) -> float:
    """The weights one decode step reads, as Lumen stores them under ``quantization`` (the
    decoder layers' matrices; the LM head in fp32, or int8 under int4; one embedding row), and
    the KV of ``context`` tokens."""
    from safetensors import safe_open

    from engine.model_config import ModelConfig

    cfg = ModelConfig.from_path(path)
    layers = head = 0
    for f in Path(path).glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
                count = math.prod(st.get_slice(name).get_shape())
                if name.startswith("model.layers.") and name.endswith("_proj.weight"):
                    layers += count
                elif name in ("lm_head.weight", "model.embed_tokens.weight"):
                    head = max(head, count)  # tied: the embedding is the head
    kv = cfg.kv_bytes_per_token(torch.float32) * context
    if quantization == "gguf":  # the file's blocks as kept; a product without them in fp32
        from engine.gguf_blocks import BLOCKS_FILE

        with safe_open(str(Path(path) / BLOCKS_FILE), "np") as st:
            kept = {n[: -len(".blocks")]: st.get_slice(n).get_shape() for n in st.keys()  # noqa: SIM118
                    if n.endswith(".blocks")}  # fmt: skip
        blocks = sum(math.prod(shape) for shape in kept.values())
        plain = 0 if "lm_head.weight" in kept else head * 4.0
        return blocks + plain + kv
    head_bytes = BYTES_PER_WEIGHT["int8"] if quantization == "int4" else 4.0
    return layers * BYTES_PER_WEIGHT[quantization] + head * head_bytes + kv


def run_lumen(
    path: str, quantization: str | None, max_tokens: int, repeats: int,
    chat_template: str | None = None,
) -> float:  # fmt: skip
    from engine import LLM, SamplingParams

    llm = LLM(model=path, quantization=quantization, enable_prefix_caching=False)
    try:
        chat = [[{"role": "user", "content": PROMPT}]]

        def run(params: SamplingParams) -> object:
            return llm.chat(chat, params, use_tqdm=False, chat_template=chat_template)

        run(SamplingParams(temperature=0, max_tokens=8))  # warm-up
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        return max(max_tokens / _timed(lambda: run(params)) for _ in range(repeats))
    finally:
        llm.shutdown()


def run_llama_cpp(gguf: Path, max_tokens: int, repeats: int) -> float:
    """llama.cpp's tok/s over ``max_tokens`` greedy tokens after the prompt (its own loop)."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=1024, n_threads=os.cpu_count(), verbose=False)
    prompt = llm.tokenize(PROMPT.encode())

    def once() -> float:
        llm.reset()
        tokens = llm.generate(prompt, top_k=1, temp=0.0)
        next(tokens)  # the prompt's evaluation and the first token: not decode
        t0 = time.perf_counter()
        for _, _ in zip(range(max_tokens), tokens):
            pass
        return max_tokens / (time.perf_counter() - t0)

    once()
    return max(once() for _ in range(repeats))


_CHILD = (
    "import sys; from bench.one_stream import run_llama_cpp as r; "
    "print(r(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))"
)


def _llama_cpp_child(gguf: Path, max_tokens: int, repeats: int) -> tuple[float, str]:
    """``run_llama_cpp`` in a process of its own: a llama.cpp build that faults on this CPU (a
    native build's AMX tiles in a VM that does not grant them, say) must not take Lumen's
    figures with it. (tok/s, "") or (0, what went wrong)."""
    cmd = [sys.executable, "-c", _CHILD, str(gguf), str(max_tokens), str(repeats)]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False)
    if done.returncode < 0:
        return 0.0, (f"its process died of {signal.Signals(-done.returncode).name}: a build for "
                     "instructions this machine refuses? Rebuild llama-cpp-python with "
                     "CMAKE_ARGS naming this CPU's features")  # fmt: skip
    if done.returncode != 0:
        return 0.0, f"it exited with status {done.returncode}; its error is above"
    return float(done.stdout.strip().splitlines()[-1]), ""


def run(args: argparse.Namespace) -> int:
    from engine.config import check_quantization
    from engine.model_files import resolve_model

    settings: list[str | None] = []
    for q in (s.strip() for s in args.quantizations.split(",") if s.strip()):
        if q != "none":
            check_quantization(q)
        settings.append(None if q == "none" else q)
    if min(args.max_tokens, args.repeats) < 1:
        raise ValueError("--max-tokens and --repeats must be >= 1")
    check_json_path(args.json)
    path = str(resolve_model(args.model))
    # gguf runs the very file llama.cpp runs (its own blocks are kept when it is converted)
    gguf_path = (
        str(resolve_model(str(gguf_file(args.model, args.gguf)))) if "gguf" in settings else path
    )
    bandwidth = read_bandwidth()
    context = args.max_tokens // 2 + 24  # the mean context of a run (the prompt is ~24 tokens)
    rows: list[dict[str, Any]] = []
    for q in settings:
        where = gguf_path if q == "gguf" else path
        tok_s = run_lumen(where, q, args.max_tokens, args.repeats, args.chat_template)
        rows.append({"system": f"lumen {q or 'fp32'}", "tok_s": tok_s,
                     "bytes_per_token": lumen_bytes_per_token(where, q, context)})  # fmt: skip
    llama_note = _llama_cpp(args, rows)
    for r in rows:
        r["floor_tok_s"] = bandwidth / r["bytes_per_token"]
        r["share_of_floor"] = r["tok_s"] / r["floor_tok_s"]
    print(f"\none stream, {args.max_tokens} greedy tokens; read bandwidth {bandwidth / 1e9:.1f} "
          f"GB/s; {machine()['device_name']}, {os.cpu_count()} cores")  # fmt: skip
    print_table(["system", "MB read per token", "tok/s", "floor tok/s", "of its floor"], [
        [r["system"], f"{r['bytes_per_token'] / 1e6:.1f}", f"{r['tok_s']:.1f}",
         f"{r['floor_tok_s']:.0f}", f"{r['share_of_floor']:.0%}"] for r in rows
    ])  # fmt: skip
    if llama_note:
        print(llama_note)
    ratios = {}
    llama = next((r for r in rows if r["system"] == "llama.cpp"), None)
    if llama is not None:
        for r in rows[:-1]:
            key = r["system"].replace(" ", "_") + "_over_llama_cpp_ratio"
            ratios[key] = r["tok_s"] / llama["tok_s"]
            print(f"{r['system']} / llama.cpp: {ratios[key]:.2f}")
    write_json(args.json, {"rows": rows, "read_bandwidth_bytes_s": bandwidth,
                           "llama_cpp": llama_note or "ran", **ratios,
                           "machine": machine()})  # fmt: skip
    return 0


def _llama_cpp(args: argparse.Namespace, rows: list[dict[str, Any]]) -> str:
    """Run llama.cpp into ``rows``; returns what it did not run and why ("" when it ran)."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return (
            "llama.cpp: not run (llama-cpp-python is not installed; `pip install "
            "llama-cpp-python` builds it for this CPU)"
        )
    from engine.model_files import PACKAGED, served_name

    if args.gguf is None and served_name(args.model) not in PACKAGED:
        return (f"llama.cpp: not run (give --gguf PATH, {args.model}'s GGUF file: a packaged "
                "model's own is fetched)")  # fmt: skip
    gguf = gguf_file(args.model, args.gguf)
    tok_s, failure = _llama_cpp_child(gguf, args.max_tokens, args.repeats)
    if failure:
        return f"llama.cpp: not measured ({failure}); Lumen's rows stand"
    rows.append({"system": "llama.cpp", "tok_s": tok_s, "gguf": gguf.name,
                 "bytes_per_token": float(gguf.stat().st_size)})  # fmt: skip
    return ""
