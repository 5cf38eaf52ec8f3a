"""Native CPU kernels (the C sources in engine/worker/native/) compiled once per machine with
the system C compiler, cached in LUMEN_HOME/kernels.

Compiled with ``-O3 -march=native -ffast-math -fopenmp`` and linked without -ffast-math:
linking with it adds crtfastmath, which sets flush-to-zero for the whole process on load.
Each library links the OpenMP runtime torch already loaded, so both share one thread pool.

A cached library is loaded only where the current user owns it and nobody else may write
it: LUMEN_HOME may be shared, and loading a library runs its code.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from engine import envs
from engine.cache_files import trusted

logger = logging.getLogger(__name__)

SOURCES = Path(__file__).with_name("native")  # shipped as package data (pyproject.toml)
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


def compiler() -> str | None:
    """The C compiler the kernels build with ($CC, else cc or gcc on PATH), or None."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def source(name: str) -> str:
    """The text of the kernel source ``name`` (a file in engine/worker/native/)."""
    return (SOURCES / name).read_text()


def compile_library(stem: str, source_name: str, defines: tuple[str, ...] = ()) -> Path:
    """The shared library of the C file ``source_name`` (in engine/worker/native/) with
    ``defines``, compiled once into LUMEN_HOME/kernels; raises RuntimeError where there is
    no compiler or it fails."""
    cc = compiler()
    if not cc:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    text = source(source_name)
    key = hashlib.sha256(
        "\n".join((text, cc, *CFLAGS, *LDFLAGS, *defines, cpu_key())).encode()
    ).hexdigest()[:16]
    folder = Path(envs.LUMEN_HOME.get()) / "kernels"
    library = folder / f"{stem}_{key}.so"
    if library.is_file() and trusted(library, "the cached kernel"):
        return library
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        src = Path(tmp) / source_name
        src.write_text(text)
        obj, out = Path(tmp) / f"{stem}.o", Path(tmp) / library.name
        for cmd in (
            [cc, *CFLAGS, *defines, "-c", str(src), "-o", str(obj)],
            [cc, *LDFLAGS, str(obj), "-o", str(out), "-lm"],
        ):
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                raise RuntimeError(f"{cc} failed: {done.stderr.strip()[-500:]}")
        out.chmod(0o755)  # whatever the umask: a group-writable library would not load again
        os.replace(out, library)  # atomic: another process may build the same one
    return library
