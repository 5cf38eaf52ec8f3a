"""The native kernels' build (engine.worker.native_build): sources shipped as package data,
compiled once, and a cached library loaded only where this user alone could have written it."""

from __future__ import annotations

import logging
import os
import tomllib
from pathlib import Path

import pytest

from engine import cache_files
from engine.worker import native_build
from tests.helpers.native import built

ROOT = Path(__file__).resolve().parents[3]


def test_every_kernel_source_ships_as_package_data() -> None:
    """An installed wheel carries the .c files the kernels compile from."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["engine.worker"]
    package = ROOT / "engine" / "worker"
    shipped = {p for pattern in patterns for p in package.glob(pattern)}
    sources = set(native_build.SOURCES.glob("*.c"))
    assert {"decode_attention.c", "greedy_head.c", "int8_linear.c"} <= {p.name for p in sources}
    assert sources <= shipped


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("LUMEN_HOME", str(tmp_path))
    monkeypatch.setattr(cache_files, "_warned", set())
    return tmp_path


def _build() -> Path:
    return built(
        lambda: native_build.compile_library("int8_linear_v8", "int8_linear.c", ("-DVL=8",))
    )


def test_a_library_is_built_once_and_only_this_user_may_write_it(home: Path) -> None:
    old = os.umask(0o002)  # a umask that leaves new files group-writable
    try:
        library = _build()
    finally:
        os.umask(old)
    assert library.parent == home / "kernels"
    assert library.stat().st_mode & 0o777 == 0o755
    mtime = library.stat().st_mtime_ns
    assert _build() == library and library.stat().st_mtime_ns == mtime  # not rebuilt


@pytest.mark.parametrize("how", ["others may write it", "another user owns it"])
def test_an_untrusted_library_is_rebuilt_with_one_warning(
    home: Path, how: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    library = _build()
    library.write_bytes(b"not a library")
    if how == "others may write it":
        library.chmod(0o666)
    else:
        uid = os.getuid()
        monkeypatch.setattr(native_build.os, "getuid", lambda: uid + 1)
    with caplog.at_level(logging.WARNING, logger="engine.worker.native_build"):
        assert _build() == library
        assert library.read_bytes() != b"not a library"  # rebuilt, not loaded
        if how == "others may write it":
            assert library.stat().st_mode & 0o777 == 0o755
            assert _build() == library
        else:
            _build()  # still "another user's": rebuilt again, but warned about once
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "not loading the cached kernel" in warnings[0].message
