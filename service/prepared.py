"""A request the server validated, ready for the engine (``Prepared``), and the checks that make
one out of what a route received: its room to generate, and the engine it may ask for."""

from __future__ import annotations

from dataclasses import dataclass

from engine.processor import PreparedPrompt
from engine.request_ids import child_id
from engine.sampling_params import SamplingParams
from service.context import RequestContext
from service.responses import ResponseHead


@dataclass(slots=True)
class Prepared:
    """A validated request, ready for the engine: its prompts are not checked again."""

    prompts: list[PreparedPrompt]
    params: SamplingParams
    head: ResponseHead
    stream: bool
    priority: int
    ctx: RequestContext  # arrival, first byte, and what the HTTP layer measures of it
    include_metrics: bool = False  # the response carries `metrics` (service/request_metrics)
    engine_rank: int | None = None  # the engine its X-data-parallel-rank header names

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p.prompt_token_ids) for p in self.prompts)

    @property
    def request_ids(self) -> list[str]:
        """The engine request of each prompt."""
        if len(self.prompts) == 1:
            return [self.head.id]
        return [child_id(self.head.id, i) for i in range(len(self.prompts))]


def max_tokens_for(num_prompt_tokens: int, requested: int | None, max_len: int) -> int:
    """The tokens a prompt may generate within ``max_len``: ``requested``, or all the room
    left; ValueError where there is none, or less than requested."""
    room = max_len - num_prompt_tokens
    if room < 1:
        raise ValueError(
            f"the prompt is {num_prompt_tokens} tokens long, which leaves no room to generate "
            f"within the maximum context length of {max_len} tokens"
        )
    if requested is None:
        return room
    if requested > room:
        raise ValueError(
            f"this model's maximum context length is {max_len} tokens, but the prompt is "
            f"{num_prompt_tokens} tokens and max_tokens asks for {requested} more"
        )
    return requested


def pinned_engine(header: str | None, engines: int) -> int | None:
    """The engine an X-data-parallel-rank header names (vLLM's, for replaying a recorded split;
    None: no header, or one engine); ValueError unless it is one of the ``engines`` ranks."""
    if header is None:
        return None
    try:
        rank = int(header)
    except ValueError:
        rank = -1
    if not 0 <= rank < engines:
        raise ValueError(
            f"X-data-parallel-rank must be an engine's rank, 0 to {engines - 1} "
            f"(--data-parallel-size {engines}), not {header!r}"
        )
    return rank if engines > 1 else None


def as_prompts(prompts: list[str | list[int]]) -> list[str | dict[str, list[int]]]:
    """A completion's prompts as the engine takes them: text, or token ids."""
    return [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompts]
