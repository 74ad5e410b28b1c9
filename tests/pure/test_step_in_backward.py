"""The optimizer step inside backward: each parameter steps as its
gradient is accumulated and the gradient is freed. Against the ordinary step on the
same seed (pure bf16 and O2), with LR schedulers, per-parameter clipping and a resume;
and every refusal."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
import torch.nn.functional as F

import ampkit
from ampkit.step_in_backward import (
    clip_each_gradient,
    enable_step_in_backward,
    steps_in_backward,
)

BF16 = torch.bfloat16
MODES = [{"master_weights": "stochastic", "rounding_seed": 5},
         {"master_weights": "kahan", "rounding_seed": 5},
         {}]  # O2 with fp32 master weights
IDS = ["stochastic", "kahan", "O2-fp32-masters"]


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 64), torch.nn.LayerNorm(64),
                               torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(),
                               torch.nn.Linear(64, 4))


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(16, 12, generator=g), torch.randint(0, 4, (16,), generator=g))
            for _ in range(n)]


def _setup(mode: dict, in_backward: bool, per_param_groups: bool = False,
           **adamw) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    net = _net()
    params = ([{"params": [p]} for p in net.parameters()] if per_param_groups
              else net.parameters())
    opt = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01, **adamw)
    return ampkit.initialize(net, opt, level="O2", dtype=BF16, step_in_backward=in_backward,
                             **mode)


def _loss(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(net(x).float(), y)


def _train(net, opt, batches, in_backward, scheduler=None, clip=None) -> list[float]:
    losses = []
    for x, y in batches:
        loss = _loss(net, x, y)
        loss.backward()
        if not in_backward:
            if clip is not None:
                for p in net.parameters():  # per parameter, as in backward
                    torch.nn.utils.clip_grad_norm_([p], clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return losses


def _state(net, opt) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in net.parameters()]
    for p in net.parameters():
        out += [v for _, v in sorted(opt.state[p].items()) if isinstance(v, torch.Tensor)]
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y)
                                    for x, y in zip(a, b))


@pytest.mark.parametrize("mode", MODES, ids=IDS)
@pytest.mark.parametrize("foreach", [False, True])
def test_stepping_in_backward_trains_bit_for_bit_like_the_ordinary_step(mode, foreach):
    batches = _batches(5)
    net, opt = _setup(mode, False, foreach=foreach)
    expected = _train(net, opt, batches, False)
    want = _state(net, opt)
    net, opt = _setup(mode, True, foreach=foreach)
    assert steps_in_backward(opt)
    got = _train(net, opt, batches, True)
    assert got == expected
    assert _same(_state(net, opt), want)
    assert all(p.grad is None for p in net.parameters())
    assert expected[-1] < expected[0]  # it trained


def test_gradients_never_all_exist_at_once():
    net, _ = _setup(MODES[0], True)
    params = list(net.parameters())
    seen = []
    for p in params:  # registered after ampkit's hooks: sees each step done
        p.register_post_accumulate_grad_hook(
            lambda _: seen.append(sum(q.grad is not None for q in params)))
    x, y = _batches(1)[0]
    _loss(net, x, y).backward()
    assert len(seen) == len(params) and max(seen) == 0


def test_a_resume_continues_bit_for_bit():
    batches = _batches(6)
    net, opt = _setup(MODES[0], True)
    _train(net, opt, batches, True)
    expected = _state(net, opt)
    net, opt = _setup(MODES[0], True)
    _train(net, opt, batches[:3], True)
    buffer = io.BytesIO()
    torch.save({"net": net.state_dict(), "opt": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    net, opt = _setup(MODES[0], True)
    net.load_state_dict(saved["net"])
    opt.load_state_dict(saved["opt"])
    _train(net, opt, batches[3:], True)
    assert _same(_state(net, opt), expected)


@pytest.mark.parametrize("mode", MODES[::2], ids=IDS[::2])
def test_a_per_parameter_lr_schedule_applies_like_the_ordinary_steps(mode):
    batches = _batches(4)

    def run(in_backward: bool) -> tuple[list[float], list[torch.Tensor], list[float]]:
        net, opt = _setup(mode, in_backward, per_param_groups=True)
        lambdas = [lambda k, i=i: 0.5 ** (k * (1 + i % 3)) for i in range(
            len(opt.param_groups))]
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambdas)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "scheduler before optimizer" warning
            losses = _train(net, opt, batches, in_backward, scheduler=scheduler)
        return losses, _state(net, opt), [g["lr"] for g in opt.param_groups]

    losses, state, lrs = run(False)
    got_losses, got_state, got_lrs = run(True)
    assert got_losses == losses and _same(got_state, state) and got_lrs == lrs
    assert len(set(lrs)) == 3  # the groups did get different rates


def test_per_parameter_clipping_matches_clipping_each_gradient_before_the_step():
    batches = _batches(4)
    net, opt = _setup(MODES[0], False)
    _train(net, opt, batches, False, clip=0.05)
    want = _state(net, opt)
    net, opt = _setup(MODES[0], True)
    clip_each_gradient(opt, max_norm=0.05)
    _train(net, opt, batches, True)
    assert _same(_state(net, opt), want)
    net, opt = _setup(MODES[0], True)
    _train(net, opt, batches, True)
    assert not _same(_state(net, opt), want)  # the clipping did change the run


def test_the_config_field_turns_it_on():
    cfg = ampkit.AmpConfig(level="O2", dtype="bfloat16", master_weights="stochastic",
                           step_in_backward=True)
    net = _net()
    net, opt = ampkit.initialize(net, torch.optim.SGD(net.parameters(), lr=0.1), config=cfg)
    assert steps_in_backward(opt)


# -- refusals -------------------------------------------------------------------------

def test_optimizer_step_after_backward_is_refused_naming_accumulation_and_closures():
    net, opt = _setup(MODES[0], True)
    x, y = _batches(1)[0]
    _loss(net, x, y).backward()
    for call in (lambda: opt.step(), lambda: opt.step(lambda: _loss(net, x, y))):
        with pytest.raises(RuntimeError, match="steps inside backward") as err:
            call()
        assert "gradient accumulation over several backward passes" in str(err.value)
        assert "closures" in str(err.value)


def test_a_grad_scaler_step_is_refused():
    net, opt = _setup(MODES[2], True)
    scaler = torch.amp.GradScaler("cpu")
    x, y = _batches(1)[0]
    scaler.scale(_loss(net, x, y)).backward()
    with pytest.raises(RuntimeError, match=r"scaler\.step"):
        scaler.step(opt)


@pytest.mark.parametrize("kwargs", [{"dtype": torch.float16},
                                    {"dtype": BF16, "loss_scale": "dynamic"},
                                    {"dtype": BF16, "loss_scale": 128.0}])
def test_loss_scaling_is_refused_before_anything_changes(kwargs):
    net = _net()
    opt = torch.optim.AdamW(net.parameters())
    with pytest.raises(ValueError, match=r"loss_scale=.*an overflow is known only once"):
        ampkit.initialize(net, opt, level="O2", step_in_backward=True, **kwargs)
    assert all(p.dtype is torch.float32 for p in net.parameters())
    assert not steps_in_backward(opt)
    with pytest.raises(ValueError, match="loss_scale="):
        ampkit.AmpConfig(level="O2", step_in_backward=True, **kwargs)


def test_an_optimizer_that_needs_a_closure_is_refused():
    net = _net()
    with pytest.raises(ValueError, match="LBFGS's step needs a closure"):
        ampkit.initialize(net, torch.optim.LBFGS(net.parameters()), level="O2",
                          dtype=BF16, step_in_backward=True)
    assert all(p.dtype is torch.float32 for p in net.parameters())


def test_a_bad_value_is_refused():
    with pytest.raises(TypeError, match="step_in_backward must be True or False"):
        ampkit.AmpConfig(level="O2", dtype=BF16, step_in_backward="yes")


@pytest.mark.parametrize("mode", MODES, ids=IDS)
def test_an_optimizer_built_later_steps_in_backward_through_prepare_optimizer(mode):
    # the FSDP2 order (the optimizer comes after sharding), on one process: initialize
    # takes step_in_backward=True without an optimizer; prepare_optimizer applies it
    import ampkit.fsdp

    batches = _batches(3)
    net, opt = _setup(mode, False)
    _train(net, opt, batches, False)
    want = _state(net, opt)
    net = ampkit.initialize(_net(), level="O2", dtype=BF16, step_in_backward=True, **mode)
    opt = ampkit.fsdp.prepare_optimizer(
        net, torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=0.01))
    assert steps_in_backward(opt)
    _train(net, opt, batches, True)
    assert _same(_state(net, opt), want)


def test_clipping_an_optimizer_that_steps_after_backward_or_nothing_is_refused():
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="does not step in backward"):
        clip_each_gradient(opt, max_norm=1.0)
    enable_step_in_backward(opt)
    with pytest.raises(ValueError, match="give max_norm, max_value or both"):
        clip_each_gradient(opt)
    with pytest.raises(ValueError, match="max_norm must be a positive finite number"):
        clip_each_gradient(opt, max_norm=-1.0)


def test_ddp_is_refused_at_the_first_hook_before_anything_steps(monkeypatch):
    # DDP averages the gradients only after each parameter's hook: each rank would
    # step on its own gradient. A 1-rank group makes a real DDP; the world size is
    # then reported as 2 (the 2-rank case is in tests/distributed/).
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        net, opt = _setup(MODES[0], True)
        ddp = torch.nn.parallel.DistributedDataParallel(net)
        before = [p.detach().clone() for p in net.parameters()]
        monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 2)
        x, y = _batches(1)[0]
        with pytest.raises(RuntimeError, match=r"held by DistributedDataParallel, which "
                           r"averages the ranks' gradients after the gradient hooks"):
            _loss(ddp, x, y).backward()
        assert _same([p.detach() for p in net.parameters()], before)
        assert not opt.state
    finally:
        dist.destroy_process_group()
