"""The image can build the native CPU kernels: its final stage installs a C compiler (no
container engine runs here, so the Dockerfile is read, not built)."""

from __future__ import annotations

import re
from pathlib import Path

DOCKERFILE = Path(__file__).resolve().parents[1] / "Dockerfile"
COMPILERS = {"gcc", "clang", "build-essential"}


def final_stage(text: str) -> tuple[str, list[str]]:
    """The final stage's base image and its RUN commands (continuation lines joined)."""
    lines = re.sub(r"\\\n", " ", text).splitlines()
    base, runs = "", []
    for line in (raw.strip() for raw in lines):
        word, _, rest = line.partition(" ")
        if word.upper() == "FROM":
            base, runs = rest.split()[0], []
        elif word.upper() == "RUN":
            runs.append(rest)
    return base, runs


def test_the_final_stage_installs_a_c_compiler() -> None:
    base, runs = final_stage(DOCKERFILE.read_text())
    assert base, "no FROM in the Dockerfile"
    installed = {
        pkg
        for run in runs
        for cmd in re.split(r"&&|;", run)
        if re.search(r"\bapt(-get)? install\b", cmd)
        for pkg in cmd.split()
    }
    full_image = not re.search(r"-(slim|alpine)\b", base)  # python:3.11 itself has gcc
    assert full_image or installed & COMPILERS, (
        f"{base} has no C compiler and no RUN installs one: the native kernels could not build"
    )
    if not full_image:
        assert "libc6-dev" in installed or "build-essential" in installed  # headers to link


def test_the_parser_sees_a_slim_image_without_a_compiler() -> None:
    base, runs = final_stage("FROM python:3.11 AS build\nRUN apt-get install -y gcc\n"
                             "FROM python:3.11-slim\nRUN pip install .\n")  # fmt: skip
    assert base == "python:3.11-slim" and runs == ["pip install ."]
