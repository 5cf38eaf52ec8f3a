"""What of a request's sampling is not plain greedy: the settings that take its step off the
fused greedy head onto the full logits and the sampler (a grammar, logprobs, penalties,
temperature and top-k/p), named when the sampler's time is a cause."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable


def settings_of(params: str | None, grammar: str | None) -> tuple[str, ...]:
    """The request's settings the sampler pays for, from its stored row (requests.params is
    its SamplingParams as JSON, defaults omitted; requests.grammar its structured output)."""
    try:
        p = json.loads(params) if params else {}
    except ValueError:
        p = {}
    out = []
    if grammar:
        out.append(f"a grammar ({grammar})")
    if p.get("logprobs") is not None:
        out.append("logprobs")
    if (p.get("presence_penalty", 0.0) or p.get("frequency_penalty", 0.0)
            or p.get("repetition_penalty", 1.0) != 1.0):  # fmt: skip
        out.append("penalties")
    temperature = p.get("temperature", 1.0)
    if temperature > 0 and p.get("top_k", 0) != 1:
        out.append("temperature")
    return tuple(out)


def named(settings: Iterable[tuple[str, ...]]) -> str:
    """'a grammar (json_schema) in 24 requests, penalties in 2' for the requests' settings,
    most common first ("" where none has any)."""
    counts: Counter[str] = Counter(s for mine in settings for s in mine)
    said = [f"{s} in {n}" for s, n in counts.most_common()]
    if said:
        said[0] += " request" + ("s" if counts.most_common(1)[0][1] != 1 else "")
    return ", ".join(said)
