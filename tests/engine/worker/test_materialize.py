"""A model built on the meta device gets real, empty storage of the model's dtype: what
``to_empty(...).to(dtype)`` gives, without torch's Python decompositions."""

from __future__ import annotations

import torch

from engine.worker.allocation import materialize


def test_storage_is_real_typed_and_still_shared() -> None:
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
        model.register_buffer("steps", torch.zeros(3, dtype=torch.long))
        model.register_buffer("scale", torch.ones(2))
    model[1].weight = torch.nn.Parameter(torch.empty(4, 8, device="meta"), requires_grad=False)
    model[0].bias = model[1].bias  # one tensor in two modules (4 wide each)
    model[0].bias = torch.nn.Parameter(torch.empty(8, device="meta"))
    shared = torch.nn.Parameter(torch.empty(4, device="meta"))
    model[1].bias = shared
    model.register_parameter("tied", shared)

    got = materialize(model, torch.device("cpu"), torch.bfloat16)

    assert got is model
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]:
        assert t.device.type == "cpu", name
        assert t.dtype == (torch.long if name == "steps" else torch.bfloat16), name
    assert isinstance(model[0].weight, torch.nn.Parameter) and model[0].weight.requires_grad
    assert not model[1].weight.requires_grad
    assert model.tied is model[1].bias  # still one tensor
