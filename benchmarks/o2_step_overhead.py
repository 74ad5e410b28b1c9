"""What O2 costs the host per training step, per parameter.

At O2 the fp32 parameters are the truth (issue 21): the user's optimizer steps them
as it would an fp32 model's, and each module computes with low-precision copies of its
weights, made in the forward (a pre-hook swaps them in, a post-hook puts the fp32
parameters back) and kept for that forward (issue 34). So O2's host cost is
in the forward (the hooks and the model's boundary), and autograd's ``ToCopyBackward``
in the backward; the step is an fp32 model's. (Before issue 21, O2 kept fp32 master
copies: a gradient hook per parameter, a pull after the backward pass, a refresh after
the step.) On an accelerator this runs on the host while the device works; when the
host is the bottleneck (many small parameters, small batches), it shows.

A dispatch-bound workload makes that cost visible: a stack of ``--layers`` tiny Linear
layers (16x16, 2 parameters each) on a 4x16 batch, AdamW (foreach), one thread. Three
configurations, timed side by side in one process, alternating round by round:

* ``bf16``: the model in bf16 (the same kernels, no casts and no bookkeeping: the floor);
* ``native``: an fp32 model under ``torch.autocast`` (weights cast in every forward);
* ``O2``: ``ampkit.initialize(level="O2", dtype=torch.bfloat16)``;
* ``py-cast``: the floor of any cast-on-use design written in Python, for comparison:
  each layer's forward casts its fp32 weight and bias with ``Tensor.bfloat16`` and
  calls ``F.linear`` (no cache, no parameter swap, no checks), under ``torch.autocast``
  as ``native``. What O2 costs above it is its bookkeeping (the one-forward
  cache, the swap, the checks that pick the fast call); what it costs above
  ``native`` is the casts made from Python instead of inside autocast's C++ kernel.

Each configuration's step is timed in three parts: the forward (with the loss), the
backward pass and ``optimizer.step()``; ``zero_grad`` is not timed. Printed: median ms
per part, O2's host cost over ``bf16`` per parameter, and O2's and ``py-cast``'s whole
step over ``native``'s.

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
import torch.nn.functional as F

import ampkit
from ampkit.tools.cli.args import positive_int

CONFIGS = ("bf16", "native", "O2", "py-cast")


class _CastInForward(nn.Linear):
    """``py-cast``'s layer: an fp32 Linear whose forward casts its parameters itself."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.linear(input, self.weight.bfloat16(), self.bias.bfloat16())


def make_step(config: str, layers: int
              ) -> tuple[Callable[[], tuple[float, float, float]], int]:
    """A function running one training step and returning (forward s, backward s,
    step s), and the number of parameters."""
    torch.manual_seed(0)
    layer = _CastInForward if config == "py-cast" else nn.Linear
    model: nn.Module = nn.Sequential(*[layer(16, 16) for _ in range(layers)])
    x = torch.randn(4, 16)
    region: Callable[[], Any] = contextlib.nullcontext
    if config == "bf16":
        model = model.to(torch.bfloat16)
        x = x.to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    if config in ("native", "py-cast"):
        region = lambda: torch.autocast("cpu", torch.bfloat16)  # noqa: E731
    elif config == "O2":
        model, optimizer = ampkit.initialize(model, optimizer, level="O2",
                                             dtype=torch.bfloat16)

    def step() -> tuple[float, float, float]:
        begin = time.perf_counter()
        with region():
            loss = model(x).float().square().mean()
        start = time.perf_counter()
        loss.backward()
        backward_done = time.perf_counter()
        optimizer.step()
        step_done = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        return start - begin, backward_done - start, step_done - backward_done

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
    samples: dict[str, list[tuple[float, ...]]] = {config: [] for config in CONFIGS}
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for config, (step, _) in steps.items():
            times = [step() for _ in range(args.steps)]
            if round_:
                samples[config].append(tuple(sum(t[i] for t in times) / args.steps
                                             for i in range(3)))
    print(f"torch {torch.__version__}; {args.layers} Linear(16, 16) layers, "
          f"{n_params} parameters; AdamW (foreach); 1 thread; median of {args.rounds} "
          f"rounds of {args.steps} steps")
    print("| config | forward (ms) | backward (ms) | optimizer.step (ms) | all (ms) |")
    print("|---|---|---|---|---|")
    medians: dict[str, tuple[float, ...]] = {}
    for config, rows in samples.items():
        parts = tuple(statistics.median(r[i] for r in rows) for i in range(3))
        medians[config] = parts
        print("| " + " | ".join([config, *(f"{p * 1e3:.3f}" for p in parts),
                                 f"{sum(parts) * 1e3:.3f}"]) + " |")
    over = [(o - b) / n_params * 1e6 for o, b in zip(medians["O2"], medians["bf16"])]
    print(f"O2 over bf16, per parameter: forward {over[0]:.1f} us, backward {over[1]:.1f} "
          f"us, step {over[2]:.1f} us")
    total = {config: sum(parts) for config, parts in medians.items()}
    print(f"all over native: O2 {total['O2'] / total['native']:.3f}x, py-cast "
          f"{total['py-cast'] / total['native']:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
