"""What the model runner builds for one step's forward (engine/worker/model_runner.py)."""

from __future__ import annotations

import torch

from engine.worker.attention import AttentionMetadata


class Rows:
    """A step's rows by kind, in the flat batch's order (what every KV group shares)."""

    __slots__ = ("decode", "decode_req_ids", "decode_starts", "masks", "prefill")

    def __init__(
        self,
        decode: list[int],
        decode_starts: list[int],
        decode_req_ids: list[str],
        prefill: list[tuple[int, int, int, int]],
    ) -> None:
        self.decode = decode
        self.decode_starts = decode_starts
        self.decode_req_ids = decode_req_ids
        self.prefill = prefill
        self.masks: dict[tuple[int, ...], torch.Tensor] = {}


class StepInputs:
    """One step's tensors for the model, and ``order``: the scheduled rows in the flat batch's
    order (decode rows first)."""

    __slots__ = ("input_ids", "logits_indices", "meta", "order", "positions", "sample_req_ids")

    def __init__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
        sample_req_ids: list[str],
        order: list[int],
    ) -> None:
        self.order = order
        self.input_ids = input_ids
        self.positions = positions
        self.meta = meta
        self.logits_indices = logits_indices
        self.sample_req_ids = sample_req_ids
