"""lumen bench spec: speculative decoding against none, side by side in one process.

Two tasks through the offline LLM, greedy, the same prompts for each setting:

- ``copy``: an answer that repeats most of a ~300-token prompt with small edits (a function
  renamed in a piece of code), where prompt lookup finds most of the answer;
- ``story``: an open answer, where it finds little.

Each ``--speculative-configs`` entry gets an engine of its own, which runs ``--streams`` copies
of the task's prompt at once without speculation (off: the scheduler's rule at 0 rows) and with
it, in turns, ``--repeats`` times each after a warm-up; the best time of each counts. The table
gives delivered tokens per second, the ratio to off in the same engine, the drafts kept, and
whether every token was the same as off's (greedy output must be, always).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from bench.common import check_json_path, machine, print_table, write_json

CODE = """def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal = subtotal + item.price * item.quantity
    subtotal = subtotal * (1 + tax_rate)
    return round(subtotal, 2)


def average_price(items):
    subtotal = 0
    for item in items:
        subtotal = subtotal + item.price
    return subtotal / len(items)


def most_expensive(items):
    best = None
    for item in items:
        if best is None or item.price > best.price:
            best = item
    return best


def cheapest(items):
    best = None
    for item in items:
        if best is None or item.price < best.price:
            best = item
    return best
"""
TASKS = {
    "copy": "Repeat this Python code exactly, but rename the function total_price to "
    "price_with_tax. Output only the code.\n\n" + CODE,
    "story": "Write a long story about a lighthouse keeper and the sea.",
}
DEFAULT_CONFIGS = json.dumps({"method": "ngram", "num_speculative_tokens": 4,
                              "prompt_lookup_min": 2, "prompt_lookup_max": 5})  # fmt: skip


def add_parser(verbs: argparse._SubParsersAction) -> None:
    p = verbs.add_parser("spec", help="speculative decoding against none: tok/s, drafts kept, "
                         "the same tokens")  # fmt: skip
    p.add_argument("--model", default=None, help="model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--tasks", default="copy,story", help=f"of {', '.join(TASKS)}")
    p.add_argument("--speculative-configs", default=DEFAULT_CONFIGS,
                   help="';'-separated --speculative-config JSONs, each against none")  # fmt: skip
    p.add_argument("--streams", type=int, default=1, help="copies of the prompt at once")
    p.add_argument("--max-tokens", type=int, default=256, help="greedy tokens a stream at most")
    p.add_argument("--repeats", type=int, default=3, help="runs per setting (the best counts)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the figures as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams
    from engine.model_files import resolve_model
    from engine.spec_config import parse

    check_json_path(args.json)
    tasks = args.tasks.split(",")
    for t in tasks:
        if t not in TASKS:
            raise ValueError(f"--tasks: unknown task {t!r}; known: {', '.join(TASKS)}")
    configs = [c for c in args.speculative_configs.split(";") if c.strip()]
    for c in configs:
        parse(c)  # a bad one fails before any model loads
    path = str(resolve_model(args.model))
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    results: list[dict[str, Any]] = []
    for setting in configs:
        # One engine per setting, off and on in turns: a process's speed moves 15-30% from one
        # engine to the next on a small VM, more than some of what is measured. Off is the same
        # engine with its scheduler's rule at 0 rows (no request speculates).
        llm = LLM(path, speculative_config=setting)
        # The core runs in this process (LLM's default): its scheduler holds the rule.
        scheduler = getattr(llm.client, "core").scheduler  # noqa: B009
        on_rows = scheduler.spec_max_rows
        llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=8))  # warm-up
        for task in tasks:
            messages = [[{"role": "user", "content": TASKS[task]}]] * args.streams
            best = {"off": float("inf"), setting: float("inf")}
            outs: dict[str, Any] = {}
            logs: dict[str, Any] = {}
            for _ in range(args.repeats):
                for name in best:
                    scheduler.spec_max_rows = 0 if name == "off" else on_rows
                    llm.step_log = []
                    start = time.perf_counter()
                    out = llm.chat(messages, params, use_tqdm=False)
                    elapsed = time.perf_counter() - start
                    if elapsed < best[name]:
                        best[name], outs[name], logs[name] = elapsed, out, llm.step_log
            for name in best:
                tokens = [list(o.outputs[0].token_ids) for o in outs[name]]
                log = logs[name]
                results.append({
                    "task": task, "setting": name, "engine": setting, "seconds": best[name],
                    "tokens": sum(map(len, tokens)), "tok_s": sum(map(len, tokens)) / best[name],
                    "steps": len(log), "drafted": sum(sum(s.num_drafted) for s, _ in log),
                    "kept": sum(sum(s.num_accepted) for s, _ in log), "ids": tokens,
                })  # fmt: skip
        llm.shutdown()
    rows = []
    for r in results:
        off = next(x for x in results if x["task"] == r["task"] and x["setting"] == "off"
                   and x["engine"] == r["engine"])  # fmt: skip
        r["ratio"] = r["tok_s"] / off["tok_s"]
        r["same_tokens"] = r["ids"] == off["ids"]
        name = f"off ({_short(r['engine'])})" if r["setting"] == "off" else _short(r["setting"])
        rate = f"{r['kept'] / r['drafted']:.2f}" if r["drafted"] else "-"
        same = "yes" if r["same_tokens"] else "NO"
        rows.append([r["task"], name, f"{r['tokens']}", f"{r['tok_s']:.1f}", f"{r['ratio']:.2f}",
                     f"{r['steps']}", f"{r['drafted']}", rate, same])  # fmt: skip
    print(f"{args.streams} stream(s), {args.max_tokens} greedy tokens at most, best of "
          f"{args.repeats}; {path}")  # fmt: skip
    print_table(["task", "setting", "tokens", "tok/s", "x off", "steps", "drafts", "kept",
                 "same"], rows)  # fmt: skip
    for r in results:
        del r["ids"]
    write_json(args.json, {"machine": machine(), "streams": args.streams, "results": results})
    return 0 if all(r["same_tokens"] for r in results) else 1


def _short(config: str) -> str:
    c = json.loads(config)
    return f"{c.get('method', 'ngram')} k={c.get('num_speculative_tokens')}"
