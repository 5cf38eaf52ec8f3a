"""The kernel tests run on a team of at least two threads, whatever team the test run gives
its workers (tests/conftest.py): the native kernels split their work by thread, and a split
is what these tests must see."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def kernel_team():
    team = torch.get_num_threads()
    torch.set_num_threads(max(2, team))
    yield
    torch.set_num_threads(team)
