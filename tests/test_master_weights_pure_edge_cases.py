"""Pure low-precision training (master_weights="stochastic" / "kahan") in the less
common uses the fp32-master mode was hardened for (issue 16): closure optimizers,
gradient life cycle, failed / good / ``assign=True`` loads, ``copy.deepcopy``, resuming
after ``add_param_group``, LR schedulers and bad input. Each is checked against fp32
training of the same model or against the mode's documented math done by hand."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampkit
from ampkit.master_weights_pure import PureLowPrecisionOptimizer

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


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor of the model and the optimizer, and the generator states."""
    out = [t.detach().clone() for t in model.state_dict(keep_vars=True).values()]
    for p in sorted(opt.state, key=lambda t: [id(q) for g in opt.param_groups
                                               for q in g["params"]].index(id(t))):
        out += [v.clone() for _, v in sorted(opt.state[p].items())
                if isinstance(v, torch.Tensor)]
    out += list(opt.state_dict()["ampkit_pure_low_precision"]["generators"].values())
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y)
                                    for x, y in zip(a, b))


# -- closure optimizers -------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_lbfgs_is_refused_clearly_and_nothing_changes(mode):
    model = _net()
    opt = torch.optim.LBFGS(model.parameters(), max_iter=5)
    with pytest.raises(TypeError, match=r"LBFGS.*closure.*master_weights=True"):
        ampkit.initialize(model, opt, level="O2", dtype=BF16, master_weights=mode)
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # not converted
    with pytest.raises(TypeError, match="LBFGS"):
        PureLowPrecisionOptimizer(torch.optim.LBFGS(
            [nn.Parameter(torch.ones(2, dtype=BF16))]), mode)


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
def test_a_failed_load_changes_nothing(mode):
    model, opt = _pure(mode)
    _train(model, opt, 2)
    before = _snapshot(model, opt)
    bad = model.state_dict()
    bad["0.weight"] = torch.randn(16, 8) * 100  # good, and loaded first by torch
    bad["2.weight"] = torch.randn(4, 15)
    with pytest.raises(RuntimeError, match=r"size mismatch for 2\.weight"):
        model.load_state_dict(bad)
    partial = {k: v * 3 for k, v in model.state_dict().items() if k != "2.bias"}
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "2.bias"'):
        model.load_state_dict(partial)
    with pytest.raises(RuntimeError, match=r"assign=True\) is not supported"):
        model.load_state_dict(model.state_dict(), assign=True)
    assert _same(before, _snapshot(model, opt))
    twin, twin_opt = _pure(mode)
    _train(twin, twin_opt, 2)
    assert _train(model, opt, 2, seed=9) == _train(twin, twin_opt, 2, seed=9)


@pytest.mark.parametrize("mode", MODES)
def test_a_loaded_fp32_state_dict_is_what_the_model_then_holds(mode):
    model, opt = _pure(mode)
    _train(model, opt, 3)  # Kahan: every weight has a compensation by now
    source = {k: torch.randn_like(v) for k, v in _net(7).state_dict().items()}
    model.load_state_dict(source)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), source[name].to(p.dtype))  # rounded to nearest
    saved = model.state_dict()
    for key, value in source.items():
        # The model reports what it loaded: exactly where bf16 holds it, and within
        # the compensation's truncation with Kahan; never an old compensation on top.
        tol = 2 ** -15 * value.abs() if mode == "kahan" else (
            value - value.to(BF16).float()).abs()
        if key.startswith("1."):  # the fp32 LayerNorm
            tol = torch.zeros_like(value)
        assert bool(((saved[key] - value).abs() <= tol).all()), key
    # ... and an fp32 model loads the pure model's state_dict exactly.
    fp32 = _net(3)
    fp32.load_state_dict(saved)
    assert all(torch.equal(v, saved[k]) for k, v in fp32.state_dict().items())


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
    for (k, a), b in zip(model.state_dict().items(), twin.state_dict().values()):
        assert torch.equal(a, b), k  # Kahan: the copy reports its compensation too
    assert _train(model, opt, 3, seed=7) == _train(twin, twin_opt, 3, seed=7)
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
        # The Kahan compensation is optimizer state: a copy without its optimizer
        # reports its bf16 weights (documented).
        assert all(torch.equal(v, p.detach().float()) for v, p in
                   zip(twin.state_dict().values(), twin.state_dict(keep_vars=True).values()))


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
                                         r"'kahan'.*got 'Kahan'"):
        ampkit.initialize(*fresh(), level="O2", dtype=BF16, master_weights="Kahan")
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
def test_a_kahan_buffer_carried_through_an_fp32_optimizer_is_ignored(mode):
    # A Kahan checkpoint resumed in fp32 carries "kahan_compensation" in the fp32
    # optimizer's state (AdamW ignores it, and the fp32 weights already hold it).
    # Loaded back into a pure optimizer it must change nothing: without Kahan it is
    # never updated; with Kahan it belongs to weights the fp32 run has since moved.
    kahan, kahan_opt = _pure("kahan")
    _train(kahan, kahan_opt, 2)
    fp32 = _net()
    fp32_opt = torch.optim.AdamW(fp32.parameters(), lr=1e-2)
    fp32.load_state_dict(kahan.state_dict())
    fp32_opt.load_state_dict(kahan_opt.state_dict())
    _train(fp32, fp32_opt, 1)
    carried = fp32_opt.state_dict()
    assert any("kahan_compensation" in s for s in carried["state"].values())
    clean = copy.deepcopy(carried)
    for state in clean["state"].values():
        state.pop("kahan_compensation", None)
    runs = []
    for saved in (carried, clean):
        model = _net()
        opt = PureLowPrecisionOptimizer(torch.optim.AdamW(
            ampkit.initialize(model, level="O2", dtype=BF16,
                              master_weights=False).parameters(), lr=1e-2), mode, seed=2)
        model.load_state_dict(fp32.state_dict())
        opt.load_state_dict(saved)
        _train(model, opt, 3)
        runs.append(([p.detach().clone() for p in model.parameters()],
                     _snapshot(model, opt)))
    assert _same(runs[0][0], runs[1][0])  # the weights
    assert _same(runs[0][1], runs[1][1])  # and no stale buffer left in the state


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
