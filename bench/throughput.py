"""lumen bench throughput: a fixed offline workload through Lumen and through Hugging Face."""

from __future__ import annotations

import argparse


def add_parser(verbs: argparse._SubParsersAction) -> None:
    p = verbs.add_parser("throughput", help="offline tokens/s, Lumen vs Hugging Face generate")
    p.add_argument("--json", default=None, metavar="PATH", help="write the figures as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    raise ValueError("not implemented yet")
