"""The harness's time budget: load stretches it, a hang still fails in bounded time."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from distributed_harness import MAX_STRETCH, load_factor, run_ranks


def test_the_budget_stretches_with_load_per_cpu_within_bounds() -> None:
    assert load_factor(load=0.5, cpus=2) == 1.0  # an idle machine: wall seconds
    assert load_factor(load=7.0, cpus=2) == 3.5  # 7 runnable on 2 cores: 3.5x slower
    assert load_factor(load=100.0, cpus=2) == MAX_STRETCH  # never unbounded
    assert 1.0 <= load_factor() <= MAX_STRETCH  # this machine, now


def _hang(rank: int) -> None:
    time.sleep(3600)  # a rank that never finishes (no collective to time out)


def test_a_hung_rank_fails_within_the_bounded_time(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match="did not finish within 2 s"):
        run_ranks(tmp_path, _hang, timeout=2.0)
    assert time.monotonic() - start < 2.0 * MAX_STRETCH + 5.0  # + the kill and the poll
