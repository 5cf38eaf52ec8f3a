"""Structured outputs, the core's half: grammars compiled off the busy loop, cached by spec, and
each step's token masks for the rows that have one.

A request with a grammar waits outside the scheduler's queue until its grammar is compiled
(Scheduler.compiling), so it never holds up the batch. Compiling runs on one thread:
llguidance builds a matcher without the GIL. The tokenizer it needs is loaded once, in the
engine's warm-up (with --no-warmup, when the first grammar arrives: that request waits for it,
~0.4 s here, in its core.grammar span). Each step the core fills one bitmask row (a bit per
token) for every row that samples under a grammar and sends the rows to the driver worker,
whose sampler masks only those rows (engine/worker/sampler.py); rows without a grammar pay
nothing.
"""

from __future__ import annotations

import concurrent.futures
import copy
import functools
import logging
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from engine import faults

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # declared in its stub only

logger = logging.getLogger(__name__)
CACHE_SIZE = 256  # compiled grammars kept, least recently used out first
# JSON as every grammar writes it: ", " and ": " between items (what the models were trained
# on), no other whitespace (a small model let loose on whitespace can pad forever).
JSON_OPTIONS: JsonCompileOptions = {
    "item_separator": ", ",
    "key_separator": ": ",
    "whitespace_flexible": False,
}
GRAMMAR_WAIT_S = 0.005  # how long an otherwise idle core waits for a grammar before a poll


class Grammar:
    """One request's grammar: compiling (``future``), then a matcher of its own."""

    __slots__ = ("cached", "compile_ns", "error", "future", "matcher", "ready_ns", "spec")

    def __init__(self, spec: str) -> None:
        self.spec = spec
        self.future: Future[Any] | None = None
        self.matcher: Any = None
        self.error: str | None = None
        self.ready_ns = 0  # compiled (or found in the cache), time.time_ns()
        self.compile_ns = 0  # how long the compile took (0: a cache hit)
        self.cached = False


class GrammarManager:
    def __init__(self, model_path: str, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.model_path = model_path
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.words = (vocab_size + 31) // 32  # int32 words per bitmask row
        self._pool: ThreadPoolExecutor | None = None
        self._tokenizer: Any = None
        self._cache: OrderedDict[str, Any] = OrderedDict()  # spec -> a pristine matcher
        self._pending: dict[str, Future[Any]] = {}
        self.compile_fault = faults.hook("grammar_compile")
        self.mask_fault = faults.hook("grammar_mask")

    # -- compiling -----------------------------------------------------------------

    def add(self, spec: str) -> Grammar:
        """A grammar for a new request: from the cache, or compiling on the thread."""
        grammar = Grammar(spec)
        if (pristine := self._cache.get(spec)) is not None:
            self._cache.move_to_end(spec)
            grammar.matcher, grammar.cached = pristine.deep_copy(), True
            grammar.ready_ns = time.time_ns()
            return grammar
        future = self._pending.get(spec)
        if future is None:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="lumen-grammar")
            future = self._pool.submit(self._compile, spec)
            self._pending[spec] = future
        else:
            grammar.cached = True  # another request is compiling the same grammar
        grammar.future = future
        return grammar

    def poll(self, grammar: Grammar) -> bool:
        """Whether the grammar is ready (or failed: ``grammar.error``); never blocks."""
        if grammar.matcher is not None or grammar.error is not None:
            return True
        future = grammar.future
        assert future is not None
        if not future.done():
            return False
        self._pending.pop(grammar.spec, None)
        try:
            pristine, took_ns, done_ns = future.result()
        except Exception as e:  # the tokenizer failed to load: every grammar request fails
            grammar.error = f"the grammar engine failed: {type(e).__name__}: {e}"
        else:
            if pristine.is_error():
                grammar.error = f"invalid grammar: {pristine.get_error()}"
            else:
                self._cache[grammar.spec] = pristine
                if len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
                grammar.matcher = pristine.deep_copy()
                grammar.compile_ns = 0 if grammar.cached else took_ns
            grammar.ready_ns = done_ns  # compiled: what follows is the queue's
        grammar.future = None
        grammar.ready_ns = grammar.ready_ns or time.time_ns()
        return True

    def warm_up(self) -> float:
        """Load the tokenizer, compile the JSON-object grammar (cached) and fill one mask,
        before the engine reports ready: the first structured request then waits ~1 ms for
        its grammar, not the ~0.4 s the tokenizer takes. Returns the seconds it took; a grammar
        engine that cannot start is logged, and its requests fail with the reason."""
        started = time.monotonic()
        try:
            import llguidance

            spec = llguidance.LLMatcher.grammar_from_json_schema(
                {"type": "object"}, defaults=JSON_OPTIONS
            )
            pristine, _, _ = self._compile(spec)
            self.fill_masks([pristine.deep_copy()])
            self._cache[spec] = pristine
        except Exception as e:
            logger.warning("the grammar engine did not warm up: %s: %s", type(e).__name__, e)
        return time.monotonic() - started

    def wait(self, requests: list[Any], timeout: float) -> None:
        """Block up to ``timeout`` seconds for any of these requests' grammars."""
        futures = [r.grammar.future for r in requests if r.grammar.future is not None]
        if futures:
            concurrent.futures.wait(futures, timeout, return_when="FIRST_COMPLETED")

    def _compile(self, spec: str) -> tuple[Any, int, int]:
        """On the grammar thread: the tokenizer (once), then the matcher."""
        import llguidance

        started = time.perf_counter_ns()
        if self._tokenizer is None:
            self._tokenizer = self._load_tokenizer()
            started = time.perf_counter_ns()  # the one-time tokenizer load is not the grammar's
        matcher = llguidance.LLMatcher(self._tokenizer, spec, log_level=0)
        self.compile_fault()
        return matcher, time.perf_counter_ns() - started, time.time_ns()

    def _load_tokenizer(self) -> Any:
        """llguidance's view of the model's tokenizer: from tokenizer.json's own text (0.3 s
        here; parsing it with `tokenizers` first and serializing it again cost 0.2 s more and
        changed no token), else through transformers (1-2 s)."""
        eos = tuple(self.eos_token_ids)
        path = Path(self.model_path) / "tokenizer.json"
        if path.is_file():
            st = path.stat()
            return _from_file(str(path.resolve()), st.st_size, st.st_mtime_ns, self.vocab_size, eos)
        from transformers import AutoTokenizer

        backend = copy.copy(AutoTokenizer.from_pretrained(self.model_path).backend_tokenizer)
        backend.no_padding()
        backend.no_truncation()
        return _ll_tokenizer(backend.to_str(), self.vocab_size, eos)

    # -- each step -----------------------------------------------------------------

    def fill_masks(self, matchers: list[Any], drafts: list[list[int]] | None = None) -> bytes:
        """One bitmask row per matcher (bit t of a row: token t is allowed), as bytes. With
        ``drafts`` (one list a matcher): a row at each of a matcher's ``len(d) + 1`` positions,
        the matcher advanced through the drafts before each and rolled back after (the drafts
        were checked against it when they were proposed: Scheduler.update_from_output)."""
        drafts = drafts or [[] for _ in matchers]
        rows = np.empty((len(matchers) + sum(map(len, drafts)), self.words), dtype=np.int32)
        address, stride = rows.ctypes.data, rows.strides[0]
        at = 0
        for matcher, mine in zip(matchers, drafts):
            for j in range(len(mine) + 1):
                matcher.unsafe_compute_mask_ptr(address + at * stride, stride)
                at += 1
                if j < len(mine):
                    matcher.consume_token(mine[j])
            if mine:
                matcher.rollback(len(mine))
        self.mask_fault()
        return rows.tobytes()

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


# By tokenizer.json (its path, size and time), vocabulary size and EOS ids: engines of one
# model in one process (LLM, in-process cores) share one, as a matcher only reads it, and a
# second engine's warm-up skips the 0.3 s load.
@functools.lru_cache(maxsize=4)
def _from_file(path: str, size: int, mtime_ns: int, vocab_size: int, eos: tuple[int, ...]) -> Any:
    return _ll_tokenizer(Path(path).read_text(encoding="utf-8"), vocab_size, eos)


def _ll_tokenizer(spec: str, vocab_size: int, eos: tuple[int, ...]) -> Any:
    import llguidance

    started = time.monotonic()
    tokenizer = llguidance.LLTokenizer(spec, n_vocab=vocab_size, eos_token=list(eos))
    logger.info("grammar tokenizer loaded in %.2fs", time.monotonic() - started)
    return tokenizer
