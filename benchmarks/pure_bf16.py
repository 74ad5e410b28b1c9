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

3. with ``--step-time``: the optimizer step side by side with torchao's
   ``_AdamW(bf16_stochastic_round=True)`` and fp32 AdamW, on MLPs of ``--sizes``
   parameters (42k to 10M), every configuration in this process, interleaved round by
   round; the median *thread CPU time* of one ``optimizer.step()`` (1 thread: the
   figure other jobs on a shared machine do not inflate), and of a whole training step
   (forward, backward, step). torchao compiles each parameter shape at its first step,
   ampkit's ``compile_step=True`` ("compiled") its few graphs: that happens in the
   warm-up, outside the timings, and its time is reported apart (inductor's on-disk
   cache makes a second run's warm-up shorter).
   ``--step-time-only`` skips the convergence runs.

``--compile-step``: the pure modes (stochastic, Kahan) of both convergence runs take the
compiled step (``compile_step=True``); fp32 and round-to-nearest run as without it.

Run: ``python benchmarks/pure_bf16.py [--seeds 5] [--epochs 5] [--steps 300]
[--skip-digits] [--skip-char-gpt] [--step-time [--step-time-only]
[--sizes 42k,600k,2.5M,10M] [--rounds 5]] [--compile-step]``
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import ampkit
from ampkit.tools.demo.pure_curves import digits_accuracy, train_curves

MODES = ("fp32", "nearest", "stochastic", "kahan")
STEP_CONFIGS = ("ampkit stochastic", "ampkit kahan", "ampkit stochastic compiled",
                "ampkit kahan compiled", "torchao SR AdamW", "fp32 AdamW")
# hidden width of a 3-layer MLP (64 -> h -> h -> 10) for each named size
SIZES = {"42k": 180, "600k": 740, "2.5M": 1550, "10M": 3140}


def cpu_description() -> str:
    """The CPU's model name and whether it has native bf16 arithmetic (AVX-512 BF16 or
    AMX), from ``/proc/cpuinfo`` where there is one (bf16 speed depends on it)."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return f"{platform.machine()} CPU"
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines()
                 if line.startswith("model name")), platform.machine())
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines()
                  if line.startswith("flags")), [])
    native = [f for f in ("avx512_bf16", "amx_bf16") if f in flags]
    vector = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    bf16 = f"native bf16 ({', '.join(native)})" if native else "no native bf16"
    return f"{name} ({vector}, {bf16})"


def _mlp(hidden: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.GELU(),
                               torch.nn.Linear(hidden, hidden), torch.nn.GELU(),
                               torch.nn.Linear(hidden, 10))


def _step_runs(config: str, hidden: int) -> tuple[Callable[[], None], Callable[[], None], float]:
    """``(optimizer step, whole training step, seconds of the warm-up)`` for ``config``
    on a fresh MLP; each call of the step first runs forward and backward (not timed
    in the first, timed in the second)."""
    model = _mlp(hidden)
    x = torch.randn(32, 64)
    y = torch.randint(0, 10, (32,))
    if config == "fp32 AdamW":
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    elif config == "torchao SR AdamW":
        from torchao.optim import _AdamW

        model = model.to(torch.bfloat16)
        opt = _AdamW(model.parameters(), lr=1e-3, bf16_stochastic_round=True)
    else:
        rounding = config.split()[1]
        model, opt = ampkit.initialize(
            model, torch.optim.AdamW(model.parameters(), lr=1e-3), level="O2",
            dtype=torch.bfloat16, master_weights=rounding, rounding_seed=0,
            compile_step=config.endswith("compiled"))
    dtype = next(model.parameters()).dtype

    def backward() -> None:
        F.cross_entropy(model(x.to(dtype)).float(), y).backward()

    def step() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    def timed_step() -> float:
        backward()
        start = time.thread_time()
        step()
        return time.thread_time() - start

    def timed_train() -> float:
        start = time.thread_time()
        backward()
        step()
        return time.thread_time() - start

    started = time.perf_counter()
    for _ in range(2):
        timed_train()
    return timed_step, timed_train, time.perf_counter() - started


def step_times(sizes: list[str], rounds: int, steps: int) -> None:
    """The step-time table: thread CPU time, medians over interleaved rounds."""
    print(f"\noptimizer step and training step, thread CPU time (1 thread), median of "
          f"{rounds} interleaved rounds x {steps} steps; MLP 64-h-h-10, batch 32")
    print("| parameters | config | optimizer step | vs torchao | training step | "
          "vs torchao | warm-up (2 steps) |")
    print("|---|---|---|---|---|---|---|")
    for size in sizes:
        hidden = SIZES[size]
        runs = {c: _step_runs(c, hidden) for c in STEP_CONFIGS}
        params = sum(p.numel() for p in _mlp(hidden).parameters())
        times: dict[str, tuple[list[float], list[float]]] = {c: ([], []) for c in runs}
        for _ in range(rounds):
            for config, (step, train, _) in runs.items():
                times[config][0].append(statistics.fmean(step() for _ in range(steps)))
                times[config][1].append(statistics.fmean(train() for _ in range(steps)))
        ref = [statistics.median(t) for t in times["torchao SR AdamW"]]
        for config, (step_s, train_s) in times.items():
            opt_ms, train_ms = statistics.median(step_s), statistics.median(train_s)
            print(f"| {params / 1e6:.3f}M | {config} | {opt_ms * 1e3:.2f} ms | "
                  f"{opt_ms / ref[0]:.2f}x | {train_ms * 1e3:.2f} ms | "
                  f"{train_ms / ref[1]:.2f}x | {runs[config][2]:.1f} s |", flush=True)


def _label(mode: str, compile_step: bool) -> str:
    """A table row's name: the pure modes say when their step was compiled."""
    return f"{mode}, compiled" if compile_step and mode in ("stochastic", "kahan") else mode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--skip-digits", action="store_true")
    parser.add_argument("--skip-char-gpt", action="store_true")
    parser.add_argument("--step-time", action="store_true")
    parser.add_argument("--compile-step", action="store_true",
                        help="digits and char GPT: the pure modes (stochastic, kahan) step "
                             "compiled (compile_step=True); fp32 and nearest as without it")
    parser.add_argument("--step-time-only", action="store_true")
    parser.add_argument("--sizes", default="42k,600k,2.5M,10M",
                        help=f"comma-separated, of {list(SIZES)}")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--round-steps", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"machine: {cpu_description()}, {args.threads} thread(s); "
          f"torch {torch.__version__}; load average {os.getloadavg()[0]:.1f}")
    if args.step_time or args.step_time_only:
        sizes = args.sizes.split(",")
        unknown = [s for s in sizes if s not in SIZES]
        if unknown:
            parser.error(f"--sizes: unknown {unknown}; accepted: {list(SIZES)}")
        step_times(sizes, args.rounds, args.round_steps)
        if args.step_time_only:
            return 0
    if not args.skip_digits:
        print(f"\ndigits CNN, {args.epochs} epochs, test accuracy over seeds "
              f"0..{args.seeds - 1}" + (", pure step compiled" if args.compile_step else ""))
        print("| mode | mean accuracy | vs fp32 (points) | per seed |")
        print("|---|---|---|---|")
        fp32 = None
        for mode in MODES:
            label = _label(mode, args.compile_step)
            accs = [digits_accuracy(mode, seed=s, epochs=args.epochs,
                                    compile_step=args.compile_step)
                    for s in range(args.seeds)]
            mean = statistics.fmean(accs)
            fp32 = mean if fp32 is None else fp32
            print(f"| {label} | {100 * mean:.2f}% | {100 * (mean - fp32):+.2f} | "
                  f"{', '.join(f'{100 * a:.1f}' for a in accs)} |", flush=True)
    if args.skip_char_gpt:
        return 0
    started = time.perf_counter()
    curves = train_curves(MODES, steps=args.steps, lr=args.lr, dim=48, heads=4, layers=2,
                          context=32, batch=16, compile_step=args.compile_step)
    print(f"\nchar GPT (d=48, 2 layers, context 32, batch 16), AdamW lr {args.lr}, "
          f"{args.steps} steps ({time.perf_counter() - started:.0f} s for all modes"
          + (", the compiled step's first-step compilation included)" if args.compile_step
             else ")"))
    print("| mode | held-out loss | vs fp32 | mean train loss, last 10% |")
    print("|---|---|---|---|")
    ref = curves["fp32"].eval_loss
    for mode, curve in curves.items():
        tail = curve.losses[-max(1, len(curve.losses) // 10):]
        print(f"| {_label(mode, args.compile_step)} | {curve.eval_loss:.4f} | "
              f"{100 * (curve.eval_loss / ref - 1):+.2f}% "
              f"| {statistics.fmean(tail):.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
