"""Convergence of pure bf16 training (master_weights="stochastic"/"kahan") vs fp32.

Two measurements, each in one process, every mode from the same initial weights on the
same batches (see :mod:`ampkit.tools.demo.pure_curves`):

1. the demo's digits CNN (SGD, momentum 0.9, lr 0.05, batch 64, ``--epochs`` epochs):
   test accuracy, mean over ``--seeds`` seeds (seed = data split, init and batch order);
   target: pure modes within 0.5 points of fp32;
2. a tiny GPT-style character model on the dataset descriptions shipped with
   scikit-learn (``sklearn/datasets/descr/*.rst``): held-out loss after ``--steps`` AdamW
   steps at ``--lr``; target: within 2% of fp32, with round-to-nearest visibly worse.

"nearest" is pure bf16 with each update computed in fp32 and rounded to nearest: the
baseline that stalls when updates are below half a bf16 ulp.

Run: ``python benchmarks/pure_bf16.py [--seeds 5] [--epochs 5] [--steps 300]``
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

import torch

from ampkit.tools.demo.pure_curves import digits_accuracy, train_curves

MODES = ("fp32", "nearest", "stochastic", "kahan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--skip-digits", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"machine: {platform.machine()} CPU, {args.threads} thread(s); "
          f"torch {torch.__version__}")
    if not args.skip_digits:
        print(f"\ndigits CNN, {args.epochs} epochs, test accuracy over seeds "
              f"0..{args.seeds - 1}")
        print("| mode | mean accuracy | vs fp32 (points) | per seed |")
        print("|---|---|---|---|")
        fp32 = None
        for mode in MODES:
            accs = [digits_accuracy(mode, seed=s, epochs=args.epochs)
                    for s in range(args.seeds)]
            mean = statistics.fmean(accs)
            fp32 = mean if fp32 is None else fp32
            print(f"| {mode} | {100 * mean:.2f}% | {100 * (mean - fp32):+.2f} | "
                  f"{', '.join(f'{100 * a:.1f}' for a in accs)} |", flush=True)
    started = time.perf_counter()
    curves = train_curves(MODES, steps=args.steps, lr=args.lr, dim=48, heads=4, layers=2,
                          context=32, batch=16)
    print(f"\nchar GPT (d=48, 2 layers, context 32, batch 16), AdamW lr {args.lr}, "
          f"{args.steps} steps ({time.perf_counter() - started:.0f} s for all modes)")
    print("| mode | held-out loss | vs fp32 | mean train loss, last 10% |")
    print("|---|---|---|---|")
    ref = curves["fp32"].eval_loss
    for mode, curve in curves.items():
        tail = curve.losses[-max(1, len(curve.losses) // 10):]
        print(f"| {mode} | {curve.eval_loss:.4f} | {100 * (curve.eval_loss / ref - 1):+.2f}% "
              f"| {statistics.fmean(tail):.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
