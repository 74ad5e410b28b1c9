"""apex-style scale_loss with one scaler per loss id (ampkit.scaling.loss_scaling)."""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator

import pytest
import torch

import ampkit
from ampkit.scaling import loss_scaling
from ampkit.scaling.loss_scaling import (
    configure_loss_scaling,
    load_loss_scaling_state_dict,
    loss_scaler,
    loss_scaling_state_dict,
    scale_loss,
)


@pytest.fixture(autouse=True)
def _fresh_configuration() -> Iterator[None]:
    configure_loss_scaling()
    yield
    configure_loss_scaling()


def _model_and_opt(lr: float = 0.5) -> tuple[torch.nn.Linear, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    return model, torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


X = torch.tensor([[1.0, 2.0, -1.0], [0.5, 0.25, 4.0]])


def test_top_level_names() -> None:
    assert ampkit.scale_loss is scale_loss
    assert ampkit.configure_loss_scaling is configure_loss_scaling


def test_yields_scaled_float_loss_and_unscales_on_exit() -> None:
    model, opt = _model_and_opt()
    reference, _ = _model_and_opt()
    reference(X).sum().backward()
    loss = model(X).sum().bfloat16()  # yielded as float32
    with scale_loss(loss, opt) as scaled:
        assert scaled.dtype is torch.float32
        assert scaled.item() == loss.float().item() * 2.0 ** 16
        scaled.backward()
        assert model.weight.grad is not None
        assert torch.equal(model.weight.grad, reference.weight.grad * 2.0 ** 16)  # type: ignore[operator]
    assert all(torch.equal(a, b) for a, b in zip(_grads(model), _grads(reference)))


def test_overflow_makes_the_next_step_a_no_op_and_lowers_the_scale() -> None:
    model, opt = _model_and_opt()
    with scale_loss(model(X).sum(), opt) as scaled:
        scaled.backward()
    opt.step()  # a real step creates momentum buffers
    before_params = [p.detach().clone() for p in model.parameters()]
    before_state = copy.deepcopy(opt.state_dict())
    opt.zero_grad()
    with scale_loss(model(X).sum() * math.inf, opt) as scaled:
        scaled.backward()
    assert opt.step() is None
    assert all(torch.equal(a, b) for a, b in zip(before_params, model.parameters()))
    after_state = opt.state_dict()
    assert all(torch.equal(before_state["state"][k]["momentum_buffer"],
                           after_state["state"][k]["momentum_buffer"])
               for k in before_state["state"])
    assert loss_scaler(0).get_scale() == 2.0 ** 15
    assert "step" not in opt.__dict__  # the one-shot skip is gone
    opt.zero_grad()
    with scale_loss(model(X).sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert not torch.equal(before_params[0], model.weight)


def test_two_losses_accumulate_unscaled_gradients_with_their_own_scales() -> None:
    configure_loss_scaling(num_losses=2, init_scale=2.0 ** 10)
    loss_scaler(1).load_state_dict({**loss_scaler(1).state_dict(), "scale": 8.0})
    model, opt = _model_and_opt()
    reference, _ = _model_and_opt()
    (reference(X).sum() + 3 * reference(X).pow(2).sum()).backward()
    with scale_loss(model(X).sum(), opt, loss_id=0) as scaled:
        scaled.backward()
    with scale_loss(3 * model(X).pow(2).sum(), opt, loss_id=1) as scaled:
        scaled.backward()
    for ours, theirs in zip(_grads(model), _grads(reference)):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_overflow_in_one_loss_skips_the_step_and_lowers_only_its_scale() -> None:
    configure_loss_scaling(num_losses=2)
    model, opt = _model_and_opt()
    before = [p.detach().clone() for p in model.parameters()]
    with scale_loss(model(X).sum() * math.inf, opt, loss_id=0) as scaled:
        scaled.backward()
    with scale_loss(model(X).sum(), opt, loss_id=1) as scaled:  # clean: skip stays armed
        scaled.backward()
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert (loss_scaler(0).get_scale(), loss_scaler(1).get_scale()) == (2.0 ** 15, 2.0 ** 16)
    assert (loss_scaler(0).skipped_steps, loss_scaler(1).skipped_steps) == (1, 0)


def test_several_optimizers_in_one_context() -> None:
    model_a, opt_a = _model_and_opt()
    model_b, opt_b = _model_and_opt()
    with scale_loss(model_a(X).sum() + model_b(X).sum(), [opt_a, opt_b]) as scaled:
        scaled.backward()
    reference, _ = _model_and_opt()
    reference(X).sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(_grads(model_b), _grads(reference)))
    with scale_loss((model_a(X).sum() + model_b(X).sum()) * math.nan, (opt_a, opt_b)) as s:
        s.backward()
    before = [p.detach().clone() for p in [*model_a.parameters(), *model_b.parameters()]]
    opt_a.step()
    opt_b.step()
    after = [*model_a.parameters(), *model_b.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


@pytest.mark.parametrize("num_losses", [1, 2])
def test_an_earlier_overflow_skips_only_the_optimizer_that_holds_it(num_losses: int) -> None:
    # apex's per-optimizer skip: the first block overflows in A's gradients only; the
    # second, clean block names A and B. A skips its step, B steps as usual.
    configure_loss_scaling(num_losses=num_losses)
    model_a, opt_a = _model_and_opt()
    model_b, opt_b = _model_and_opt()
    with scale_loss(model_a(X).sum() * math.inf, opt_a, loss_id=0) as scaled:
        scaled.backward()
    with scale_loss(model_a(X).sum() + model_b(X).sum(), [opt_a, opt_b],
                    loss_id=num_losses - 1) as scaled:
        scaled.backward()
    a_before = [p.detach().clone() for p in model_a.parameters()]
    b_before = [p.detach().clone() for p in model_b.parameters()]
    b_grads = _grads(model_b)
    opt_a.step()
    opt_b.step()
    assert all(torch.equal(x, y) for x, y in zip(a_before, model_a.parameters()))
    # SGD with momentum, first step: p - lr * grad
    assert all(torch.equal(p, before - 0.5 * g)
               for p, before, g in zip(model_b.parameters(), b_before, b_grads))
    assert loss_scaler(num_losses - 1).get_scale() == 2.0 ** (15 if num_losses == 1 else 16)


def test_delay_unscale_accumulates_and_refuses_a_step_on_scaled_grads() -> None:
    model, opt = _model_and_opt()
    reference, _ = _model_and_opt()
    batches = [X, X * 2, X * -0.5]
    for xb in batches:
        reference(xb).sum().backward()
    for i, xb in enumerate(batches):
        with scale_loss(model(xb).sum(), opt, delay_unscale=i < 2) as scaled:
            scaled.backward()
        if i < 2:
            with pytest.raises(RuntimeError, match="still scaled"):
                opt.step()
    assert all(torch.equal(a, b) for a, b in zip(_grads(model), _grads(reference)))
    before = model.weight.detach().clone()
    opt.step()
    assert not torch.equal(before, model.weight)


def test_delayed_overflow_is_caught_when_unscaling() -> None:
    model, opt = _model_and_opt()
    before = [p.detach().clone() for p in model.parameters()]
    with scale_loss(model(X).sum() * math.inf, opt, delay_unscale=True) as scaled:
        scaled.backward()
    with scale_loss(model(X).sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert loss_scaler(0).get_scale() == 2.0 ** 15


def test_earlier_overflow_survives_a_later_delayed_context() -> None:
    configure_loss_scaling(num_losses=2)
    model, opt = _model_and_opt()
    before = [p.detach().clone() for p in model.parameters()]
    with scale_loss(model(X).sum() * math.inf, opt, loss_id=0) as scaled:
        scaled.backward()
    for delay in (True, False):
        with scale_loss(model(X).sum(), opt, loss_id=1, delay_unscale=delay) as scaled:
            scaled.backward()
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_inf_left_over_from_a_skipped_iteration_never_reaches_the_weights() -> None:
    model, opt = _model_and_opt()
    before = [p.detach().clone() for p in model.parameters()]
    with scale_loss(model(X).sum() * math.inf, opt) as scaled:
        scaled.backward()
    opt.step()  # skipped
    # no zero_grad(): the inf gradients are put aside, then added back on exit
    with scale_loss(model(X).sum(), opt) as scaled:
        scaled.backward()
    opt.step()  # skipped too, though this loss itself was clean
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert loss_scaler(0).get_scale() == 2.0 ** 15  # lowered once, by the real overflow


def test_mixing_loss_ids_over_scaled_gradients_is_an_error() -> None:
    configure_loss_scaling(num_losses=2)
    model, opt = _model_and_opt()
    with scale_loss(model(X).sum(), opt, loss_id=0, delay_unscale=True) as scaled:
        scaled.backward()
    with pytest.raises(RuntimeError, match="loss_id=0"), scale_loss(model(X).sum(), opt,
                                                                   loss_id=1):
        pass


def test_an_exception_in_the_block_restores_the_gradients() -> None:
    model, opt = _model_and_opt()
    with scale_loss(model(X).sum(), opt) as scaled:
        scaled.backward()
    before = _grads(model)
    with pytest.raises(KeyError), scale_loss(model(X).sum(), opt) as scaled:
        scaled.backward()
        raise KeyError("boom")
    assert all(torch.equal(a, b) for a, b in zip(before, _grads(model)))
    with scale_loss(model(X).sum(), opt) as scaled:  # still usable afterwards
        scaled.backward()


def test_static_and_disabled_scaling() -> None:
    configure_loss_scaling(128.0)
    model, opt = _model_and_opt()
    before = [p.detach().clone() for p in model.parameters()]
    for factor in (math.inf, math.inf, math.inf):
        with scale_loss(model(X).sum() * factor, opt) as scaled:
            assert not math.isfinite(scaled.item())
            scaled.backward()
        opt.step()
    assert loss_scaler(0).get_scale() == 128.0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))

    configure_loss_scaling(None)
    loss = model(X).sum()
    with scale_loss(loss, opt) as scaled:
        assert scaled is loss
        scaled.backward()
    assert loss_scaler(0).is_enabled() is False


def test_scale_loss_before_configuration_uses_dynamic_defaults(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loss_scaling, "_state", None)
    model, opt = _model_and_opt()
    with scale_loss(model(X).sum(), opt) as scaled:
        scaled.backward()
    scaler = loss_scaler(0)
    assert scaler.get_scale() == 2.0 ** 16
    assert scaler.schedule.max_scale == 2.0 ** 24 and scaler.schedule.dynamic
    with pytest.raises(ValueError, match="num_losses"):
        loss_scaler(1)


@pytest.mark.parametrize(("kwargs", "error", "argument"), [
    ({"loss_scale": "auto"}, ValueError, "'dynamic'"),
    ({"loss_scale": -1.0}, ValueError, "loss_scale"),
    ({"loss_scale": True}, ValueError, "loss_scale"),
    ({"num_losses": 0}, ValueError, "num_losses"),
    ({"num_losses": 1.5}, TypeError, "num_losses"),
    ({"min_scale": 0.0}, ValueError, "min_scale"),
    ({"max_scale": 2.0 ** 10}, ValueError, "max_scale"),
    ({"hysteresis": 0}, ValueError, "hysteresis"),
])
def test_configure_bad_input(kwargs: dict, error: type, argument: str) -> None:
    configure_loss_scaling(num_losses=2)
    with pytest.raises(error, match=argument):
        configure_loss_scaling(**kwargs)
    assert loss_scaler(1).is_enabled()  # the earlier configuration is still in place


def test_scale_loss_bad_input() -> None:
    model, opt = _model_and_opt()
    with pytest.raises(TypeError, match="optimizers"), scale_loss(model(X).sum(), model):  # type: ignore[arg-type]
        pass
    with pytest.raises(ValueError, match="loss_id"), scale_loss(model(X).sum(), opt,
                                                               loss_id=3):
        pass
    with pytest.raises(TypeError, match="delay_unscale"), scale_loss(
            model(X).sum(), opt, delay_unscale=1):  # type: ignore[arg-type]
        pass


def test_state_dict_round_trip() -> None:
    configure_loss_scaling(num_losses=2, hysteresis=2)
    model, opt = _model_and_opt()
    for factor in (math.inf, math.inf, 1.0):
        with scale_loss(model(X).sum() * factor, opt, loss_id=1) as scaled:
            scaled.backward()
    saved = loss_scaling_state_dict()
    assert saved["loss_scaler1"]["scale"] == 2.0 ** 15
    configure_loss_scaling(num_losses=2, hysteresis=2)
    load_loss_scaling_state_dict(saved)
    assert loss_scaling_state_dict() == saved
    with pytest.raises(ValueError, match=r"missing keys \['loss_scaler1'\].*unknown keys "
                                         r"\['loss_scaler7'\]"):
        load_loss_scaling_state_dict({"loss_scaler0": saved["loss_scaler0"],
                                      "loss_scaler7": {}})


def test_skip_guard_restores_a_schedulers_step_wrapper() -> None:
    model, opt = _model_and_opt()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    own_step = opt.__dict__.get("step")
    with scale_loss(model(X).sum() * math.inf, opt) as scaled:
        scaled.backward()
    opt.step()
    assert opt.__dict__.get("step") is own_step
    opt.zero_grad()
    with scale_loss(model(X).sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    sched.step()
    assert sched.last_epoch == 1


def test_scale_loss_with_a_scaler_of_its_own_leaves_the_configured_ones_alone() -> None:
    configure_loss_scaling("dynamic", init_scale=1024.0)
    own = loss_scaling.build_loss_scaler("dynamic", init_scale=8.0)
    model, opt = _model_and_opt()
    loss = model(X).sum()
    with scale_loss(loss, opt, scaler=own) as scaled:
        assert scaled.item() == loss.item() * 8.0
        scaled.backward()
    opt.zero_grad()
    with scale_loss(model(X).sum() * math.inf, opt, scaler=own) as scaled:
        scaled.backward()
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()  # skipped
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert (own.get_scale(), loss_scaler(0).get_scale()) == (4.0, 1024.0)
    with (pytest.raises(TypeError, match="scaler must be None or an ampkit GradScaler"),
          scale_loss(model(X).sum(), opt, scaler=torch.amp.GradScaler("cpu"))):
        pass


# -- what it reads of GradScaler --------------------------------------

def test_loss_scaling_reads_only_public_members_of_grad_scaler():
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(loss_scaling))
    private = sorted({node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                      and isinstance(node.value, ast.Name)
                      and node.value.id in ("scaler", "GradScaler")
                      and node.attr.startswith("_")})
    assert private == []


def test_grad_scaler_found_inf_and_process_group_accessors():
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler = ampkit.GradScaler("cpu", init_scale=4.0)
    assert scaler.found_inf() is None and scaler.process_group is None
    scaler.scale(w.sum()).backward()
    scaler.unscale_(opt)
    found = scaler.found_inf()
    assert found is not None and found.item() == 0.0
    assert w.grad is not None and torch.equal(w.grad, torch.ones(2))
    scaler.step(opt)
    scaler.update()
    assert scaler.found_inf() is None  # the next iteration starts clean
    opt.zero_grad()
    scaler.scale(w.sum() * math.inf).backward()
    scaler.unscale_(opt)
    found = scaler.found_inf()
    assert found is not None and found.item() != 0.0
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0  # backed off: the overflow found_inf reported


def test_grad_scaler_skips_on_device_once_a_fused_optimizer_has_state():
    w = torch.nn.Parameter(torch.ones(2))
    plain = torch.optim.SGD([w], lr=0.1)
    fused = torch.optim.Adam([w], lr=0.1, fused=True)
    w.grad = torch.ones(2)
    assert not ampkit.GradScaler.skips_on_device(plain)
    assert not ampkit.GradScaler.skips_on_device(fused)  # no state yet: decided on host
    fused.step()
    assert ampkit.GradScaler.skips_on_device(fused)
    assert not ampkit.GradScaler.skips_on_device(plain)
