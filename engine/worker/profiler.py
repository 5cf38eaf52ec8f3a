"""A torch profiler a worker starts and stops on request, writing a Chrome trace file."""

from __future__ import annotations

from pathlib import Path

import torch


class Profiler:
    def __init__(self) -> None:
        self._prof: torch.profiler.profile | None = None
        self._path: Path | None = None

    def start(self, path: str) -> None:
        if self._prof is not None:
            raise ValueError("the profiler is already running")
        target = Path(path)
        if not target.parent.is_dir():
            raise ValueError(f"profile folder {target.parent} does not exist")
        self._prof = torch.profiler.profile(record_shapes=True)
        self._prof.__enter__()
        self._path = target

    def stop(self) -> str | None:
        """Stop and write the trace; returns its path (None if it was not running)."""
        if self._prof is None:
            return None
        prof, path = self._prof, self._path
        self._prof = self._path = None
        prof.__exit__(None, None, None)
        assert path is not None
        prof.export_chrome_trace(str(path))
        return str(path)
