"""lumen bench prefill: one prompt's prefill through Lumen against Hugging Face's forward.

Lumen's time is a whole request through the offline LLM (max_tokens=1,
prefix caching off, fresh random token ids each time), which includes its
scheduler and its chunking of the prompt by the step's token budget; Hugging
Face's is one ``model(ids, logits_to_keep=1)`` forward on the same weights.
The timings are interleaved (every length, every budget, then HF, five rounds
by default) and each figure is the median of its rounds, so a drift of the
machine's speed falls on both sides alike.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np
import torch

from bench.common import check_json_path, machine, parse_ints, print_table, write_json


def add_parser(verbs: argparse._SubParsersAction) -> None:
    p = verbs.add_parser("prefill", help="one prompt's prefill, Lumen against HF's forward")
    p.add_argument("--model", default=None, help="model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--lengths", default="512,2000,4000", help="prompt lengths, comma-separated")
    p.add_argument(
        "--budgets",
        default="2048",
        help="Lumen step token budgets (--max-num-batched-tokens) to compare, comma-separated",
    )
    p.add_argument("--rounds", type=int, default=5, help="interleaved timings of each")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--json", default=None, metavar="PATH", help="write the figures as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from transformers import AutoModelForCausalLM

    from engine import LLM, SamplingParams
    from engine.model_config import ModelConfig
    from engine.model_files import resolve_model

    lengths = parse_ints(args.lengths, "--lengths")
    budgets = parse_ints(args.budgets, "--budgets")
    if args.rounds < 1:
        raise ValueError(f"--rounds must be at least 1, got {args.rounds}")
    check_json_path(args.json)
    path = resolve_model(args.model)
    cfg = ModelConfig.from_path(path)
    if max(lengths) >= cfg.max_position_embeddings:
        raise ValueError(f"--lengths: the model's context is {cfg.max_position_embeddings}")
    rng = np.random.default_rng(args.seed)
    blocks = -(-max(lengths) // 16) + 8
    options = {"enable_prefix_caching": False, "num_kv_blocks": blocks, "max_num_seqs": 1}
    llms = {b: LLM(model=str(path), max_num_batched_tokens=b, **options) for b in budgets}
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    params = SamplingParams(temperature=0, max_tokens=1)

    def ids(n: int) -> list[int]:
        return rng.integers(100, cfg.vocab_size - 100, size=n).tolist()

    def lumen(llm: Any, n: int) -> float:
        prompt = {"prompt_token_ids": ids(n)}
        t0 = time.perf_counter()
        llm.generate(prompt, params, use_tqdm=False)
        return time.perf_counter() - t0

    def hf_forward(n: int) -> float:
        x = torch.tensor([ids(n)])
        with torch.inference_mode():
            t0 = time.perf_counter()
            hf(x, logits_to_keep=1)
            return time.perf_counter() - t0

    times: dict[str, dict[int, list[float]]] = {
        k: {n: [] for n in lengths} for k in ["hf", *(f"lumen_{b}" for b in budgets)]
    }
    try:
        for n in lengths:  # one untimed pass of each: first-call costs are not prefill
            hf_forward(n)
            for llm in llms.values():
                lumen(llm, n)
        for r in range(args.rounds):
            for n in lengths:
                for b, llm in llms.items():
                    times[f"lumen_{b}"][n].append(lumen(llm, n))
                times["hf"][n].append(hf_forward(n))
            print(f"round {r + 1}/{args.rounds} done", flush=True)
    finally:
        for llm in llms.values():
            llm.shutdown()
    median = {k: {n: statistics.median(v) for n, v in per.items()} for k, per in times.items()}
    rows = []
    for n in lengths:
        row = [str(n), f"{median['hf'][n]:.3f}"]
        for b in budgets:
            m = median[f"lumen_{b}"][n]
            row += [f"{m:.3f}", f"{m / median['hf'][n]:.2f}"]
        rows.append(row)
    header = ["tokens", "HF forward s"]
    for b in budgets:
        header += [f"Lumen@{b} s", "/ HF"]
    print(f"\nmedian of {args.rounds} interleaved timings, {machine()['device_name']}, "
          f"{torch.get_num_threads()} threads, fp32")  # fmt: skip
    print_table(header, rows)
    write_json(
        args.json,
        {
            "machine": machine(),
            "rounds": args.rounds,
            "median_s": {k: {str(n): s for n, s in v.items()} for k, v in median.items()},
            "all_s": {k: {str(n): s for n, s in v.items()} for k, v in times.items()},
            "ratio": {
                f"lumen_{b}": {str(n): median[f"lumen_{b}"][n] / median["hf"][n] for n in lengths}
                for b in budgets
            },
        },
    )
    return 0
