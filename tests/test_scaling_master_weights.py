"""Loss scaling over ampkit's fp32 master weights (the levels issue's contract)."""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import ampkit
from ampkit import GradScaler
from ampkit.master_weights import MasterWeightOptimizer, master_params
from ampkit.scaling.multi_loss import configure_loss_scaling, loss_scaler, scale_loss

X = torch.tensor([[0.5, -1.0, 2.0], [1.5, 0.25, -0.75]])


@pytest.fixture(autouse=True)
def _fresh_configuration() -> Iterator[None]:
    configure_loss_scaling()
    yield
    configure_loss_scaling()


def _half_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(),
                               torch.nn.Linear(4, 2)).half()


def _loss(model: torch.nn.Module, factor: float = 1.0) -> torch.Tensor:
    return model(X.half()).float().pow(2).sum() * factor


def _snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": [p.detach().clone() for p in model.parameters()],
            "masters": [p.detach().clone() for p in master_params(opt)],
            "state": copy.deepcopy(opt.state_dict()["state"])}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


@pytest.mark.parametrize("make_opt", [
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    lambda p: torch.optim.Adam(p, lr=0.1, fused=True),
])
def test_grad_scaler_unscales_master_grads_and_skips_cleanly(make_opt: Any) -> None:
    model, reference = _half_model(), _half_model()
    opt = MasterWeightOptimizer(make_opt(list(model.parameters())))
    scaler = GradScaler("cpu", init_scale=2.0 ** 8)
    for step, factor in enumerate((math.inf, 1.0, math.nan, 1.0)):
        opt.zero_grad()
        scaler.scale(_loss(model, factor)).backward()
        before = _snapshot(model, opt)
        if factor == 1.0 and step == 1:
            scaler.unscale_(opt)
            # unscaled fp32 master grads = the fp16 model's own unscaled grads
            reference.load_state_dict(model.state_dict())
            reference.zero_grad()
            _loss(reference).backward()
            for master, ref in zip(master_params(opt), reference.parameters()):
                assert master.grad is not None and master.grad.dtype is torch.float32
                assert ref.grad is not None
                assert torch.equal(master.grad, ref.grad.float())
        scaler.step(opt)
        scaler.update()
        after = _snapshot(model, opt)
        if math.isfinite(factor):
            assert not _same(before["masters"], after["masters"])
        else:
            assert _same(before, after), f"step {step} changed something though skipped"
    assert scaler.skipped_steps == 2
    assert all(p.dtype is torch.float16 for p in model.parameters())


def test_scale_loss_with_two_losses_over_master_weights() -> None:
    configure_loss_scaling(num_losses=2, init_scale=2.0 ** 6)
    model, reference = _half_model(), _half_model()
    opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with scale_loss(_loss(model), opt, loss_id=0) as scaled:
        scaled.backward()
    with scale_loss(_loss(model, 3.0), opt, loss_id=1) as scaled:
        scaled.backward()
    expected = []
    for factor in (1.0, 3.0):
        reference.zero_grad()
        _loss(reference, factor).backward()
        expected.append([p.grad.float() for p in reference.parameters()])  # type: ignore[union-attr]
    for master, g0, g1 in zip(master_params(opt), *expected):
        assert master.grad is not None
        torch.testing.assert_close(master.grad, g0 + g1, rtol=0, atol=0)

    before = _snapshot(model, opt)
    opt.zero_grad()
    with scale_loss(_loss(model, math.inf), opt, loss_id=1) as scaled:
        scaled.backward()
    opt.step()
    assert _same(before, _snapshot(model, opt))
    assert loss_scaler(1).get_scale() == 2.0 ** 5


def test_initialize_o2_fp16_configures_scale_loss() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4),
                                torch.nn.Linear(4, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = ampkit.initialize(model, opt, level="O2", dtype=torch.float16)
    assert model[0].weight.dtype is torch.float16 and model[1].weight.dtype is torch.float32
    scales, stepped = [], False
    for _ in range(12):  # the fp16 gradients overflow until the scale has backed off
        opt.zero_grad()
        with scale_loss(model(X).float().pow(2).sum(), opt) as scaled:
            scaled.backward()
        before = _snapshot(model, opt)
        opt.step()
        after = _snapshot(model, opt)
        scales.append(loss_scaler(0).get_scale())
        if not loss_scaler(0).last_step_skipped:
            assert not _same(before["model"], after["model"])
            stepped = True
            break
        assert _same(before, after)
    assert stepped and scales[0] == 2.0 ** 15
    assert loss_scaler(0).schedule.max_scale == 2.0 ** 24  # the apex default
