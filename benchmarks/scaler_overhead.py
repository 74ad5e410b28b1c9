"""Loss-scaler overhead: ampkit.GradScaler vs torch.amp.GradScaler, side by side.

Two measurements, each a median over interleaved rounds in this one process:

* ``scaler ops``: only ``scale(loss)`` + ``step(optimizer)`` + ``update()`` per
  iteration, gradients written directly (no forward/backward), 20 parameter tensors:
  the scaler's own cost, magnified;
* ``train step``: a whole fp32 training step of a small MLP (forward, backward, scaler),
  what a user pays.

Configurations: torch vs ampkit (default settings, so the same rule as torch), ampkit
with hysteresis=2 and max_scale=2**24 (the tensor-op rule instead of torch's fused
update kernel), and each with a plain optimizer (SGD with momentum: one host sync per
step) and a fused one (Adam fused=True: grad_scale/found_inf, no host sync).

Run: ``python benchmarks/scaler_overhead.py [--rounds 15]``
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable

import torch

from ampkit import GradScaler

N_PARAMS = 20


def make_scaler(kind: str) -> object:
    if kind == "torch":
        return torch.amp.GradScaler("cpu")
    if kind == "ampkit":
        return GradScaler("cpu")
    if kind == "ampkit+hyst":
        return GradScaler("cpu", hysteresis=2, max_scale=2.0 ** 24)
    raise ValueError(kind)


def make_optimizer(params: list[torch.nn.Parameter], fused: bool) -> torch.optim.Optimizer:
    if fused:
        return torch.optim.Adam(params, lr=1e-3, fused=True)
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9)


def scaler_ops_case(kind: str, fused: bool, iters: int) -> Callable[[], float]:
    params = [torch.nn.Parameter(torch.randn(64)) for _ in range(N_PARAMS)]
    grads = [torch.randn(64) for _ in params]
    opt = make_optimizer(params, fused)
    scaler = make_scaler(kind)
    loss = torch.ones(())

    def run() -> float:
        start = time.perf_counter()
        for _ in range(iters):
            scaled = scaler.scale(loss)  # type: ignore[attr-defined]
            for p, g in zip(params, grads):
                p.grad = g * scaled  # stands in for backward
            scaler.step(opt)  # type: ignore[attr-defined]
            scaler.update()  # type: ignore[attr-defined]
        return (time.perf_counter() - start) / iters

    return run


def train_step_case(kind: str, fused: bool, iters: int) -> Callable[[], float]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10))
    opt = make_optimizer(list(model.parameters()), fused)
    scaler = make_scaler(kind)
    x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))

    def run() -> float:
        start = time.perf_counter()
        for _ in range(iters):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            scaler.scale(loss).backward()  # type: ignore[attr-defined]
            scaler.step(opt)  # type: ignore[attr-defined]
            scaler.update()  # type: ignore[attr-defined]
        return (time.perf_counter() - start) / iters

    return run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    kinds = ("torch", "ampkit", "ampkit+hyst")
    print(f"machine: {platform.machine()}, {platform.processor() or 'cpu'}, torch "
          f"{torch.__version__}, {args.threads} thread(s), {args.rounds} rounds, median")
    for label, factory, iters in (("scaler ops", scaler_ops_case, 200),
                                  ("train step", train_step_case, 40)):
        for fused in (False, True):
            cases = {k: factory(k, fused, iters) for k in kinds}
            for run in cases.values():  # warm-up (the first steps create state)
                run()
            times: dict[str, list[float]] = {k: [] for k in kinds}
            for _ in range(args.rounds):
                for k, run in cases.items():
                    times[k].append(run())
            base = statistics.median(times["torch"])
            optimizer = "Adam fused" if fused else "SGD momentum"
            cells = ", ".join(f"{k} {statistics.median(v) * 1e6:8.1f} us "
                              f"({statistics.median(v) / base:.3f}x)"
                              for k, v in times.items())
            print(f"{label:10s} | {optimizer:12s} | {cells}")


if __name__ == "__main__":
    main()
