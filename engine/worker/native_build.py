"""Native CPU kernels compiled once per machine with the system C compiler, cached in
LUMEN_HOME/kernels (cpu_attention, cpu_int8).

Compiled with ``-O3 -march=native -ffast-math -fopenmp`` and linked without -ffast-math:
linking with it adds crtfastmath, which sets flush-to-zero for the whole process on load.
Each library links the OpenMP runtime torch already loaded, so both share one thread pool.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from engine import envs

CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC")
LDFLAGS = ("-shared", "-fopenmp")


def cpu_key() -> str:
    """What -march=native depends on: the CPU's flags (LUMEN_HOME may be shared)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        flags = next((line for line in text.splitlines() if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return f"{platform.machine()} {flags}"


def vector_floats() -> int:
    """fp32 lanes of the widest vector this CPU has (what -march=native compiles for)."""
    return 16 if " avx512f" in cpu_key() else 8


def compile_library(stem: str, source: str, defines: tuple[str, ...] = ()) -> Path:
    """The shared library of ``source`` (C) with ``defines``, compiled once into
    LUMEN_HOME/kernels; raises RuntimeError where there is no compiler or it fails."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    key = hashlib.sha256(
        "\n".join((source, compiler, *CFLAGS, *LDFLAGS, *defines, cpu_key())).encode()
    ).hexdigest()[:16]
    folder = Path(envs.LUMEN_HOME.get()) / "kernels"
    library = folder / f"{stem}_{key}.so"
    if library.is_file():
        return library
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        src = Path(tmp) / f"{stem}.c"
        src.write_text(source)
        obj, out = Path(tmp) / f"{stem}.o", Path(tmp) / library.name
        for cmd in (
            [compiler, *CFLAGS, *defines, "-c", str(src), "-o", str(obj)],
            [compiler, *LDFLAGS, str(obj), "-o", str(out), "-lm"],
        ):
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-500:]}")
        os.replace(out, library)  # atomic: another process may build the same one
    return library
