"""lumen bench scheduler: the cost of one engine step outside the model, per running request.

The engine's VirtualCore (the real Scheduler and KVCacheManager) with its
stand-in model, which samples token 1 for every row at once. For each size
N, N requests are admitted (prompts of --prompt-len tokens) and prefilled;
then --steps decode steps are timed, each ``schedule()`` + the stand-in's
output + ``update_from_output()``, which is the whole of a step's core-side
bookkeeping: block allocation as requests cross block boundaries, block
tables, stop checks, outputs.
"""

from __future__ import annotations

import argparse
import gc
import time

from bench.common import check_json_path, parse_ints, print_table, write_json
from engine.config import EngineConfig
from engine.core.virtual import VirtualCore
from engine.messages import EngineCoreRequest
from engine.sampling_params import SamplingParams

TARGET_US = 20.0  # per running request per step, at 256 running


def add_parser(verbs: argparse._SubParsersAction) -> None:
    p = verbs.add_parser("scheduler", help="scheduler + KV cache step cost per running request")
    p.add_argument("--sizes", default="16,64,256,1024", help="running requests, comma-separated")
    p.add_argument("--steps", type=int, default=200, help="timed decode steps per size")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    p.add_argument("--json", default=None, metavar="PATH", help="write the figures as JSON")
    p.set_defaults(func=run)


def step_cost(
    num_running: int, steps: int, prompt_len: int, block_size: int, caching: bool
) -> float:
    """Median seconds of one decode step with ``num_running`` requests."""
    budget = max(2048, 2 * num_running)
    # Requests admitted first decode while later ones prefill (with at least
    # budget - num_running tokens a step): room for those tokens too.
    max_tokens = steps + -(-num_running * prompt_len // (budget - num_running)) + 2
    max_len = prompt_len + max_tokens
    blocks = num_running * (-(-max_len // block_size) + 1)
    core = VirtualCore(
        EngineConfig(
            num_kv_blocks=blocks, block_size=block_size, enable_prefix_caching=caching,
            max_num_batched_tokens=budget, max_num_seqs=num_running, max_model_len=max_len + 1,
        ),
        token=1,
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(num_running):
        # Distinct prompts: no prefix hits, every request holds its own blocks.
        prompt = [(i * 7919 + j) % 30000 + 1 for j in range(prompt_len)]
        core.add_request(EngineCoreRequest(f"r{i}", prompt, params, [], arrival_ns=0))
    one_step = core.step

    while core.num_running < num_running or core.num_waiting:
        one_step()  # admission and prefill, untimed
    gc.collect()
    gc.disable()  # a collection in one step is noise, not the scheduler's cost
    try:
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            one_step()
            times.append(time.perf_counter() - t0)
    finally:
        gc.enable()
    if core.num_running != num_running:
        raise RuntimeError(f"{num_running - core.num_running} requests ended early")
    return sorted(times)[len(times) // 2]


def run(args: argparse.Namespace) -> int:
    sizes = parse_ints(args.sizes, "--sizes")
    if min(args.steps, args.prompt_len, args.block_size) < 1:
        raise ValueError("--steps, --prompt-len and --block-size must be at least 1")
    check_json_path(args.json)
    caching = not args.no_prefix_caching
    step_cost(16, 5, args.prompt_len, args.block_size, caching)  # warm the interpreter
    results = []
    for n in sizes:
        seconds = step_cost(n, args.steps, args.prompt_len, args.block_size, caching)
        results.append(
            {"running": n, "step_us": seconds * 1e6, "us_per_request": seconds * 1e6 / n}
        )
    print(
        f"scheduler + KV cache manager, stand-in model: median of {args.steps} decode steps, "
        f"prompts of {args.prompt_len} tokens, blocks of {args.block_size}"
    )
    print_table(
        ("running", "step (us)", "us / request"),
        [(str(r["running"]), f"{r['step_us']:.0f}", f"{r['us_per_request']:.2f}") for r in results],
    )
    first, last = results[0], results[-1]
    # Linear growth keeps the per-request cost flat: this ratio stays near 1.
    growth = last["us_per_request"] / first["us_per_request"]
    at_256 = next((r for r in results if r["running"] == 256), None)
    if at_256 is not None:
        print(
            f"at 256 running: {at_256['us_per_request']:.2f} us per request per step "
            f"({at_256['us_per_request'] / TARGET_US:.2f} of the {TARGET_US:.0f} us target)"
        )
    print(
        f"per-request cost at {last['running']} / at {first['running']}: {growth:.2f} "
        "(1.0 = linear growth)"
    )
    write_json(
        args.json,
        {
            "sizes": results,
            "steps": args.steps,
            "prompt_len": args.prompt_len,
            "block_size": args.block_size,
            "prefix_caching": caching,
            "us_per_request_at_256": at_256["us_per_request"] if at_256 else None,
            "target_ratio_at_256": at_256["us_per_request"] / TARGET_US if at_256 else None,
            "per_request_growth_ratio": growth,
        },
    )
    return 0
