"""fp16 training on scikit-learn's digits: dynamic loss scaling keeps fp32 accuracy, and
prevents the gradient underflow that stops training without it.

A small MLP under ``torch.autocast("cpu", torch.float16)``. The underflow case multiplies
the loss by 2**-24 and the learning rate by 2**24: in fp32 that changes nothing (powers of
two), in fp16 the gradients flowing back through the half-precision logits flush to
zero unless the loss is scaled.
"""

from __future__ import annotations

import dataclasses
from functools import cache

import pytest
import torch

from ampkit import GradScaler

SEEDS = (0, 1, 2)
TINY = 2.0 ** -24


@dataclasses.dataclass
class Run:
    accuracy: float  # percent, on the held-out split
    zero_grad_fraction: float  # of last-layer gradient entries, over all steps
    final_scale: float


@cache
def _data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    datasets = pytest.importorskip("sklearn.datasets")
    model_selection = pytest.importorskip("sklearn.model_selection")
    x, y = datasets.load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = model_selection.train_test_split(
        x, y, test_size=0.3, random_state=0, stratify=y)
    return (torch.tensor(x_tr / 16, dtype=torch.float32), torch.tensor(y_tr),
            torch.tensor(x_te / 16, dtype=torch.float32), torch.tensor(y_te))


def _train(fp16: bool, scaler: GradScaler, *, loss_factor: float = 1.0, seed: int = 0,
           epochs: int = 20) -> Run:
    x_tr, y_tr, x_te, y_te = _data()
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
    return Run(accuracy, zeros / total, scaler.get_scale())


def _mean_accuracy(runs: list[Run]) -> float:
    return sum(r.accuracy for r in runs) / len(runs)


def test_fp16_with_dynamic_scaling_matches_fp32_accuracy() -> None:
    fp32 = [_train(False, GradScaler("cpu", enabled=False), seed=s) for s in SEEDS]
    fp16 = [_train(True, GradScaler("cpu", growth_interval=100), seed=s) for s in SEEDS]
    assert _mean_accuracy(fp32) > 93.0  # the baseline learned
    assert _mean_accuracy(fp16) >= _mean_accuracy(fp32) - 1.0
    assert all(r.final_scale > 2.0 ** 16 for r in fp16)  # the scale grew on clean steps


def test_scaling_prevents_fp16_gradient_underflow() -> None:
    fp32 = [_train(False, GradScaler("cpu", enabled=False), loss_factor=TINY, seed=s)
            for s in SEEDS]
    unscaled = [_train(True, GradScaler("cpu", enabled=False), loss_factor=TINY, seed=s)
                for s in SEEDS]
    scaled = [_train(True, GradScaler("cpu", growth_interval=100), loss_factor=TINY, seed=s)
              for s in SEEDS]
    # fp32 does not care about the tiny magnitude ...
    assert _mean_accuracy(fp32) > 93.0
    # ... fp16 without scaling loses every gradient and stays at chance ...
    assert all(r.zero_grad_fraction > 0.99 for r in unscaled)
    assert _mean_accuracy(unscaled) < 20.0
    # ... and with dynamic scaling it trains like fp32.
    assert all(r.zero_grad_fraction < 0.5 for r in scaled)
    assert _mean_accuracy(scaled) >= _mean_accuracy(fp32) - 1.0
