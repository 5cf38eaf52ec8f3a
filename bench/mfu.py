"""lumen bench mfu: achieved model FLOP/s against the machine's ceiling, measured in one run.

1. The ceiling: the best FLOP/s of the model's widest matrix product
   ([2048, hidden] x [hidden, 2 x intermediate]), measured before and after
   the workload (the higher counts).
2. The floor of a decode step: one pass of a batch of rows through every
   weight matrix, against Lumen's real decode step at that batch.
3. The offline workload of `lumen bench throughput` through LLM; every
   step's record gives its model FLOPs (attention included) and its model
   time (the worker's execute span). Achieved FLOP/s = FLOPs / wall time.
"""

from __future__ import annotations

import argparse
import gc

from bench.common import check_json_path, machine, parse_ints, print_table, write_json
from bench.roofline import FlopCounter, StepTimer, kv_pass, matmul_ceiling, weights_pass
from bench.throughput import ENGINE_SKIP, make_workload, run_lumen, warmup_workload

ROUNDS = 3  # interleaved weights-pass / decode-step rounds per batch size (--rounds)
TARGETS = {"mfu": 0.70, "decode_over_floor": 1.1, "model_time": 0.90}


def add_parser(verbs: argparse._SubParsersAction) -> None:
    from engine.arg_utils import add_engine_options

    p = verbs.add_parser("mfu", help="achieved model FLOP/s over a measured matmul ceiling")
    p.add_argument("--num-requests", type=int, default=64, help="requests in the workload")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload's lengths and ids")
    p.add_argument(
        "--decode-batches", default="1,16,64", help="decode batch sizes timed against the weights"
    )
    p.add_argument(
        "--decode-contexts",
        default="128,512",
        help="tokens before each timed decode row, comma-separated",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=ROUNDS,
        help="interleaved weights-pass / decode-step rounds per batch, the fastest of each "
        "counting (more on a noisy machine)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the figures as JSON")
    add_engine_options(p, skip=ENGINE_SKIP)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from engine import LLM
    from engine.arg_utils import engine_options
    from engine.config import EngineConfig
    from engine.model_config import ModelConfig
    from engine.model_files import resolve_model

    batches = parse_ints(args.decode_batches, "--decode-batches")
    contexts = parse_ints(args.decode_contexts, "--decode-contexts")
    if args.num_requests < 1:
        raise ValueError("--num-requests must be at least 1")
    if args.rounds < 1:
        raise ValueError(f"--rounds must be at least 1, got {args.rounds}")
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    check_json_path(args.json)
    options = engine_options(args, skip=ENGINE_SKIP)
    config = EngineConfig(**options)
    device = config.resolve_device()
    dtype = config.resolve_dtype(device)
    kv_dtype = config.resolve_kv_cache_dtype(dtype)
    path = str(resolve_model(args.model))
    cfg = ModelConfig.from_path(path)

    ceiling_before = matmul_ceiling(cfg, device, dtype)
    timer = StepTimer(path, device, dtype, kv_dtype)
    decode = []
    for b in batches:
        # Interleaved rounds, the fastest of each: the two figures share the machine's state.
        floors: list[float] = []
        steps_by_ctx: dict[int, list[float]] = {ctx: [] for ctx in contexts}
        for _ in range(args.rounds):
            floors.append(weights_pass(timer.model, b, device))
            for ctx in contexts:
                steps_by_ctx[ctx].append(timer.decode_step(b, ctx))
        for ctx in contexts:
            decode.append(
                {"batch": b, "context": ctx, "weights_pass_s": min(floors),
                 "kv_pass_s": kv_pass(cfg, b * ctx, device, kv_dtype),
                 "decode_step_s": min(steps_by_ctx[ctx])}
            )  # fmt: skip
    timer.release()
    del timer
    gc.collect()

    llm = LLM(**options)
    tok = llm.get_tokenizer()
    special = set(tok.all_special_ids) | set(tok.added_tokens_decoder)
    work = make_workload(args.num_requests, args.seed, cfg.vocab_size, special)
    run_lumen(llm, warmup_workload(args.seed, cfg.vocab_size, special))
    llm.reset_prefix_cache()
    llm.step_log = []
    wall = run_lumen(llm, work)
    steps, llm.step_log = llm.step_log, None
    llm.shutdown()
    del llm
    gc.collect()
    ceiling_after = matmul_ceiling(cfg, device, dtype)
    ceiling = max(ceiling_before, ceiling_after)

    flops = FlopCounter(cfg)
    for step, sampled in steps:
        flops.add(step, sampled)
    achieved = flops.flops / wall
    mfu = achieved / ceiling
    model_fraction = flops.model_seconds / wall

    print(
        f"{cfg.path.rstrip('/').rsplit('/', 1)[-1]}, {device.type}, "
        f"{str(dtype).removeprefix('torch.')}, KV cache {str(kv_dtype).removeprefix('torch.')}, "
        f"{torch.get_num_threads()} threads"
    )
    print(
        f"matmul ceiling: {ceiling / 1e9:.1f} GFLOP/s "
        f"(before {ceiling_before / 1e9:.1f}, after {ceiling_after / 1e9:.1f})"
    )
    print("\ndecode step vs its floor (a pass over the weights + a read of the KV it attends to):")
    print_table(
        ("batch", "context", "weights (ms)", "KV (ms)", "decode step (ms)", "/ weights", "/ floor"),
        [
            (
                str(d["batch"]),
                str(d["context"]),
                f"{d['weights_pass_s'] * 1e3:.1f}",
                f"{d['kv_pass_s'] * 1e3:.1f}",
                f"{d['decode_step_s'] * 1e3:.1f}",
                f"{d['decode_step_s'] / d['weights_pass_s']:.2f}",
                f"{d['decode_step_s'] / (d['weights_pass_s'] + d['kv_pass_s']):.2f}",
            )
            for d in decode
        ],
    )
    print(f"(target: decode step within {TARGETS['decode_over_floor']}x its floor)")
    print(
        f"\nworkload: {args.num_requests} requests, {work.prompt_tokens} prompt + "
        f"{work.output_tokens} output tokens in {wall:.2f} s, {flops.steps} steps"
    )
    print(
        f"model FLOPs {flops.flops / 1e12:.2f} T; achieved {achieved / 1e9:.1f} GFLOP/s "
        f"= {mfu:.1%} of the ceiling (target {TARGETS['mfu']:.0%})"
    )
    print(
        f"model time {flops.model_seconds:.2f} s = {model_fraction:.1%} of wall "
        f"(target >= {TARGETS['model_time']:.0%}); during model time "
        f"{flops.flops / flops.model_seconds / 1e9:.1f} GFLOP/s"
    )
    ratios = {}
    for d in decode:
        d["ratio"] = d["decode_step_s"] / d["weights_pass_s"]
        key = f"decode_b{d['batch']}_ctx{d['context']}"
        ratios[f"{key}_over_weights_pass_ratio"] = d["ratio"]
        d["floor_ratio"] = d["decode_step_s"] / (d["weights_pass_s"] + d["kv_pass_s"])
        ratios[f"{key}_over_floor_ratio"] = d["floor_ratio"]
    write_json(
        args.json,
        {
            "ceiling_flops": ceiling,
            "ceiling_before_flops": ceiling_before,
            "ceiling_after_flops": ceiling_after,
            "decode": decode,
            "rounds": args.rounds,
            **ratios,
            "workload": {
                "num_requests": args.num_requests,
                "seed": args.seed,
                "prompt_tokens": work.prompt_tokens,
                "output_tokens": work.output_tokens,
            },
            "wall_s": wall,
            "steps": flops.steps,
            "model_flops": flops.flops,
            "achieved_flops": achieved,
            "mfu_ratio": mfu,
            "model_seconds": flops.model_seconds,
            "model_time_ratio": model_fraction,
            "targets": TARGETS,
            "machine": machine(device),
        },
    )
    return 0
