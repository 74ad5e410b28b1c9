"""Every place a loss scale enters checks it: finite and > 0, a ValueError naming the
argument and the value, and nothing changed. Tensors are checked as numbers
are; the dialects' scalers go through the same check."""

from __future__ import annotations

import pytest
import torch

import ampkit.mindspore as ms
import ampkit.paddle as paddle
from ampkit.scaling import DynamicLossScale, GradScaler, StaticLossScale

NAN, INF = float("nan"), float("inf")
BAD = [NAN, INF, -1.0, 0.0]


@pytest.mark.parametrize("value", BAD)
def test_static_loss_scale_refuses_a_bad_tensor(value: float) -> None:
    with pytest.raises(ValueError, match=rf"loss_scale must be a positive finite number, "
                                         rf"got {value}"):
        StaticLossScale(torch.tensor(value))


@pytest.mark.parametrize("value", BAD)
def test_dynamic_loss_scale_refuses_a_bad_tensor(value: float) -> None:
    with pytest.raises(ValueError, match=rf"loss_scale must be a positive finite number, "
                                         rf"got {value}"):
        DynamicLossScale(torch.tensor(value))


def test_dynamic_loss_scale_tensor_is_held_to_the_bounds_as_a_number_is() -> None:
    with pytest.raises(ValueError, match=r"loss_scale \(16.0\) must be <= max_scale \(8.0\)"):
        DynamicLossScale(torch.tensor(16.0), max_scale=8.0)
    with pytest.raises(ValueError, match=r"loss_scale \(16.0\) must be <= max_scale \(8.0\)"):
        DynamicLossScale(16.0, max_scale=8.0)


@pytest.mark.parametrize("value", BAD)
def test_grad_scaler_update_new_scale_tensor_is_checked_and_changes_nothing(
        value: float) -> None:
    scaler = GradScaler("cpu", init_scale=8.0)
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler.scale(w.sum()).backward()
    scaler.step(opt)
    with pytest.raises(ValueError, match=rf"new_scale must be a positive finite number, "
                                         rf"got {value}"):
        scaler.update(new_scale=torch.tensor(value))  # (a float was checked already)
    assert scaler.get_scale() == 8.0
    scaler.update()  # the iteration is still open: it ends as it would have
    assert scaler.get_scale() == 8.0


@pytest.mark.parametrize("value", BAD)
def test_paddle_grad_scaler_goes_through_the_core_check(value: float) -> None:
    with pytest.raises(ValueError, match=r"init_loss_scaling must be a positive finite"):
        paddle.GradScaler(init_loss_scaling=value)
    scaler = paddle.GradScaler(init_loss_scaling=16.0)
    for new in (value, torch.tensor(value)):
        # The error names the argument given, not an internal state_dict key.
        with pytest.raises(ValueError, match=rf"new_init_loss_scaling must be a positive "
                                             rf"finite number, got {value}"):
            scaler.set_init_loss_scaling(new)
    assert scaler.get_init_loss_scaling() == 16.0
    assert scaler.state_dict()["scale"] == 16.0


@pytest.mark.parametrize("value", [NAN, INF, -1.0])
def test_mindspore_scalers_go_through_the_core_check(value: float) -> None:
    for make in (lambda v: ms.StaticLossScaler(v), lambda v: ms.DynamicLossScaler(v, 2, 10),
                 lambda v: ms.DynamicLossScaleManager(v),
                 lambda v: ms.FixedLossScaleManager(v)):
        with pytest.raises(ValueError, match="must be a positive finite number"):
            make(torch.tensor(value))
    with pytest.raises(ValueError, match="scale_value must be a finite number >= 1"):
        ms.StaticLossScaler(torch.tensor(0.5))  # MindSpore's own floor, after the core's


def test_apex_loss_scale_setter_names_its_argument() -> None:
    import ampkit.apex as amp
    from ampkit.scaling.loss_scaling import configure_loss_scaling

    amp.initialize(torch.nn.Linear(2, 2), opt_level="O2", verbosity=0)  # patches nothing
    try:
        view = amp._amp_state.loss_scalers[0]
        before = view.loss_scale()
        with pytest.raises(ValueError, match=r"_loss_scale must be a positive finite "
                                             r"number, got nan"):
            view._loss_scale = NAN
        assert view.loss_scale() == before
    finally:
        configure_loss_scaling("dynamic")  # the defaults again, for other tests
