"""Differential tests: ampkit.GradScaler against torch.amp.GradScaler on the same gradients.

The oracle is torch's own scaler, run side by side on an identical stream of random
gradients with injected inf/NaN and with values that overflow only once scaled. Scales,
skip decisions and parameters must agree bit for bit at every step.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ampkit import GradScaler
from ampkit.scaling.schedule import ScaleSchedule, _update_by_ops


@dataclasses.dataclass
class Trajectory:
    scales: list[float]
    skipped: list[bool]
    params: list[list[torch.Tensor]]


def _grad_stream(steps: int, seed: int, p_inf: float, p_nan: float, p_huge: float,
                 dtype: torch.dtype = torch.float32) -> list[list[torch.Tensor]]:
    """Raw (unscaled) gradients for two parameters of shapes (3,) and (2, 2)."""
    gen = torch.Generator().manual_seed(seed)
    stream = []
    for _ in range(steps):
        grads = [torch.randn(3, generator=gen), torch.randn(2, 2, generator=gen)]
        r = float(torch.rand((), generator=gen))
        if r < p_inf:
            grads[0][1] = float("inf") if r < p_inf / 2 else float("-inf")
        elif r < p_inf + p_nan:
            grads[1][0, 1] = float("nan")
        elif r < p_inf + p_nan + p_huge:
            grads[1][1, 0] = 3e34  # finite, but overflows float32 once scaled by >= 2**14
        stream.append([g.to(dtype) for g in grads])
    return stream


def _run(scaler: object, stream: list[list[torch.Tensor]], optimizer_kind: str,
         dtype: torch.dtype = torch.float32, record_params_every: int = 1) -> Trajectory:
    params = [torch.nn.Parameter(torch.ones(3, dtype=dtype)),
              torch.nn.Parameter(torch.ones(2, 2, dtype=dtype))]
    if optimizer_kind == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(params, lr=1e-2, momentum=0.9)
    elif optimizer_kind == "adam_fused":
        opt = torch.optim.Adam(params, lr=1e-2, fused=True)
    elif optimizer_kind == "sgd_fused":
        opt = torch.optim.SGD(params, lr=1e-2, momentum=0.9, fused=True)
    else:
        raise AssertionError(optimizer_kind)
    out = Trajectory([], [], [])
    for i, raw in enumerate(stream):
        before = [p.detach().clone() for p in params]
        for p, g in zip(params, raw):
            p.grad = scaler.scale(g.clone())  # type: ignore[attr-defined]
        scaler.step(opt)  # type: ignore[attr-defined]
        scaler.update()  # type: ignore[attr-defined]
        out.scales.append(scaler.get_scale())  # type: ignore[attr-defined]
        # lr * a unit-normal gradient always moves a parameter of 1.0: unchanged means
        # the step was skipped (the oracle for torch, which does not report skips)
        out.skipped.append(all(torch.equal(b, p) for b, p in zip(before, params)))
        if i % record_params_every == 0:
            out.params.append([p.detach().clone() for p in params])
    return out


def _assert_same(ours: Trajectory, theirs: Trajectory) -> None:
    assert ours.scales == theirs.scales
    assert ours.skipped == theirs.skipped
    for step, (a, b) in enumerate(zip(ours.params, theirs.params)):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), f"params differ at {step}"


@pytest.mark.parametrize("optimizer_kind", ["sgd", "adam_fused"])
def test_default_settings_5000_steps_match_torch(optimizer_kind: str) -> None:
    # Rare overflows so the default 2000-step window is reached (the scale grows).
    stream = _grad_stream(5000, seed=1, p_inf=0.0004, p_nan=0.0004, p_huge=0.0)
    ours = _run(GradScaler("cpu"), stream, optimizer_kind, record_params_every=50)
    theirs = _run(torch.amp.GradScaler("cpu"), stream, optimizer_kind,
                  record_params_every=50)
    _assert_same(ours, theirs)
    # both branches of the rule ran: a back-off and a growth after 2000 clean steps
    changes = [b / a for a, b in zip(theirs.scales, theirs.scales[1:]) if a != b]
    assert 0.5 in changes and 2.0 in changes


@pytest.mark.parametrize("optimizer_kind", ["sgd", "sgd_fused"])
def test_5000_steps_with_frequent_overflows_match_torch(optimizer_kind: str) -> None:
    settings = {"init_scale": 2.0 ** 20, "growth_interval": 10}
    stream = _grad_stream(5000, seed=2, p_inf=0.02, p_nan=0.02, p_huge=0.03)
    ours = _run(GradScaler("cpu", **settings), stream, optimizer_kind)
    theirs = _run(torch.amp.GradScaler("cpu", **settings), stream, optimizer_kind)
    _assert_same(ours, theirs)
    skipped = sum(theirs.skipped)
    assert 150 < skipped < 1000  # injected and scale-induced overflows both occurred
    assert len(set(theirs.scales)) > 5


def test_odd_factors_round_like_torch() -> None:
    # Factors that are not powers of two expose the float64-then-float32 rounding.
    settings = {"init_scale": 1000.3, "growth_factor": 1.7, "backoff_factor": 0.3,
                "growth_interval": 3}
    stream = _grad_stream(2000, seed=3, p_inf=0.05, p_nan=0.05, p_huge=0.05)
    ours = _run(GradScaler("cpu", **settings), stream, "sgd")
    theirs = _run(torch.amp.GradScaler("cpu", **settings), stream, "sgd")
    _assert_same(ours, theirs)
    assert any(s != round(s) for s in theirs.scales)


def test_bfloat16_gradients_match_torch_on_cpu() -> None:
    # torch's CPU kernel accepts bfloat16, so the two can be compared directly here.
    settings = {"init_scale": 2.0 ** 10, "growth_interval": 5}
    stream = _grad_stream(500, seed=4, p_inf=0.03, p_nan=0.03, p_huge=0.0,
                          dtype=torch.bfloat16)
    # scale_bfloat16: torch's behaviour (by default ampkit keeps a bfloat16 run at 1.0)
    ours = _run(GradScaler("cpu", scale_bfloat16=True, **settings), stream, "sgd",
                dtype=torch.bfloat16)
    theirs = _run(torch.amp.GradScaler("cpu", **settings), stream, "sgd",
                  dtype=torch.bfloat16)
    _assert_same(ours, theirs)
    assert sum(theirs.skipped) > 10


@pytest.mark.parametrize("factors", [(2.0, 0.5, 7), (1.7, 0.3, 3), (3.0, 0.25, 1)])
def test_tensor_op_rule_matches_torch_kernel(factors: tuple[float, float, int]) -> None:
    # The rule ampkit runs when hysteresis or bounds are set, restricted to torch's
    # settings, against torch's fused kernel: 5,000 random overflow/no-overflow steps.
    growth, backoff, interval = factors
    schedule = ScaleSchedule(growth_factor=growth, backoff_factor=backoff,
                             growth_interval=interval)
    gen = torch.Generator().manual_seed(5)
    found = (torch.rand(5000, generator=gen) < 0.2).float()
    ours = torch.tensor(777.7), torch.tensor(0, dtype=torch.int32)
    overflows = torch.tensor(0, dtype=torch.int32)
    theirs = torch.tensor(777.7), torch.tensor(0, dtype=torch.int32)
    for f in found:
        _update_by_ops(ours[0], ours[1], overflows, f, schedule)
        torch._amp_update_scale_(theirs[0], theirs[1], f, growth, backoff, interval)
        assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
