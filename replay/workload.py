"""The requests of a trace db, re-created: arrival offsets, prompts and sampling parameters.

A prompt is the exact recorded token ids when the recording kept them
(`--trace-prompts tokens`); otherwise deterministic synthetic tokens, the same
for the same block hash, so requests that shared a prefix share one again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from engine.config import EngineConfig
from engine.sampling_params import SamplingParams, StructuredOutputsParams
from tracing.store import latest_run, open_db


@dataclass
class ReplayRequest:
    request_id: str  # the recorded id
    offset_s: float  # arrival, from the first request's
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    # How the recorded client behaved (server recordings; offline ones stream and read fast).
    stream: bool = True
    hang_up_after: int | None = None  # tokens read before the client disconnected
    read_interval_s: float = 0.0  # a slow reader: time between reads of the stream
    engine: int | None = None  # the data-parallel engine that served it (--data-parallel-size)
    lora_name: str | None = None  # the LoRA adapter it ran with (None: the base model)


# A recorded client was a slow reader when its writes waited at least this long, and this
# share of its time from first to last token.
SLOW_READER_WAIT_S = 0.010
SLOW_READER_SHARE = 0.05


def load_workload(
    db: str,
    *,
    vocab: np.ndarray,
    run_id: str | None = None,
    limit: int | None = None,
    window: tuple[float, float] = (0.0, float("inf")),
    seed: int = 0,
) -> tuple[str, list[ReplayRequest]]:
    """The run's requests (default: the latest run that has any), in arrival order.

    ``vocab`` is the token ids synthetic prompts are drawn from (no special tokens).
    Requests that never reached the engine (status error, no prompt) are skipped.
    """
    with open_db(db, timeout=10) as con:
        run_id = run_id or latest_run(con)
        have = {c for (c,) in con.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_name = 'requests'"
        ).fetchall()}  # fmt: skip
        engine = "engine" if "engine" in have else "NULL"  # stores before migration 10
        lora = "lora_name" if "lora_name" in have else "NULL"  # before migration 13
        rows = con.execute(
            "SELECT request_id, arrival_ns, prompt_tokens, output_tokens, params, priority, "
            "prompt_block_size, prompt_block_hashes, prompt_token_ids, stream, status, "
            f"send_wait_ns, first_delivered_ns, last_delivered_ns, {engine}, {lora} FROM requests "
            "WHERE run_id = ? AND prompt_tokens > 0 AND params IS NOT NULL "
            "ORDER BY arrival_ns, request_id",
            [run_id],
        ).fetchall()
    if not rows:
        raise ValueError(f"run {run_id} of {db} has no request to replay")
    first = rows[0][1]
    start, end = window
    rows = [r for r in rows if start <= (r[1] - first) / 1e9 < end]
    rows = rows[:limit] if limit else rows
    if not rows:
        raise ValueError(f"no request of run {run_id} falls in the window")
    first = rows[0][1]
    out = []
    for i, row in enumerate(rows):
        rid, arrival, n_prompt, n_out, params, prio, block, hashes, ids, stream = row[:10]
        status, send_wait, first_delivered, last_delivered, engine_rank, lora_name = row[10:]
        if ids is None:
            ids = synthetic_prompt(n_prompt, block, hashes, vocab, seed=seed + i)
        recorded = json.loads(params)
        hang_up = n_out if status == "aborted" and stream is not False and n_out else None
        params_ = _params(recorded, n_out)
        if hang_up is not None:  # generate as the recorded request would have, had it stayed
            params_ = params_.clone(max_tokens=recorded.get("max_tokens") or n_out + 64)
        span = (last_delivered - first_delivered) / 1e9 if last_delivered and first_delivered else 0
        slow = (send_wait or 0) / 1e9 >= max(SLOW_READER_WAIT_S, SLOW_READER_SHARE * span)
        out.append(
            ReplayRequest(
                rid,
                (arrival - first) / 1e9,
                list(ids),
                params_,
                prio or 0,
                stream is not False,
                hang_up,
                span / max(n_out - 1, 1) if slow and stream is not False else 0.0,
                engine_rank,
                lora_name,
            )
        )
    return run_id, out


def recorded_engines(db: str, run_id: str | None = None) -> int:
    """The engines the run was recorded on (``lumen serve --data-parallel-size``; 1 where the
    store predates the column)."""
    with open_db(db, timeout=10) as con:
        run_id = run_id or latest_run(con)
        have = {c for (c,) in con.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_name = 'runs'"
        ).fetchall()}  # fmt: skip
        if "data_parallel_size" not in have:
            return 1
        row = con.execute(
            "SELECT data_parallel_size FROM runs WHERE run_id = ?", [run_id]
        ).fetchone()
    return int(row[0]) if row and row[0] else 1


def _params(recorded: dict, num_output_tokens: int) -> SamplingParams:
    """The recorded sampling parameters, generating exactly the recorded output length."""
    keep = {k: v for k, v in recorded.items() if k in SamplingParams.__struct_fields__}
    keep.update(max_tokens=max(1, num_output_tokens), ignore_eos=True, min_tokens=0)
    keep.pop("stop", None)  # a stop string could end it early
    # Structured outputs replay under their grammar (its compile and masks are part of the
    # recorded cost); such a request may end where its grammar does, before the recorded length.
    if isinstance(so := keep.get("structured_outputs"), dict):
        keep["structured_outputs"] = msgspec.convert(so, StructuredOutputsParams)
    return SamplingParams(**keep)


def synthetic_prompt(
    num_tokens: int,
    block_size: int | None,
    block_hashes: list[int] | None,
    vocab: np.ndarray,
    *,
    seed: int,
) -> list[int]:
    """Token ids whose blocks are a function of their hash id (equal hashes, equal blocks)."""
    if not block_size or not block_hashes:
        rng = np.random.default_rng([seed, 0x5EED])
        return vocab[rng.integers(0, len(vocab), num_tokens)].tolist()
    out: list[int] = []
    for h in block_hashes:
        rng = np.random.default_rng([int(h) & 0xFFFFFFFFFFFFFFFF, 0xB10C])
        out += vocab[rng.integers(0, len(vocab), block_size)].tolist()
    if len(out) < num_tokens:  # hashes that cover less than the prompt: pad, unshared
        rng = np.random.default_rng([seed, 0x5EED])
        out += vocab[rng.integers(0, len(vocab), num_tokens - len(out))].tolist()
    return out[:num_tokens]


# What a replay takes from the recording's engine configuration; the rest (the model's
# files, the process layout, sockets) belongs to the machine that replays.
REPLAYED_OPTIONS = ("dtype", "kv_cache_dtype", "quantization", "block_size",
                    "enable_prefix_caching", "max_num_batched_tokens", "max_num_seqs",
                    "scheduling_policy", "seed", "warmup", "stream_interval",
                    "speculative_config", "enable_lora", "max_loras", "max_lora_rank",
                    "max_cpu_loras")  # fmt: skip


def is_server_recording(db: str, run_id: str | None = None) -> bool:
    """Whether the run's requests came over HTTP (a `lumen serve` recording)."""
    with open_db(db, timeout=10) as con:
        run_id = run_id or latest_run(con)
        [(served,)] = con.execute(
            "SELECT count(*) FROM requests WHERE run_id = ? AND starts_with(endpoint, '/v1/')",
            [run_id],
        ).fetchall()
    return served > 0


def recorded_config(db: str, run_id: str) -> dict[str, Any]:
    """The recorded run's engine options (``REPLAYED_OPTIONS``) and the KV blocks and context
    length its core ended up with; {} for an imported trace, which recorded no engine."""
    with open_db(db, timeout=10) as con:
        row = con.execute(
            "SELECT num_kv_blocks, max_model_len, block_size, engine_config, model FROM runs "
            "WHERE run_id = ?", [run_id],
        ).fetchone()  # fmt: skip
    if row is None:
        return {}
    num_kv_blocks, max_model_len, block_size, engine_config, model = row
    recorded = json.loads(engine_config) if engine_config else {}
    out = {k: recorded[k] for k in REPLAYED_OPTIONS if recorded.get(k) is not None}
    if engine_config and model and Path(model).is_dir():
        out["model"] = model  # the recorded model folder, where this machine has it too
    for name, value in (("num_kv_blocks", num_kv_blocks), ("max_model_len", max_model_len),
                        ("block_size", block_size)):  # fmt: skip
        if value:
            out[name] = value
    return out


def replay_config(
    db: str, run_id: str | None, given: dict[str, Any], **fixed: Any
) -> tuple[EngineConfig, str]:
    """The engine configuration a replay of ``run_id`` uses: the recording's, then the flags the
    user gave (``given``), then ``fixed``; and a line that says where each setting came from."""
    if run_id is None:
        with open_db(db, timeout=10) as con:
            run_id = latest_run(con)
    recorded = recorded_config(db, run_id)
    config = EngineConfig(**{**recorded, **given, **fixed})
    if config.speculative_config and "speculative_config" in given:
        with open_db(db, timeout=10) as con:
            row = con.execute("SELECT trace_prompts FROM runs WHERE run_id = ?",
                              [run_id]).fetchone()  # fmt: skip
        if row is None or row[0] != "tokens":
            raise ValueError(
                "--speculative-config: what speculation does depends on the text, and this "
                f"recording kept its prompts as {row[0] if row else 'nothing'!s}, not their "
                "token ids: record with --trace-prompts tokens to replay it with speculation"
            )
    shown = ("model", "max_num_seqs", "max_num_batched_tokens", "num_kv_blocks", "block_size",
             "max_model_len", "enable_prefix_caching", "scheduling_policy")  # fmt: skip
    cells = []
    for name in shown:
        value = getattr(config, name)
        source = "flag" if name in given else "recorded" if name in recorded else "default"
        value = Path(value).name if name == "model" and value else value
        cells.append(f"{name} {'auto' if value is None else value} ({source})")
    for name in ("dtype", "kv_cache_dtype", "quantization", "stream_interval",
                 "speculative_config"):  # fmt: skip
        value = getattr(config, name)  # shown where not the default
        if value not in (None, "auto", 1):
            source = "flag" if name in given else "recorded" if name in recorded else "replay"
            cells.append(f"{name} {value} ({source})")
    # An import records the block size of its hashes, and no engine.
    where = "recorded" if "max_num_seqs" in recorded else "no engine recorded (an imported trace)"
    return config, f"engine configuration, {where}: " + ", ".join(cells)


def lora_adapters(work: list[ReplayRequest], modules: list[str] | None) -> dict[str, str]:
    """The folder of each LoRA adapter the recording's requests ran (``--lora-modules``
    name=path entries): a ValueError naming those not given (their paths are not recorded)."""
    from engine.lora import parse_module

    given = dict(parse_module(m)[:2] for m in modules or ())
    used = sorted({r.lora_name for r in work if r.lora_name is not None})
    missing = [name for name in used if name not in given]
    if missing:
        runs = sum(r.lora_name in missing for r in work)
        raise ValueError(
            f"the recording's requests ran LoRA adapters the replay has no folder for: "
            f"{', '.join(missing)} ({runs} requests); give each with --lora-modules NAME=PATH"
        )
    return {name: given[name] for name in used}
