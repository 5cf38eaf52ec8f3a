"""A real `lumen serve` process on a loopback port: replay through a server, and the
benchmarks and tests that start one."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LumenServer:
    """Starts ``lumen serve MODEL ARGS`` and waits until /health answers 200.

    Its output goes to ``log_path``; ``stop()`` sends SIGTERM and returns the
    exit code. Use as a context manager.
    """

    name = "lumen serve"

    def __init__(
        self,
        model: Path | str,
        *args: str,
        log_path: Path,
        api_key: str | None = None,
        trace_db: Path | None = None,
        startup_timeout: float = 180.0,
        env: dict[str, str] | None = None,
        python: str = sys.executable,
        wait: bool = True,
        **popen: Any,
    ) -> None:
        """The trace db goes beside the log unless ``trace_db`` is given (or --no-trace-db).
        ``wait=False``: return once the process is started (``wait_healthy`` waits)."""
        self.port = free_port()
        self.trace_db = trace_db or log_path.parent / "trace.db"
        self.api_key = api_key
        self.base_url = f"http://127.0.0.1:{self.port}"
        # One client for the health polls and metric reads: each of httpx's module-level calls
        # builds a client and an SSL context (about 30 ms of CPU), which polling pays per call.
        self.http = httpx.Client(timeout=10)
        cmd = [python, "-m", "service.cli", "serve", str(model), "--port", str(self.port)]
        cmd += list(args)
        if "--no-trace-db" not in args:
            cmd += ["--trace-db", str(self.trace_db)]
        if api_key:
            cmd += ["--api-key", api_key]
        self.log_path = log_path
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        env.pop("LUMEN_API_KEY", None)
        self._log = open(log_path, "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT, **popen
        )
        if wait:
            self.wait_healthy(startup_timeout)

    def wait_healthy(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if (
                    self.http.get(
                        self.url("/health"), headers=self.headers(), timeout=1
                    ).status_code
                    == 200
                ):
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)  # a refused connection costs the poll about a millisecond
        self.stop()
        raise RuntimeError(f"{self.name} did not become healthy:\n{self.log()}")

    def url(self, path: str) -> str:
        return self.base_url + path

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics, keyed as ``name{label="v",...}`` (labels sorted)."""
        return parse_metrics(self.http.get(self.url("/metrics"), headers=self.headers()).text)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-6000:]

    def stop(self, timeout: float = 30.0, drain: float = 5.0) -> int:
        """SIGTERM: the server drains; past ``drain`` s a second one aborts what is left."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(drain)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        self._log.close()
        self.http.close()
        return self.proc.returncode

    def __enter__(self) -> LumenServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def parse_metrics(text: str) -> dict[str, float]:
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}"] = s.value
    return samples


def metric(samples: dict[str, float], name: str, **labels: str) -> float:
    """The sum of ``name`` over the samples whose labels include ``labels``."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(
        v
        for key, v in samples.items()
        if key.split("{", 1)[0] == name and all(w in key for w in want)
    )
