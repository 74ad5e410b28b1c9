"""Host syncs of fp16 training steps through ``ampkit.scale_loss`` and
``ampkit.GradScaler``: fused optimizers none after warm-up, others at most
the one that decides a skip.

On CPU a host sync is counted as what it is below the dispatcher: a call of
``aten._local_scalar_dense`` (what ``.item()``, ``bool(tensor)`` and ``if tensor``
become). On CUDA the same steps run under ``torch.cuda.set_sync_debug_mode("error")``."""

import copy

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import ampkit
from ampkit.scaling.loss_scaling import configure_loss_scaling


class _CountSyncs(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten._local_scalar_dense:
            self.syncs += 1
        return func(*args, **(kwargs or {}))


def _optimizer(params, fused):
    # Non-fused: SGD, whose own step reads nothing back (AdamW's reads its CPU step
    # counters, which on CUDA are no device sync but would count here).
    if fused:
        return torch.optim.AdamW(params, lr=1e-3, fused=True)
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9)


def _model(device="cpu"):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2)).to(device)


def _scale_loss_step(model, optimizer, x, *, poison=False):
    loss = model(x).float().pow(2).mean() * (float("inf") if poison else 1.0)
    with ampkit.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _grad_scaler_step(scaler, model, optimizer, x):
    scaler.scale(model(x).float().pow(2).mean()).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize(("level", "fused", "most"), [
    ("O1", False, 1), ("O2", False, 1), ("O1", True, 0), ("O2", True, 0)])
def test_scale_loss_syncs_per_step(level, fused, most):
    configure_loss_scaling("dynamic")
    model = _model()
    optimizer = _optimizer(model.parameters(), fused)
    model, optimizer = ampkit.initialize(model, optimizer, level=level, dtype=torch.float16)
    x = torch.rand(4, 8)
    _scale_loss_step(model, optimizer, x)  # warm-up: the optimizer state is created
    for _ in range(3):
        with _CountSyncs() as counter:
            _scale_loss_step(model, optimizer, x)
        assert counter.syncs <= most


@pytest.mark.parametrize(("fused", "most"), [(False, 1), (True, 0)])
def test_grad_scaler_syncs_per_step(fused, most):
    model = _model()
    optimizer = _optimizer(model.parameters(), fused)
    scaler = ampkit.GradScaler("cpu")
    x = torch.rand(4, 8)
    _grad_scaler_step(scaler, model, optimizer, x)
    for _ in range(3):
        with _CountSyncs() as counter:
            _grad_scaler_step(scaler, model, optimizer, x)
        assert counter.syncs <= most


def test_fused_scale_loss_matches_torch_grad_scaler_and_skips_on_the_device():
    # Oracle: torch.amp.GradScaler with the same fused AdamW, overflowing step included.
    configure_loss_scaling("dynamic", init_scale=2.0 ** 10)
    mine, theirs = _model(), _model()
    opt_mine = torch.optim.AdamW(mine.parameters(), lr=1e-2, fused=True)
    opt_theirs = torch.optim.AdamW(theirs.parameters(), lr=1e-2, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    x = torch.rand(4, 8)
    for poison in (False, False, True, False):
        before = copy.deepcopy(opt_mine.state_dict()), [p.clone() for p in mine.parameters()]
        _scale_loss_step(mine, opt_mine, x, poison=poison)
        loss = theirs(x).float().pow(2).mean() * (float("inf") if poison else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt_theirs)
        scaler.update()
        opt_theirs.zero_grad(set_to_none=True)
        for a, b in zip(mine.parameters(), theirs.parameters()):
            torch.testing.assert_close(a, b)
        if poison:  # a skipped step leaves every tensor as it was, step counts included
            assert all(torch.equal(a, b) for a, b in zip(mine.parameters(), before[1]))
            for key, state in opt_mine.state_dict()["state"].items():
                for name, value in state.items():
                    assert torch.equal(value, before[0]["state"][key][name]), name
    assert ampkit.scaling.loss_scaling.loss_scaler(0).get_scale() == scaler.get_scale()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_cuda_fused_fp16_steps_make_no_host_sync(level):
    configure_loss_scaling("dynamic")
    model = _model("cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    model, optimizer = ampkit.initialize(model, optimizer, level=level, dtype=torch.float16)
    scaler_model = _model("cuda")
    scaler_opt = torch.optim.AdamW(scaler_model.parameters(), lr=1e-3, fused=True)
    scaler = ampkit.GradScaler("cuda")
    x = torch.rand(4, 8, device="cuda")
    _scale_loss_step(model, optimizer, x)
    _grad_scaler_step(scaler, scaler_model, scaler_opt, x)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            _scale_loss_step(model, optimizer, x)
            with torch.autocast("cuda", torch.float16):
                _grad_scaler_step(scaler, scaler_model, scaler_opt, x)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_o2_fused_skip_on_the_device_leaves_masters_and_state_as_they_were():
    # The ON_DEVICE path with fp32 masters: the fused step sees found_inf on the masters'
    # optimizer, and a skipped step changes no model weight, master or moment.
    configure_loss_scaling("dynamic", init_scale=2.0 ** 10)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    model, optimizer = ampkit.initialize(model, optimizer, level="O2", dtype=torch.float16)
    x = torch.rand(4, 8)
    for poison in (False, False, True, False, True):
        weights = [p.clone() for p in model.parameters()]
        masters = [m.clone() for m in (p for g in optimizer.param_groups for p in g["params"])]
        state = copy.deepcopy(optimizer.state_dict()["state"])
        _scale_loss_step(model, optimizer, x, poison=poison)
        unchanged = [torch.equal(a, b) for a, b in zip(model.parameters(), weights)]
        stepped = (p for g in optimizer.param_groups for p in g["params"])
        unchanged += [torch.equal(a, b) for a, b in zip(stepped, masters)]
        unchanged += [torch.equal(value, state[key][name]) for key, entry in
                      optimizer.state_dict()["state"].items() for name, value in entry.items()
                      if key in state]
        assert all(unchanged) if poison else not any(unchanged[:len(weights)])
