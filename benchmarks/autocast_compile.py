"""Compiled training step: ampkit.autocast vs native torch.autocast, both + torch.compile.

One training step (forward + backward) of a small residual MLP block stack, on CPU in
bfloat16, with the model wrapped in ``torch.compile`` and the autocast region entered
around the compiled call every step (the loop of issue 9), in two sizes:

* dispatch-bound: tiny tensors, so per-step guard and launch overhead dominates;
* compute-bound: larger tensors, so the matmuls dominate.

Configurations, measured in this one process, interleaved round by round:

* ``native``: ``torch.autocast("cpu", torch.bfloat16)`` + compile;
* ``ampkit``: ``ampkit.autocast("cpu", torch.bfloat16)`` (default policy) + compile;
* ``ampkit+5same``: five custom entries re-listing ops native already runs in bf16
  (linear, matmul, bmm, baddbmm, addmm): the same graph, so any difference is the cost
  of the region's entry/exit and of the compiled code's guards on the policy;
* ``ampkit+5new``: five entries that change what runs (white: add, mul; black:
  softmax, gelu, layer_norm): a different graph, reported for information.

It also prints how many graphs each configuration compiled over all its steps (one
per configuration is the point of issue 9: lists written inline are one policy).

Target (issue 9): ``ampkit+5same`` <= 1.02x native.

Run: ``python benchmarks/autocast_compile.py [--rounds 15] [--backend inductor]``
"""

from __future__ import annotations

import argparse
import contextlib
import platform
from collections.abc import Callable

import torch
import torch.nn as nn
from _interleaved import interleaved_medians, print_ratios
from torch._dynamo.testing import CompileCounterWithBackend

import ampkit

SIZES = {
    # name: (width, blocks, batch, steps per round)
    "dispatch-bound": (16, 3, 4, 40),
    "compute-bound": (256, 3, 64, 4),
}


class Block(nn.Module):
    """linear -> gelu -> layer_norm -> linear, residual, then a softmax gate."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.norm = nn.LayerNorm(2 * d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(self.norm(torch.nn.functional.gelu(self.up(x))))
        return x + h * h.softmax(-1)


def make_model(d: int, blocks: int) -> nn.Module:
    return nn.Sequential(*[Block(d) for _ in range(blocks)])


def regions() -> dict[str, Callable[[], contextlib.AbstractContextManager]]:
    # Lists written inline: new Python objects on every step, as a user writes them.
    return {
        "native": lambda: torch.autocast("cpu", torch.bfloat16),
        "ampkit": lambda: ampkit.autocast("cpu", torch.bfloat16),
        "ampkit+5same": lambda: ampkit.autocast(
            "cpu", torch.bfloat16,
            custom_white_list=["linear", "matmul", "bmm", "baddbmm", "addmm"]),
        "ampkit+5new": lambda: ampkit.autocast(
            "cpu", torch.bfloat16, custom_white_list=["add", "mul"],
            custom_black_list=["softmax", "gelu", "layer_norm"]),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--backend", default="inductor")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"machine: {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"backend {args.backend}")
    for size, (d, blocks, batch, steps) in SIZES.items():
        torch._dynamo.reset()
        runs: dict[str, Callable[[], None]] = {}
        counters: dict[str, CompileCounterWithBackend] = {}
        for name, region in regions().items():
            model = make_model(d, blocks)
            counters[name] = CompileCounterWithBackend(args.backend)
            compiled = torch.compile(model, backend=counters[name], fullgraph=True)
            x = torch.randn(batch, d)

            def run(compiled: Callable = compiled, model: nn.Module = model,
                    x: torch.Tensor = x, region: Callable = region) -> None:
                with region():
                    out = compiled(x)
                (out.float() * 0.5).mean().backward()
                model.zero_grad(set_to_none=True)

            runs[name] = run
        medians = interleaved_medians(runs, rounds=args.rounds, steps=steps)
        print(f"\n{size}: width={d} blocks={blocks} batch={batch}")
        print_ratios(medians)
        print("  graphs compiled: " + ", ".join(f"{n}={c.frame_count}"
                                               for n, c in counters.items()))


if __name__ == "__main__":
    main()
