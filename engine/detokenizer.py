"""Incremental detokenization and stop strings, per request."""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# Prompt tokens fed to a fresh stream so the first output token decodes with
# the spacing it has in context (metaspace tokenizers strip a leading space).
_PRIME_TOKENS = 4


class IncrementalDetokenizer:
    """Turns token ids into text as they arrive, holding back incomplete UTF-8.

    Stop strings are searched only in the tail that the new text can have
    completed, so a stop string split over several tokens is still found.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        *,
        skip_special_tokens: bool,
        stop: list[str],
        include_stop_str_in_output: bool,
    ) -> None:
        self.tokenizer = tokenizer
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        for token_id in prompt_token_ids[-_PRIME_TOKENS:]:
            self.stream.step(tokenizer, token_id)
        self.stop = stop
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.include_stop = include_stop_str_in_output
        self.text = ""
        # Of the last update's tokens, how many the text took: fewer where a stop string ended
        # the text before the last (several tokens a step, speculative decoding's).
        self.num_used = 0

    def update(self, token_ids: list[int]) -> str | None:
        """Add tokens to the text; returns the stop string if one matched (text is cut there,
        and ``num_used`` says how many of the tokens it took: as one token at a time would)."""
        start = len(self.text)
        self.num_used = len(token_ids)
        if self.stop and len(token_ids) > 1:
            for i, token_id in enumerate(token_ids):
                before = len(self.text)
                piece = self.stream.step(self.tokenizer, token_id)
                if piece:
                    self.text += piece
                    if (found := self._check_stop(before)) is not None:
                        self.num_used = i + 1
                        return found
            return None
        for token_id in token_ids:
            piece = self.stream.step(self.tokenizer, token_id)
            if piece:
                self.text += piece
        if not self.stop or len(self.text) == start:
            return None
        return self._check_stop(start)

    def _check_stop(self, new_from: int) -> str | None:
        search_from = max(0, new_from - self.max_stop_len + 1)
        best: tuple[int, str] | None = None
        for s in self.stop:
            idx = self.text.find(s, search_from)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        idx, s = best
        self.text = self.text[: idx + len(s)] if self.include_stop else self.text[:idx]
        return s
