"""The `replay` command: import, run (real, --server or --virtual), calibrate, report, diff,
export and regress (see DESIGN §7)."""

from __future__ import annotations

import argparse
import logging
import os
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="replay", description="Replay recorded LLM traffic")
    verbs = parser.add_subparsers(dest="verb", required=True)
    imp = verbs.add_parser("import", help="a public trace, or a fleet's OTLP spans, into a "
                           "trace db")  # fmt: skip
    imp.add_argument("file", help="the trace file (otlp-json: an OTLP JSON file; clickhouse: "
                     "the server's URL, http://HOST:8123, or chdb:FOLDER)")  # fmt: skip
    imp.add_argument("--format", required=True,
                     help="mooncake, azure or burstgpt (public traces); otlp-json (a Lumen "
                          "server's --otlp-detail store spans as the Collector's file exporter "
                          "writes them, or `replay export --format otlp-json`); clickhouse "
                          "(the same spans in the Collector ClickHouse exporter's "
                          "table)")  # fmt: skip
    imp.add_argument("--out", required=True, help="trace db to write (public traces: appended "
                     "to if it exists; spans: a new file)")  # fmt: skip
    ch = imp.add_argument_group("clickhouse")
    ch.add_argument("--table", default="otel_traces", help="the exporter's traces table")
    ch.add_argument(
        "--since",
        default=None,
        help="the window's start: ISO 8601 (UTC unless it says) or Unix seconds",
    )
    ch.add_argument("--until", default=None, help="the window's end (default: now)")
    ch.add_argument(
        "--request",
        default=None,
        metavar="ID",
        help="instead of a window: this request and its run around it",
    )
    ch.add_argument(
        "--margin",
        type=float,
        default=10.0,
        help="--request: seconds of its run to take before and after its life",
    )
    imp.add_argument("--window", default=None, help="START:END seconds from the trace's start")
    imp.add_argument("--scale-lengths", type=float, default=1.0,
                     help="multiply prompt and output lengths (and hash blocks) by F")  # fmt: skip
    imp.add_argument("--max-prompt-len", type=int, default=None, help="clip longer prompts")
    imp.add_argument("--spread", type=float, default=0.0,
                     help="spread requests that share a timestamp over this many seconds "
                          "(Mooncake's are bucketed to 3 s)")  # fmt: skip
    imp.add_argument("--block-size", type=int, default=16, help="the engine's KV block size")
    imp.add_argument("--seed", type=int, default=0, help="seed of --spread")
    imp.set_defaults(func=_import)
    from engine.arg_utils import add_engine_options

    run = verbs.add_parser("run", help="recorded requests through the real engine")
    run.add_argument("db", help="trace db to replay (a recording or an import)")
    run.add_argument("--out", default=None, help="trace db of the replay (default: DB.replay.db)")
    run.add_argument("--speed", type=float, default=1.0, help="2 = arrivals twice as fast")
    run.add_argument("--limit", type=int, default=None, help="replay the first N requests")
    run.add_argument("--run", default=None, help="which run of DB (default: the latest)")
    run.add_argument("--window", default=None, help="START:END seconds of the run to replay")
    run.add_argument("--virtual", action="store_true",
                     help="simulated clock and step-cost model instead of the model")  # fmt: skip
    run.add_argument(
        "--cost-model", default=None, metavar="PATH",
        help="--virtual: step-cost model file (made from DB's steps if missing)",
    )  # fmt: skip
    run.add_argument("--json", default=None, metavar="PATH", help="--virtual: figures as JSON")
    run.add_argument("--step-noise", action="store_true",
                     help="--virtual: scale each step by a seeded draw from the measured "
                          "spread around the cost model (default: its prediction)")  # fmt: skip
    run.add_argument("--server", default=None, metavar="URL",
                     help="replay over HTTP against a running `lumen serve` instead")  # fmt: skip
    run.add_argument("--api-key", default=None, help="--server: its API key")
    run.add_argument("--in-process", action="store_true",
                     help="a server recording through the engine in this process, not "
                          "through a `lumen serve` started for the replay")  # fmt: skip
    run.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                     help="the folder of each LoRA adapter the recording's requests ran (its "
                          "paths are not recorded), as lumen serve takes them")  # fmt: skip
    # Unset flags take the recorded run's configuration (or the defaults for an imported trace).
    add_engine_options(run, skip=("core_process",), only_given=True)
    run.set_defaults(func=_run)
    cal = verbs.add_parser("calibrate", help="fit a step-cost model to a trace db's steps")
    cal.add_argument("db")
    cal.add_argument("--out", required=True, help="the model file (JSON)")
    cal.add_argument("--run", default=None, help="fit one run's steps (default: every run's)")
    cal.set_defaults(func=_calibrate)
    val = verbs.add_parser(
        "validate", help="does replay reproduce the recording? (virtual vs real vs recorded, "
        "and the cost model on steps it never saw)",
    )  # fmt: skip
    val.add_argument("db", help="a recording (or an imported trace)")
    val.add_argument("--run", default=None, help="which run of DB (default: the latest)")
    val.add_argument("--real-runs", type=int, default=3, help="real replays (their spread is "
                     "the noise floor)")  # fmt: skip
    val.add_argument("--speed", type=float, default=1.0, help="2 = arrivals twice as fast")
    val.add_argument("--limit", type=int, default=None, help="the first N requests")
    val.add_argument("--window", default=None, help="START:END seconds of the run")
    val.add_argument("--in-process", action="store_true",
                     help="real replays through the engine in this process, even for a server "
                          "recording")  # fmt: skip
    val.add_argument("--keep", default=None, metavar="DIR",
                     help="keep the real replays' trace dbs in DIR")  # fmt: skip
    val.add_argument("--json", default=None, metavar="PATH", help="the figures as JSON")
    add_engine_options(val, skip=("core_process",), only_given=True)
    val.set_defaults(func=_validate)
    cap = verbs.add_parser("capacity", help="the highest arrival rate at which the recorded "
                           "mix meets latency targets (virtual; --check: real)")  # fmt: skip
    cap.add_argument("db", help="a recording (its steps calibrate the cost model)")
    cap.add_argument("--target", action="append", required=True, metavar="METRIC:PCT:SECONDS",
                     help="e.g. ttft:p90:2 or tpot:p90:0.1; repeat for several")  # fmt: skip
    cap.add_argument("--run", default=None, help="which run of DB (default: the latest)")
    cap.add_argument("--limit", type=int, default=None, help="the first N requests")
    cap.add_argument("--window", default=None, help="START:END seconds of the run")
    cap.add_argument("--cost-model", default=None, metavar="PATH",
                     help="step-cost model file (default: fitted on DB's steps)")  # fmt: skip
    cap.add_argument("--check", action="store_true",
                     help="replay for real at the predicted rate and at 1.1x it")  # fmt: skip
    add_engine_options(cap, skip=("core_process",), only_given=True)
    cap.set_defaults(func=_capacity)
    report = verbs.add_parser("report", help="percentiles and where the tail's time went")
    report.add_argument("db", nargs="+", help="trace db, several, or a folder: one fleet")
    report.add_argument("--run", default=None, help="which run (default: the latest)")
    report.add_argument("--html", default=None, metavar="PATH",
                        help="also write a self-contained HTML report with plots")  # fmt: skip
    report.set_defaults(func=_report)
    export = verbs.add_parser("export", help="a run's spans for other tools")
    export.add_argument("db")
    export.add_argument("--format", default="otel-jsonl",
                        help="otlp-json (the run's store as OTLP JSON, as the Collector's file "
                             "exporter writes it: replay import rebuilds the store from it), "
                             "otel-jsonl (flat OTLP-style JSON lines, one span each) or "
                             "perfetto (Chrome trace events for ui.perfetto.dev and "
                             "chrome://tracing)")  # fmt: skip
    export.add_argument("--out", required=True, help="the file to write")
    export.add_argument("--run", default=None, help="which run (default: the latest)")
    export.set_defaults(func=_export)
    d = verbs.add_parser("diff", help="two runs side by side, change told from noise")
    d.add_argument("a")
    d.add_argument("b")
    d.add_argument("--run-a", default=None)
    d.add_argument("--run-b", default=None)
    d.set_defaults(func=_diff)
    reg = verbs.add_parser("regress", help="the latency regression gate (CI runs it)")
    reg.add_argument("--baseline", default="regress", metavar="DIR",
                     help="folder with the excerpt, baseline.json and cost.json")  # fmt: skip
    reg.add_argument("--update-baseline", action="store_true",
                     help="measure and write a new baseline (commit it, saying why)")  # fmt: skip
    reg.add_argument("--model", default=None, help="model of the measured layer")
    reg.add_argument("--virtual-only", action="store_true", help="skip the measured layer")
    reg.set_defaults(func=_regress)
    return parser


def _import(args: argparse.Namespace) -> int:
    if args.format == "otlp-json":
        from replay.otlp_io import import_otlp_json

        print(import_otlp_json(args.file, args.out))
        return 0
    if args.format == "clickhouse":
        from replay.clickhouse import import_clickhouse

        print(import_clickhouse(args.file, args.out, table=args.table, since=args.since,
                                until=args.until, request=args.request,
                                margin_s=args.margin))  # fmt: skip
        return 0
    from replay.formats import parse_window, read_trace, transform
    from replay.importer import write_trace_db

    records, start_ns = read_trace(args.file, args.format)
    kept = transform(
        records,
        window=parse_window(args.window),
        scale_lengths=args.scale_lengths,
        max_prompt_len=args.max_prompt_len,
        spread=args.spread,
        block_size=args.block_size,
        seed=args.seed,
    )
    if not kept:
        raise ValueError(f"no request of {args.file} falls in --window {args.window}")
    source = {k: v for k, v in vars(args).items() if k not in ("func", "verb")}
    source["file"] = os.path.basename(args.file)
    run_id = write_trace_db(kept, start_ns, args.out, source=source)
    prompt = sum(r.prompt_tokens for r in kept)
    output = sum(r.output_tokens for r in kept)
    span = kept[-1].arrival_s - kept[0].arrival_s
    print(f"{len(kept)} of {len(records)} requests over {span:.1f} s ({prompt:,} prompt and "
          f"{output:,} output tokens) -> {args.out} (run {run_id})")  # fmt: skip
    return 0


def _run(args: argparse.Namespace) -> int:
    if args.virtual:
        return _run_virtual(args)
    if args.server:
        return _run_http(args)
    import asyncio

    from engine.arg_utils import engine_options
    from replay.formats import parse_window
    from replay.report import render_text
    from replay.runner import run_replay, run_replay_served, summarize
    from replay.workload import is_server_recording, replay_config

    out = args.out or str(args.db).removesuffix(".db") + ".replay.db"
    given = engine_options(args, skip=("core_process",))
    config, used = replay_config(args.db, args.run, given, core_process=True)
    print(used)
    options = dict(speed=args.speed, limit=args.limit, run_id=args.run,
                   window=parse_window(args.window),
                   lora_modules=args.lora_modules or [])  # fmt: skip
    if is_server_recording(args.db, args.run) and not args.in_process:
        print("replaying through a `lumen serve` started with it, over HTTP, each request "
              "streamed or not as recorded (--in-process: the engine in this process)")  # fmt: skip
        result, _ = run_replay_served(args.db, out, config, **options)
    else:
        result = asyncio.run(run_replay(args.db, out, config, **options))
    print(summarize(result))
    print(f"trace of the replay: {out} (run {result.run_id})\n")
    print(render_text(out, result.run_id))
    return 0


def _run_http(args: argparse.Namespace) -> int:
    import asyncio

    from replay.formats import parse_window
    from replay.report import percentiles
    from replay.runner import run_replay_http, summarize

    result, client_s = asyncio.run(
        run_replay_http(
            args.db, args.server, model=getattr(args, "model", None), api_key=args.api_key,
            speed=args.speed, limit=args.limit, run_id=args.run, window=parse_window(args.window),
        )
    )  # fmt: skip
    print(summarize(result))
    for name, values in client_s.items():
        if values:
            p = percentiles(values)
            print(f"client-side {name.removesuffix('_s').upper()}: p50 {p['p50'] * 1e3:.1f} ms, "
                  f"p99 {p['p99'] * 1e3:.1f} ms")  # fmt: skip
    print("the server recorded the replay in its own trace db: `replay report` it")
    return 0


def _run_virtual(args: argparse.Namespace) -> int:
    import dataclasses
    import json
    from pathlib import Path

    import numpy as np

    from engine.arg_utils import engine_options
    from replay.formats import parse_window
    from replay.virtual import StepCostModel, render, run_virtual
    from replay.workload import load_workload, replay_config

    if args.cost_model and Path(args.cost_model).exists():
        cost = StepCostModel.load(args.cost_model)
    else:
        cost = StepCostModel.calibrate(args.db)
        if args.cost_model:
            cost.save(args.cost_model)
            print(f"calibrated on {cost.num_steps} steps of {args.db} -> {args.cost_model}")
    # Synthetic tokens from a fixed range: the report must not depend on any model files.
    run_id, work = load_workload(
        args.db, vocab=np.arange(1, 32000), run_id=args.run, limit=args.limit,
        window=parse_window(args.window),
    )  # fmt: skip
    engine, used = replay_config(args.db, run_id, engine_options(args))
    print(used)
    # No memory to size a KV pool from and no model to read a context length from: an imported
    # trace, with neither flag, gets 4,096 blocks and 8K.
    engine = dataclasses.replace(
        engine,
        num_kv_blocks=engine.num_kv_blocks or 4096,
        max_model_len=engine.max_model_len or 8192,
    )
    result = run_virtual(work, engine, cost, speed=args.speed, step_noise=args.step_noise)
    print(render(result, engine, cost))
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_json(), indent=2, sort_keys=True) + "\n")
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from replay.virtual import StepCostModel

    cost = StepCostModel.calibrate(args.db, run_id=args.run)
    cost.save(args.out)
    print(f"step cost: {cost.describe()}")
    print(cost.describe_fit())
    print("a what-if beyond that range extrapolates (`replay run --virtual` says when it does)")
    print(f"-> {args.out}")
    return 0


def _validate(args: argparse.Namespace) -> int:
    import json
    import tempfile
    from pathlib import Path

    from engine.arg_utils import engine_options
    from replay.formats import parse_window
    from replay.validate import render, validate

    with tempfile.TemporaryDirectory(prefix="lumen-validate-") as tmp:
        workdir = Path(args.keep or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        result = validate(
            args.db, workdir, run_id=args.run, real_runs=args.real_runs,
            given=engine_options(args, skip=("core_process",)), speed=args.speed,
            limit=args.limit, window=parse_window(args.window), in_process=args.in_process,
        )  # fmt: skip
    print(render(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_json(), indent=2, sort_keys=True) + "\n")
    return 0


def _capacity(args: argparse.Namespace) -> int:
    from engine.arg_utils import engine_options
    from replay.capacity import capacity_report
    from replay.formats import parse_window

    text, met = capacity_report(
        args.db, args.target, run_id=args.run, limit=args.limit,
        window=parse_window(args.window), cost_model=args.cost_model,
        given=engine_options(args, skip=("core_process",)), check=args.check,
    )  # fmt: skip
    print(text)
    return 0 if met else 1


def _diff(args: argparse.Namespace) -> int:
    from replay.diff import diff

    print(diff(args.a, args.b, args.run_a, args.run_b))
    return 0


def _export(args: argparse.Namespace) -> int:
    from replay.export import export

    print(export(args.db, args.out, args.format, args.run))
    return 0


def _report(args: argparse.Namespace) -> int:
    from replay.report import render_text

    db = args.db[0] if len(args.db) == 1 else args.db
    print(render_text(db, args.run))
    if args.html:
        from replay.html import render_html

        render_html(db, args.html, args.run)
        print(f"\nHTML report: {args.html}")
    return 0


def _regress(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from replay.regress import check, update_baseline

    folder = Path(args.baseline)
    start = time.monotonic()
    if args.update_baseline:
        baseline = update_baseline(folder, args.model)
        for name, m in baseline["measured"].items():
            tolerance = "not gated" if m["tolerance"] is None else f"+ {m['tolerance']:.3f}"
            runs = ", ".join(f"{r:.3f}" for r in m["runs"])
            print(f"{name:<36} {m['value']:>8.3f} {tolerance:>11} (runs {runs})")
        print(f"baseline written to {folder} in {time.monotonic() - start:.0f} s")
        return 0
    passed, table = check(folder, args.model, measured=not args.virtual_only)
    print(table)
    print(f"gate took {time.monotonic() - start:.0f} s")
    return 0 if passed else 1


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # One line per HTTP call otherwise: a replay through a server polls its /health while it
    # starts and restarts (300 lines of 503s in one run).
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"replay: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
