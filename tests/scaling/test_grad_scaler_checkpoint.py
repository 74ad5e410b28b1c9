"""Checkpoint round trip: resuming mid-training reproduces the trajectory bit for bit."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch

from ampkit import GradScaler


def _losses(steps: int) -> list[float]:
    # a loss multiplier per step: 1.0, or inf/NaN to force an overflow
    gen = torch.Generator().manual_seed(7)
    out = []
    for r in torch.rand(steps, generator=gen).tolist():
        out.append(math.inf if r < 0.15 else math.nan if r < 0.25 else 1.0)
    return out


def _build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, scaler: GradScaler,
           factors: list[float]) -> list[tuple[float, bool, list[torch.Tensor]]]:
    x = torch.linspace(-1, 1, 12).reshape(3, 4)
    out = []
    for factor in factors:
        opt.zero_grad()
        loss = model(x).pow(2).mean() * factor
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        out.append((scaler.get_scale(), scaler.last_step_skipped,
                    [p.detach().clone() for p in model.parameters()]))
    return out


def _same(a: list, b: list) -> bool:
    return all(sa == sb and ka == kb and all(torch.equal(x, y) for x, y in zip(pa, pb))
               for (sa, ka, pa), (sb, kb, pb) in zip(a, b)) and len(a) == len(b)


@pytest.mark.parametrize("settings", [
    {},
    {"growth_interval": 3, "hysteresis": 2, "min_scale": 4.0, "max_scale": 2.0 ** 18},
    {"growth_interval": 2, "growth_factor": 1.5, "backoff_factor": 0.3},
])
def test_resume_reproduces_the_trajectory_bit_for_bit(settings: dict) -> None:
    factors = _losses(120)
    model, opt = _build()
    scaler = GradScaler("cpu", init_scale=2.0 ** 16, **settings)
    _train(model, opt, scaler, factors[:50])
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                "scaler": scaler.state_dict()}, buffer)
    uninterrupted = _train(model, opt, scaler, factors[50:])

    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    model2, opt2 = _build()
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    scaler2 = GradScaler("cpu")  # settings come back from the checkpoint
    scaler2.load_state_dict(saved["scaler"])
    resumed = _train(model2, opt2, scaler2, factors[50:])

    assert _same(uninterrupted, resumed)
    assert scaler2.state_dict() == scaler.state_dict()
    scales = [s for s, _, _ in uninterrupted]
    assert len(set(scales)) > 1 and any(k for _, k, _ in uninterrupted)


def test_loading_into_a_scaler_that_already_has_tensors() -> None:
    factors = _losses(40)
    model, opt = _build()
    scaler = GradScaler("cpu", growth_interval=3, hysteresis=2)
    _train(model, opt, scaler, factors[:20])
    state = copy.deepcopy(scaler.state_dict())
    model_state, opt_state = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    first = _train(model, opt, scaler, factors[20:])
    model.load_state_dict(model_state)
    opt.load_state_dict(opt_state)
    scaler.load_state_dict(state)  # rewinds the live scale and counters in place
    assert _same(first, _train(model, opt, scaler, factors[20:]))
