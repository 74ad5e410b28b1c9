"""Skip without corruption: an overflowing step leaves every tensor exactly as it was.

Property tests: for any sequence of overflow / no-overflow steps, parameters, optimizer
state (moments, step counters) and the LR scheduler are bitwise unchanged exactly on the
overflow steps, and changed on the others. Also: the no-host-sync path of optimizers
that take ``grad_scale``/``found_inf``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from ampkit import GradScaler

OPTIMIZERS: dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=0.1),
    "adamw_foreach": lambda p: torch.optim.AdamW(p, lr=0.1, foreach=True),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=0.1),
    "adam_fused": lambda p: torch.optim.Adam(p, lr=0.1, fused=True),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=0.1, fused=True),
    "sgd_fused": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True),
    "adagrad_fused": lambda p: torch.optim.Adagrad(p, lr=0.1, fused=True),
}
FUSED = [name for name in OPTIMIZERS if name.endswith("_fused")]


def _snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer,
              sched: torch.optim.lr_scheduler.LRScheduler) -> dict[str, Any]:
    return {"params": [p.detach().clone() for p in model.parameters()],
            "opt": copy.deepcopy(opt.state_dict()),
            "sched": copy.deepcopy(sched.state_dict()),
            "lr": [g["lr"] for g in opt.param_groups]}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _train(optimizer_name: str, overflow_steps: list[bool], *, hysteresis: int = 1,
           dynamic: bool = True, grad_dtype: torch.dtype = torch.float32) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).to(grad_dtype)
    opt = OPTIMIZERS[optimizer_name](list(model.parameters()))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    scaler = GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2,
                        hysteresis=hysteresis, dynamic=dynamic)
    x = torch.randn(4, 3).to(grad_dtype)
    for step, overflow in enumerate(overflow_steps):
        opt.zero_grad()
        loss = model(x).float().pow(2).mean()
        if overflow:
            loss = loss * float("inf") if step % 2 else loss * float("nan")
        scaler.scale(loss).backward()
        before = _snapshot(model, opt, sched)
        scaler.step(opt)
        scaler.update()
        if not scaler.last_step_skipped:  # the documented scheduler pattern
            sched.step()
        after = _snapshot(model, opt, sched)
        assert scaler.last_step_skipped is overflow
        if overflow:
            assert _same(before, after), f"step {step} changed state though skipped"
        else:
            assert not _same(before["params"], after["params"])
            assert not _same(before["sched"], after["sched"])
    assert scaler.skipped_steps == sum(overflow_steps)


@pytest.mark.parametrize("optimizer_name", list(OPTIMIZERS))
@settings(max_examples=12, deadline=None)
@given(overflow_steps=st.lists(st.booleans(), min_size=1, max_size=10))
def test_overflow_steps_leave_everything_untouched(optimizer_name: str,
                                                  overflow_steps: list[bool]) -> None:
    _train(optimizer_name, overflow_steps)


@settings(max_examples=15, deadline=None)
@given(overflow_steps=st.lists(st.booleans(), min_size=1, max_size=10),
       hysteresis=st.integers(1, 3), dynamic=st.booleans())
def test_skips_with_hysteresis_and_static_scale(overflow_steps: list[bool], hysteresis: int,
                                                dynamic: bool) -> None:
    _train("adam", overflow_steps, hysteresis=hysteresis, dynamic=dynamic)


@pytest.mark.parametrize("grad_dtype", [torch.float16, torch.bfloat16])
def test_low_precision_gradients_skip_cleanly(grad_dtype: torch.dtype) -> None:
    _train("sgd_momentum", [False, True, True, False, True, False], grad_dtype=grad_dtype)


def test_step_counter_does_not_advance_on_skip() -> None:
    for name in ("adam", "adam_fused", "adagrad_fused"):
        w = torch.nn.Parameter(torch.ones(2))
        opt = OPTIMIZERS[name]([w])
        scaler = GradScaler("cpu")
        for loss_factor in (1.0, float("inf"), 1.0):
            opt.zero_grad()
            scaler.scale((w * loss_factor).sum()).backward()
            scaler.step(opt)
            scaler.update()
        assert float(opt.state[w]["step"]) == 2.0, name


class _CountHostSyncs(TorchDispatchMode):
    """Counts ops that copy a tensor value to the host (``.item()``, ``bool()``, ...)."""

    SYNCING = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default,
               torch.ops.aten.equal.default, torch.ops.aten.nonzero.default}

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if func in self.SYNCING:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _syncs_during_step(optimizer_name: str, overflow: bool, *, unscale_first: bool) -> int:
    w = torch.nn.Parameter(torch.ones(4))
    opt = OPTIMIZERS[optimizer_name]([w])
    scaler = GradScaler("cpu", hysteresis=2, max_scale=2.0 ** 24)  # the tensor-op rule
    scaler.scale(w.sum()).backward()  # a first, clean step creates the optimizer state
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    scaler.scale((w * (float("inf") if overflow else 1.0)).sum()).backward()
    with _CountHostSyncs() as counter:
        if unscale_first:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
    return counter.count


def _torch_own_syncs(optimizer_name: str, overflow: bool) -> int:
    """Host syncs of the fused optimizer's own step, given ``grad_scale``/``found_inf``
    by hand (no ampkit at all): what ampkit's step may not add to."""
    w = torch.nn.Parameter(torch.ones(4))
    opt = OPTIMIZERS[optimizer_name]([w])
    w.grad = torch.ones(4)
    opt.step()  # the state exists, as in _syncs_during_step
    w.grad = torch.full((4,), float("inf") if overflow else 2.0)
    opt.grad_scale = torch.tensor(2.0)  # type: ignore[attr-defined]
    opt.found_inf = torch.tensor(1.0 if overflow else 0.0)  # type: ignore[attr-defined]
    with _CountHostSyncs() as counter:
        opt.step()
    return counter.count


@pytest.mark.parametrize("optimizer_name", FUSED)
@pytest.mark.parametrize("overflow", [False, True])
@pytest.mark.parametrize("unscale_first", [False, True])
def test_fused_optimizers_step_without_host_sync(optimizer_name: str, overflow: bool,
                                                 unscale_first: bool) -> None:
    # An optimizer that declares it takes grad_scale/found_inf
    # (``_step_supports_amp_scaling``: fused Adam, AdamW, SGD; fused Adagrad from torch
    # 2.13 on, not on 2.11) skips on the device: ampkit's part of the step reads nothing
    # back, so the count is the optimizer's own, which is none. One that does not
    # declare it is decided on the host, as by torch's GradScaler: exactly one read.
    declares = getattr(OPTIMIZERS[optimizer_name]([torch.nn.Parameter(torch.ones(1))]),
                       "_step_supports_amp_scaling", False)
    syncs = _syncs_during_step(optimizer_name, overflow, unscale_first=unscale_first)
    if declares:
        assert _torch_own_syncs(optimizer_name, overflow) == 0
        assert syncs == 0
    else:
        assert syncs == 1


def test_fused_first_steps_are_decided_on_the_host() -> None:
    # Until the optimizer has state, a skipped step must not create it (zero moments).
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.Adam([w], lr=0.1, fused=True)
    scaler = GradScaler("cpu")
    scaler.scale((w * float("nan")).sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert len(opt.state) == 0


def test_other_optimizers_sync_once_per_step() -> None:
    # The counter does see syncs: a plain optimizer needs exactly one to decide. (SGD
    # itself reads nothing back on CPU; Adam would add its own step-counter read.)
    for overflow in (False, True):
        for unscale_first in (False, True):
            assert _syncs_during_step("sgd_momentum", overflow,
                                      unscale_first=unscale_first) == 1


def test_fused_step_unscales_inside_the_optimizer() -> None:
    # The fused path must give the same update as unscaling first: compare with plain Adam.
    results = []
    for name in ("adam", "adam_fused"):
        w = torch.nn.Parameter(torch.linspace(-1, 1, 5))
        opt = OPTIMIZERS[name]([w])
        scaler = GradScaler("cpu", init_scale=2.0 ** 12)
        for _ in range(3):
            opt.zero_grad()
            scaler.scale((w ** 3).sum()).backward()
            scaler.step(opt)
            scaler.update()
        results.append(w.detach())
    torch.testing.assert_close(results[0], results[1], rtol=1e-6, atol=1e-6)
