"""``--speculative-config``: vLLM's SpeculativeConfig, the fields Lumen reads and their defaults,
checked where the engine's options are (the proposers: engine/worker/ngram.py and
engine/worker/draft.py; verification: engine/worker/spec_decode.py; the scheduler's rule:
engine/core/scheduler.py)."""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict, dataclass
from pathlib import Path

# Built here. vLLM's other methods are named apart, so a user bringing one hears what is missing.
METHODS = ("ngram", "draft_model")
NOT_BUILT = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "suffix")
# vLLM's fields that Lumen reads; a known vLLM field that changes nothing here is refused by name.
FIELDS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model",
          "quantization", "disable_by_batch_size",
          "num_speculative_tokens_per_batch_size")  # fmt: skip
DRAFT_QUANTIZATIONS = ("int8", "int4")
# Lumen's default for disable_by_batch_size (vLLM has none). A verifying row runs k + 1 tokens
# through the target: SmolLM2 fp32 on 2 CPU cores, k = 4, gave 2.02x / 1.91x / 1.20x / 1.17x
# off's tok/s on a copy-heavy task at 1 / 2 / 4 / 8 streams, and 1.51x / 1.56x / 1.05x / 0.96x
# on an open one (docs/benchmarks.md): past 4 rows the open task loses.
DEFAULT_MAX_ROWS = 4
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None  # ngram's
    prompt_lookup_min: int | None = None
    # Requests verify drafts only in steps that start with at most this many running (vLLM's
    # field: speculation stops for a larger batch).
    disable_by_batch_size: int = DEFAULT_MAX_ROWS
    # draft_model: the draft's checkpoint (a folder once resolved), and how to quantize it on
    # load (None: as it is): the target's own folder with int4 is the self-draft.
    model: str | None = None
    quantization: str | None = None
    # vLLM's dynamic speculation (num_speculative_tokens_per_batch_size): [start, end, k] rows,
    # k drafts a request in steps that start with start to end requests running.
    num_speculative_tokens_per_batch_size: tuple[tuple[int, int, int], ...] | None = None

    def to_json(self) -> str:
        return json.dumps({k: v for k, v in asdict(self).items() if v is not None})

    def k_for(self, running: int, max_rows: int) -> int:
        """The drafts a request verifies in a step that starts with ``running`` requests: the
        user's batch-size table where a row holds that size; else k while ``running`` is at most
        ``max_rows`` (disable_by_batch_size), none past it."""
        for start, end, k in self.num_speculative_tokens_per_batch_size or ():
            if start <= running <= end:
                return k
        return self.num_speculative_tokens if running <= max_rows else 0

    @property
    def needs_kv(self) -> bool:
        """The proposer keeps KV of its own at the request's positions (a draft model)."""
        return self.method == "draft_model"


def _err(message: str) -> ValueError:
    return ValueError(f"--speculative-config: {message}")


def parse(value: str | dict[str, object] | None) -> SpeculativeConfig | None:
    """``--speculative-config``'s JSON (or the dict ``LLM(speculative_config=...)`` takes); None
    when unset. ValueError, in one line, for anything Lumen cannot do as asked."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            raw = json.loads(value)
        except json.JSONDecodeError as e:
            raise _err(f"not JSON ({e.msg}): {value!r}") from None
    else:
        raw = dict(value)
    if not isinstance(raw, dict):
        raise _err(f"must be a JSON object, not {value!r}")
    unknown = sorted(set(raw) - set(FIELDS))
    if unknown:
        raise _err(f"field(s) {', '.join(unknown)} not read here; Lumen reads {', '.join(FIELDS)}")
    model = raw.get("model")
    method = raw.get("method")
    if method is None:  # vLLM: a draft model's path alone means draft_model
        method = "ngram" if model in (None, "[ngram]") else "draft_model"
    if method == "[ngram]":
        method = "ngram"
    if method in NOT_BUILT:
        raise _err(f"method {method!r} is not built yet; built: {', '.join(METHODS)}")
    if method not in METHODS:
        raise _err(f"unknown method {method!r}; built: {', '.join(METHODS)}; vLLM's others: "
                   f"{', '.join(NOT_BUILT)}")  # fmt: skip
    k = raw.get("num_speculative_tokens")
    max_rows = raw.get("disable_by_batch_size")
    max_rows = DEFAULT_MAX_ROWS if max_rows is None else max_rows
    lookup_min, lookup_max = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
    checked = (("num_speculative_tokens", k), ("prompt_lookup_min", lookup_min),
               ("prompt_lookup_max", lookup_max), ("disable_by_batch_size", max_rows))  # fmt: skip
    for name, v in checked:
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise _err(f"{name} must be an integer of at least 1, not {v!r}")
    if k is None:
        raise _err("num_speculative_tokens is required (vLLM requires it too), e.g. 3")
    if k > MAX_SPECULATIVE_TOKENS:
        raise _err(f"num_speculative_tokens {k} is over {MAX_SPECULATIVE_TOKENS}")
    table = _batch_size_table(raw.get("num_speculative_tokens_per_batch_size"), k)
    quantization = raw.get("quantization")
    if method == "draft_model":
        if not isinstance(model, str) or not model:
            raise _err(
                "draft_model needs model: the draft's folder, GGUF file or packaged "
                "name (the target's own with quantization int4 drafts for itself)"
            )
        if lookup_min is not None or lookup_max is not None:
            raise _err("prompt_lookup_min and prompt_lookup_max are ngram's, not draft_model's")
        if quantization is not None and quantization not in DRAFT_QUANTIZATIONS:
            raise _err(f"quantization must be one of {', '.join(DRAFT_QUANTIZATIONS)} (the "
                       f"draft quantized on load) or unset, not {quantization!r}")  # fmt: skip
        return SpeculativeConfig(method, k, disable_by_batch_size=max_rows, model=model,
                                 quantization=quantization,
                                 num_speculative_tokens_per_batch_size=table)  # fmt: skip
    if model not in (None, "[ngram]"):
        raise _err(f"ngram takes no model (it looks up the prompt and the output), not {model!r}")
    if quantization is not None:
        raise _err("quantization is draft_model's (ngram has no weights)")
    # vLLM's defaults: neither given, both 5; one given, the other equal to it.
    if lookup_min is None and lookup_max is None:
        lookup_min = lookup_max = 5
    lookup_min = lookup_min if lookup_min is not None else lookup_max
    lookup_max = lookup_max if lookup_max is not None else lookup_min
    assert lookup_min is not None and lookup_max is not None
    if lookup_min > lookup_max:
        raise _err(f"prompt_lookup_min {lookup_min} is over prompt_lookup_max {lookup_max}")
    return SpeculativeConfig(method, k, lookup_max, lookup_min, max_rows,
                             num_speculative_tokens_per_batch_size=table)  # fmt: skip


def _batch_size_table(value: object, k: int) -> tuple[tuple[int, int, int], ...] | None:
    """num_speculative_tokens_per_batch_size: a list of [start, end, k] (vLLM's shape), sizes
    from 1, each range start <= end, no two overlapping, each k from 0 (no drafts) to
    num_speculative_tokens."""
    if value is None:
        return None
    name = "num_speculative_tokens_per_batch_size"
    shape = f"{name} must be a list of [start_batch_size, end_batch_size, k], e.g. [[1, 8, {k}]]"
    if not isinstance(value, list) or not value:
        raise _err(f"{shape}, not {value!r}")
    rows = []
    for row in value:
        if (not isinstance(row, list) or len(row) != 3
                or any(not isinstance(v, int) or isinstance(v, bool) for v in row)):  # fmt: skip
            raise _err(f"{shape}; {row!r} is not")
        start, end, drafts = row
        if not 1 <= start <= end:
            raise _err(f"{name}: {row!r} needs 1 <= start <= end")
        if not 0 <= drafts <= k:
            raise _err(f"{name}: {row!r} asks k = {drafts}, outside 0 to num_speculative_tokens "
                       f"({k})")  # fmt: skip
        rows.append((start, end, drafts))
    rows.sort()
    for (_, end, _), (start, _, _) in itertools.pairwise(rows):
        if start <= end:
            raise _err(f"{name}: the ranges overlap at batch size {start}")
    return tuple(rows)


def check_draft(config: SpeculativeConfig, draft: Path, target: Path) -> None:
    """A draft model proposes the target's token ids: the same vocabulary and tokenizer."""
    from engine.model_config import ModelConfig

    d, t = ModelConfig.from_path(draft), ModelConfig.from_path(target)
    if d.vocab_size != t.vocab_size:
        raise _err(
            f"the draft's vocabulary ({d.vocab_size} tokens, {draft}) is not the "
            f"target's ({t.vocab_size}): a draft shares the target's tokenizer"
        )
    mine, theirs = draft / "tokenizer.json", target / "tokenizer.json"
    if mine.is_file() and theirs.is_file() and mine.read_bytes() != theirs.read_bytes():
        raise _err(f"the draft's tokenizer ({mine}) is not the target's ({theirs}): a draft "
                   "must share the target's tokenizer")  # fmt: skip
