"""Cast traffic of one training step: fp32, native autocast, ampkit O1, O2, O3.

Counts the dtype-changing copies (``_to_copy``, ``copy_``, ``_foreach_copy_`` between
different dtypes) of one training step (forward, backward, optimizer step, zero_grad)
below autograd, with :func:`ampkit.tools.ops.cast_traffic.count_casts`, on two small models:

* ``cnn``: a ResNet-style CNN with BatchNorm (the one of ``_training.py``, widths
  16-32-64, one basic block per stage, 10 classes) on 16 random 32x32 images;
* ``transformer``: the pre-norm GPT decoder of ``_training.py`` (d=128, 4 layers,
  4 heads, vocab 512, tied head) on 8 x 64 random tokens.

Modes: ``fp32``; ``native`` (``torch.autocast`` around the forward, and
``torch.amp.GradScaler`` for float16); ``O1``, ``O2``, ``O3`` (``ampkit.initialize``,
and ``ampkit.scale_loss`` where the level scales the loss). AdamW, one warm-up step
before the counted one. Casts are counted, not timed: the counts do not depend on the
machine, and the bytes they move are what a memory-bound accelerator pays for.

``--accumulate K`` splits the batch into K micro-batches, each with its own forward and
backward pass, before the one optimizer step (gradient accumulation; ``delay_unscale``
for every micro-batch but the last under ``ampkit.scale_loss``). Native autocast casts
every weight in each forward and its gradient in each backward; so does O2 (a copy
lives for one forward), casting each gradient into the fp32 ``.grad`` (autograd's
``ToCopyBackward``), where it accumulates in fp32.

``--reuse-casts`` runs each step's micro-batches (forwards and backward passes) in one
:func:`ampkit.conversion.parameter_casts.reuse_casts` block at O1-O3: at O2 each weight is then
cast once per optimizer step instead of once per micro-batch (the opt-in; by default a
copy lives for one forward).

``--by-op`` adds, per mode, the bytes by (source dtype -> destination dtype) and by op.

Run: ``python benchmarks/cast_traffic.py [--dtype bfloat16 float16] [--models cnn
transformer] [--accumulate K] [--by-op]``
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _training import GPT, GPTConfig, ResNet

import ampkit
from ampkit.conversion.parameter_casts import reuse_casts
from ampkit.tools.cli.args import positive_int
from ampkit.tools.ops.cast_traffic import CastTraffic, count_casts

MODES = ("fp32", "native", "O1", "O2", "O3")


def make_workload(name: str) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor],
                                      Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """``(model, (inputs, targets), loss)`` of a model name, seeded."""
    torch.manual_seed(0)
    if name == "cnn":
        model: nn.Module = ResNet(widths=(16, 32, 64), blocks=(1, 1, 1), classes=10)
        batch = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
        return model, batch, lambda out, y: F.cross_entropy(out.float(), y)
    model = GPT(GPTConfig(vocab=512, dim=128, heads=4, layers=4, max_len=64))
    ids = torch.randint(0, 512, (8, 65))

    def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    return model, (ids[:, :-1], ids[:, 1:]), lm_loss


def training_step(mode: str, model: nn.Module, dtype: torch.dtype,
                  accumulate: int = 1, reuse: bool = False) -> Callable[..., Any]:
    """A function ``step(inputs, targets, loss_fn)`` training ``model`` in ``mode``: one
    optimizer step over ``accumulate`` micro-batches (the batch split along dim 0);
    ``reuse``: the micro-batches in one ``reuse_casts`` block (ampkit modes)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    region: Callable[[], Any] = contextlib.nullcontext
    scaler = None
    scale_loss = False
    if mode == "native":
        region = lambda: torch.autocast("cpu", dtype)  # noqa: E731
        if dtype is torch.float16:
            scaler = torch.amp.GradScaler("cpu")
    elif mode != "fp32":
        model, optimizer = ampkit.initialize(model, optimizer, level=mode, dtype=dtype)
        scale_loss = dtype is torch.float16 and mode in ("O1", "O2")

    def step(inputs: torch.Tensor, targets: torch.Tensor,
             loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        micro_batches = list(zip(inputs.chunk(accumulate), targets.chunk(accumulate)))
        with reuse_casts() if reuse and mode not in ("fp32", "native") else (
                contextlib.nullcontext()):
            run_micro_batches(micro_batches, loss_fn)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def run_micro_batches(micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
                          loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
                          ) -> None:
        for i, (x, y) in enumerate(micro_batches):
            with region():
                out = model(x)
            loss = loss_fn(out, y) / len(micro_batches)
            if scaler is not None:
                scaler.scale(loss).backward()
            elif scale_loss:
                last = i == len(micro_batches) - 1
                with ampkit.scale_loss(loss, optimizer, delay_unscale=not last) as scaled:
                    scaled.backward()
            else:
                loss.backward()

    return step


def measure(name: str, mode: str, dtype: torch.dtype, accumulate: int = 1,
            reuse: bool = False) -> CastTraffic:
    """The cast traffic of one training step (after one warm-up step)."""
    model, (inputs, targets), loss_fn = make_workload(name)
    step = training_step(mode, copy.deepcopy(model), dtype, accumulate, reuse)
    step(inputs, targets, loss_fn)
    with count_casts() as traffic:
        step(inputs, targets, loss_fn)
    return traffic


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(
        dtype, str(dtype).removeprefix("torch."))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "float16"],
                        choices=["bfloat16", "float16"])
    parser.add_argument("--models", nargs="+", default=["cnn", "transformer"],
                        choices=["cnn", "transformer"])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--accumulate", type=positive_int, default=1,
                        help="micro-batches per optimizer step (default 1)")
    parser.add_argument("--reuse-casts", action="store_true",
                        help="the micro-batches of a step in one reuse_casts block")
    parser.add_argument("--by-op", action="store_true", help="break the bytes down")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}; one AdamW training step "
          f"({args.accumulate} micro-batch{'es' if args.accumulate > 1 else ''}"
          f"{' in one reuse_casts block' if args.reuse_casts else ''}) after one "
          f"warm-up step; bytes = read + written")
    for dtype_name in args.dtype:
        dtype = getattr(torch, dtype_name)
        for name in args.models:
            print(f"\n{name}, {dtype_name}")
            print("| mode | casts | MiB | vs native (bytes) |")
            print("|---|---|---|---|")
            results = {mode: measure(name, mode, dtype, args.accumulate, args.reuse_casts)
                       for mode in args.modes}
            native = results.get("native")
            for mode, traffic in results.items():
                ratio = (f"{traffic.bytes / native.bytes:.2f}x" if native and native.bytes
                         else "-")
                print(f"| {mode} | {traffic.casts} | {traffic.bytes / 2 ** 20:.3f} | "
                      f"{ratio} |", flush=True)
            if args.by_op:
                for mode, traffic in results.items():
                    parts = ", ".join(
                        f"{_dtype_name(s)}->{_dtype_name(d)} {n} ({b / 2 ** 20:.3f} MiB)"
                        for (s, d), (n, b) in traffic.by_dtypes().items())
                    ops = ", ".join(f"{op} {n}" for op, (n, _) in traffic.by_op().items())
                    print(f"  {mode}: {parts or 'none'}; ops: {ops or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
