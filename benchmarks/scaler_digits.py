"""fp16 training with and without loss scaling on scikit-learn's digits: accuracy.

A 64-64-10 MLP, SGD with momentum, batch 64, 20 epochs, 70/30 stratified split, under
``torch.autocast("cpu", torch.float16)``, several seeds. Four runs per seed:

* fp32 (no autocast, no scaling);
* fp16 with ``ampkit.GradScaler`` (dynamic, growth_interval=100);
* the "small gradients" case: loss x 2**-24 and learning rate x 2**24 (the same training
  in fp32, exactly), in fp16 without scaling and with the dynamic scaler.

Prints mean accuracy, the fraction of last-layer gradient entries that were exactly
zero, and the skipped steps. Run: ``python benchmarks/scaler_digits.py [--seeds 5]``
"""

from __future__ import annotations

import argparse
import statistics

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from ampkit import GradScaler

TINY = 2.0 ** -24


def load() -> tuple[torch.Tensor, ...]:
    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.3, random_state=0,
                                              stratify=y)
    return (torch.tensor(x_tr / 16, dtype=torch.float32), torch.tensor(y_tr),
            torch.tensor(x_te / 16, dtype=torch.float32), torch.tensor(y_te))


def train(data: tuple[torch.Tensor, ...], fp16: bool, scaler: GradScaler, seed: int,
          loss_factor: float = 1.0, epochs: int = 20) -> tuple[float, float, int]:
    x_tr, y_tr, x_te, y_te = data
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1 / loss_factor, momentum=0.9)
    order = torch.Generator().manual_seed(seed)
    zeros = total = 0
    for _ in range(epochs):
        perm = torch.randperm(len(x_tr), generator=order)
        for start in range(0, len(perm), 64):
            idx = perm[start:start + 64]
            opt.zero_grad()
            with torch.autocast("cpu", torch.float16, enabled=fp16):
                loss = torch.nn.functional.cross_entropy(model(x_tr[idx]), y_tr[idx])
            scaler.scale(loss * loss_factor).backward()
            scaler.unscale_(opt)
            grad = model[2].weight.grad
            assert grad is not None
            zeros += int((grad == 0).sum())
            total += grad.numel()
            scaler.step(opt)
            scaler.update()
    with torch.no_grad():
        accuracy = float((model(x_te).argmax(1) == y_te).float().mean()) * 100
    return accuracy, zeros / total, scaler.skipped_steps


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    data = load()
    runs = {
        "fp32": lambda s: train(data, False, GradScaler("cpu", enabled=False), s),
        "fp16 + dynamic scaling": lambda s: train(
            data, True, GradScaler("cpu", growth_interval=100), s),
        "fp32, loss x 2**-24": lambda s: train(
            data, False, GradScaler("cpu", enabled=False), s, TINY),
        "fp16, loss x 2**-24, no scaling": lambda s: train(
            data, True, GradScaler("cpu", enabled=False), s, TINY),
        "fp16, loss x 2**-24, dynamic scaling": lambda s: train(
            data, True, GradScaler("cpu", growth_interval=100), s, TINY),
    }
    print(f"torch {torch.__version__}, 1 thread, {args.seeds} seeds, 20 epochs")
    for name, run in runs.items():
        results = [run(seed) for seed in range(args.seeds)]
        acc = [r[0] for r in results]
        print(f"{name:38s} accuracy {statistics.mean(acc):6.2f}% "
              f"(min {min(acc):6.2f}, max {max(acc):6.2f}), zero grads "
              f"{statistics.mean(r[1] for r in results) * 100:5.1f}%, skipped steps "
              f"{sum(r[2] for r in results)}")


if __name__ == "__main__":
    main()
