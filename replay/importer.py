"""`replay import`: a public trace into a trace db that `replay run` can re-create."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

from engine import __version__
from replay.formats import TraceRecord
from tracing.ids import new_span_id, new_trace_id
from tracing.store import TraceStore, open_db, row


def write_trace_db(
    records: list[TraceRecord], start_ns: int, out: str | Path, *, source: dict[str, Any]
) -> str:
    """Append the records as one imported run; returns its run id.

    Each becomes a `requests` row with its arrival, lengths, sampling
    parameters (greedy, ``max_tokens`` = the recorded output, ``ignore_eos``)
    and, where the trace has them, its prompt block hashes.
    """
    out = Path(out)
    run_id = "import-" + uuid.uuid4().hex[:10]
    store = TraceStore(out)
    block_sizes = {r.block_size for r in records if r.block_size}
    store.add("runs", [row(
        "runs", run_id=run_id, started_ns=time.time_ns(), model=f"import:{source['format']}",
        version=__version__, block_size=block_sizes.pop() if len(block_sizes) == 1 else None,
        engine_config=json.dumps(source), trace_prompts="hashes",
    )])  # fmt: skip
    rows = []
    for i, r in enumerate(records):
        params = {"max_tokens": r.output_tokens, "ignore_eos": True, "temperature": 0.0}
        rows.append(row(
            "requests", run_id=run_id, request_id=f"{source['format']}-{i:06d}",
            trace_id=new_trace_id(), root_span_id=new_span_id(), endpoint="import", model="",
            arrival_ns=start_ns + round(r.arrival_s * 1e9), prompt_tokens=r.prompt_tokens,
            output_tokens=r.output_tokens, cached_tokens=0, num_preemptions=0,
            params=json.dumps(params), stream=True, priority=0, finish_reason="length",
            status="ok", prompt_block_size=r.block_size,
            prompt_block_hashes=list(r.block_hashes) if r.block_hashes is not None else None,
        ))  # fmt: skip
    store.add("requests", rows)
    if not store.flush():
        store.close()
        raise ValueError(f"could not write {out}: another process holds it")
    store.close()
    with open_db(out) as con:  # the file opens and holds what was written
        [(count,)] = con.execute(
            "SELECT count(*) FROM requests WHERE run_id = ?", [run_id]
        ).fetchall()
    assert count == len(records)
    return run_id
