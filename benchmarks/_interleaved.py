"""Side-by-side timing shared by the benchmark scripts.

Every configuration runs in the same process, alternating round by round, so that
machine noise (other jobs, frequency changes) hits all of them alike; each reports the
median over rounds. The first round only warms up.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping


def interleaved_medians(runs: Mapping[str, Callable[[], None]], *, rounds: int,
                        steps: int) -> dict[str, float]:
    """Median seconds per call of each run, over ``rounds`` interleaved rounds of
    ``steps`` calls each (after one warm-up round)."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for round_ in range(rounds + 1):
        for name, run in runs.items():
            start = time.perf_counter()
            for _ in range(steps):
                run()
            if round_ > 0:
                times[name].append((time.perf_counter() - start) / steps)
    return {name: statistics.median(samples) for name, samples in times.items()}


def print_ratios(medians: Mapping[str, float], base: str = "native") -> None:
    """One line per configuration: ms per call and the ratio to ``base``."""
    for name, seconds in medians.items():
        print(f"  {name:<14} {seconds * 1e3:9.3f} ms/step  ({seconds / medians[base]:.3f}x "
              f"{base})")
