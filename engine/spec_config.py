"""``--speculative-config``: vLLM's SpeculativeConfig, the fields Lumen reads and their defaults,
checked where the engine's options are (the proposer: engine/worker/ngram.py; verification:
engine/worker/spec_decode.py; the scheduler's rule: engine/core/scheduler.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass

# Built here. vLLM's other methods are named apart, so a user bringing one hears what is missing.
METHODS = ("ngram",)
NOT_BUILT = ("draft_model", "eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "suffix")
# vLLM's fields that Lumen reads; a known vLLM field that changes nothing here is refused by name.
FIELDS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model",
          "disable_by_batch_size")  # fmt: skip
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
    prompt_lookup_max: int
    prompt_lookup_min: int
    # Requests verify drafts only in steps that start with at most this many running (vLLM's
    # field: speculation stops for a larger batch).
    disable_by_batch_size: int = DEFAULT_MAX_ROWS

    def to_json(self) -> str:
        return json.dumps(self.__dict__)


def parse(value: str | dict[str, object] | None) -> SpeculativeConfig | None:
    """``--speculative-config``'s JSON (or the dict ``LLM(speculative_config=...)`` takes); None
    when unset. ValueError, in one line, for anything Lumen cannot do as asked."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            raw = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config is not JSON ({e.msg}): {value!r}") from None
    else:
        raw = dict(value)
    if not isinstance(raw, dict):
        raise ValueError(f"--speculative-config must be a JSON object, not {value!r}")
    unknown = sorted(set(raw) - set(FIELDS))
    if unknown:
        raise ValueError(f"--speculative-config: field(s) {', '.join(unknown)} not read here; "
                         f"Lumen reads {', '.join(FIELDS)}")  # fmt: skip
    method = raw.get("method")
    if method is None:
        # vLLM: a draft model's path alone means draft_model; "[ngram]" was the old spelling.
        model = raw.get("model")
        method = "ngram" if model in (None, "[ngram]") else "draft_model"
    if method == "[ngram]":
        method = "ngram"
    if method in NOT_BUILT:
        raise ValueError(f"--speculative-config: method {method!r} is not built yet; built: "
                         f"{', '.join(METHODS)} (prompt lookup)")  # fmt: skip
    if method not in METHODS:
        raise ValueError(f"--speculative-config: unknown method {method!r}; built: "
                         f"{', '.join(METHODS)}; vLLM's others: "
                         f"{', '.join(NOT_BUILT)}")  # fmt: skip
    if raw.get("model") not in (None, "[ngram]"):
        raise ValueError("--speculative-config: ngram takes no model (it looks up the prompt "
                         f"and the output), not {raw['model']!r}")  # fmt: skip
    k = raw.get("num_speculative_tokens")
    max_rows = raw.get("disable_by_batch_size")
    max_rows = DEFAULT_MAX_ROWS if max_rows is None else max_rows
    lookup_min, lookup_max = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
    checked = (("num_speculative_tokens", k), ("prompt_lookup_min", lookup_min),
               ("prompt_lookup_max", lookup_max), ("disable_by_batch_size", max_rows))  # fmt: skip
    for name, v in checked:
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"--speculative-config: {name} must be an integer of at least 1, "
                             f"not {v!r}")  # fmt: skip
    if k is None:
        raise ValueError("--speculative-config: num_speculative_tokens is required (vLLM's "
                         "ngram requires it too), e.g. 3")  # fmt: skip
    if k > MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"--speculative-config: num_speculative_tokens {k} is over "
                         f"{MAX_SPECULATIVE_TOKENS}")  # fmt: skip
    # vLLM's defaults: neither given, both 5; one given, the other equal to it.
    if lookup_min is None and lookup_max is None:
        lookup_min = lookup_max = 5
    lookup_min = lookup_min if lookup_min is not None else lookup_max
    lookup_max = lookup_max if lookup_max is not None else lookup_min
    assert lookup_min is not None and lookup_max is not None
    if lookup_min > lookup_max:
        raise ValueError(f"--speculative-config: prompt_lookup_min {lookup_min} is over "
                         f"prompt_lookup_max {lookup_max}")  # fmt: skip
    return SpeculativeConfig(method, k, lookup_max, lookup_min, max_rows)
