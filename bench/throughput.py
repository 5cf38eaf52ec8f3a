"""lumen bench throughput: a fixed offline workload through Lumen and through Hugging Face."""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

PROMPT_LENS = (32, 512)
OUTPUT_LENS = (16, 256)
ENGINE_SKIP = ("seed",)  # --seed is the workload's seed; greedy decoding needs no other


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass
class Result:
    system: str
    requests: int
    output_tokens: int
    total_tokens: int
    seconds: float

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def total_tok_s(self) -> float:
        return self.total_tokens / self.seconds

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "output_tok_s": self.output_tok_s, "total_tok_s": self.total_tok_s}


def add_parser(verbs: argparse._SubParsersAction) -> None:
    from service.cli import add_engine_options

    p = verbs.add_parser("throughput", help="offline tokens/s, Lumen vs Hugging Face generate")
    p.add_argument("--num-requests", type=int, default=64, help="requests in the workload")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload's lengths and ids")
    p.add_argument("--hf-batch-size", type=int, default=16, help="HF generate static batch size")
    p.add_argument("--skip-hf", action="store_true", help="run Lumen only")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the figures as JSON")
    add_engine_options(p, skip=ENGINE_SKIP)
    p.set_defaults(func=run)


def make_workload(num_requests: int, seed: int, vocab_size: int, special: set[int]) -> Workload:
    """Synthetic prompts of random non-special token ids; the same for a given seed."""
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(PROMPT_LENS[0], PROMPT_LENS[1] + 1, size=num_requests)
    output_lens = rng.integers(OUTPUT_LENS[0], OUTPUT_LENS[1] + 1, size=num_requests)
    allowed = np.setdiff1d(np.arange(vocab_size), np.fromiter(special, dtype=np.int64))
    prompts = [rng.choice(allowed, size=int(n)).tolist() for n in prompt_lens]
    return Workload(prompts, output_lens.tolist())


def warmup_workload(seed: int, vocab_size: int, special: set[int]) -> Workload:
    """Two short requests (16-token prompts, 4 output tokens) to warm a system up."""
    warm = make_workload(2, seed + 1, vocab_size, special)
    return Workload([p[:16] for p in warm.prompts], [4, 4])


def run_lumen(llm: Any, work: Workload) -> float:
    from engine import SamplingParams

    prompts = [{"prompt_token_ids": p} for p in work.prompts]
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in work.output_lens
    ]
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    got = [len(r.outputs[0].token_ids) for r in results]
    if got != work.output_lens:
        raise RuntimeError(f"Lumen generated {got} tokens, expected {work.output_lens}")
    return seconds


def run_hf(model: Any, work: Workload, batch_size: int, pad_id: int, device: torch.device) -> float:
    """Static batches in request order, left-padded; each batch runs to its longest output."""
    seconds = 0.0
    for start in range(0, len(work.prompts), batch_size):
        prompts = work.prompts[start : start + batch_size]
        max_new = max(work.output_lens[start : start + batch_size])
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        ids, mask = ids.to(device), mask.to(device)
        _sync(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new,
                min_new_tokens=max_new,  # EOS cannot end a row early
                do_sample=False,
                pad_token_id=pad_id,
            )
        _sync(device)
        seconds += time.perf_counter() - t0
        if out.shape[1] - width != max_new:
            raise RuntimeError(f"HF generated {out.shape[1] - width} tokens, expected {max_new}")
    return seconds


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _validate(args: argparse.Namespace) -> None:
    if args.num_requests < 1:
        raise ValueError(f"--num-requests must be at least 1, got {args.num_requests}")
    if args.hf_batch_size < 1:
        raise ValueError(f"--hf-batch-size must be at least 1, got {args.hf_batch_size}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be at least 1, got {args.threads}")
    if args.json is not None and not Path(args.json).parent.is_dir():
        raise ValueError(f"--json: folder {Path(args.json).parent} does not exist")


def run(args: argparse.Namespace) -> int:
    from service.cli import engine_options

    _validate(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    from engine import LLM
    from engine.config import ModelConfig
    from engine.model_files import resolve_model

    path = resolve_model(args.model)
    vocab_size = ModelConfig.from_path(path).vocab_size
    llm = LLM(**engine_options(args, skip=ENGINE_SKIP))
    tok = llm.get_tokenizer()
    special = set(tok.all_special_ids) | set(tok.added_tokens_decoder)
    work = make_workload(args.num_requests, args.seed, vocab_size, special)
    warm = warmup_workload(args.seed, vocab_size, special)
    device = llm.config.resolve_device()
    dtype = llm.config.resolve_dtype(device)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    total = work.prompt_tokens + work.output_tokens
    print(
        f"workload: {args.num_requests} requests (seed {args.seed}), "
        f"{work.prompt_tokens} prompt + {work.output_tokens} output tokens; "
        f"{path.name}, {device.type}, {str(dtype).removeprefix('torch.')}; Lumen runs first"
    )

    run_lumen(llm, warm)
    llm.reset_prefix_cache()
    lumen = Result("lumen", len(work.prompts), work.output_tokens, total, run_lumen(llm, work))
    llm.shutdown()
    del llm
    gc.collect()
    results = [lumen]

    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        run_hf(model, warm, args.hf_batch_size, pad_id, device)
        seconds = run_hf(model, work, args.hf_batch_size, pad_id, device)
        results.append(Result("hf_generate", len(work.prompts), work.output_tokens, total, seconds))
        del model
        gc.collect()

    _print_table(results)
    ratio = results[0].output_tok_s / results[1].output_tok_s if len(results) > 1 else None
    if ratio is not None:
        print(f"throughput ratio (Lumen / HF generate, output tok/s): {ratio:.2f}x")
    bs = args.hf_batch_size
    chunks = [work.output_lens[i : i + bs] for i in range(0, len(work.output_lens), bs)]
    hf_generated = sum(len(c) * max(c) for c in chunks)  # what HF computes, wasted rows too
    if args.json is not None:
        doc = {
            "workload": {
                "num_requests": args.num_requests,
                "seed": args.seed,
                "prompt_len_range": list(PROMPT_LENS),
                "output_len_range": list(OUTPUT_LENS),
                "prompt_tokens": work.prompt_tokens,
                "output_tokens": work.output_tokens,
                "hf_batch_size": args.hf_batch_size,
                "model": path.name,
                "dtype": str(dtype).removeprefix("torch."),
                "order": "lumen first, freed before hf_generate",
            },
            "lumen": lumen.as_json(),
            "hf_generate": {**results[1].as_json(), "generated_incl_padding": hf_generated}
            if len(results) > 1
            else None,
            "throughput_ratio": ratio,
            "machine": {
                "cpu_count": os.cpu_count(),
                "torch_threads": torch.get_num_threads(),
                "torch_version": torch.__version__,
                "device": device.type,
                "device_name": torch.cuda.get_device_name(device)
                if device.type == "cuda"
                else platform.processor() or platform.machine(),
            },
        }
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def _print_table(results: list[Result]) -> None:
    header = ("system", "requests", "output tokens", "seconds", "output tok/s", "total tok/s")
    rows = [
        (
            r.system,
            str(r.requests),
            str(r.output_tokens),
            f"{r.seconds:.2f}",
            f"{r.output_tok_s:.1f}",
            f"{r.total_tok_s:.1f}",
        )
        for r in results
    ]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    for row in (header, *rows):
        print(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))
            )
        )
