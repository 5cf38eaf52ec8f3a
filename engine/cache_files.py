"""Files Lumen caches in LUMEN_HOME and reads back on a later start: compiled kernels, kernel
choices, tokenizer classes.

LUMEN_HOME may be shared between users, and what is read back decides what runs: a cached
file is used only where the current user owns it and nobody else may write it, and written
atomically (a reader never sees half a file), readable by all and writable by its owner only.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_warned: set[Path] = set()  # untrusted files already warned about: one warning each


def trusted(path: Path, what: str) -> bool:
    """Whether ``path`` is owned by the current user and writable by nobody else; else
    False, with one warning per file (``what`` names it for the log)."""
    st = path.stat()
    if st.st_uid == os.getuid() and not st.st_mode & 0o022:
        return True
    if path not in _warned:
        _warned.add(path)
        logger.warning(
            "not loading %s %s: it is owned by uid %d with mode %o, and only files of this "
            "user (uid %d) that group and others cannot write are loaded; replacing it",
            what, path, st.st_uid, st.st_mode & 0o777, os.getuid(),
        )  # fmt: skip
    return False


def read_json(path: Path, what: str) -> dict[str, Any] | None:
    """The JSON object cached at ``path``; None where it is absent, torn or not trusted."""
    try:
        if not trusted(path, what):
            return None
        entry = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return entry if isinstance(entry, dict) else None


def write_json(path: Path, entry: dict[str, Any], what: str) -> None:
    """Atomically; a cache that cannot be written (a read-only LUMEN_HOME) only costs the
    next start the work the file would have saved."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(entry, f, indent=1)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("could not cache %s in %s: %s", what, path, e)
