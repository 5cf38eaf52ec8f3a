"""The API process's busy stretches (service/monitor.py): recorded in the trace store with the
CPU time they used, so that the diagnosis can lay them over the steps they slowed."""

from __future__ import annotations

import time

import httpx

from tests.helpers.load import wait_until
from tests.helpers.server import LumenServer
from tracing.store import open_db


def test_large_bodies_leave_a_busy_stretch_with_its_cpu(tiny_server: LumenServer) -> None:
    """Three 4 MB bodies (an unknown field, read and decoded, then ignored): the process was
    busy for at least the time it took to decode them, and its row says how much CPU it used."""
    padding = list(range(600_000))
    model = tiny_server.client().models.list().data[0].id
    start = time.time_ns()
    headers = {"Authorization": f"Bearer {tiny_server.api_key}"}
    with httpx.Client(timeout=60) as http:
        for _ in range(3):
            r = http.post(tiny_server.url("/v1/completions"), headers=headers, json={
                "model": model, "prompt": "Hello", "max_tokens": 2, "padding": padding,
            })  # fmt: skip
            assert r.status_code == 200, r.text
    end = time.time_ns()

    def rows() -> list[tuple[int, int, int]]:
        with open_db(tiny_server.trace_db, timeout=10) as con:
            return con.execute(
                "SELECT start_ns, duration_ns, cpu_ns FROM pauses WHERE process = 'api' "
                "AND kind = 'cpu' AND start_ns < ? AND start_ns + duration_ns > ?",
                [end, start],
            ).fetchall()

    wait_until(lambda: bool(rows()), 30)
    got = rows()
    busy, cpu = sum(d for _, d, _ in got), sum(c for _, _, c in got)
    print(f"\n{len(got)} busy stretches, {busy / 1e6:.1f} ms, {cpu / 1e6:.1f} ms of CPU")
    assert all(c >= 0.5 * d for _, d, c in got), got  # half a core, at least, throughout
    assert busy >= 20e6
