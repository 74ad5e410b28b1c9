"""Dialect overhead: each dialect's mixed-precision training step vs native torch.autocast.

One training step (forward + backward) of a small CNN classifier (two conv blocks with
BatchNorm, a LayerNorm'd MLP head), on CPU in bfloat16, in two sizes:

* dispatch-bound: 8x8 images, batch 16: per-op Python/dispatcher overhead dominates;
* compute-bound: 32x32 images, 64 channels, batch 32: convolutions dominate.

Configurations, each on its own copy of the same fp32 model, measured in this one
process and interleaved round by round so machine noise hits them alike:

* ``native``: ``torch.autocast("cpu", torch.bfloat16)`` around the forward;
* ``ampkit.torch``: ``ampkit.torch.autocast("cpu", torch.bfloat16)``;
* ``apex O1``: ``ampkit.apex.initialize(model, opt_level="O1", dtype=torch.bfloat16)``;
* ``paddle O1``: ``ampkit.paddle.auto_cast(dtype="bfloat16")`` around the forward
  (Paddle's lists; every op not on them is promoted, so every op is intercepted);
* ``mxnet``: ``ampkit.mxnet.convert_hybrid_block(model, "bfloat16")`` (MXNet's lists);
* ``mindspore O1``: ``ampkit.mindspore.auto_mixed_precision(model, "O1", bfloat16)``.

The dialects other than torch/apex run different op tables (other ops in fp32), so part
of their difference is a different computation, not overhead.

Run: ``python benchmarks/dialect_overhead.py [--rounds 15] [--threads 2]``
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import platform
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from _interleaved import interleaved_medians, print_ratios

import ampkit.apex
import ampkit.mindspore
import ampkit.mxnet
import ampkit.paddle
import ampkit.torch

SIZES = {
    # name: (image side, channels, batch, steps per round)
    "dispatch-bound": (8, 8, 16, 40),
    "compute-bound": (32, 64, 32, 2),
}


def make_model(side: int, channels: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(),
        nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(),
        nn.MaxPool2d(2), nn.Flatten(),
        nn.Linear(channels * (side // 2) ** 2, 64), nn.LayerNorm(64), nn.ReLU(),
        nn.Linear(64, 10))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {platform.machine()}, {args.threads} threads, "
          f"{args.rounds} rounds; median ms per training step (forward + backward), bf16")
    for size, (side, channels, batch, steps) in SIZES.items():
        torch.manual_seed(0)
        base = make_model(side, channels)
        x = torch.rand(batch, 1, side, side)
        y = torch.randint(0, 10, (batch,))
        none = contextlib.nullcontext
        configs: dict[str, tuple[nn.Module, Callable[[], contextlib.AbstractContextManager]]]
        configs = {
            "native": (copy.deepcopy(base), lambda: torch.autocast("cpu", torch.bfloat16)),
            "ampkit.torch": (copy.deepcopy(base),
                             lambda: ampkit.torch.autocast("cpu", torch.bfloat16)),
            "apex O1": (ampkit.apex.initialize(copy.deepcopy(base), opt_level="O1",
                                               dtype=torch.bfloat16, verbosity=0), none),
            "paddle O1": (copy.deepcopy(base),
                          lambda: ampkit.paddle.auto_cast(dtype="bfloat16",
                                                          device_type="cpu")),
            "mxnet": (ampkit.mxnet.convert_hybrid_block(copy.deepcopy(base), "bfloat16"),
                      none),
            "mindspore O1": (ampkit.mindspore.auto_mixed_precision(
                copy.deepcopy(base), "O1", torch.bfloat16), none),
        }
        def run(model: nn.Module, region: Callable[[], contextlib.AbstractContextManager],
                x: torch.Tensor = x, y: torch.Tensor = y) -> None:
            with region():
                out = model(x)
            F.cross_entropy(out.float(), y).backward()
            model.zero_grad(set_to_none=True)

        runs = {name: functools.partial(run, *config) for name, config in configs.items()}
        medians = interleaved_medians(runs, rounds=args.rounds, steps=steps)
        print(f"\n{size} (image {side}x{side}, {channels} channels, batch {batch})")
        print_ratios(medians)

if __name__ == "__main__":
    main()
