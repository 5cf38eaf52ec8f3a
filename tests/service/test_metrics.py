"""observe_all counts a batch of values into a Prometheus histogram as observing each does."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from service.metrics import observe_all

BUCKETS = [0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0]


def _histogram() -> tuple[CollectorRegistry, Histogram]:
    registry = CollectorRegistry()
    return registry, Histogram("itl", "itl", ["model_name"], buckets=BUCKETS,
                               registry=registry).labels("m")  # fmt: skip


def test_observe_all_counts_as_observe_does() -> None:
    rng = random.Random(7)
    batches = [
        [0.004] * 64,  # one step's latencies: one bucket
        [*BUCKETS, 0.0, -0.5, 3.0, 1e9],  # on each bound, below the first, above the last
        [rng.expovariate(20) for _ in range(500)],
        [],
    ]
    (mine_registry, mine), (theirs_registry, theirs) = _histogram(), _histogram()
    for batch in batches:
        if batch:
            observe_all(mine, batch)
        for v in batch:
            theirs.observe(v)
    ours, observed = _samples(mine_registry), _samples(theirs_registry)
    assert ours.keys() == observed.keys()
    for name, value in observed.items():
        if name.startswith("itl_sum"):  # added up in another order
            assert abs(ours[name] - value) < 1e-6 * max(1.0, abs(value)), name
        else:
            assert ours[name] == value, name


def _samples(registry: CollectorRegistry) -> dict[str, float]:
    """Each sample line (its name and labels) and its value, but the creation times."""
    lines = generate_latest(registry).decode().splitlines()
    return {
        line.rpartition(" ")[0]: float(line.rpartition(" ")[2])
        for line in lines
        if line and not line.startswith("#") and "_created" not in line
    }
