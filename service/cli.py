"""The `lumen` command, grouped by noun: serve, model, generate, trace, bench."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING

from engine.arg_utils import add_engine_options, add_options, engine_options, options
from engine.config import EngineConfig
from service.config import ServerConfig
from tracing.config import TracingConfig

if TYPE_CHECKING:
    from service.lora_adapters import LoraAdapters


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser for ``argv``: the benchmarks' verbs (they import torch and the engine) are
    added only when ``argv`` asks for `lumen bench`, so `lumen serve` starts its core first."""
    parser = argparse.ArgumentParser(prog="lumen", description="Lumen LLM inference server")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    nouns = parser.add_subparsers(dest="noun", required=True)

    model = nouns.add_parser("model", help="local model files")
    model_verbs = model.add_subparsers(dest="verb", required=True)
    path = model_verbs.add_parser("path", help="print a model's local folder (fetches the default)")
    path.add_argument("model", nargs="?", default=None, help="model folder or name")
    path.set_defaults(func=_model_path)

    serve = nouns.add_parser("serve", help="the OpenAI-compatible HTTP server")
    serve.add_argument(
        "model_arg", nargs="?", default=None, metavar="MODEL", help="same as --model"
    )
    add_options(serve, ServerConfig, "server options")
    add_options(serve, TracingConfig, "tracing options")
    add_engine_options(serve, skip=("core_process",))
    serve.set_defaults(func=_serve)

    gen = nouns.add_parser("generate", help="generate offline from a prompt (a quick demo)")
    gen.add_argument("prompt", nargs="+", help="prompt text (one or more)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    add_engine_options(gen)
    gen.set_defaults(func=_generate)

    from tracing import cli as trace_cli

    trace_cli.add_parser(nouns)

    bench = nouns.add_parser("bench", help="benchmarks, side by side with baselines")
    if _noun(sys.argv[1:] if argv is None else argv) == "bench":
        _add_bench_verbs(bench)
    return parser


def _noun(argv: list[str]) -> str | None:
    return next((a for a in argv if not a.startswith("-")), None)


def _add_bench_verbs(bench: argparse.ArgumentParser) -> None:
    bench_verbs = bench.add_subparsers(dest="verb", required=True)
    from bench import (
        cold_start,
        lora,
        mfu,
        mp_overhead,
        one_stream,
        overhead,
        precision,
        prefill,
        scheduler,
        spec,
        structured,
        throughput,
        tracing_overhead,
    )
    from bench import diagnose as bench_diagnose
    from bench import serve as bench_serve  # `serve` above is the server's parser

    throughput.add_parser(bench_verbs)
    bench_serve.add_parser(bench_verbs)
    tracing_overhead.add_parser(bench_verbs)
    overhead.add_parser(bench_verbs)
    cold_start.add_parser(bench_verbs)
    scheduler.add_parser(bench_verbs)
    mfu.add_parser(bench_verbs)
    mp_overhead.add_parser(bench_verbs)
    prefill.add_parser(bench_verbs)
    precision.add_parser(bench_verbs)
    one_stream.add_parser(bench_verbs)
    structured.add_parser(bench_verbs)
    spec.add_parser(bench_verbs)
    lora.add_parser(bench_verbs)
    bench_diagnose.add_parser(bench_verbs)


def _model_path(args: argparse.Namespace) -> int:
    from engine.model_files import resolve_model

    print(resolve_model(args.model, log=lambda m: print(m, file=sys.stderr)))
    return 0


def _serve(args: argparse.Namespace) -> int:
    import asyncio

    from engine.gc_pauses import gc_setting
    from engine.launch import launch_cores

    engine = engine_options(args, skip=("core_process",))
    if args.model_arg is not None:
        engine["model"] = args.model_arg
    server_config = ServerConfig(**options(ServerConfig, args))
    tracing = TracingConfig(**options(TracingConfig, args))
    engine_config = EngineConfig(**engine, core_process=True)
    gc_setting()  # a bad LUMEN_GC fails here, before the core starts
    if server_config.data_parallel_size > 1:
        from engine.cpu_share import check_split

        check_split(server_config.data_parallel_size, engine_config.tensor_parallel_size)
    elif server_config.data_parallel_prefix_affinity:
        logging.getLogger("lumen").warning(
            "--data-parallel-prefix-affinity has no effect with one engine (--data-parallel-size 1)"
        )
    # Until the server takes the stop signals over (service/lifecycle.py), one ends the start
    # as Ctrl-C does: no traceback, and the core is stopped with this process.
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, _interrupt)
    adapters = _lora_adapters(engine_config, server_config)  # a bad one fails before the core
    # The cores import torch and load the model while this process imports the server.
    cores = launch_cores(engine_config, server_config.data_parallel_size)
    from service.api_server import serve

    return asyncio.run(serve(engine_config, server_config, tracing, cores, adapters))


def _lora_adapters(engine_config: EngineConfig, server_config: ServerConfig) -> LoraAdapters:
    """--lora-modules checked against the model and served (ValueError: one line, exit 2)."""
    from engine.model_files import resolve_model, served_name
    from service import lora_adapters

    name = server_config.served_model_name or served_name(engine_config.model)
    path = None
    if engine_config.enable_lora:
        path = str(resolve_model(engine_config.model, log=lambda m: print(m, file=sys.stderr)))
    return lora_adapters.start(name, path, server_config.lora_modules,
                               engine_config.enable_lora, engine_config.max_lora_rank)  # fmt: skip


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _generate(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams

    llm = LLM(**engine_options(args))
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    if args.chat:
        convs = [[{"role": "user", "content": p}] for p in args.prompt]
        results = llm.chat(convs, params, use_tqdm=False)
    else:
        results = llm.generate(args.prompt, params, use_tqdm=False)
    for prompt, result in zip(args.prompt, results):
        out = result.outputs[0]
        print(f"> {prompt}\n{out.text}\n[{len(out.token_ids)} tokens, {out.finish_reason}]\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser(argv).parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per HTTP call otherwise
    try:
        return args.func(args)
    except ValueError as e:
        # A user error: one line, no traceback.
        print(f"lumen: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `lumen trace top | head`
        return 0


if __name__ == "__main__":
    sys.exit(main())
