"""Autocast engine overhead: ampkit.autocast vs native torch.autocast, side by side.

One training step (forward + backward) of a small transformer encoder, on CPU in
bfloat16, in two sizes:

* dispatch-bound: tiny tensors, so per-op Python/dispatcher overhead dominates;
* compute-bound: larger tensors, so the matmuls dominate.

Configurations, all measured in this one process, interleaved round by round so that
machine noise hits them alike:

* ``native``: ``torch.autocast("cpu", torch.bfloat16)``;
* ``ampkit``: ``ampkit.autocast("cpu", torch.bfloat16)`` (default policy = native);
* ``empty-mode``: native autocast plus a ``TorchFunctionMode`` that does nothing, for
  reference: the cost PyTorch charges for any Python interception by mode, before
  ampkit does any work;
* ``ampkit+5same``: five custom entries re-listing ops native already runs in bf16
  (linear, matmul, bmm, baddbmm, addmm): same computation, so this is the pure cost of
  intercepting;
* ``ampkit+5new``: five entries that change what runs (white: add, mul; black:
  softmax, gelu, layer_norm): interception plus a different computation (extra casts,
  fp32 kernels).

Listed ops are intercepted by ampkit's kernels on the Autocast dispatch key (issue 24).
Once registered they stay, and a listed op called under native autocast pays a Python
call to reach native's kernel; so every configuration that uses no ampkit kernels runs
with them released (``ampkit.engine.regions.release_kernels``), and the two that use
them register them again on the first step of each round, paying for it.

Targets (issue 2): default <= 1.03x native in both sizes; with five entries <= 1.25x
dispatch-bound and <= 1.05x compute-bound.

Run: ``python benchmarks/autocast_overhead.py [--rounds 15]``
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import platform
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
from _interleaved import interleaved_medians, print_ratios
from torch.overrides import TorchFunctionMode

import ampkit
from ampkit.engine.kernels import registered
from ampkit.engine.regions import release_kernels

# Five entries that change numerics: ops native autocast leaves alone on CPU.
FIVE_NEW: dict[str, Any] = {"custom_white_list": {"add", "mul"},
            "custom_black_list": {"softmax", "gelu", "layer_norm"}}
# Five entries that re-list ops native autocast already runs in bf16: the computation is
# identical, so the difference to native is the engine's interception cost alone.
FIVE_SAME: dict[str, Any] = {"custom_white_list": {"linear", "matmul", "bmm", "baddbmm", "addmm"}}

SIZES = {
    # name: (d_model, layers, seq, batch, steps per round)
    "dispatch-bound": (16, 2, 8, 2, 60),
    "compute-bound": (256, 2, 128, 8, 3),
}


def make_model(d: int, layers: int) -> nn.Module:
    layer = nn.TransformerEncoderLayer(d, 4 if d >= 64 else 2, 4 * d, dropout=0.0,
                                       activation="gelu", batch_first=True)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


class _EmptyMode(TorchFunctionMode):
    """A TorchFunctionMode that does nothing: the floor of any interception by mode."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _native_with_empty_mode() -> Iterator[None]:
    with torch.autocast("cpu", torch.bfloat16), _EmptyMode():
        yield


def _without_kernels(make: Callable[[], contextlib.AbstractContextManager]
                     ) -> Callable[[], contextlib.AbstractContextManager]:
    """Run with ampkit's Autocast kernels off the dispatcher (a listed op outside a
    kernel region would pay a Python call to defer to native): the configurations that
    use them register them again on their first step of each round, and pay for it."""
    def region() -> contextlib.AbstractContextManager:
        if registered():
            release_kernels()
        return make()
    return region


def step(model: nn.Module, x: torch.Tensor, region: Callable[[], contextlib.AbstractContextManager]
         ) -> None:
    with region():
        out = model(x)
        loss = (out.float() * 0.5).mean()
    loss.backward()
    model.zero_grad(set_to_none=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    def same() -> ampkit.autocast:
        return ampkit.autocast("cpu", torch.bfloat16, **FIVE_SAME)

    def new() -> ampkit.autocast:
        return ampkit.autocast("cpu", torch.bfloat16, **FIVE_NEW)

    regions: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
        "native": _without_kernels(lambda: torch.autocast("cpu", torch.bfloat16)),
        "empty-mode": _without_kernels(_native_with_empty_mode),
        "ampkit": _without_kernels(lambda: ampkit.autocast("cpu", torch.bfloat16)),
        "ampkit+5same": same,
        "ampkit+5new": new,
    }
    print(f"machine: {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    for size, (d, layers, seq, batch, steps) in SIZES.items():
        model = make_model(d, layers)
        x = torch.randn(batch, seq, d)
        runs = {name: functools.partial(step, model, x, region)
                for name, region in regions.items()}
        medians = interleaved_medians(runs, rounds=args.rounds, steps=steps)
        print(f"\n{size}: d_model={d} layers={layers} seq={seq} batch={batch}")
        print_ratios(medians)

if __name__ == "__main__":
    main()
