"""The `replay` command (replay run / import / report / diff / regress): not built yet."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    print("replay: not available yet in this version of Lumen", file=sys.stderr)
    return 2
