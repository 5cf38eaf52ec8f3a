"""lumen bench throughput: a fixed offline workload through Lumen and through Hugging Face."""

from __future__ import annotations

import argparse
import gc
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from bench.common import check_json_path, machine, parse_ints, print_table, write_json
from bench.server import HF_PAGE_TOKENS

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
    from engine.arg_utils import add_engine_options

    p = verbs.add_parser(
        "throughput", help="offline tokens/s, Lumen vs Hugging Face generate and generate_batch"
    )
    p.add_argument("--num-requests", type=int, default=64, help="requests in the workload")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload's lengths and ids")
    p.add_argument(
        "--prompt-lens",
        default=",".join(map(str, PROMPT_LENS)),
        metavar="MIN,MAX",
        help="prompt lengths, drawn uniformly in [MIN, MAX] (default %(default)s)",
    )
    p.add_argument(
        "--output-lens",
        default=",".join(map(str, OUTPUT_LENS)),
        metavar="MIN,MAX",
        help="output lengths, drawn uniformly in [MIN, MAX] (default %(default)s)",
    )
    p.add_argument(
        "--hf-batch-sizes",
        default="16,32,64",
        help="HF generate static batch sizes, comma-separated (the best one counts)",
    )
    p.add_argument("--skip-hf", action="store_true", help="skip HF generate (static batches)")
    p.add_argument("--skip-hf-cb", action="store_true", help="skip HF continuous batching")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the figures as JSON")
    add_engine_options(p, skip=ENGINE_SKIP)
    p.set_defaults(func=run)


def make_workload(
    num_requests: int,
    seed: int,
    vocab_size: int,
    special: set[int],
    prompt_range: tuple[int, int] = PROMPT_LENS,
    output_range: tuple[int, int] = OUTPUT_LENS,
) -> Workload:
    """Synthetic prompts of random non-special token ids; the same for a given seed."""
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(prompt_range[0], prompt_range[1] + 1, size=num_requests)
    output_lens = rng.integers(output_range[0], output_range[1] + 1, size=num_requests)
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


def run_hf_cb(model: Any, work: Workload, device: torch.device, kv_tokens: int) -> float:
    """Hugging Face continuous batching: the manager that ``generate_batch`` drives.

    ``generate_batch`` takes one ``max_new_tokens`` for every prompt; the
    workload gives each request its own, so each is added with its own
    length (and EOS off) to the same manager, sized by the same hints. Its paged
    cache holds ``kv_tokens``, Lumen's KV pool: left to itself, HF sizes the cache
    from free memory (14 GB on a 24 GB CPU machine, for any workload), and
    allocating it took longer than the run.
    """
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    config = GenerationConfig(
        do_sample=False, max_new_tokens=max(work.output_lens), eos_token_id=-1
    )
    hints = WorkloadHints(
        max_prompt_length=max(len(p) for p in work.prompts),
        max_generated_length=max(work.output_lens),
        num_requests=len(work.prompts),
    )
    _sync(device)
    t0 = time.perf_counter()
    with model.continuous_batching_context_manager(
        generation_config=config,
        block=True,
        timeout=30,
        warmup=False,
        workload_hints=hints,
        continuous_batching_config=ContinuousBatchingConfig(
            num_blocks=-(-kv_tokens // HF_PAGE_TOKENS), page_size=HF_PAGE_TOKENS
        ),
    ) as manager:
        ids = [
            manager.add_request(p, max_new_tokens=n, eos_token_id=-1)
            for p, n in zip(work.prompts, work.output_lens)
        ]
        done: dict[str, Any] = {}
        while len(done) < len(ids):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                done[result.request_id] = result
            elif result is None and not manager.is_running():
                raise RuntimeError("HF continuous batching stopped before finishing")
    _sync(device)
    seconds = time.perf_counter() - t0
    got = [len(done[i].generated_tokens) for i in ids]
    if got != work.output_lens:
        raise RuntimeError(f"HF continuous batching generated {got}, expected {work.output_lens}")
    return seconds


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _length_range(value: str, flag: str) -> tuple[int, int]:
    lengths = parse_ints(value, flag)
    if len(lengths) != 2 or lengths[0] > lengths[1]:
        raise ValueError(f"{flag} takes MIN,MAX with MIN <= MAX, got {value!r}")
    return lengths[0], lengths[1]


def _validate(args: argparse.Namespace) -> list[int]:
    args.prompt_range = _length_range(args.prompt_lens, "--prompt-lens")
    args.output_range = _length_range(args.output_lens, "--output-lens")
    if args.num_requests < 1:
        raise ValueError(f"--num-requests must be at least 1, got {args.num_requests}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be at least 1, got {args.threads}")
    check_json_path(args.json)
    return parse_ints(args.hf_batch_sizes, "--hf-batch-sizes")


def run(args: argparse.Namespace) -> int:
    from engine.arg_utils import engine_options

    batch_sizes = _validate(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    from engine import LLM
    from engine.model_config import ModelConfig
    from engine.model_files import resolve_model

    path = resolve_model(args.model)
    vocab_size = ModelConfig.from_path(path).vocab_size
    llm = LLM(**engine_options(args, skip=ENGINE_SKIP))
    tok = llm.get_tokenizer()
    special = set(tok.all_special_ids) | set(tok.added_tokens_decoder)
    work = make_workload(
        args.num_requests, args.seed, vocab_size, special, args.prompt_range, args.output_range
    )
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

    def result(system: str, seconds: float) -> Result:
        r = Result(system, len(work.prompts), work.output_tokens, total, seconds)
        print(f"  {system}: {seconds:.2f} s, {r.output_tok_s:.1f} output tok/s", flush=True)
        return r

    stats = llm.get_stats()
    kv_tokens = stats.num_kv_blocks_total * llm.config.block_size  # HF's paged cache gets as much
    run_lumen(llm, warm)
    llm.reset_prefix_cache()
    lumen = result("lumen", run_lumen(llm, work))
    llm.shutdown()
    del llm
    gc.collect()
    static: list[Result] = []
    cb: Result | None = None
    if not (args.skip_hf and args.skip_hf_cb):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        model = model.to(device).eval()  # type: ignore[arg-type]  # transformers' stub of to()
        if not args.skip_hf:
            run_hf(model, warm, 2, pad_id, device)
            for bs in batch_sizes:
                static.append(result(f"hf_generate_b{bs}", run_hf(model, work, bs, pad_id, device)))
        if not args.skip_hf_cb:
            run_hf_cb(model, warm, device, kv_tokens)
            cb = result("hf_generate_batch", run_hf_cb(model, work, device, kv_tokens))
        del model
        gc.collect()

    results = [lumen, *static, *([cb] if cb else [])]
    print()
    print_table(
        ("system", "requests", "output tokens", "seconds", "output tok/s", "total tok/s"),
        [
            (r.system, str(r.requests), str(r.output_tokens), f"{r.seconds:.2f}",
             f"{r.output_tok_s:.1f}", f"{r.total_tok_s:.1f}")
            for r in results
        ],
    )  # fmt: skip
    best = min(static, key=lambda r: r.seconds) if static else None
    ratio_static = lumen.output_tok_s / best.output_tok_s if best else None
    ratio_cb = lumen.output_tok_s / cb.output_tok_s if cb else None
    if best is not None:
        print(
            f"throughput ratio, Lumen / HF generate (best static batch, {best.system}): "
            f"{ratio_static:.2f}x (target >= 2x)"
        )
    if cb is not None:
        print(f"throughput ratio, Lumen / HF generate_batch: {ratio_cb:.2f}x (target >= 3x)")

    def padded(bs: int) -> int:  # what a static batch computes, wasted rows too
        chunks = [work.output_lens[i : i + bs] for i in range(0, len(work.output_lens), bs)]
        return sum(len(c) * max(c) for c in chunks)

    write_json(
        args.json,
        {
            "workload": {
                "num_requests": args.num_requests,
                "seed": args.seed,
                "prompt_len_range": list(args.prompt_range),
                "output_len_range": list(args.output_range),
                "prompt_tokens": work.prompt_tokens,
                "output_tokens": work.output_tokens,
                "model": path.name,
                "dtype": str(dtype).removeprefix("torch."),
                "order": "lumen first, freed before the HF model is loaded",
            },
            "lumen": lumen.as_json(),
            "hf_generate": [
                {**r.as_json(), "batch_size": bs, "generated_incl_padding": padded(bs)}
                for r, bs in zip(static, batch_sizes)
            ],
            "hf_generate_best": best.system if best else None,
            "hf_generate_batch": cb.as_json() if cb else None,
            "throughput_ratio_vs_hf_generate_best": ratio_static,
            "throughput_ratio_vs_hf_generate_batch": ratio_cb,
            "machine": machine(device),
        },
    )
    return 0
