"""The gradient life cycle with fp32 master weights is plain PyTorch's (issue 15).

Oracle: an fp32 model driven by the same loop. At O2 the forward runs in low precision,
so trajectories agree within the level's rounding, far tighter than the errors these
tests guard against (gradients counted twice, clipping that does nothing).
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

import ampkit
from ampkit.master_weights import master_params

BF16, FP16 = torch.bfloat16, torch.float16
ZERO_GRAD = ("model.zero_grad", "optimizer.zero_grad", "optimizer.zero_grad(False)",
             "p.grad = None")
CLIP = ("none", "model.parameters()", "optimizer params", "clip_master_grad_norm_")
MAX_NORM = 0.25


@pytest.fixture(autouse=True)
def _reset_loss_scaling():
    yield
    from ampkit.scaling.multi_loss import configure_loss_scaling

    configure_loss_scaling(None)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.LayerNorm(16), nn.Linear(16, 1))


def _data(steps: int, micro: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(1)
    return [[(torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g))
             for _ in range(micro)] for _ in range(steps)]


def _zero(kind: str, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    if kind == "model.zero_grad":
        model.zero_grad()
    elif kind == "optimizer.zero_grad":
        opt.zero_grad()
    elif kind == "optimizer.zero_grad(False)":
        opt.zero_grad(set_to_none=False)
    else:
        for p in model.parameters():
            p.grad = None


def _clip(kind: str, model: nn.Module, opt: torch.optim.Optimizer) -> torch.Tensor | None:
    if kind == "model.parameters()":
        return torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    if kind == "optimizer params":
        return torch.nn.utils.clip_grad_norm_(
            [p for g in opt.param_groups for p in g["params"]], MAX_NORM)
    if kind == "clip_master_grad_norm_":
        return ampkit.clip_master_grad_norm_(opt, MAX_NORM)
    return None


def _train(model: nn.Module, opt: torch.optim.Optimizer, batches, zero: str, clip: str,
           scaler=None) -> tuple[list[float], list[float]]:
    """The loop trainers write; returns the losses and the clipped total norms."""
    losses, norms = [], []
    for micro in batches:
        for x, y in micro:
            loss = nn.functional.mse_loss(model(x).float(), y) / len(micro)
            losses.append(loss.item())
            (scaler.scale(loss) if scaler else loss).backward()
        if scaler is not None and clip != "none":
            scaler.unscale_(opt)
        norm = _clip(clip, model, opt)
        if norm is not None:
            norms.append(float(norm))
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        _zero(zero, model, opt)
    return losses, norms


def _fp32_reference(batches, clip: str) -> tuple[nn.Module, list[float], list[float]]:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    ref_clip = "model.parameters()" if clip != "none" else "none"
    losses, norms = _train(model, opt, batches, "optimizer.zero_grad", ref_clip)
    return model, losses, norms


def _assert_close_to_fp32(model: nn.Module, reference: nn.Module, start: nn.Module,
                          rel: float) -> None:
    """Every weight (the masters, as O2's state_dict reports them) is within ``rel`` of
    how far the fp32 run moved it."""
    got, want, init = model.state_dict(), reference.state_dict(), start.state_dict()
    for key, value in want.items():
        moved = (value - init[key]).abs().max().item()
        error = (got[key].float() - value).abs().max().item()
        assert error <= rel * moved + 1e-4, (key, error, moved)


@pytest.mark.parametrize("clip", CLIP)
@pytest.mark.parametrize("zero", ZERO_GRAD)
@pytest.mark.parametrize("micro", [1, 3])
def test_o2_bf16_loop_trains_like_fp32(zero, clip, micro):
    batches = _data(steps=6, micro=micro)
    reference, ref_losses, ref_norms = _fp32_reference(batches, clip)
    start = _net()
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    model, opt = ampkit.initialize(model, opt, level="O2", dtype=BF16)
    losses, norms = _train(model, opt, batches, zero, clip)
    if clip != "none":
        assert all(n > MAX_NORM for n in ref_norms)  # clipping is active in the reference
        assert norms == pytest.approx(ref_norms, rel=0.03)
    assert losses == pytest.approx(ref_losses, rel=0.03, abs=1e-3)
    _assert_close_to_fp32(model, reference, start, rel=0.05)


@pytest.mark.parametrize("clip", ["none", "model.parameters()", "optimizer params"])
@pytest.mark.parametrize("zero", ["model.zero_grad", "optimizer.zero_grad"])
@pytest.mark.parametrize("micro", [1, 3])
def test_o2_fp16_loop_with_a_grad_scaler_trains_like_fp32(zero, clip, micro):
    batches = _data(steps=6, micro=micro)
    reference, ref_losses, ref_norms = _fp32_reference(batches, clip)
    start = _net()
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    model, opt = ampkit.initialize(model, opt, level="O2", dtype=FP16)
    scaler = ampkit.GradScaler("cpu", init_scale=2.0 ** 12)
    losses, norms = _train(model, opt, batches, zero, clip, scaler)
    assert scaler.skipped_steps == 0
    if clip != "none":
        assert norms == pytest.approx(ref_norms, rel=0.01)
    assert losses == pytest.approx(ref_losses, rel=0.01, abs=1e-4)
    _assert_close_to_fp32(model, reference, start, rel=0.01)


def test_the_issue_script_sees_one_steps_gradient_each_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 1))
    fp32 = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt = ampkit.initialize(model, opt, level="O2", dtype=BF16)
    master = opt.param_groups[0]["params"][0]
    x = torch.randn(8, 4)
    fp32(x).sum().backward()
    expected = fp32[0].weight.grad.norm().item()
    norms = []
    for _ in range(3):
        model(x).sum().backward()
        opt.step()
        model.zero_grad()
        norms.append(master.grad.norm().item())
    assert norms[0] == norms[1] == norms[2]
    assert norms[0] == pytest.approx(expected, rel=0.02)


def test_gradients_read_between_backward_and_step_are_there_on_both_sides():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ampkit.initialize(model, opt, level="O2", dtype=BF16)
    x, y = _data(1, 1)[0][0]
    nn.functional.mse_loss(model(x).float(), y).backward()
    model_grads = [p.grad for p in model.parameters()]
    opt_grads = [p.grad for g in opt.param_groups for p in g["params"]]
    assert all(g is not None and torch.isfinite(g).all() for g in model_grads + opt_grads)
    for p, m in zip(model.parameters(), master_params(opt)):
        assert torch.equal(p.grad.float(), m.grad)


def test_editing_one_gradient_on_both_sides_is_an_error():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ampkit.initialize(model, opt, level="O2", dtype=BF16)
    model(torch.randn(2, 6)).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    model[0].weight.grad.mul_(0.5)
    opt.param_groups[0]["params"][0].grad.mul_(0.5)
    with pytest.raises(RuntimeError, match="in place both on the model and on its fp32"):
        opt.step()
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))


# -- property: random orders of the public calls ---------------------------------------

_CALLS = ("backward", "zero model", "zero optimizer", "zero optimizer keep", "grad None",
          "clip model", "clip optimizer", "step", "state_dict round trip", "deepcopy")


class _Run:
    """One model and optimizer (and scaler) driven call by call."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer, scaler) -> None:
        self.model, self.opt, self.scaler = model, opt, scaler
        self.unscaled = False

    def call(self, name: str, x: torch.Tensor) -> None:
        model, opt = self.model, self.opt
        if name == "backward":
            self.scaler.scale(model(x).float().pow(2).mean()).backward()
        elif name == "zero model":
            model.zero_grad()
        elif name == "zero optimizer":
            opt.zero_grad()
        elif name == "zero optimizer keep":
            opt.zero_grad(set_to_none=False)
        elif name == "grad None":
            for p in model.parameters():
                p.grad = None
        elif name in ("clip model", "clip optimizer"):
            if not self.unscaled:
                self.scaler.unscale_(opt)
                self.unscaled = True
            params = (list(model.parameters()) if name == "clip model"
                      else [p for g in opt.param_groups for p in g["params"]])
            torch.nn.utils.clip_grad_norm_(params, 0.1)
        elif name == "step":
            self.scaler.step(opt)
            self.scaler.update()
            self.unscaled = False
        elif name == "state_dict round trip":
            model.load_state_dict(model.state_dict())
            opt.load_state_dict(opt.state_dict())
        elif name == "deepcopy":
            self.model, self.opt = copy.deepcopy((model, opt))
            self.scaler = copy.deepcopy(self.scaler)


class _BothSidesEdited:
    """What the O2 run must refuse: a gradient edited in place on the model and on its
    master before the two next agree (backward, step, unscale_, optimizer.zero_grad)."""

    def __init__(self) -> None:
        self.model = self.master = False

    def before(self, name: str, has_grads: bool, unscales: bool) -> bool:
        """Whether ``name`` must raise; updates the bookkeeping for the call."""
        if name in ("backward", "step") or unscales:
            # A backward pass accumulates into existing model gradients in place.
            model_edited = self.model or (name == "backward" and has_grads)
            refused = model_edited and self.master
            self.model = self.master = False
            if refused or not unscales:
                return refused
        if name in ("zero model", "grad None", "zero optimizer", "zero optimizer keep",
                    "deepcopy"):
            self.model = self.master = False
        elif name == "clip model":
            self.model = has_grads
        elif name == "clip optimizer":
            self.master = has_grads
        return False


@settings(max_examples=30, deadline=None)
@given(st.lists(st.sampled_from(_CALLS), min_size=1, max_size=14))
def test_any_order_of_public_calls_matches_fp32(calls):
    """The same sequence on an fp32 model with torch's GradScaler and on an O2 fp16
    model with ampkit's: the weights (O2's masters) agree within fp16 rounding, or, when
    the sequence edited one gradient in place on both sides, O2 refuses it."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    fp32 = _Run(net, torch.optim.SGD(net.parameters(), lr=0.2),
                torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=1000))
    start = copy.deepcopy(net)
    low_net = copy.deepcopy(net)
    low_model, low_opt = ampkit.initialize(
        low_net, torch.optim.SGD(low_net.parameters(), lr=0.2), level="O2", dtype=FP16)
    o2 = _Run(low_model, low_opt, ampkit.GradScaler("cpu", init_scale=2.0 ** 8,
                                                      growth_interval=1000))
    both = _BothSidesEdited()
    g = torch.Generator().manual_seed(3)
    backward_seen = False
    for name in calls:
        has_grads = any(p.grad is not None for p in fp32.model.parameters())
        if name in ("clip model", "clip optimizer", "step") and not (
                backward_seen and has_grads):
            continue  # torch's scaler refuses to unscale or step before any gradient
        if name == "deepcopy" and fp32.unscaled:
            continue  # torch's scaler cannot be copied between unscale_ and update
        x = torch.randn(5, 4, generator=g)
        unscales = name.startswith("clip") and not fp32.unscaled
        must_refuse = both.before(name, has_grads, unscales)
        fp32.call(name, x)
        if must_refuse:
            with pytest.raises(RuntimeError, match="in place both on the model"):
                o2.call(name, x)
            return
        o2.call(name, x)
        backward_seen = backward_seen or name == "backward"
        if name == "deepcopy":
            backward_seen = False  # copies drop gradients, and torch's scaler state
    _assert_close_to_fp32(o2.model, fp32.model, start, rel=0.02)
    for key, value in o2.model.state_dict().items():
        assert value.dtype == torch.float32, key  # O2 checkpoints hold fp32 values


# -- the dialects share the mechanism ------------------------------------------------------

def _dialect_loop(model, opt, step_fn, batches, region=contextlib.nullcontext) -> None:
    for micro in batches:
        for x, y in micro:
            with region():
                out = model(x)
            step_fn(nn.functional.mse_loss(out.float(), y) / len(micro))
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        model.zero_grad()  # the trainers' way: must clear what the masters apply


def test_apex_o2_loop_with_model_zero_grad_and_clipping_trains_like_fp32():
    from ampkit import apex as amp

    batches = _data(steps=5, micro=2)
    reference, _, _ = _fp32_reference(batches, "model.parameters()")
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    model, opt = amp.initialize(model, opt, opt_level="O2", loss_scale=1.0, verbosity=0,
                                cast_model_type=BF16)

    def backward(loss):
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()

    _dialect_loop(model, opt, backward, batches)
    _assert_close_to_fp32(model, reference, _net(), rel=0.05)


def test_paddle_decorate_o2_loop_with_model_zero_grad_and_clipping_trains_like_fp32():
    from ampkit import paddle as amp

    batches = _data(steps=5, micro=2)
    reference, _, _ = _fp32_reference(batches, "model.parameters()")
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    model, opt = amp.decorate(model, opt, level="O2", dtype="bfloat16", master_weight=True)
    _dialect_loop(model, opt, lambda loss: loss.backward(), batches,
                  lambda: amp.auto_cast(level="O2", dtype="bfloat16"))
    _assert_close_to_fp32(model, reference, _net(), rel=0.05)
