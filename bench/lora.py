"""lumen bench lora: many LoRA adapters against the base model alone, side by side in one engine.

Random adapters in PEFT's format are written for the model (``--adapters`` of them, rank
``--rank`` on every product of every layer, B not zero), then one engine with --enable-lora
runs the same ``--streams`` greedy prompts, in turns, ``--repeats`` times after a warm-up:

- ``base``: every stream on the base model;
- ``one adapter``: every stream on the first adapter;
- ``N adapters``: the streams spread over all of them (stream i on adapter i mod N);
- ``load``: as ``N adapters``, with one stream's adapter loaded anew (an id the worker has not
  read): its step reads the adapter from disk.

The best run of each counts. The table gives delivered tokens per second, the ratio to
``base`` in the same engine, and the decode steps' median and p99 time (what a stream waits per
token), so the cost of the LoRA products per step, and of a load, read side by side.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import check_json_path, machine, print_table, write_json

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPT = "Write a short story about a lighthouse keeper and the sea, number {i}."


def add_parser(verbs: argparse._SubParsersAction) -> None:
    p = verbs.add_parser("lora", help="LoRA adapters against the base model: tok/s, step times")
    p.add_argument("--model", default=None, help="model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--adapters", type=int, default=8, help="adapters the streams spread over")
    p.add_argument("--rank", type=int, default=16, help="each adapter's rank (every product)")
    p.add_argument("--streams", default="32", help="','-separated stream counts, each measured")
    p.add_argument("--max-tokens", type=int, default=64, help="greedy tokens a stream")
    p.add_argument("--repeats", type=int, default=3, help="runs per setting (the best counts)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the figures as JSON")
    p.set_defaults(func=run)


def write_adapter(model: Path, out: Path, rank: int, seed: int) -> Path:
    """A random PEFT LoRA folder for every product of every layer of ``model``."""
    import torch
    from safetensors.torch import save_file

    from engine.lora import module_shape
    from engine.model_config import ModelConfig

    cfg = ModelConfig.from_path(model)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for name in MODULES:
            fan_in, fan_out = module_shape(cfg, name)
            part = "self_attn" if name in MODULES[:4] else "mlp"
            stem = f"base_model.model.model.layers.{layer}.{part}.{name}"
            tensors[f"{stem}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / math.sqrt(
                fan_in
            )
            tensors[f"{stem}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.01
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(MODULES),
        "bias": "none", "base_model_name_or_path": str(model),
    }))  # fmt: skip
    return out


def run(args: argparse.Namespace) -> int:
    from engine import LLM, LoRARequest, SamplingParams
    from engine.model_files import resolve_model

    check_json_path(args.json)
    counts = [int(s) for s in args.streams.split(",")]
    if args.adapters < 1 or min(counts) < 1:
        raise ValueError("--adapters and --streams must be at least 1")
    path = resolve_model(args.model)
    folder = Path(tempfile.mkdtemp(prefix="lumen-bench-lora-"))
    started = time.perf_counter()
    adapters = [write_adapter(path, folder / f"a{i}", args.rank, i) for i in range(args.adapters)]
    print(f"{args.adapters} adapters of rank {args.rank} written in "
          f"{time.perf_counter() - started:.1f} s")  # fmt: skip
    # One slot more than the adapters: the load setting's new adapter finds one free; and
    # memory for every load, so that none pushes out an adapter another setting reads.
    llm = LLM(str(path), enable_lora=True, max_loras=args.adapters + 1,
              max_cpu_loras=args.adapters + 1 + args.repeats * len(counts),
              max_lora_rank=max(16, args.rank), max_num_seqs=max(64, max(counts)))  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    loras = [LoRARequest(f"a{i}", i + 1, str(a)) for i, a in enumerate(adapters)]
    llm.generate(["Hi"] * 2, SamplingParams(max_tokens=4), lora_request=[None, loras[0]],
                 use_tqdm=False)  # fmt: skip
    fresh_id = [len(loras) + 1]
    results: list[dict[str, Any]] = []
    for streams in counts:
        prompts = [PROMPT.format(i=i) for i in range(streams)]
        spread = [loras[i % len(loras)] for i in range(streams)]
        llm.generate(prompts, params, lora_request=spread, use_tqdm=False)  # every one read

        def plan(name: str, spread: list[LoRARequest] = spread) -> Any:
            if name == "base":
                return None
            if name == "one adapter":
                return loras[0]
            if name == "load":  # one stream's adapter is a new load: the worker reads it
                fresh_id[0] += 1
                last = loras[-1]
                new = LoRARequest(f"load{fresh_id[0]}", fresh_id[0], last.lora_path)
                return [*spread[:-1], new]
            return spread

        best: dict[str, dict[str, Any]] = {}
        for _ in range(args.repeats):
            for name in ("base", "one adapter", f"{len(loras)} adapters", "load"):
                llm.step_log = []
                start = time.perf_counter()
                out = llm.generate(prompts, params, lora_request=plan(name), use_tqdm=False)
                seconds = time.perf_counter() - start
                tokens = sum(len(o.outputs[0].token_ids) for o in out)
                steps = sorted(
                    (s.execute_end_ns - s.schedule_start_ns) / 1e6
                    for s, _ in llm.step_log
                    if s.num_decode_tokens == streams
                )
                figures = {"streams": streams, "setting": name, "seconds": seconds,
                           "tokens": tokens, "tok_s": tokens / seconds,
                           "step_p50_ms": _pct(steps, 0.5), "step_p99_ms": _pct(steps, 0.99),
                           "step_max_ms": steps[-1] if steps else 0.0}  # fmt: skip
                if name not in best or seconds < best[name]["seconds"]:
                    best[name] = figures
        base = best["base"]["tok_s"]
        for figures in best.values():
            figures["ratio"] = figures["tok_s"] / base
            results.append(figures)
    llm.shutdown()
    rows = [[str(r["streams"]), r["setting"], str(r["tokens"]), f"{r['tok_s']:.1f}",
             f"{r['ratio']:.2f}", f"{r['step_p50_ms']:.1f}", f"{r['step_p99_ms']:.1f}",
             f"{r['step_max_ms']:.1f}"] for r in results]  # fmt: skip
    print(f"{args.max_tokens} greedy tokens a stream, best of {args.repeats}; {path}")
    print_table(["streams", "setting", "tokens", "tok/s", "x base", "step p50 ms",
                 "step p99 ms", "step max ms"], rows)  # fmt: skip
    write_json(args.json, {"machine": machine(), "rank": args.rank, "adapters": args.adapters,
                           "results": results})  # fmt: skip
    return 0


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    return values[min(len(values) - 1, int(q * len(values)))]
