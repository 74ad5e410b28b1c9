"""fp32 master weights: differential against plain torch optimizers on fp32 copies,
accuracy against pure fp32 training, schedulers, clipping, zero_grad, skipped steps."""

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers_models import TinyTransformer, digits_split

import ampkit
from ampkit.conversion import convert_model, master_copy
from ampkit.master_weights import (
    MasterWeightOptimizer,
    clip_master_grad_norm_,
    master_params,
    model_params,
    sync_master_grads,
)

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.fixture(autouse=True)
def _fresh_loss_scaling():
    from ampkit.scaling.multi_loss import configure_loss_scaling

    yield
    configure_loss_scaling("dynamic")  # undo what a test (or initialize) configured


UNIT_ROUNDOFF = {BF16: 2.0 ** -8, FP16: 2.0 ** -11}

OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "sgd-momentum-foreach": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9,
                                                       nesterov=True, foreach=True),
    "sgd-fused": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=False),
    "adam-foreach": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True),
    "adam-fused": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1,
                                                  foreach=True),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True,
                                                amsgrad=True),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
}


def _low_params(dtype=BF16):
    torch.manual_seed(0)
    return [nn.Parameter(torch.randn(5, 3).to(dtype)), nn.Parameter(torch.randn(3).to(dtype)),
            nn.Parameter(torch.randn(4))]  # the last stays fp32 (a kept norm, say)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_masters_follow_the_plain_optimizer_on_fp32_copies_bit_for_bit(name):
    make = OPTIMIZERS[name]
    params = _low_params()
    opt = MasterWeightOptimizer(make(params))
    reference = [nn.Parameter(p.detach().float().clone()) for p in params]
    ref_opt = make(reference)
    for step in range(4):
        torch.manual_seed(100 + step)
        grads = [torch.randn(p.shape).to(p.dtype) for p in params]
        for p, r, g in zip(params, reference, grads):
            p.grad = g
            r.grad = g.float().clone()  # foreach nesterov SGD writes into the gradient
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        masters = list(master_params(opt))
        for p, m, r in zip(params, masters, reference):
            assert m.dtype is FP32
            assert torch.equal(m, r), (name, step)
            assert torch.equal(p, r.detach().to(p.dtype)), (name, step)  # refreshed
    assert masters[2] is params[2]  # fp32 parameters are their own masters
    for state in opt.state.values():  # optimizer state lives in fp32
        for value in state.values():
            if torch.is_tensor(value) and value.numel() > 1:
                assert value.dtype is FP32


def test_class_and_identity():
    opt = torch.optim.Adam(_low_params(), lr=0.1)
    same = MasterWeightOptimizer(opt)
    assert same is opt
    assert isinstance(opt, torch.optim.Adam) and isinstance(opt, MasterWeightOptimizer)
    assert type(opt).__name__ == "MasterWeightAdam"
    assert MasterWeightOptimizer(opt) is opt  # already managed: unchanged
    assert len(opt.param_groups[0]["params"]) == 3
    assert ampkit.MasterWeightOptimizer is MasterWeightOptimizer
    assert ampkit.master_params is master_params
    assert ampkit.clip_master_grad_norm_ is clip_master_grad_norm_


def _mlp():
    return nn.Sequential(nn.Linear(64, 32), nn.LayerNorm(32), nn.Tanh(), nn.Linear(32, 10))


def _train(level, dtype, make_opt, steps=20, model_fn=_mlp):
    x_train, y_train, _, _ = digits_split()
    x_train = x_train.flatten(1)
    torch.manual_seed(0)
    model = model_fn()
    start = [p.detach().clone() for p in model.parameters()]
    opt = make_opt(model.parameters())
    if level is not None:
        model, opt = ampkit.initialize(model, opt, level=level, dtype=dtype)
    losses = []
    for step in range(steps):
        idx = torch.arange(step * 64, step * 64 + 64) % len(y_train)
        loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    final = [(master_copy(p) if master_copy(p) is not None else p).detach().float()
             for p in model.parameters()]
    return start, final, losses


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_o2_sgd_masters_agree_with_fp32_training_within_round_off(dtype):
    """20 SGD steps. Each gradient is computed from low-precision weights and
    activations, so it carries a relative error of a few unit round-offs u (2**-8 for
    bf16, 2**-11 for fp16) that mostly averages out over the batch and the steps; the
    fp32 masters accumulate the updates exactly. Bound: the masters' displacement from
    the initial weights is within 2u (relative, per tensor) of the fp32 run's. Pure
    low-precision training (O3, no masters) rounds every update and misses that bound."""
    u = UNIT_ROUNDOFF[dtype]

    def sgd(ps):
        return torch.optim.SGD(ps, lr=0.1)

    start, fp32, _ = _train(None, None, sgd)
    _, o2, _ = _train("O2", dtype, sgd)
    _, o3, _ = _train("O3", dtype, sgd)
    o3_errors = []
    for w0, w32, w2, w3 in zip(start, fp32, o2, o3):
        moved = (w32 - w0).norm()
        assert moved > 0
        assert (w2 - w32).norm() <= 2 * u * moved
        o3_errors.append(((w3 - w32).norm() / moved).item())
    assert max(o3_errors) > 2 * u  # the bound tells masters from no masters


def test_o2_adam_loss_goes_down_like_fp32():
    def adam(ps):
        return torch.optim.Adam(ps, lr=3e-3)

    _, _, fp32 = _train(None, None, adam, steps=30)
    _, _, o2 = _train("O2", BF16, adam, steps=30)
    assert fp32[-1] < 0.5 * fp32[0]
    assert o2[-1] < 0.5 * o2[0]
    # step by step within 2% of the fp32 loss (bf16 rounds activations to ~0.4%)
    assert all(abs(a - b) <= 0.02 * b for a, b in zip(o2, fp32))


# -- gradients ------------------------------------------------------------------------------

def test_master_gradients_follow_the_model_gradients_after_every_backward():
    w = nn.Parameter(torch.ones(3, dtype=BF16))
    opt = MasterWeightOptimizer(torch.optim.SGD([w], lr=1.0))
    master = next(master_params(opt))
    (w * 2).sum().backward()
    # The model keeps its gradient; the master's is derived at the end of the backward.
    assert torch.equal(w.grad, torch.full((3,), 2.0, dtype=BF16))
    assert torch.equal(master.grad, torch.full((3,), 2.0))
    assert sync_master_grads(opt) is True  # idempotent
    assert torch.equal(master.grad, torch.full((3,), 2.0))
    (w * 3).sum().backward()  # gradient accumulation, in the model's gradient
    assert torch.equal(master.grad, torch.full((3,), 5.0))
    w.grad = None  # plain PyTorch's way of dropping a gradient reaches the master
    sync_master_grads(opt)
    assert master.grad is None


def test_sync_on_an_unmanaged_optimizer_does_nothing():
    w = nn.Parameter(torch.ones(2))
    w.grad = torch.ones(2)
    opt = torch.optim.SGD([w], lr=1.0)
    assert sync_master_grads(opt) is False
    assert torch.equal(w.grad, torch.ones(2))
    assert list(master_params(opt)) == [w] and list(model_params(opt)) == [w]


def test_gradient_accumulation_equals_one_summed_backward():
    torch.manual_seed(1)
    model = convert_model(nn.Linear(4, 2), "O2", BF16)
    opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    reference = [nn.Parameter(m.detach().clone()) for m in master_params(opt)]
    ref_opt = torch.optim.SGD(reference, lr=0.5)
    x1, x2 = torch.rand(3, 4), torch.rand(3, 4)
    model(x1).sum().backward()
    grads_1 = [p.grad.float() for p in model.parameters()]
    model(x2).sum().backward()  # accumulates on the bf16 parameters
    grads_12 = [p.grad.float() for p in model.parameters()]
    opt.step()
    for r, g in zip(reference, grads_12):
        r.grad = g
    ref_opt.step()
    assert all(torch.equal(m, r) for m, r in zip(master_params(opt), reference))
    assert not all(torch.equal(a, b) for a, b in zip(grads_1, grads_12))


def test_zero_grad_clears_model_and_master_gradients():
    w = nn.Parameter(torch.ones(2, dtype=FP16))
    opt = MasterWeightOptimizer(torch.optim.SGD([w], lr=1.0))
    master = next(master_params(opt))
    w.grad = torch.ones(2, dtype=FP16)
    sync_master_grads(opt)
    w.grad = torch.ones(2, dtype=FP16)
    opt.zero_grad(set_to_none=False)
    assert torch.equal(w.grad, torch.zeros(2, dtype=FP16))
    assert torch.equal(master.grad, torch.zeros(2))
    opt.zero_grad()
    assert w.grad is None and master.grad is None


def test_a_step_never_taken_leaves_everything_as_it_was():
    model = convert_model(nn.Linear(3, 3), "O2", FP16)
    opt = MasterWeightOptimizer(torch.optim.Adam(model.parameters(), lr=0.1))
    model(torch.rand(2, 3)).sum().backward()
    opt.step()
    snapshot = (copy.deepcopy(list(model.parameters())), copy.deepcopy(list(master_params(opt))),
                copy.deepcopy(opt.state_dict()))
    model(torch.rand(2, 3)).sum().backward()
    sync_master_grads(opt)  # what a scaler does before it finds an overflow
    opt.zero_grad()  # ... and no step
    after = (list(model.parameters()), list(master_params(opt)), opt.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(snapshot[0], after[0]))
    assert all(torch.equal(a, b) for a, b in zip(snapshot[1], after[1]))
    for key, state in snapshot[2]["state"].items():
        for name, value in state.items():
            assert torch.equal(value, after[2]["state"][key][name])


def test_scale_loss_overflow_skips_the_step_and_leaves_every_tensor():
    from ampkit.scaling.multi_loss import configure_loss_scaling, loss_scaler, scale_loss

    configure_loss_scaling("dynamic", init_scale=2.0 ** 10)
    model = convert_model(nn.Linear(3, 2), "O2", FP16)
    opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    with scale_loss(model(torch.rand(2, 3)).sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    params = [p.detach().clone() for p in model.parameters()]
    masters = [m.detach().clone() for m in master_params(opt)]
    momentum = [opt.state[m]["momentum_buffer"].clone() for m in master_params(opt)]
    opt.zero_grad()
    with scale_loss(model(torch.full((2, 3), float("inf"))).sum(), opt) as scaled:
        scaled.backward()
    opt.step()  # skipped
    assert loss_scaler(0).get_scale() == 2.0 ** 9
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(masters, master_params(opt)))
    assert all(torch.equal(a, opt.state[m]["momentum_buffer"])
               for a, m in zip(momentum, master_params(opt)))


def test_ampkit_grad_scaler_unscales_master_gradients():
    torch.manual_seed(2)
    model = convert_model(nn.Linear(3, 2), "O2", FP16)
    opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = ampkit.GradScaler("cpu", init_scale=256.0)
    x = torch.rand(4, 3)
    scaler.scale(model(x).float().sum()).backward()
    raw = [p.grad.float() / 256.0 for p in model.parameters()]
    scaler.unscale_(opt)
    assert all(torch.equal(m.grad, g) for m, g in zip(master_params(opt), raw))
    before = [m.detach().clone() for m in master_params(opt)]
    scaler.step(opt)
    scaler.update()
    for b, m, g, p in zip(before, master_params(opt), raw, model.parameters()):
        assert torch.equal(m, torch.add(b, g, alpha=-0.1))  # SGD's own rounding
        assert torch.equal(p, m.detach().to(FP16))


# -- clipping, groups, schedulers, closures, state dicts ----------------------------------

def test_clip_master_grad_norm_matches_torch_on_fp32_gradients():
    params = _low_params()
    opt = MasterWeightOptimizer(torch.optim.SGD(params, lr=0.1))
    torch.manual_seed(3)
    grads = [torch.randn(p.shape).to(p.dtype) * 10 for p in params]
    for p, g in zip(params, grads):
        p.grad = g
    reference = [torch.zeros(p.shape, requires_grad=True) for p in params]
    for r, g in zip(reference, grads):
        r.grad = g.float().clone()  # clipping is in place
    expected = torch.nn.utils.clip_grad_norm_(reference, 1.5, norm_type=3.0)
    total = clip_master_grad_norm_(opt, 1.5, norm_type=3.0)
    assert torch.equal(total, expected)
    assert all(torch.equal(m.grad, r.grad) for m, r in zip(master_params(opt), reference))


def test_param_groups_keep_their_own_settings():
    a, b = nn.Parameter(torch.zeros(2, dtype=BF16)), nn.Parameter(torch.zeros(2, dtype=BF16))
    opt = MasterWeightOptimizer(torch.optim.SGD([{"params": [a], "lr": 1.0},
                                                 {"params": [b], "lr": 0.25}], lr=0.1))
    a.grad = torch.ones(2, dtype=BF16)
    b.grad = torch.ones(2, dtype=BF16)
    opt.step()
    assert torch.equal(a, torch.full((2,), -1.0, dtype=BF16))
    assert torch.equal(b, torch.full((2,), -0.25, dtype=BF16))
    c = nn.Parameter(torch.zeros(1, dtype=BF16))
    opt.add_param_group({"params": c, "lr": 2.0})
    assert opt.param_groups[2]["params"][0] is master_copy(c)
    c.grad = torch.ones(1, dtype=BF16)
    opt.step()
    assert c.item() == -2.0


@pytest.mark.parametrize("scheduler_first", [False, True])
def test_lr_schedulers_work_whether_made_before_or_after(scheduler_first):
    w = nn.Parameter(torch.zeros(1, dtype=BF16))
    opt = torch.optim.SGD([w], lr=1.0)
    if scheduler_first:
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        MasterWeightOptimizer(opt)
    else:
        MasterWeightOptimizer(opt)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()"
        for _ in range(3):
            opt.zero_grad()
            (w * 1.0).sum().backward()
            opt.step()
            sched.step()
    assert w.item() == -(1.0 + 0.5 + 0.25)  # masters moved, model refreshed each step
    assert opt.param_groups[0]["lr"] == 0.125


def test_closure_gradients_reach_the_masters():
    torch.manual_seed(4)
    model = convert_model(nn.Linear(3, 1), "O2", BF16)
    opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.rand(5, 3)
    before = [m.detach().clone() for m in master_params(opt)]

    def closure():
        opt.zero_grad()
        loss = model(x).pow(2).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert loss is not None
    assert not all(torch.equal(a, b) for a, b in zip(before, master_params(opt)))
    assert all(torch.equal(p, m.detach().to(BF16))
               for p, m in zip(model.parameters(), master_params(opt)))


def test_existing_optimizer_state_moves_to_the_masters():
    w = nn.Parameter(torch.ones(2, dtype=BF16))
    opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    w.grad = torch.ones(2, dtype=BF16)
    opt.step()
    MasterWeightOptimizer(opt)
    master = next(master_params(opt))
    assert w not in opt.state and opt.state[master]["momentum_buffer"].dtype is FP32


def test_model_params_maps_masters_back():
    params = _low_params()
    opt = MasterWeightOptimizer(torch.optim.SGD(params, lr=0.1))
    assert all(a is b for a, b in zip(model_params(opt), params))


def test_optimizer_state_dict_round_trip_in_fp32():
    params = _low_params()
    opt = MasterWeightOptimizer(torch.optim.Adam(params, lr=0.1))
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    state = copy.deepcopy(opt.state_dict())
    assert state["state"][0]["exp_avg"].dtype is FP32
    fresh_params = [nn.Parameter(p.detach().clone()) for p in params]
    fresh = MasterWeightOptimizer(torch.optim.Adam(fresh_params, lr=0.5))
    fresh.load_state_dict(state)
    assert fresh.param_groups[0]["lr"] == 0.1
    assert torch.equal(fresh.state[next(master_params(fresh))]["exp_avg"],
                       opt.state[next(master_params(opt))]["exp_avg"])


def test_moved_model_is_reported():
    from ampkit.conversion import _MASTERS

    # A model on another device than its masters (as if moved after initialize). This
    # machine has one real device, so the meta device stands in for the other one.
    w = nn.Parameter(torch.ones(2, dtype=BF16, device="meta"))
    _MASTERS[w] = nn.Parameter(torch.ones(2))
    opt = MasterWeightOptimizer(torch.optim.SGD([w], lr=0.1))
    w.grad = torch.ones(2, dtype=BF16, device="meta")
    with pytest.raises(RuntimeError, match="move the model to its device before"):
        opt.step()


@pytest.mark.parametrize("bad", [None, [torch.ones(1)], nn.Linear(1, 1)])
def test_not_an_optimizer(bad):
    with pytest.raises(TypeError, match=r"optimizer must be a torch.optim.Optimizer"):
        MasterWeightOptimizer(bad)
    with pytest.raises(TypeError, match=r"optimizer must be a torch.optim.Optimizer"):
        sync_master_grads(bad)


def test_foreign_patched_step_is_refused():
    opt = torch.optim.SGD([nn.Parameter(torch.ones(1, dtype=BF16))], lr=0.1)
    opt.step = lambda *a, **k: None
    with pytest.raises(RuntimeError, match="replaced on this optimizer instance"):
        MasterWeightOptimizer(opt)
    assert not isinstance(opt, MasterWeightOptimizer)
    assert opt.param_groups[0]["params"][0].dtype is BF16  # nothing changed


def test_transformer_o2_trains_with_tied_weights():
    torch.manual_seed(5)
    model = TinyTransformer()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt = ampkit.initialize(model, opt, level="O2", dtype=BF16)
    tied = model.embed.weight
    assert sum(p is master_copy(tied) for p in master_params(opt)) == 1
    ids = torch.arange(24).remainder(8).view(2, 12)
    first = None
    for _ in range(15):
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 64), ids[:, 1:].reshape(-1))
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.5 * first
    assert model.head.weight is tied and torch.equal(tied, master_copy(tied).to(BF16))


def test_a_parameter_changed_without_its_master_wins():
    model = convert_model(nn.Linear(2, 2), "O2", BF16)
    with torch.no_grad():
        model.weight.copy_(torch.full((2, 2), 3.0))  # an edit the master does not see
    assert torch.equal(model.state_dict()["weight"], torch.full((2, 2), 3.0))  # not stale
    opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    assert torch.equal(next(master_params(opt)), torch.full((2, 2), 3.0))  # refreshed
    model.weight.grad = torch.ones(2, 2, dtype=BF16)
    opt.step()
    assert torch.equal(model.weight, torch.full((2, 2), 2.5, dtype=BF16))  # not reverted


def test_training_without_master_weights_never_reports_stale_masters():
    torch.manual_seed(9)
    model = convert_model(nn.Linear(3, 2), "O2", BF16)
    plain = torch.optim.SGD(model.parameters(), lr=0.5)  # updates the bf16 weights only
    model(torch.rand(4, 3)).sum().backward()
    plain.step()
    state = model.state_dict()
    assert torch.equal(state["weight"], model.weight.detach().float())
    assert state["weight"].dtype is FP32
