"""Process helpers for tests that start engines in other processes."""

from __future__ import annotations

import os
import time

import psutil


def live_children(pid: int | None = None) -> list[psutil.Process]:
    """Descendants of ``pid`` (default: this process) that are still running.

    multiprocessing's resource tracker is left out: spawn starts one per
    parent, it outlives no one (it exits with its parent) and is not ours.
    So are the `lumen serve` processes of server fixtures shared across the
    session (and their engines): they belong to the fixture, not to the test.
    """
    try:
        children = psutil.Process(pid or os.getpid()).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    fixtures = set()
    if pid is None:
        for c in children:
            if _is_server(c):
                fixtures.add(c.pid)
                fixtures.update(g.pid for g in _descendants(c))
    return [
        c for c in children if c.pid not in fixtures and _alive(c) and not _is_resource_tracker(c)
    ]


def _is_server(p: psutil.Process) -> bool:
    try:
        return "service.cli" in p.cmdline()
    except psutil.NoSuchProcess:
        return False


def _descendants(p: psutil.Process) -> list[psutil.Process]:
    try:
        return p.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _is_resource_tracker(p: psutil.Process) -> bool:
    try:
        return any("resource_tracker" in part for part in p.cmdline())
    except psutil.NoSuchProcess:
        return False


def wait_no_children(pid: int | None = None, timeout: float = 10.0) -> list[psutil.Process]:
    """Wait until no descendant is left; returns the stragglers (empty on success)."""
    deadline = time.monotonic() + timeout
    while (left := live_children(pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def pid_alive(pid: int) -> bool:
    try:
        return _alive(psutil.Process(pid))
    except psutil.NoSuchProcess:
        return False


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
