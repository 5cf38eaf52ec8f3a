"""The one registry of environment variables Lumen reads, all prefixed LUMEN_."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str
    help: str

    def get(self) -> str:
        return os.environ.get(self.name, self.default)


LUMEN_HOME = EnvVar(
    "LUMEN_HOME", str(Path.home() / ".cache" / "lumen"), "cache folder for converted models"
)
LUMEN_DEVICE = EnvVar("LUMEN_DEVICE", "", "force the device (cpu or cuda); empty = automatic")

LUMEN_API_KEY = EnvVar("LUMEN_API_KEY", "", "bearer key `lumen serve` requires (--api-key)")

LUMEN_DEBUG_SCHEDULE_DELAY = EnvVar(
    "LUMEN_DEBUG_SCHEDULE_DELAY",
    "0",
    "testing only: seconds every scheduler step sleeps (proves the regression gate catches it)",
)

ALL = (LUMEN_HOME, LUMEN_DEVICE, LUMEN_API_KEY, LUMEN_DEBUG_SCHEDULE_DELAY)


def lumen_home() -> Path:
    return Path(LUMEN_HOME.get()).expanduser()
