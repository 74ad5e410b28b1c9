"""What O2's fp32 master weights cost the host per training step, per parameter.

O2 keeps an fp32 master for each low-precision parameter. Each step, after the backward
pass, the masters' gradients are derived from the model's (``pull``), the optimizer
steps the masters, and the model parameters are refreshed from them. On an accelerator
this bookkeeping runs on the host while the device works; when the host is the
bottleneck (many small parameters, small batches), it shows in the step time.

A dispatch-bound workload makes that cost visible: a stack of ``--layers`` tiny Linear
layers (16x16, 2 parameters each) on a 4x16 batch, AdamW (foreach), one thread. Three
configurations, timed side by side in one process, alternating round by round:

* ``bf16``: the model in bf16, no masters (the same kernels, no bookkeeping: the floor);
* ``native``: an fp32 model under ``torch.autocast`` (weights cast in every forward);
* ``O2``: ``ampkit.initialize(level="O2", dtype=torch.bfloat16)``.

Each configuration's step is timed in two parts, the backward pass (which ends with
O2's ``pull``) and ``optimizer.step()`` (the masters' step and the refresh); the
forward and ``zero_grad`` are not timed. Printed: median ms per part, and O2's host cost
over ``bf16`` per parameter.

Run: ``python benchmarks/o2_step_overhead.py [--layers 150] [--rounds 15]``
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

import ampkit
from ampkit.tools.cli_args import positive_int

CONFIGS = ("bf16", "native", "O2")


def make_step(config: str, layers: int) -> tuple[Callable[[], tuple[float, float]], int]:
    """A function running one training step and returning (backward s, step s), and the
    number of parameters."""
    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(*[nn.Linear(16, 16) for _ in range(layers)])
    x = torch.randn(4, 16)
    region: Callable[[], Any] = contextlib.nullcontext
    if config == "bf16":
        model = model.to(torch.bfloat16)
        x = x.to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    if config == "native":
        region = lambda: torch.autocast("cpu", torch.bfloat16)  # noqa: E731
    elif config == "O2":
        model, optimizer = ampkit.initialize(model, optimizer, level="O2",
                                             dtype=torch.bfloat16)

    def step() -> tuple[float, float]:
        with region():
            loss = model(x).float().square().mean()
        start = time.perf_counter()
        loss.backward()
        backward_done = time.perf_counter()
        optimizer.step()
        step_done = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        return backward_done - start, step_done - backward_done

    return step, len(list(model.parameters()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=positive_int, default=150)
    parser.add_argument("--rounds", type=positive_int, default=15)
    parser.add_argument("--steps", type=positive_int, default=10, help="steps per round")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    steps = {config: make_step(config, args.layers) for config in CONFIGS}
    n_params = steps["O2"][1]
    samples: dict[str, list[tuple[float, float]]] = {config: [] for config in CONFIGS}
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for config, (step, _) in steps.items():
            times = [step() for _ in range(args.steps)]
            if round_:
                samples[config].append((sum(t[0] for t in times) / args.steps,
                                        sum(t[1] for t in times) / args.steps))
    print(f"torch {torch.__version__}; {args.layers} Linear(16, 16) layers, "
          f"{n_params} parameters; AdamW (foreach); 1 thread; median of {args.rounds} "
          f"rounds of {args.steps} steps")
    print("| config | backward (ms) | optimizer.step (ms) | both (ms) |")
    print("|---|---|---|---|")
    medians: dict[str, tuple[float, float]] = {}
    for config, rows in samples.items():
        backward = statistics.median(r[0] for r in rows)
        step = statistics.median(r[1] for r in rows)
        medians[config] = (backward, step)
        print(f"| {config} | {backward * 1e3:.3f} | {step * 1e3:.3f} | "
              f"{(backward + step) * 1e3:.3f} |")
    (b_o2, s_o2), (b_low, s_low) = medians["O2"], medians["bf16"]
    print(f"O2 over bf16, per parameter: backward {(b_o2 - b_low) / n_params * 1e6:.1f} us, "
          f"step {(s_o2 - s_low) / n_params * 1e6:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
