"""Pure low-precision training (master_weights="stochastic" / "kahan") in the less
common uses: closure optimizers (LBFGS), the gradient life cycle, loads and edits of
the weights, ``copy.deepcopy`` / ``torch.save``, resuming after ``add_param_group``,
LR schedulers, step hooks, scalar state and bad input. Each is checked against fp32
training of the same model or against the mode's documented math done by hand."""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampkit
from ampkit.pure import PureLowPrecisionOptimizer

DEVICE = "cpu"
BF16 = torch.bfloat16
MODES = ["stochastic", "kahan"]


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4)).to(DEVICE)


def _pure(mode: str, seed: int = 0, optimizer=torch.optim.AdamW, **kwargs):
    model = _net(seed)
    opt = optimizer(model.parameters(), **(kwargs or {"lr": 1e-2}))
    return ampkit.initialize(model, opt, level="O2", dtype=BF16, master_weights=mode,
                             rounding_seed=1)


def _batches(n: int, seed: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g))
            for _ in range(n)]


def _train(model, opt, steps: int, seed: int = 5) -> list[float]:
    losses = []
    for x, y in _batches(steps, seed):
        loss = F.mse_loss(model(x).float(), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> list[Any]:
    """Every tensor of the model and every state entry of the optimizer (the rounding
    counts included), in parameter order."""
    out: list[Any] = [t.detach().clone() for t in model.state_dict(keep_vars=True).values()]
    for p in sorted(opt.state, key=lambda t: [id(q) for g in opt.param_groups
                                               for q in g["params"]].index(id(t))):
        out += [v.clone() if isinstance(v, torch.Tensor) else v
                for _, v in sorted(opt.state[p].items())]
    return out


def _same(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(
        x.dtype == y.dtype and torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
        for x, y in zip(a, b))


# -- closure optimizers -------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_lbfgs_evaluates_its_closure_at_the_weights_it_tries_and_trains_like_fp32(mode):
    # LBFGS calls the closure several times per step, at weights of its own line search:
    # the model must compute at those weights (rounded to bf16), and the gradients the
    # closure leaves must reach the optimizer.
    x, y = _batches(1)[0]

    def run(model, opt) -> tuple[list[float], list[float]]:
        seen, recomputed = [], []

        def closure():
            opt.zero_grad()
            loss = F.mse_loss(model(x).float(), y)
            loss.backward()
            seen.append(loss.item())
            with torch.no_grad():  # what the parameters the model holds now give
                recomputed.append(F.mse_loss(model(x).float(), y).item())
            return loss

        for _ in range(3):
            opt.step(closure)
        return seen, recomputed

    fp32 = _net()
    expected, _ = run(fp32, torch.optim.LBFGS(fp32.parameters(), lr=0.5, max_iter=4))
    model, opt = _pure_lbfgs(mode)
    before = [p.detach().clone() for p in model.parameters()]
    seen, recomputed = run(model, opt)
    assert len(seen) == len(expected) > 3  # several evaluations per step
    assert seen == recomputed  # each evaluation saw the weights the model held
    assert seen[-1] < 0.5 * seen[0]
    assert seen == pytest.approx(expected, rel=0.05)
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # LBFGS's flat vectors over all parameters are not per-element state: kept fp32
    w = model[0].weight
    assert w.dtype is BF16 and opt.state[w]["d"].dtype is torch.float32


def _pure_lbfgs(mode: str):
    model = _net()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    return ampkit.initialize(model, opt, level="O2", dtype=BF16, master_weights=mode,
                             rounding_seed=1)


@pytest.mark.parametrize("mode", MODES)
def test_a_closure_sees_the_current_weights_each_step_like_fp32(mode):
    fp32 = _net()
    fp32_opt = torch.optim.AdamW(fp32.parameters(), lr=1e-2)
    model, opt = _pure(mode)

    def run(net, optimizer) -> tuple[list[float], list[float]]:
        seen, before = [], []
        for x, y in _batches(1) * 6:  # one batch: the loss must fall
            def closure(x=x, y=y):
                optimizer.zero_grad()
                loss = F.mse_loss(net(x).float(), y)
                loss.backward()
                seen.append(loss.item())
                return loss

            with torch.no_grad():  # what the current weights give, computed outside
                before.append(F.mse_loss(net(x).float(), y).item())
            assert optimizer.step(closure).item() == seen[-1]
        return seen, before

    seen, before = run(model, opt)
    assert seen == before  # each closure call saw the weights as they were then
    expected, _ = run(fp32, fp32_opt)
    assert expected[-1] < 0.8 * expected[0]
    assert seen == pytest.approx(expected, rel=0.03)


# -- the gradient life cycle --------------------------------------------------------------

def _accumulating_loop(model, opt, zero, clip: float | None, micro: int) -> list[float]:
    losses = []
    for x, y in _batches(5):
        (model if zero == "model" else opt).zero_grad()
        for part_x, part_y in zip(x.chunk(micro), y.chunk(micro)):
            loss = F.mse_loss(model(part_x).float(), part_y) / micro
            loss.backward()
            losses.append(loss.item())
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return losses


@pytest.mark.parametrize("mode", MODES)
def test_zero_grad_either_way_accumulation_and_clipping_train_like_fp32(mode):
    fp32 = _net()
    expected = _accumulating_loop(fp32, torch.optim.AdamW(fp32.parameters(), lr=1e-2),
                                  "opt", 0.5, 2)
    results = []
    for zero in ("model", "opt"):
        model, opt = _pure(mode)
        results.append(_accumulating_loop(model, opt, zero, 0.5, 2))
    assert results[0] == results[1]  # model.zero_grad() and opt.zero_grad() alike
    assert results[0] == pytest.approx(expected, rel=0.03)


@pytest.mark.parametrize("clip", [None, 1.0])
def test_accumulated_clipped_gradient_is_what_the_step_applies(clip):
    # SGD lr=1: weight + Kahan compensation after the step is w0 - (clipped g1 + g2),
    # up to the compensation's truncation (relative 2**-16), computed by hand.
    w = nn.Parameter(torch.tensor([4.0, -3.0, 0.5], dtype=BF16))
    opt = PureLowPrecisionOptimizer(torch.optim.SGD([w], lr=1.0), "kahan")
    g1, g2 = torch.tensor([1.0, 2.0, 0.5]), torch.tensor([2.0, 2.0, 0.25])
    (w.float() * g1).sum().backward()
    (w.float() * g2).sum().backward()
    total = g1 + g2
    if clip is not None:
        torch.nn.utils.clip_grad_norm_([w], clip)
        total = total * clip / total.norm()
    assert torch.allclose(w.grad.float(), total, rtol=2 ** -7)  # bf16 gradient
    applied = w.grad.float()
    grad_before = w.grad
    opt.step()
    assert w.grad is grad_before and w.grad.dtype is BF16  # the step leaves it
    new = w.detach().float() + opt.state[w]["kahan_compensation"].float()
    assert torch.allclose(new, torch.tensor([4.0, -3.0, 0.5]) - applied, rtol=2 ** -14,
                          atol=0)


# -- loading ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_a_loaded_state_dict_is_what_the_model_then_holds_and_trains_from(mode):
    model, opt = _pure(mode, optimizer=torch.optim.SGD, lr=1e-3)
    _train(model, opt, 3)  # Kahan: every weight has a compensation by now
    source = {k: torch.randn_like(v) for k, v in _net(7).state_dict().items()}
    model.load_state_dict(source)
    saved = model.state_dict()
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), source[name].to(p.dtype))  # rounded to nearest
        assert torch.equal(saved[name].float(), p.detach().float())  # saved: the truth
    # One SGD step from the loaded weights, by hand: loaded - lr * gradient. With Kahan,
    # weight + compensation is that within the compensation's truncation (2**-17
    # relative), with no compensation left over from the weights before the load (up
    # to 2**-9 relative); stochastic lands on a bf16 neighbour of it.
    x, y = _batches(1, seed=3)[0]
    opt.zero_grad()
    F.mse_loss(model(x).float(), y).backward()
    expected = {n: p.detach().float().add(p.grad.float(), alpha=-1e-3)
                for n, p in model.named_parameters()}
    opt.step()
    for name, p in model.named_parameters():
        got, want = p.detach().float(), expected[name]
        if p.dtype is torch.float32:  # the LayerNorm, stepped as it is
            assert torch.equal(got, want), name
        elif mode == "kahan":
            got = got + opt.state[p]["kahan_compensation"].float()
            assert bool(((got - want).abs() <= 2 ** -15 * want.abs()).all()), name
        else:
            down = (want.view(torch.int32) & -65536).view(torch.float32)
            gap = torch.where(want.to(BF16).float() == want, 0.0, 2 ** -7 * down.abs())
            assert bool(((got - want).abs() <= gap).all()), name  # within one bf16 gap


@pytest.mark.parametrize("edit", ["copy_", "data =", "data.copy_"])
def test_a_kahan_weight_changed_outside_the_step_drops_its_compensation(edit):
    # SGD, lr 1e-3, gradient 1, from 1.0: three steps leave the weight at 0.99609375
    # with 0.00090625 in the compensation. Then the weight is set to 2.0 and stepped.
    w = nn.Parameter(torch.ones(64, dtype=BF16))
    opt = PureLowPrecisionOptimizer(torch.optim.SGD([w], lr=1e-3), "kahan")
    for _ in range(3):
        w.grad = torch.ones_like(w)
        opt.step()
    old = opt.state[w]["kahan_compensation"].float()
    assert bool(old.ne(0).all())
    new = torch.full((64,), 2.0, dtype=BF16)
    if edit == "copy_":  # what model.load_state_dict does
        with torch.no_grad():
            w.copy_(new)
    elif edit == "data =":
        w.data = new
    else:  # through .data: its version counter is not the parameter's (documented)
        w.data.copy_(new)
    w.grad = torch.ones_like(w)
    opt.step()
    got = w.detach().float() + opt.state[w]["kahan_compensation"].float()
    start = torch.full((64,), 2.0) + (old if edit == "data.copy_" else 0.0)
    want = start.add(torch.ones(64), alpha=-1e-3)  # SGD's fp32 math, by hand
    assert torch.allclose(got, want, rtol=2 ** -14, atol=0)


# -- deepcopy -----------------------------------------------------------------------------

def _save_and_load(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("copier", [copy.deepcopy, _save_and_load])
@pytest.mark.parametrize("mode", MODES)
def test_a_copy_of_model_and_optimizer_trains_bit_for_bit_like_the_original(mode, copier):
    model, opt = _pure(mode)
    _train(model, opt, 2)
    twin, twin_opt = copier((model, opt))
    assert isinstance(twin_opt, torch.optim.AdamW) and type(twin_opt) is type(opt)
    assert twin_opt.param_groups[0]["params"][0] is twin[0].weight
    assert _same(_snapshot(model, opt), _snapshot(twin, twin_opt))
    assert _train(model, opt, 3, seed=7) == _train(twin, twin_opt, 3, seed=7)
    assert _same(_snapshot(model, opt), _snapshot(twin, twin_opt))


@pytest.mark.parametrize("mode", MODES)
def test_a_pickle_naming_the_former_module_loads_and_trains_alike(mode):
    # Pickles made before the rename name ampkit.master_weights_pure and its private
    # names; new ones name the package ampkit.pure only. The old module is gone, so
    # ampkit.common.unpickling reads them.
    import pickle
    import pickletools

    from ampkit.common import unpickling

    model, opt = _pure(mode)
    _train(model, opt, 2)
    data = pickle.dumps((model, opt), protocol=2)  # GLOBAL opcodes: "module\nname\n"
    named = {a for op, a, _ in pickletools.genops(data) if op.name == "GLOBAL"}
    assert {"ampkit.pure rebuild_pure", "ampkit.pure PureState"} <= named
    assert not any(n.startswith("ampkit.pure.") for n in named)
    old = data.replace(b"ampkit.pure\nrebuild_pure\n",
                       b"ampkit.master_weights_pure\n_rebuild_pure\n").replace(
        b"ampkit.pure\nPureState\n", b"ampkit.master_weights_pure\n_Pure\n")
    assert old != data
    with pytest.raises(ModuleNotFoundError, match=r"ampkit\.master_weights_pure"):
        pickle.loads(old)
    twin, twin_opt = unpickling.loads(old)
    assert type(twin_opt) is type(opt)
    assert _train(model, opt, 2, seed=7) == _train(twin, twin_opt, 2, seed=7)
    assert _same(_snapshot(model, opt), _snapshot(twin, twin_opt))


def test_deepcopy_of_the_model_alone_copies_its_weights():
    for mode in MODES:
        model, opt = _pure(mode)
        _train(model, opt, 2)
        twin = copy.deepcopy(model)
        for a, b in zip(model.parameters(), twin.parameters()):
            assert a is not b and a.dtype == b.dtype and torch.equal(a, b)
        _train(model, opt, 1)  # the copy is its own
        assert not torch.equal(model[0].weight, twin[0].weight)
        # The Kahan compensation is optimizer state; any model saves its weights.
        assert all(torch.equal(v.float(), p.detach().float()) for v, p in
                   zip(twin.state_dict().values(), twin.state_dict(keep_vars=True).values()))


@pytest.mark.parametrize("mode", MODES)
def test_torch_save_of_the_optimizer_alone_keeps_its_class_state_and_rounding(mode):
    model, opt = _pure(mode)
    _train(model, opt, 2)
    loaded = _save_and_load(opt)  # its parameters are copies, in their groups
    assert type(loaded).__name__ == "PureLowPrecisionAdamW"
    assert isinstance(loaded, torch.optim.AdamW) and loaded.param_groups[0]["rounding_seed"] == 1
    params = [p for g in loaded.param_groups for p in g["params"]]
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), params))
    for _ in range(2):
        for a, b in zip(model.parameters(), params):
            a.grad = torch.full_like(a, 0.01)
            b.grad = torch.full_like(b, 0.01)
        opt.step()
        loaded.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), params))
    assert [sorted(s) for s in opt.state.values()] == [sorted(s) for s in loaded.state.values()]


# -- optimizer checkpoints ----------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_resume_after_add_param_group_is_bit_for_bit(mode):
    def setup():
        model = _net()
        opt = torch.optim.AdamW(model[0].parameters(), lr=1e-2)
        model, opt = ampkit.initialize(model, opt, level="O2", dtype=BF16,
                                       master_weights=mode, rounding_seed=4)
        _train(model, opt, 1)
        opt.add_param_group({"params": [*model[1].parameters(), *model[2].parameters()],
                             "lr": 3e-3})
        return model, opt

    model, opt = setup()
    _train(model, opt, 2)
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    assert mode != "kahan" or "kahan_compensation" in opt.state[model[2].weight]
    expected = _train(model, opt, 3, seed=8)

    resumed, resumed_opt = setup()  # a different history: everything comes from files
    _train(resumed, resumed_opt, 1, seed=11)
    resumed.load_state_dict(saved[0])
    resumed_opt.load_state_dict(saved[1])
    assert _train(resumed, resumed_opt, 3, seed=8) == expected
    assert _same(_snapshot(model, opt), _snapshot(resumed, resumed_opt))


def test_a_float16_parameter_group_is_refused():
    _, opt = _pure("kahan")
    groups = len(opt.param_groups)
    with pytest.raises(ValueError, match="bfloat16 parameters"):
        opt.add_param_group({"params": [nn.Parameter(torch.ones(2, dtype=torch.float16))]})
    assert len(opt.param_groups) == groups


# -- learning rates -----------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_step_lr_and_edited_lr_act_like_fp32(mode):
    # SGD on a constant gradient of 1: the weight moves by exactly the lr of each step
    # (Kahan: weight + compensation; stochastic: on average over 2**16 weights).
    def run(make) -> tuple[list[float], list[float]]:
        w = nn.Parameter(torch.full((2 ** 16,), 2.0))
        opt = make(torch.optim.SGD([w], lr=1e-3))
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.1)
        values, lrs = [], []
        for i in range(6):
            if i == 4:
                opt.param_groups[0]["lr"] = 0.5  # an edit by hand
            lrs.append(opt.param_groups[0]["lr"])
            w.grad = torch.ones_like(w)
            opt.step()
            sched.step()
            value = w.detach().float()
            if "kahan_compensation" in opt.state[w]:
                value = value + opt.state[w]["kahan_compensation"].float()
            values.append(value.mean().item())
        return values, lrs

    def pure(opt):
        opt.param_groups[0]["params"][0].data = opt.param_groups[0]["params"][0].data.to(BF16)
        return PureLowPrecisionOptimizer(opt, mode, seed=0)

    expected, expected_lrs = run(lambda o: o)
    got, lrs = run(pure)
    assert lrs == expected_lrs == pytest.approx([1e-3, 1e-3, 1e-4, 1e-4, 0.5, 0.5])
    # lr 1e-3 then 1e-4: a missed decay would be 9e-4 off from the third step on
    assert got == pytest.approx(expected, abs=2e-5 if mode == "kahan" else 2e-4)
    assert got[-1] == pytest.approx(2.0 - 2e-3 - 2e-4 - 1.0, abs=1e-4)


# -- bad input ----------------------------------------------------------------------------

def test_bad_pure_arguments_are_refused_before_anything_changes():
    def fresh():
        model = nn.Linear(2, 2).to(DEVICE)
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    model, opt = fresh()
    with pytest.raises(TypeError, match=r"rounding_seed must be an int or None, got 'x'"):
        ampkit.initialize(model, opt, level="O2", dtype=BF16, master_weights="kahan",
                          rounding_seed="x")
    assert model.weight.dtype is torch.float32 and not hasattr(opt, "_ampkit_pure")
    with pytest.raises(ValueError, match=r"master_weights='kahan'.*bfloat16.*level O2 or O3"):
        ampkit.initialize(*fresh(), level="O0", master_weights="kahan")
    with pytest.raises(ValueError, match=r"master_weights.*must be False or None"):
        ampkit.initialize(*fresh(), level="O1", master_weights="stochastic")
    with pytest.raises(ValueError, match=r"master_weights must be .*'stochastic', "
                                         r"'kahan'.*got 'kahn'"):
        ampkit.initialize(*fresh(), level="O2", dtype=BF16, master_weights="kahn")
    # a mode's name in any case, as the text of a flag or a file
    _, kahan = ampkit.initialize(*fresh(), level="O2", dtype=BF16, master_weights="Kahan")
    assert type(kahan).__name__ == "PureLowPrecisionSGD"
    with pytest.raises(ValueError, match=r"float16 has too little range.*"
                                         r"master_weights=True"):
        ampkit.initialize(*fresh(), level="O3", dtype=torch.float16,
                          master_weights="stochastic")


# -- step hooks ---------------------------------------------------------------------------

def test_step_hooks_run_once_per_step_and_see_every_parameter_like_fp32():
    def run(make) -> list[tuple[str, int]]:
        model = _net()
        opt = make(model, torch.optim.SGD(model.parameters(), lr=0.1))
        calls = []

        def hook(kind):
            return lambda o, args, kwargs: calls.append(
                (kind, sum(len(g["params"]) for g in o.param_groups)))

        opt.register_step_pre_hook(hook("pre"))
        opt.register_step_post_hook(hook("post"))
        _train(model, opt, 2)
        return calls

    def pure(model, opt):
        model = ampkit.initialize(model, level="O2", dtype=BF16)
        return PureLowPrecisionOptimizer(opt, "kahan", chunk_bytes=1)  # a chunk each

    expected = run(lambda model, opt: opt)
    assert expected == [("pre", 6), ("post", 6)] * 2
    assert run(pure) == expected


# -- checkpoints across modes -------------------------------------------------------------

@pytest.mark.parametrize("mode", ["stochastic", "nearest", "kahan"])
def test_a_kahan_checkpoint_loads_its_compensation_only_into_kahan(mode):
    # With the mark torch.save keeps, another rounding is refused; without it (as in
    # Distributed Checkpoint's state dicts), a Kahan optimizer takes the compensation
    # and the others drop it: they would never update it.
    kahan, kahan_opt = _pure("kahan")
    _train(kahan, kahan_opt, 2)
    saved = copy.deepcopy(kahan_opt.state_dict())
    bare = {k: v for k, v in saved.items() if k != "ampkit_pure_low_precision"}
    _, opt = _pure(mode) if mode != "nearest" else _nearest()
    if mode != "kahan":
        with pytest.raises(ValueError, match=f"saved with rounding='kahan'.*'{mode}'"):
            opt.load_state_dict(saved)
    opt.load_state_dict(bare)
    comps = [s.get("kahan_compensation") for s in opt.state.values()]
    if mode == "kahan":
        expected = [s["kahan_compensation"] for s in kahan_opt.state.values()
                    if "kahan_compensation" in s]
        loaded = [c for c in comps if c is not None]
        assert len(loaded) == len(expected) == 4  # the bf16 Linears' weights and biases
        assert all(torch.equal(a, b) for a, b in zip(loaded, expected))
    else:
        assert comps == [None] * len(comps)


def _nearest():
    model = _net()
    model[0].to(BF16)  # the Linears in bf16, as the pure modes have them
    model[2].to(BF16)
    return model, PureLowPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                                            "nearest", seed=1)


# -- scalar optimizer state -----------------------------------------------------------------

@pytest.mark.parametrize("make,keys", [
    (lambda p: torch.optim.NAdam(p, lr=1e-2), ["mu_product"]),
    (lambda p: torch.optim.ASGD(p, lr=1e-2), ["eta", "mu"]),
])
def test_scalar_state_stays_float32_and_exact_like_fp32(make, keys):
    # NAdam's mu_product and ASGD's eta and mu follow from the step count and the
    # hyper-parameters only: the pure optimizer must hold fp32's very values.
    fp32 = _net()
    fp32_opt = make(fp32.parameters())
    _train(fp32, fp32_opt, 2)
    _train(fp32, fp32_opt, 2, seed=6)
    for mode in MODES:
        model = _net()
        model, opt = ampkit.initialize(model, make(model.parameters()), level="O2",
                                       dtype=BF16, master_weights=mode, rounding_seed=0)
        _train(model, opt, 2)
        resumed = _net()  # ... also through a checkpoint (torch would store it in bf16)
        resumed, resumed_opt = ampkit.initialize(
            resumed, make(resumed.parameters()), level="O2", dtype=BF16,
            master_weights=mode)
        saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
        resumed.load_state_dict(saved[0])
        resumed_opt.load_state_dict(saved[1])
        _train(resumed, resumed_opt, 2, seed=6)
        _train(model, opt, 2, seed=6)
        for key in keys:
            expected = fp32_opt.state[fp32[0].weight][key]
            for got in (opt.state[model[0].weight][key],
                        resumed_opt.state[resumed[0].weight][key]):
                assert got.dtype is torch.float32 and torch.equal(got, expected), (mode, key)
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed.parameters()))
        assert opt.state[model[0].weight]["exp_avg" if "mu" not in keys else "ax"
                                          ].dtype is BF16


@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
def test_an_optimizer_built_after_initialize_must_be_made_pure(rounding: str) -> None:
    """Built after ``initialize(master_weights=...)``, a plain optimizer would step the
    bf16 weights with updates rounded to nearest: its first step raises, before any
    change, and says how to build it; made pure as it says, it trains."""
    torch.manual_seed(0)
    model = ampkit.initialize(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)),
                              level="O2", dtype=torch.bfloat16, master_weights=rounding,
                              rounding_seed=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # after initialize
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.rand(2, 4, device="cpu")).sum().backward()
    with pytest.raises(RuntimeError, match=rf"master_weights='{rounding}'.*"
                                           rf"PureLowPrecisionOptimizer\(optimizer, "
                                           rf"'{rounding}', seed=3\)"):
        opt.step()
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert not opt.state
    from ampkit.pure import PureLowPrecisionOptimizer

    opt = PureLowPrecisionOptimizer(opt, rounding, seed=3)
    opt.step()
    assert opt.state[model[0].weight]["exp_avg"].dtype == torch.bfloat16
    # and an optimizer over a model not trained purely is left alone
    plain = torch.nn.Linear(2, 2).to(torch.bfloat16)
    sgd = torch.optim.SGD(plain.parameters(), lr=0.1)
    plain(torch.ones(1, 2, dtype=torch.bfloat16)).sum().backward()
    sgd.step()


@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
def test_prepare_optimizer_reads_the_rounding_and_seed_from_the_model(rounding: str) -> None:
    """``ampkit.fsdp.prepare_optimizer`` (FSDP2's one optimizer call; it needs no
    sharding) makes a plain optimizer pure as ``initialize`` would have: the two train
    bit for bit alike, the mode and seed given once."""
    import ampkit.fsdp

    def build(prepared: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8),
                                    torch.nn.Linear(8, 2))
        settings = dict(level="O2", dtype=BF16, master_weights=rounding, rounding_seed=9)
        if prepared:
            model = ampkit.initialize(model, **settings)
            return model, ampkit.fsdp.prepare_optimizer(
                model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        return ampkit.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                 **settings)

    runs = []
    for prepared in (False, True):
        model, opt = build(prepared)
        for x, y in _batches(4):
            opt.zero_grad()
            F.mse_loss(model(x[:, :4]).float(), y[:, :2]).backward()
            opt.step()
        runs.append(([p.detach().clone() for p in model.parameters()], opt))
    (expected, _), (got, opt) = runs
    assert type(opt).__name__ == "PureLowPrecisionAdamW"
    assert opt.param_groups[0]["rounding_seed"] == 9
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


def test_prepare_optimizer_refuses_what_is_not_the_models() -> None:
    import ampkit.fsdp

    model = ampkit.initialize(torch.nn.Linear(2, 2), level="O2", dtype=BF16)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    assert ampkit.fsdp.prepare_optimizer(model, sgd) is sgd  # O2: nothing to make pure
    assert type(sgd) is torch.optim.SGD
    with pytest.raises(TypeError, match=r"optimizer must be a torch\.optim\.Optimizer"):
        ampkit.fsdp.prepare_optimizer(model, "sgd")
    other = torch.optim.SGD(torch.nn.Linear(2, 3).parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"param_groups\[0\] holds a parameter of shape "
                                         r"\(3, 2\) that is not one of model.parameters"):
        ampkit.fsdp.prepare_optimizer(model, other)
    with pytest.raises(ValueError, match=r"takes the model ampkit\.initialize"):
        ampkit.fsdp.prepare_optimizer(torch.nn.Linear(2, 2), sgd)
