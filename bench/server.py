"""Servers on loopback ports for benchmarks and tests: `lumen serve` (replay.server), the
transformers baseline, and their metrics."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from replay.server import ROOT, LumenServer, free_port, metric, parse_metrics

__all__ = [
    "ROOT",
    "LumenServer",
    "TransformersServer",
    "free_port",
    "metric",
    "parse_metrics",
    "streamed_chat",
]  # fmt: skip


def streamed_chat(server: LumenServer, content: str, max_tokens: int) -> dict[str, Any]:
    """A greedy streamed chat of exactly ``max_tokens`` tokens, as each server takes it
    (transformers serve ignores EOS through its generation_config)."""
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if isinstance(server, TransformersServer):
        body["model"] = server.model
        body["generation_config"] = json.dumps({"do_sample": False, "eos_token_id": -1})
    else:
        body["ignore_eos"] = True
    return body


HF_PAGE_TOKENS = 256  # a page of HF's paged cache (ContinuousBatchingConfig.page_size)
KV_TOKENS = 32768  # the KV capacity the server benchmarks give each system (--kv-tokens)


def add_kv_tokens_option(p: argparse.ArgumentParser) -> None:
    """--kv-tokens, for the benchmarks that start both servers (kv_flags and TransformersServer's
    ``kv_tokens`` apply it); argparse refuses a count below 1."""
    p.add_argument("--kv-tokens", type=_token_count, default=KV_TOKENS,
                   help="KV cache capacity in tokens, the same for Lumen and transformers serve "
                        "(default %(default)s)")  # fmt: skip


def _token_count(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes an integer, not {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, not {n}")
    return n


def kv_flags(kv_tokens: int, block_size: int = 16) -> tuple[str, ...]:
    """`lumen serve`'s flags for a KV pool of ``kv_tokens``, as TransformersServer's
    ``kv_tokens`` sizes HF's: the same capacity on both sides."""
    return ("--num-kv-blocks", str(-(-kv_tokens // block_size)), "--block-size", str(block_size))


class TransformersServer(LumenServer):
    """``transformers serve --continuous-batching MODEL`` on a loopback port (the HF baseline).

    Needs the serving extras (``pip install -e '.[bench]'``). The model is
    preloaded, so requests name it by its path.
    """

    name = "transformers serve"

    def __init__(
        self,
        model: Path | str,
        *args: str,
        log_path: Path,
        startup_timeout: float = 300.0,
        python: str = sys.executable,
        kv_tokens: int | None = None,
    ) -> None:
        """``kv_tokens``: what its paged cache holds (``--cb-num-blocks`` of 256-token pages).
        Left to itself, transformers serve sizes that cache from free memory on its first
        request: 14 GB on a 24 GB CPU machine, which made that request take 22.7 s against
        0.5 s for 64 pages."""
        from transformers.utils import is_serve_available

        if not is_serve_available():
            raise ValueError(
                "transformers serve needs its serving extras: pip install -e '.[bench]'"
            )
        self.port = free_port()
        self.api_key = None
        self.model = str(model)
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.http = httpx.Client(timeout=10)
        cmd = [python, "-m", "transformers.cli.transformers", "serve", "--continuous-batching"]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), *args]
        if kv_tokens is not None:
            cmd += ["--cb-num-blocks", str(-(-kv_tokens // HF_PAGE_TOKENS))]
        cmd.append(self.model)
        self.log_path = log_path
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        self._log = open(log_path, "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self.wait_healthy(startup_timeout)
