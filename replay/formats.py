"""Public trace formats (Mooncake, Azure LLM inference, BurstGPT) read into one record type,
and the transforms a small machine needs: a time window, length scaling, clipping, and
spreading the requests of a timestamp bucket over it."""

from __future__ import annotations

import csv
import json
import math
import random
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

FORMATS = ("mooncake", "azure", "burstgpt")
MOONCAKE_BLOCK = 512  # tokens per Mooncake hash id


@dataclass(frozen=True)
class TraceRecord:
    arrival_s: float  # from the trace's start
    prompt_tokens: int
    output_tokens: int
    # One id per prompt block (equal ids = equal content, chained); None: no prefix info.
    block_hashes: tuple[int, ...] | None = None
    block_size: int | None = None


def read_trace(path: str | Path, fmt: str) -> tuple[list[TraceRecord], int]:
    """Records sorted by arrival, and the trace's start as ns since the epoch (0 if unknown)."""
    path = Path(path)
    if fmt not in FORMATS:
        raise ValueError(f"--format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    if not path.is_file():
        raise ValueError(f"no trace file at {path}")
    reader = {"mooncake": _mooncake, "azure": _azure, "burstgpt": _burstgpt}[fmt]
    records, start_ns = reader(path)
    if not records:
        raise ValueError(f"{path} holds no request")
    records.sort(key=lambda r: r.arrival_s)
    return records, start_ns


def _mooncake(path: Path) -> tuple[list[TraceRecord], int]:
    out = []
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                hashes = tuple(int(h) for h in row["hash_ids"])
                rec = TraceRecord(
                    row["timestamp"] / 1000.0,
                    int(row["input_length"]),
                    int(row["output_length"]),
                    hashes,
                    MOONCAKE_BLOCK,
                )
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: not a Mooncake record ({e})") from None
            _check(path, n, rec)
            out.append(rec)
    return out, 0


def _azure(path: Path) -> tuple[list[TraceRecord], int]:
    rows = _csv_rows(path, ("TIMESTAMP", "ContextTokens", "GeneratedTokens"))
    stamps = []
    for n, row in rows:
        try:
            stamps.append((n, _azure_time(row["TIMESTAMP"]), row))
        except ValueError as e:
            raise ValueError(f"{path}:{n}: bad TIMESTAMP ({e})") from None
    start = min(t for _, t, _ in stamps)
    out = []
    for n, t, row in stamps:
        rec = TraceRecord(
            (t - start).total_seconds(),
            _int(path, n, row["ContextTokens"]),
            _int(path, n, row["GeneratedTokens"]),
        )
        _check(path, n, rec)
        out.append(rec)
    return out, int(start.timestamp() * 1e9)


def _azure_time(text: str) -> datetime:
    # "2023-11-16 18:15:46.6805900": seven fraction digits, one more than Python parses.
    text = text.strip()
    if "." in text:
        head, frac = text.split(".", 1)
        text = f"{head}.{frac[:6]}"
    return datetime.fromisoformat(text)


def _burstgpt(path: Path) -> tuple[list[TraceRecord], int]:
    need = ("Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type")
    out = []
    for n, row in _csv_rows(path, need):
        try:
            t = float(row["Timestamp"])
        except ValueError:
            raise ValueError(f"{path}:{n}: bad Timestamp {row['Timestamp']!r}") from None
        rec = TraceRecord(t, _int(path, n, row["Request tokens"]),
                          _int(path, n, row["Response tokens"]))  # fmt: skip
        if rec.output_tokens == 0:
            continue  # a failed request in the log: nothing to replay
        _check(path, n, rec)
        out.append(rec)
    start = min((r.arrival_s for r in out), default=0.0)
    return [replace(r, arrival_s=r.arrival_s - start) for r in out], 0


def _csv_rows(path: Path, need: tuple[str, ...]) -> list[tuple[int, dict[str, str]]]:
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in need if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: missing column(s) {', '.join(missing)}")
        return [(n, row) for n, row in enumerate(reader, 2)]


def _int(path: Path, n: int, text: str) -> int:
    try:
        return int(float(text))
    except ValueError:
        raise ValueError(f"{path}:{n}: not a token count: {text!r}") from None


def _check(path: Path, n: int, rec: TraceRecord) -> None:
    if rec.prompt_tokens < 1 or rec.output_tokens < 0 or rec.arrival_s < 0:
        raise ValueError(f"{path}:{n}: lengths must be positive and times not negative")


def parse_window(text: str | None) -> tuple[float, float]:
    """'START:END' in seconds from the trace's start; either side may be empty."""
    if not text:
        return 0.0, math.inf
    try:
        start, _, end = text.partition(":")
        window = float(start or 0), float(end) if end else math.inf
    except ValueError:
        raise ValueError(f"--window must be START:END in seconds, not {text!r}") from None
    if window[1] <= window[0]:
        raise ValueError(f"--window {text!r} is empty")
    return window


def transform(
    records: list[TraceRecord],
    *,
    window: tuple[float, float] = (0.0, math.inf),
    scale_lengths: float = 1.0,
    max_prompt_len: int | None = None,
    spread: float = 0.0,
    block_size: int = 16,
    seed: int = 0,
) -> list[TraceRecord]:
    """Window (arrivals then start at 0), spread, scale lengths (hash blocks of
    round(512 * F) tokens, a multiple of ``block_size``), clip prompts."""
    if scale_lengths <= 0:
        raise ValueError("--scale-lengths must be positive")
    if max_prompt_len is not None and max_prompt_len < 1:
        raise ValueError("--max-prompt-len must be at least 1")
    if spread:
        records = _spread(records, spread, seed)
    start, end = window
    kept = [r for r in records if start <= r.arrival_s < end]
    out = []
    for r in kept:
        prompt = max(1, round(r.prompt_tokens * scale_lengths))
        output = max(1, round(r.output_tokens * scale_lengths)) if r.output_tokens else 0
        hashes, size = r.block_hashes, r.block_size
        if hashes is not None and size is not None:
            size = max(block_size, round(size * scale_lengths / block_size) * block_size)
            # Keep ceil(prompt / size) == len(hashes), as in the source.
            prompt = min(max(prompt, (len(hashes) - 1) * size + 1), len(hashes) * size)
        if max_prompt_len is not None and prompt > max_prompt_len:
            prompt = max_prompt_len
            if hashes is not None and size is not None:
                hashes = hashes[: math.ceil(prompt / size)]
        out.append(TraceRecord(r.arrival_s - start, prompt, output, hashes, size))
    return out


def _spread(records: list[TraceRecord], bucket: float, seed: int) -> list[TraceRecord]:
    """Requests that share a timestamp are spread over [t, t + bucket), in order, seeded."""
    rng = random.Random(seed)
    out: list[TraceRecord] = []
    i = 0
    while i < len(records):
        j = i
        while j < len(records) and records[j].arrival_s == records[i].arrival_s:
            j += 1
        offsets = sorted(rng.random() * bucket for _ in range(j - i))
        out += [replace(r, arrival_s=r.arrival_s + o) for r, o in zip(records[i:j], offsets)]
        i = j
    return out
