"""The engine's CPU thread count: a wider team only where it makes a real step faster."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from engine.worker import cpu_threads

# Each case times a step made of sleeps: a busy neighbour's scheduling noise could flip a choice.
pytestmark = pytest.mark.serial


@pytest.fixture(autouse=True)
def restore_threads(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LUMEN_CPU_THREADS", raising=False)
    monkeypatch.setenv("LUMEN_AUTOTUNE", "retune")  # each case times its own step
    torch.set_num_threads(4)
    yield
    torch.set_num_threads(before)


def step_taking(one_thread_s: float, team_s: float):  # type: ignore[no-untyped-def]
    """A step that takes ``one_thread_s`` on one thread and ``team_s`` on more."""
    return lambda: time.sleep(one_thread_s if torch.get_num_threads() == 1 else team_s)


@pytest.mark.parametrize(
    ("one_thread_s", "team_s", "kept"),
    [
        (0.030, 0.012, 4),  # a large step the team makes 2.5x faster: kept
        (0.030, 0.028, 1),  # a large step the team barely helps: one thread
        (0.002, 0.0005, 1),  # a step shorter than the Python around it: one thread
    ],
)
def test_the_team_is_kept_only_where_it_pays(one_thread_s: float, team_s: float, kept: int) -> None:
    why = cpu_threads.choose(step_taking(one_thread_s, team_s), owns_process=True)
    print(why)
    assert torch.get_num_threads() == kept
    assert why is not None and why.startswith(f"{kept} (a 16-row step")


def test_a_process_the_engine_does_not_own_is_left_alone() -> None:
    assert cpu_threads.choose(step_taking(0.002, 0.0005), owns_process=False) is None
    assert torch.get_num_threads() == 4


def test_the_users_settings_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LUMEN_CPU_THREADS", "3")
    assert cpu_threads.choose(step_taking(0.002, 0.0005), owns_process=False) == (
        "3 (set by LUMEN_CPU_THREADS)"
    )
    assert torch.get_num_threads() == 3
    monkeypatch.delenv("LUMEN_CPU_THREADS")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_threads.choose(step_taking(0.002, 0.0005), owns_process=True) == (
        "3 (set by OMP_NUM_THREADS)"
    )


@pytest.mark.parametrize("value", ["0", "two", "-1"])
def test_a_bad_setting_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("LUMEN_CPU_THREADS", value)
    with pytest.raises(ValueError, match="LUMEN_CPU_THREADS must be auto or a whole number"):
        cpu_threads.choose(step_taking(0.002, 0.0005), owns_process=True)


def test_a_second_start_takes_the_cached_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    shape = {"model": "a large one"}
    first = cpu_threads.choose(step_taking(0.030, 0.012), owns_process=True, shape=shape)
    assert first is not None and first.startswith("4 (a 16-row step")
    monkeypatch.delenv("LUMEN_AUTOTUNE")
    torch.set_num_threads(4)
    # The step now says one thread would do, but it is not timed: the cache decides.
    second = cpu_threads.choose(step_taking(0.030, 0.029), owns_process=True, shape=shape)
    assert second == f"4 (cached: {first[3:-1]})"
    assert torch.get_num_threads() == 4
