"""Request ids: minted once where a request enters, and one convention for its children.

A request enters at the server's front door (``service/front_door.py``) or at
``LLM.generate`` / ``AsyncLLM.generate``; each calls ``new_request_id`` there
and nowhere else. A completion with several prompts is one engine request per
prompt, and a request with ``n`` > 1 is one core sequence per sample: both
children are ``child_id(parent, i)``, that is ``ID-i`` (prompt 2, sample 1 of
``cmpl-…`` is ``cmpl-…-2-1``). Recordings made before this convention named a
sample ``i_ID``: readers of old trace dbs match both patterns below.
"""

from __future__ import annotations

import itertools
import uuid

_PREFIX = uuid.uuid4().hex[:8]  # one per process run, so ids never repeat across restarts
_COUNTER = itertools.count()
# Regular expressions (Python's and DuckDB's) for what a child id adds to its parent's.
CHILD_SUFFIX = "-[0-9]+$"
OLD_SAMPLE_PREFIX = "^[0-9]+_"


def new_request_id(kind: str = "cmpl") -> str:
    """A fresh id (``cmpl-…``, ``chatcmpl-…``): unique in this process and never reused."""
    return f"{kind}-{_PREFIX}{next(_COUNTER):08x}"


def child_id(parent: str, index: int) -> str:
    """The id of child ``index`` (a prompt, or a sample) of request ``parent``."""
    return f"{parent}-{index}"
