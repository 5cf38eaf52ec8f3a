"""Tensor parallelism over worker processes: TP=1 tokens, fast dead-rank errors, no orphans."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.executor.base import WorkerDeadError
from tests.helpers.factories import make_core_request
from tests.helpers.models import hf_greedy
from tests.helpers.procs import live_children, pid_alive

MAX_TOKENS = 10


def _prompts() -> list[list[int]]:
    """Six prompts of lengths 1..120; the last two share two full blocks (a prefix-cache hit)."""
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (1, 5, 17, 40, 64)]
    prompts.append(prompts[-1][:32] + [rng.randrange(3, 49152) for _ in range(88)])
    return prompts


def _children() -> set[int]:
    return {p.pid for p in live_children()}


def _assert_gone(pids: list[int] | set[int], before: set[int]) -> None:
    assert not [pid for pid in pids if pid_alive(pid)], "a worker process outlived the engine"
    assert _children() <= before


def test_tp2_greedy_matches_tp1_and_hf(tiny_model_path: Path) -> None:
    before = _children()
    prompts = _prompts()
    inputs = [{"prompt_token_ids": p} for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)

    def generate(tp: int) -> tuple[list[list[int]], set[int]]:
        llm = LLM(str(tiny_model_path), tensor_parallel_size=tp, num_kv_blocks=128)
        try:
            started = _children() - before
            outs = llm.generate(inputs, params, use_tqdm=False)
        finally:
            llm.shutdown()
        return [o.outputs[0].token_ids for o in outs], started

    tp1, _ = generate(1)
    tp2, started = generate(2)
    assert len(started) >= 2, "TP=2 should run one process per rank"
    _assert_gone(started, before)
    for i, (a, b) in enumerate(zip(tp1, tp2)):
        assert a == b, f"prompt {i} (len {len(prompts[i])}): TP=2 differs from TP=1"
    assert tp1 == hf_greedy(tiny_model_path, prompts, MAX_TOKENS)


@pytest.mark.e2e  # three pairs of ranks, 13 s (test_tp2_greedy_matches_tp1_and_hf stays)
@pytest.mark.parametrize("family", ["gemma3", "phi3", "llama_bias"])
def test_tp2_of_other_families_matches_hf(
    family: str, tiny_family_path: Callable[[str], Path]
) -> None:
    """Gemma 3's q/k norms over sharded heads and its norms after each branch, which must
    follow the all-reduce, with its local layers' window; Phi-3's fused q/k/v and gate/up,
    each part cut per rank, and its window on every layer; a Llama with a bias on every
    product: q, k, v, gate and up sliced with their rows, o and down added once (rank 0)
    before the all-reduce."""
    model = tiny_family_path(family)
    prompts = _prompts()
    llm = LLM(str(model), tensor_parallel_size=2, num_kv_blocks=128)
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(model, prompts, MAX_TOKENS)


@pytest.mark.serial
@pytest.mark.parametrize("when", ["idle", "pending"])
def test_killed_worker_raises_worker_dead_error_within_1s(
    tiny_model_path: Path, tmp_path: Path, when: str
) -> None:
    before = _children()
    config = EngineConfig(num_kv_blocks=64, tensor_parallel_size=2)
    core = EngineCore(config, str(tiny_model_path))
    pids = [p.pid for p in core.executor.procs]  # type: ignore[attr-defined]
    try:
        core.add_request(make_core_request("a", list(range(10, 40)), max_tokens=50))
        if when == "idle":
            core.start_profile(str(tmp_path / "trace.json"))
        core.step()  # healthy ranks: a real step
        if when == "idle":
            core.stop_profile()
            assert {p.name for p in tmp_path.iterdir()} == {"trace.rank0.json", "trace.rank1.json"}
            victim = pids[0]
            t_kill = time.monotonic()
            os.kill(victim, signal.SIGKILL)
        else:
            # A stopped rank 1 makes the step hang in rank 0's all_reduce until the kill.
            victim = pids[1]
            os.kill(victim, signal.SIGSTOP)
            killed_at: list[float] = []

            def kill() -> None:
                killed_at.append(time.monotonic())
                os.kill(victim, signal.SIGKILL)

            timer = threading.Timer(0.3, kill)
            timer.start()
        t_start = time.monotonic()
        with pytest.raises(WorkerDeadError, match=rf"pid {victim}\) died: killed by signal 9"):
            core.step()
        t_raised = time.monotonic()
        if when == "pending":
            timer.join()
            t_kill = killed_at[0]
            assert t_raised - t_start >= 0.3, "the step was not pending when the worker died"
        elapsed = t_raised - t_kill
        print(f"kill -9 while {when}: WorkerDeadError after {elapsed * 1000:.0f} ms")
        assert elapsed < 1.0
        with pytest.raises(WorkerDeadError):
            core.step()
        with pytest.raises(WorkerDeadError):
            core.executor.check_health()
    finally:
        core.shutdown()
    _assert_gone(pids, before)


def test_tp_that_does_not_divide_the_heads_is_refused(tiny_model_path: Path) -> None:
    before = _children()
    with pytest.raises(ValueError, match=r"attention heads \(4\) and of KV heads \(2\)"):
        EngineCore(EngineConfig(num_kv_blocks=16, tensor_parallel_size=3), str(tiny_model_path))
    assert _children() <= before


def test_worker_startup_failure_reaches_the_caller(tiny_model_path: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_path, broken)
    (weights,) = broken.glob("*.safetensors")
    tensors = load_file(str(weights))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(weights), metadata={"format": "pt"})
    before = _children()
    with pytest.raises(ValueError, match=r"worker rank \d: .*no tensor 'model\.layers\.1\.mlp"):
        EngineCore(EngineConfig(num_kv_blocks=16, tensor_parallel_size=2), str(broken))
    assert _children() <= before


def test_workers_exit_when_the_core_process_dies(tiny_model_path: Path) -> None:
    script = textwrap.dedent(
        """
        import sys, time
        from engine.config import EngineConfig
        from engine.core.engine_core import EngineCore
        config = EngineConfig(num_kv_blocks=16, tensor_parallel_size=2)
        core = EngineCore(config, sys.argv[1])
        print(*(p.pid for p in core.executor.procs), flush=True)
        time.sleep(600)
        """
    )
    root = Path(__file__).resolve().parents[3]
    core = subprocess.Popen(
        [sys.executable, "-c", script, str(tiny_model_path)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=root,
    )
    try:
        assert core.stdout is not None
        pids = [int(pid) for pid in core.stdout.readline().split()]
        assert len(pids) == 2
        core.kill()
        core.wait()
        deadline = time.monotonic() + 3.0
        while any(pid_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = [pid for pid in pids if pid_alive(pid)]
    finally:
        core.kill()
    for pid in left:
        os.kill(pid, signal.SIGKILL)  # leave nothing behind, even when failing
    assert not left, f"workers {left} outlived their core process"
