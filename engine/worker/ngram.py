"""The ``ngram`` proposer (prompt lookup): the tokens that followed the sequence's last n tokens
the last time they occurred, in its prompt or its output, are its drafts.

Each sequence keeps an index from every ``prompt_lookup_min``-gram it holds to the positions
just after it (its last ``CANDIDATES`` occurrences), extended by the tokens each step adds, so a
proposal costs a lookup and a few comparisons, not a scan of the context. Among the candidates,
the longest match of the sequence's end (up to ``prompt_lookup_max`` tokens) wins, the most
recent on a tie; its next ``k`` tokens (fewer at the end of what is known) are the drafts.
"""

from __future__ import annotations

from typing import Any

CANDIDATES = 4  # occurrences of a gram kept, most recent last


class NgramIndex:
    """One sequence's tokens and the index over them."""

    __slots__ = ("index", "lookup_max", "lookup_min", "tokens")

    def __init__(self, prompt: list[int], lookup_min: int, lookup_max: int) -> None:
        self.tokens: list[int] = []
        self.index: dict[tuple[int, ...], list[int]] = {}
        self.lookup_min, self.lookup_max = lookup_min, lookup_max
        self.extend(prompt)

    def extend(self, new: list[int]) -> None:
        tokens, index, n = self.tokens, self.index, self.lookup_min
        for token in new:
            # The gram that ends at the sequence's current end, indexed before the token that
            # follows it arrives: a proposal never finds the end itself.
            if len(tokens) >= n:
                after = index.setdefault(tuple(tokens[-n:]), [])
                after.append(len(tokens))
                if len(after) > CANDIDATES:
                    del after[0]
            tokens.append(token)

    def propose(self, k: int) -> list[int]:
        tokens, n = self.tokens, self.lookup_min
        end = len(tokens)
        if end <= n:
            return []
        found = self.index.get(tuple(tokens[-n:]))
        if not found:
            return []
        best, best_len = -1, 0
        for after in reversed(found):  # most recent first: it wins a tie
            length = n
            while (length < self.lookup_max and after - length - 1 >= 0
                   and tokens[after - length - 1] == tokens[end - length - 1]):  # fmt: skip
                length += 1
            if length > best_len:
                best, best_len = after, length
        return tokens[best : best + k]


class NgramProposer:
    """The driver's proposer: an index per request, drafts for the rows that sampled."""

    def __init__(self, lookup_min: int, lookup_max: int) -> None:
        self.lookup_min, self.lookup_max = lookup_min, lookup_max
        self.indexes: dict[str, NgramIndex] = {}
        self.num_prompt: dict[str, int] = {}

    def add(self, req_id: str, prompt: list[int]) -> None:
        self.indexes[req_id] = NgramIndex(prompt, self.lookup_min, self.lookup_max)
        self.num_prompt[req_id] = len(prompt)

    def drop(self, req_ids: list[str], preempted: list[str] = ()) -> None:  # type: ignore[assignment]
        for req_id in req_ids:
            self.indexes.pop(req_id, None)
            self.num_prompt.pop(req_id, None)

    def propose(
        self, req_ids: list[str], rows: dict[str, Any], k: int, sched: object = None
    ) -> dict[str, list[int]]:
        """Up to ``k`` drafts for each of ``req_ids`` (rows that sampled this step) that has
        any; ``rows``: the runner's SamplingRow of each request (its output so far)."""
        out: dict[str, list[int]] = {}
        for req_id in req_ids:
            index, row = self.indexes.get(req_id), rows.get(req_id)
            if index is None or row is None:
                continue
            have = len(index.tokens) - self.num_prompt[req_id]
            index.extend(row.output_token_ids[have:])
            drafts = index.propose(k)
            if drafts:
                out[req_id] = drafts
        return out
