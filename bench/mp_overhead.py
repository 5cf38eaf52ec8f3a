"""lumen bench mp-overhead: one workload through InprocClient and SyncMPClient, interleaved."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.throughput import ENGINE_SKIP, make_workload, run_lumen, warmup_workload


def add_parser(verbs: argparse._SubParsersAction) -> None:
    from engine.arg_utils import add_engine_options

    p = verbs.add_parser(
        "mp-overhead", help="throughput with the core in this process vs in its own process"
    )
    p.add_argument("--num-requests", type=int, default=32, help="requests in the workload")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds per client")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload's lengths and ids")
    p.add_argument("--json", default=None, metavar="PATH", help="write the figures as JSON")
    add_engine_options(p, skip=(*ENGINE_SKIP, "core_process"))
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from engine import LLM
    from engine.arg_utils import engine_options
    from engine.model_config import ModelConfig
    from engine.model_files import resolve_model

    if args.num_requests < 1 or args.rounds < 1:
        raise ValueError("--num-requests and --rounds must be at least 1")
    options = engine_options(args, skip=(*ENGINE_SKIP, "core_process"))
    path = resolve_model(args.model)
    engines = {
        "inproc": LLM(**options),
        "sync_mp": LLM(**options, core_process=True),
    }
    tok = engines["inproc"].get_tokenizer()
    special = set(tok.all_special_ids) | set(tok.added_tokens_decoder)
    vocab_size = ModelConfig.from_path(path).vocab_size
    work = make_workload(args.num_requests, args.seed, vocab_size, special)
    seconds: dict[str, list[float]] = {name: [] for name in engines}
    for llm in engines.values():
        run_lumen(llm, warmup_workload(args.seed, vocab_size, special))
    for _ in range(args.rounds):
        for name, llm in engines.items():
            llm.reset_prefix_cache()
            seconds[name].append(run_lumen(llm, work))
    for llm in engines.values():
        llm.shutdown()
    tok_s = {name: work.output_tokens / min(s) for name, s in seconds.items()}
    ratio = tok_s["sync_mp"] / tok_s["inproc"]
    print(
        f"workload: {args.num_requests} requests, {work.output_tokens} output tokens, "
        f"{args.rounds} interleaved rounds (best round counts)"
    )
    for name, s in seconds.items():
        print(
            f"{name:8s}  rounds {', '.join(f'{x:.2f}s' for x in s)}  "
            f"best {tok_s[name]:.1f} output tok/s"
        )
    print(f"throughput ratio (SyncMPClient / InprocClient): {ratio:.3f}")
    if args.json:
        doc = {
            "seconds": seconds,
            "output_tok_s": tok_s,
            "mp_over_inproc_ratio": ratio,
            "num_requests": args.num_requests,
            "output_tokens": work.output_tokens,
        }
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0
