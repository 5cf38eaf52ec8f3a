"""The machine's limits and the model's costs, measured in the benchmark's own run.

- ``matmul_ceiling``: FLOP/s of fp32 (or the model dtype) matrix products at
  the model's own largest shapes, best of several tries.
- ``weights_pass``: one pass of ``rows`` activations through every weight
  matrix of the model (the memory-bound floor of a decode step).
- ``StepTimer``: Lumen's real worker path (ModelRunner.execute_model: input
  preparation, forward, sampling) on hand-built decode batches.
- ``FlopCounter``: model FLOPs of engine steps, from their StepRecords.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from engine.messages import StepRecord
from engine.model_config import ModelConfig
from engine.sampling_params import SamplingParams
from engine.worker import cpu_matmul
from engine.worker.messages import NewRequestData, SchedulerOutput


def best_time(
    fn: Callable[[], object], repeat: int = 5, device: torch.device | None = None
) -> float:
    """Fastest of ``repeat`` timed calls (after one untimed call), in seconds."""
    sync = torch.cuda.synchronize if device is not None and device.type == "cuda" else None
    fn()
    best = float("inf")
    for _ in range(repeat):
        if sync:
            sync()
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_ceiling(
    cfg: ModelConfig, device: torch.device, dtype: torch.dtype, rows: int = 2048
) -> float:
    """Best FLOP/s of [rows, hidden] @ [hidden, 2 * intermediate] (the model's widest product),
    by torch's BLAS or, on CPU, oneDNN on a packed weight, whichever is faster."""
    a = torch.randn(rows, cfg.hidden_size, device=device, dtype=dtype)
    w = torch.randn(2 * cfg.intermediate_size, cfg.hidden_size, device=device, dtype=dtype)
    flops = 2 * rows * cfg.hidden_size * 2 * cfg.intermediate_size
    with torch.inference_mode():
        best = best_time(lambda: F.linear(a, w), repeat=7, device=device)
        if device.type == "cpu" and cpu_matmul.onednn_available(dtype):
            packed = cpu_matmul.pack(w)
            best = min(best, best_time(lambda: cpu_matmul.onednn_linear(a, packed), repeat=7))
        return flops / best


def weights_pass(model: torch.nn.Module, rows: int, device: torch.device) -> float:
    """Seconds for ``rows`` activations through every weight matrix of ``model`` once.

    The weights' share of a decode step's floor. A plain matrix W [a, b] can
    be read by ``x @ W`` (x: [rows, a]) or by ``x @ W.T`` (x: [rows, b]); each
    uses the faster of the two (timed alone). A matrix the model handed to
    oneDNN or to Lumen's panels (cpu_matmul: chosen at load because it was
    faster) is read by that kernel. Then whole passes over all the weights are
    timed, so each pass streams them from memory.
    """
    products: list[Callable[[], object]] = []
    with torch.inference_mode():
        for module in model.modules():
            if hasattr(module, "packed"):  # the model's Linear: plain, oneDNN's or panels
                # Typed loosely: bench may not import the worker's model (engine.worker.llama).
                linear: Any = module
                if linear.panels is not None:  # Lumen's panels (cpu_matmul.NativePanels)
                    products.append(_read_panels(linear.panels[1], rows))
                else:
                    products.append(_read(linear.packed, linear.weight, rows, device))
        llama: Any = model
        products.append(_read(llama.kernels.packed_head, llama.head_weight(), rows, device))

        def one_pass() -> None:
            for product in products:
                product()

        return best_time(one_pass, repeat=5, device=device)


def _read(
    packed: torch.Tensor | None, w: torch.Tensor, rows: int, device: torch.device
) -> Callable[[], object]:
    if packed is not None:
        xp = torch.randn(rows, packed.shape[1], device=device, dtype=packed.dtype)
        return lambda: cpu_matmul.onednn_linear(xp, packed)
    x_nn = torch.randn(rows, w.shape[0], device=device, dtype=w.dtype)
    x_nt = torch.randn(rows, w.shape[1], device=device, dtype=w.dtype)
    nn_s = best_time(lambda: x_nn @ w, repeat=3, device=device)
    nt_s = best_time(lambda: F.linear(x_nt, w), repeat=3, device=device)
    return (lambda: x_nn @ w) if nn_s <= nt_s else (lambda: F.linear(x_nt, w))


def _read_panels(described: cpu_matmul.Panels, rows: int) -> Callable[[], object]:
    x = torch.randn(rows, described.k)
    return lambda: cpu_matmul.panels().linear(x, described)


def kv_pass(cfg: ModelConfig, tokens: int, device: torch.device, dtype: torch.dtype) -> float:
    """Seconds to read the K and V of ``tokens`` context tokens once (every layer): the KV's
    share of a decode step's floor, timed as a sum over a tensor of that many bytes."""
    # An 8-bit cache's bytes (codes and scales) are summed as fp32 words: the same bytes,
    # read at the memory's speed (a sum of int8 values widens each one).
    stored = torch.float32 if dtype.itemsize == 1 else dtype
    elems = tokens * cfg.kv_bytes_per_token(dtype) // stored.itemsize
    kv = torch.ones(elems, device=device, dtype=stored)
    with torch.inference_mode():
        return best_time(lambda: kv.sum(), repeat=5, device=device)


class StepTimer:
    """A ModelRunner of its own on the model, timing hand-built batches."""

    def __init__(
        self,
        model_path: str,
        device: torch.device,
        dtype: torch.dtype,
        kv_dtype: torch.dtype | None = None,
        quantization: str | None = None,
    ) -> None:
        from engine.worker.model_runner import ModelRunner

        self.cfg = ModelConfig.from_path(model_path)
        self.device = device
        self.block_size = 16
        self.runner = ModelRunner(
            self.cfg, device, dtype, self.cfg.max_position_embeddings, self.block_size,
            kv_dtype=kv_dtype, quantization=quantization,
        )  # fmt: skip
        self.runner.load_model()
        self.num_blocks = 0
        self._next_id = 0

    @property
    def model(self) -> torch.nn.Module:
        assert self.runner.model is not None
        return self.runner.model

    def _ensure_blocks(self, n: int) -> None:
        if n > self.num_blocks:
            # Twice what the batch holds: the CPU decode mirror is bounded by the cache's size.
            self.runner.init_kv_cache(2 * n + 64)
            self.num_blocks = 2 * n + 64

    def _batch(self, lens: list[int], starts: list[int], extra: int = 0) -> SchedulerOutput:
        """One row per request: ``lens[i]`` tokens after ``starts[i]`` cached ones
        (and blocks for ``extra`` more)."""
        blocks_each = [-(-(s + n + extra) // self.block_size) for s, n in zip(starts, lens)]
        self._ensure_blocks(sum(blocks_each))
        sched, news = SchedulerOutput(step_id=0), []
        first = 0
        for n, start, nb in zip(lens, starts, blocks_each):
            req_id = f"timer-{self._next_id}"
            self._next_id += 1
            news.append(
                NewRequestData(
                    req_id, [11] * max(start, 1), SamplingParams(temperature=0), frozenset()
                )
            )
            sched.req_ids.append(req_id)
            sched.token_ids.append([11] * n)
            sched.num_computed_tokens.append(start)
            sched.block_tables.append(list(range(first, first + nb)))
            sched.sample.append(True)
            first += nb
        self.runner.execute_model(SchedulerOutput(step_id=0, new_requests=news))  # adds them
        return sched

    def decode_step(self, batch: int, context: int, steps: int = 9) -> float:
        """Seconds of one decode step: ``batch`` rows after about ``context`` tokens.

        Successive steps, as in a real decode (each row's context grows by
        one); the fastest counts, as for ``weights_pass``: on a shared
        machine noise only ever adds time.
        """
        sched = self._batch([1] * batch, [context] * batch, extra=steps + 1)

        def step() -> None:
            self.runner.execute_model(sched)
            sched.num_computed_tokens = [n + 1 for n in sched.num_computed_tokens]

        seconds = best_time(step, repeat=steps, device=self.device)
        self.runner.execute_model(SchedulerOutput(step_id=0, finished_req_ids=sched.req_ids))
        return seconds

    def prefill_step(self, tokens: int, repeat: int = 3) -> float:
        """Seconds of one whole-prompt prefill step of ``tokens`` tokens (the fastest)."""

        def step() -> None:
            sched = self._batch([tokens], [0])
            self.runner.execute_model(sched)
            self.runner.execute_model(SchedulerOutput(step_id=0, finished_req_ids=sched.req_ids))

        return best_time(step, repeat=repeat, device=self.device)

    @torch.inference_mode()
    def logits(self, token_ids: list[int], prompt_len: int | None = None) -> torch.Tensor:
        """fp32 logits [len, vocab] at every position of one sequence: its first
        ``prompt_len`` tokens (all by default) prefilled in one step, then each later
        token decoded in a step of its own, reading the KV cache as a generation does."""
        first = len(token_ids) if prompt_len is None else prompt_len
        sched = self._batch([first], [0], extra=len(token_ids) - first + 1)
        sched.token_ids = [list(token_ids[:first])]
        rows = [self._logits(sched, first)]
        for pos in range(first, len(token_ids)):
            sched.token_ids, sched.num_computed_tokens = [[token_ids[pos]]], [pos]
            rows.append(self._logits(sched, 1))
        self.runner.execute_model(SchedulerOutput(step_id=0, finished_req_ids=sched.req_ids))
        return torch.cat(rows).float()

    def _logits(self, sched: SchedulerOutput, tokens: int) -> torch.Tensor:
        inputs = self.runner._prepare_inputs(sched)
        everywhere = torch.arange(tokens, device=self.device)
        return self.model(
            inputs.input_ids, inputs.positions, self.runner.rotary, self.runner.kv_caches,
            inputs.meta, everywhere,
        )  # fmt: skip

    def release(self) -> None:
        self.runner.release_kv_cache()
        self.runner.model = None


class FlopCounter:
    """Model FLOPs of engine steps: every matrix product, attention included.

    Per token: 2 x the layers' weights; per sampled row: 2 x the LM head;
    per token and layer, attention: 4 x heads x head_dim x the tokens it
    attends to (QK^T and PV). A request's context is tracked from the steps
    (a preempted request starts again from zero).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        h, d = cfg.hidden_size, cfg.head_dim
        q, kv, inter = cfg.num_heads * d, cfg.num_kv_heads * d, cfg.intermediate_size
        per_layer = h * (q + 2 * kv) + q * h + 2 * h * inter + inter * h
        self.token_flops = 2 * cfg.num_layers * per_layer
        self.head_flops = 2 * h * cfg.vocab_size
        self.attn_flops = 4 * cfg.num_layers * q  # x attended tokens
        self.context: dict[str, int] = {}
        self.flops = 0.0
        self.tokens = 0
        self.model_seconds = 0.0
        self.steps = 0

    def add(self, step: StepRecord, sampled_rows: int) -> None:
        for req_id in step.preempted_req_ids:
            self.context.pop(req_id, None)
        attended = 0
        for req_id, n in zip(step.req_ids, step.num_scheduled):
            start = self.context.get(req_id, 0)
            attended += n * start + n * (n + 1) // 2
            self.context[req_id] = start + n
        self.flops += (
            step.num_scheduled_tokens * self.token_flops
            + sampled_rows * self.head_flops
            + attended * self.attn_flops
        )
        self.tokens += step.num_scheduled_tokens
        self.model_seconds += (step.execute_end_ns - step.execute_start_ns) / 1e9
        self.steps += 1
