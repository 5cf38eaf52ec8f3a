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
from tracing.store import TraceStore, open_db


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
    store.add("runs", [(
        run_id, time.time_ns(), f"import:{source['format']}", __version__, None, None,
        block_sizes.pop() if len(block_sizes) == 1 else None, json.dumps(source), "hashes",
    )])  # fmt: skip
    rows = []
    for i, r in enumerate(records):
        params = {"max_tokens": r.output_tokens, "ignore_eos": True, "temperature": 0.0}
        rows.append((
            run_id, f"{source['format']}-{i:06d}", new_trace_id(), new_span_id(), None,
            "import", "", start_ns + round(r.arrival_s * 1e9), r.prompt_tokens, r.output_tokens,
            0, 0, json.dumps(params), True, 0, "length", "ok", None, None, None, None,
            r.block_size, list(r.block_hashes) if r.block_hashes is not None else None, None,
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
