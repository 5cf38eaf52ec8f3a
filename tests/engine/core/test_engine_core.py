"""EngineCore through the InprocClient: steps, abort mid-flight, step records."""

from __future__ import annotations

from pathlib import Path

from engine.client import InprocClient
from engine.config import EngineConfig
from engine.messages import FinishReason
from tests.helpers.factories import make_core_request as req


def test_abort_frees_blocks_and_a_reused_id_gets_only_new_outputs(tiny_model_path: Path) -> None:
    client = InprocClient(EngineConfig(num_kv_blocks=64), str(tiny_model_path))
    kv = client.core.scheduler.kv_cache
    client.add_request(req("a", list(range(10, 50)), max_tokens=50))
    client.add_request(req("b", list(range(60, 90)), max_tokens=6))
    for _ in range(3):
        client.get_output()
    assert kv.req_blocks.keys() == {"a", "b"}
    client.abort_requests(["a"])
    assert "a" not in kv.req_blocks
    # The same id again, with another prompt: it must see its own tokens only.
    client.add_request(req("a", [7, 8, 9], max_tokens=2))
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    finish: dict[str, FinishReason | None] = {}
    steps = []
    while client.core.has_work():
        outs = client.get_output()
        if outs.step is not None:  # (the last call only tells the workers what ended)
            steps.append(outs.step)
        for o in outs.outputs:
            tokens[o.request_id] += o.new_token_ids
            if o.finish_reason is not None:
                finish[o.request_id] = o.finish_reason
    assert len(tokens["a"]) == 2 and finish["a"] == FinishReason.LENGTH
    assert finish["b"] == FinishReason.LENGTH
    assert kv.pool.num_free_blocks == kv.num_blocks
    for s in steps:
        assert s.schedule_start_ns <= s.schedule_end_ns <= s.execute_end_ns <= s.output_ns
        assert s.num_scheduled_tokens == s.num_prefill_tokens + s.num_decode_tokens > 0


def test_engine_info_reports_the_cache(tiny_model_path: Path) -> None:
    client = InprocClient(EngineConfig(num_kv_blocks=40, block_size=8), str(tiny_model_path))
    info = client.info
    assert (info.num_kv_blocks, info.block_size, info.dtype, info.device) == (
        40,
        8,
        "float32",
        "cpu",
    )
    assert info.max_model_len == 320  # capped to what 40 blocks of 8 hold
