"""Pure low-precision training (master_weights="stochastic" / "kahan"): rounding,
checkpoints, skipped steps, memory and convergence against plain fp32 training."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import ampkit
from ampkit.master_weights_pure import (
    PureLowPrecisionOptimizer,
    pure_rounding,
    stochastic_round,
)
from ampkit.tools.pure_curves import CharGPT, digits_accuracy, train_curves

DEVICE = "cpu"
BF16 = torch.bfloat16


def _neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values just below and just above fp32 ``x`` (by truncating the bit
    pattern: an oracle independent of the code under test)."""
    bits = x.view(torch.int32)
    down = (bits & -65536).view(torch.float32)
    up = torch.where(down == x, down, (down.to(BF16).view(torch.int16) + 1)
                     .view(BF16).float())
    lo = torch.minimum(down, up)
    hi = torch.maximum(down, up)
    return lo, hi


# -- stochastic rounding --------------------------------------------------------------

def test_stochastic_rounding_is_unbiased_and_lands_on_a_neighbour():
    gen = torch.Generator(DEVICE).manual_seed(0)
    x = torch.randn(64, device=DEVICE) * 10.0 ** torch.randint(-6, 4, (64,))
    lo, hi = _neighbours(x)
    draws = torch.stack([stochastic_round(x, gen).float() for _ in range(4000)])
    assert bool(((draws == lo) | (draws == hi)).all())
    # Expected value is x: the share rounded up is (x - lo) / (hi - lo).
    gap = (hi - lo).clamp_min(torch.finfo(torch.float32).tiny)
    share_up = (draws == hi).double().mean(0)
    expected = ((x - lo) / gap).double()
    expected = torch.where(hi == lo, torch.zeros_like(expected), expected)
    assert (share_up - expected).abs().max().item() < 0.035  # ~4.4 sigma at n=4000
    nearest_bias = (x.to(BF16).float() - x).abs().mean() / (hi - lo).mean()
    assert nearest_bias > 0.1  # round-to-nearest is biased on the same values


def test_stochastic_rounding_keeps_exact_values_and_specials():
    exact = torch.tensor([0.0, -0.0, 1.0, -2.5, float("inf"), -float("inf")])
    assert torch.equal(stochastic_round(exact).float(), exact)
    assert stochastic_round(torch.tensor([float("nan")])).isnan().all()
    with pytest.raises(TypeError, match="float32"):
        stochastic_round(torch.ones(2, dtype=torch.float64))


def _sgd_run(seed: int, rounding: str = "stochastic", steps: int = 20) -> torch.Tensor:
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(257, device=DEVICE).to(BF16))
    opt = PureLowPrecisionOptimizer(torch.optim.SGD([w], lr=1e-3, momentum=0.9),
                                    rounding, seed=seed)
    for _ in range(steps):
        w.grad = torch.sin(w.detach().float() * 3).to(BF16)
        opt.step()
    return w.detach().clone()


def test_stochastic_rounding_is_reproducible_with_a_seed():
    assert torch.equal(_sgd_run(1), _sgd_run(1))
    assert not torch.equal(_sgd_run(1), _sgd_run(2))


# -- Kahan and round-to-nearest -------------------------------------------------------

@pytest.mark.parametrize("rounding", ["kahan", "stochastic"])
def test_tiny_updates_accumulate_where_round_to_nearest_loses_them(rounding):
    # 1000 steps of 1e-4 on 1.0: the exact result is 0.9; bf16's half ulp at 1 is 2**-9.
    def run(mode: str) -> float:
        w = torch.nn.Parameter(torch.ones(512, dtype=BF16, device=DEVICE))
        opt = PureLowPrecisionOptimizer(torch.optim.SGD([w], lr=1e-4), mode, seed=0)
        for _ in range(1000):
            w.grad = torch.ones_like(w)
            opt.step()
        value = w.detach().float()
        if mode == "kahan":
            value = value + opt.state[w]["kahan_compensation"].float()
        return value.mean().item()

    assert run("nearest") == 1.0
    assert run(rounding) == pytest.approx(0.9, abs=2e-3)


@pytest.mark.parametrize("variant", [{"foreach": False}, {"foreach": True},
                                     {"fused": True}])
def test_one_step_matches_fp32_adamw_up_to_the_final_rounding(variant):
    torch.manual_seed(0)
    w0 = torch.randn(300, device=DEVICE).to(BF16)
    g = torch.randn(300, device=DEVICE).to(BF16)
    ref = torch.nn.Parameter(w0.float())
    ref.grad = g.float()
    torch.optim.AdamW([ref], lr=1e-2, **variant).step()
    lo, hi = _neighbours(ref.detach())
    for rounding in ("stochastic", "kahan", "nearest"):
        w = torch.nn.Parameter(w0.clone())
        w.grad = g.clone()
        opt = PureLowPrecisionOptimizer(torch.optim.AdamW([w], lr=1e-2, **variant),
                                        rounding, seed=0)
        opt.step()
        out = w.detach().float()
        assert w.dtype is BF16 and opt.state[w]["exp_avg"].dtype is BF16
        assert bool(((out == lo) | (out == hi)).all()), rounding
        if rounding == "kahan":
            comp = opt.state[w]["kahan_compensation"].float()
            assert torch.allclose(out + comp, ref.detach(), rtol=2 ** -14, atol=0)
        if rounding == "nearest":
            assert torch.equal(w.detach(), ref.detach().to(BF16))
        assert w.grad is not None and w.grad.dtype is BF16


# -- skipped steps and checkpoints ----------------------------------------------------

def _snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in model.parameters()]
    for state in opt.state.values():
        out += [v.clone() for v in state.values() if isinstance(v, torch.Tensor)]
    return out


def _generator_states(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return list(opt.state_dict()["ampkit_pure_low_precision"]["generators"].values())


@pytest.mark.parametrize("fused", [False, True])
def test_a_step_skipped_by_the_loss_scaler_changes_nothing(fused):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8).to(device=DEVICE, dtype=BF16)
    opt = PureLowPrecisionOptimizer(torch.optim.AdamW(model.parameters(), fused=fused),
                                    "stochastic", seed=0)
    scaler = ampkit.GradScaler(DEVICE, init_scale=2.0 ** 4)
    for poison in (False, True, False):
        loss = model(torch.ones(2, 8, dtype=BF16)).sum()
        scaler.scale(loss * (float("inf") if poison else 1.0)).backward()
        before = _snapshot(model, opt) + _generator_states(opt)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        after = _snapshot(model, opt) + _generator_states(opt)
        same = len(before) == len(after) and all(
            torch.equal(a, b) for a, b in zip(before, after))
        assert same is poison and scaler.last_step_skipped is poison


def test_found_inf_handed_to_the_step_skips_it():
    w = torch.nn.Parameter(torch.ones(4, dtype=BF16))
    opt = PureLowPrecisionOptimizer(torch.optim.SGD([w], lr=0.1), "stochastic", seed=0)
    w.grad = torch.ones_like(w)
    opt.found_inf = torch.ones(())  # what torch.amp.GradScaler sets on fused optimizers
    opt.step()
    assert torch.equal(w.detach(), torch.ones(4, dtype=BF16)) and not opt.state
    del opt.found_inf
    opt.step()
    assert w.detach().float().max().item() < 1.0


def _char_gpt() -> torch.nn.Module:
    torch.manual_seed(0)
    return CharGPT(vocab=16, dim=16, heads=2, layers=1, context=8).to(DEVICE)


def _train(model, opt, steps: int, start: int) -> None:
    for s in range(start, start + steps):
        ids = torch.randint(0, 16, (4, 9), generator=torch.Generator().manual_seed(s))
        loss = F.cross_entropy(model(ids[:, :-1]).float().flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("mode,make_opt", [
    ("stochastic", lambda p: torch.optim.AdamW(p, lr=1e-3)),
    ("kahan", lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=True)),
    ("kahan", lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9)),
])
def test_resume_from_a_checkpoint_continues_bit_for_bit(mode, make_opt):
    def setup():
        model = _char_gpt()
        return ampkit.initialize(model, make_opt(model.parameters()), level="O2",
                                 dtype=BF16, master_weights=mode, rounding_seed=3)

    model, opt = setup()
    _train(model, opt, 3, 0)
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    assert all(v.dtype is torch.float32 for v in saved[0].values() if v.is_floating_point())
    _train(model, opt, 3, 3)

    resumed, resumed_opt = setup()
    resumed.load_state_dict(saved[0])
    resumed_opt.load_state_dict(saved[1])
    _train(resumed, resumed_opt, 3, 3)
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert all(torch.equal(a, b) for a, b in zip(_snapshot(model, opt),
                                                  _snapshot(resumed, resumed_opt)))


def test_a_kahan_model_saves_weights_plus_compensation_and_loads_into_fp32():
    model = _char_gpt()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    model, opt = ampkit.initialize(model, opt, level="O2", dtype=BF16,
                                   master_weights="kahan")
    _train(model, opt, 2, 0)
    state = model.state_dict()
    w = model.blocks[0].qkv.weight
    expected = w.detach().float() + opt.state[w]["kahan_compensation"].float()
    assert torch.equal(state["blocks.0.qkv.weight"], expected)
    assert not torch.equal(expected, w.detach().float())  # the compensation counts
    fp32 = _char_gpt()
    fp32.load_state_dict(state)
    assert torch.equal(fp32.blocks[0].qkv.weight.detach(), expected)


# -- errors ---------------------------------------------------------------------------

def test_bad_names_and_float16_are_refused_clearly():
    def fresh():
        model = torch.nn.Linear(2, 2).to(DEVICE)
        return model, torch.optim.AdamW(model.parameters())

    with pytest.raises(ValueError, match=r"master_weights must be .*\['stochastic', "
                                         r"'kahan'\].*'stochastc'"):
        ampkit.initialize(*fresh(), level="O2", dtype=BF16, master_weights="stochastc")
    with pytest.raises(ValueError, match="float16 has too little range"):
        ampkit.initialize(*fresh(), level="O2", dtype=torch.float16, master_weights="kahan")
    with pytest.raises(ValueError, match="rounding_seed"):
        ampkit.initialize(*fresh(), level="O2", dtype=BF16, rounding_seed=1)
    with pytest.raises(ValueError, match="nothing for master_weights"):
        ampkit.initialize(*fresh(), level="O1", dtype=BF16, master_weights="kahan")
    w16 = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
    with pytest.raises(ValueError, match="bfloat16 parameters"):
        PureLowPrecisionOptimizer(torch.optim.SGD([w16], lr=0.1), "kahan")
    w = torch.nn.Parameter(torch.ones(2, dtype=BF16))
    with pytest.raises(ValueError, match=r"\['stochastic', 'kahan', 'nearest'\], got 'sr'"):
        PureLowPrecisionOptimizer(torch.optim.SGD([w], lr=0.1), "sr")
    opt = PureLowPrecisionOptimizer(torch.optim.SGD([w], lr=0.1), "kahan")
    assert PureLowPrecisionOptimizer(opt, "kahan") is opt and pure_rounding(opt) == "kahan"
    with pytest.raises(ValueError, match="already"):
        PureLowPrecisionOptimizer(opt, "stochastic")
    with pytest.raises(TypeError, match="fp32 master weights"):
        PureLowPrecisionOptimizer(ampkit.MasterWeightOptimizer(
            torch.optim.SGD([torch.nn.Parameter(torch.ones(2, dtype=BF16))], lr=0.1)))


# -- memory ---------------------------------------------------------------------------

def _held_and_peak(mode: str, **adamw) -> tuple[float, int]:
    """(bytes per parameter held between steps, peak bytes of one step)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = CharGPT(vocab=64, dim=64, heads=2, layers=4, context=16).to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **adamw)
    if mode != "fp32":
        model, opt = ampkit.initialize(model, opt, level="O2", dtype=BF16,
                                       master_weights=mode, rounding_seed=0)
    ids = torch.randint(0, 64, (1, 17))

    def step():
        F.cross_entropy(model(ids[:, :-1]).float().flatten(0, 1), ids[:, 1:].flatten()
                        ).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)  # between steps: no gradients

    step()
    tensors = {id(t): t for t in model.parameters()}
    for state in opt.state.values():
        tensors.update({id(v): v for k, v in state.items()
                        if isinstance(v, torch.Tensor) and k != "step"})
    held = sum(t.numel() * t.element_size() for t in tensors.values())
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    changes = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]" and e.device_type() == DeviceType.CPU)
    running = highest = 0
    for _, nbytes in changes:
        running += nbytes
        highest = max(highest, running)
    return held / sum(p.numel() for p in model.parameters()), held + highest


def test_memory_per_parameter_and_peak_against_fp32():
    fp32_held, fp32_peak = _held_and_peak("fp32")
    sr_held, sr_peak = _held_and_peak("stochastic")
    kahan_held, kahan_peak = _held_and_peak("kahan")
    assert fp32_held == 12.0  # weight and two moments
    # bf16 weight and moments: 6 bytes (+2 Kahan); the fp32 LayerNorms add a little
    assert 6.0 < sr_held <= 6.1 and 8.0 < kahan_held <= 8.1
    # The floor is 0.5 (8 bytes against 16 at the end of the backward pass) plus one
    # chunk of the step's fp32 working copies (see benchmarks/RESULTS.md).
    assert sr_peak <= 0.70 * fp32_peak, (sr_peak, fp32_peak)
    assert kahan_peak <= 0.85 * fp32_peak, (kahan_peak, fp32_peak)


# -- convergence ----------------------------------------------------------------------

def test_digits_accuracy_matches_fp32():
    fp32 = digits_accuracy("fp32", epochs=2)
    for mode in ("stochastic", "kahan"):
        assert abs(digits_accuracy(mode, epochs=2) - fp32) <= 0.02, mode


def test_char_gpt_loss_tracks_fp32_where_round_to_nearest_stalls():
    curves = train_curves(("fp32", "nearest", "stochastic", "kahan"), steps=60, lr=3e-4,
                          dim=32, layers=1, context=32, batch=8)
    fp32 = curves["fp32"].eval_loss
    assert curves["nearest"].eval_loss > 1.01 * fp32
    for mode in ("stochastic", "kahan"):
        assert abs(curves[mode].eval_loss - fp32) <= 0.02 * fp32, mode


# -- the demo report ------------------------------------------------------------------

def test_the_demo_report_plots_the_three_curves(tmp_path):
    import json

    from ampkit.tools.demo import DemoSettings, demo_configurations, run_demo
    from ampkit.tools.report import write_report

    result = run_demo(DemoSettings(epochs=1, device="cpu", pure_bf16_steps=15,
                                   configurations=demo_configurations(["fp32"])))
    assert sorted(result.pure_bf16_curves) == ["fp32", "nearest", "stochastic"]
    assert all(len(v) == 15 for v in result.pure_bf16_curves.values())
    files = write_report(result, tmp_path)
    assert files.pure_bf16_png is not None and files.pure_bf16_png.stat().st_size > 1000
    assert 'id="pure-bf16"' in files.html.read_text()
    data = json.loads(files.json.read_text())
    assert len(data["pure_bf16_curves"]["nearest"]) == 15
    with pytest.raises(ValueError, match="pure_bf16_steps"):
        DemoSettings(pure_bf16_steps=-1)


# -- the rest of the optimizer API ----------------------------------------------------

def test_o3_scheduler_made_before_and_closure():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)).to(DEVICE)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt = ampkit.initialize(model, opt, level="O3", dtype=BF16,
                                   master_weights="stochastic", rounding_seed=0)
    assert {p.dtype for p in model.parameters()} == {BF16}  # O3: norms too
    before = [p.detach().clone() for p in model.parameters()]
    calls = []

    def closure():
        calls.append(1)
        opt.zero_grad()
        loss = model(torch.ones(2, 4, dtype=BF16)).float().pow(2).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    sched.step()  # warns if the optimizer's step was not seen
    assert calls == [1] and loss.dtype is torch.float32
    assert opt.param_groups[0]["lr"] == 0.25
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert opt.state[model[0].weight]["momentum_buffer"].dtype is BF16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_stochastic_rounding_on_cuda_is_reproducible_and_unbiased():
    def run(seed):
        w = torch.nn.Parameter(torch.ones(4096, dtype=BF16, device="cuda"))
        opt = PureLowPrecisionOptimizer(torch.optim.SGD([w], lr=1e-4), "stochastic",
                                        seed=seed)
        for _ in range(100):
            w.grad = torch.ones_like(w)
            opt.step()
        return w.detach().float().cpu()

    a, b = run(0), run(0)
    assert torch.equal(a, b)
    assert a.mean().item() == pytest.approx(0.99, abs=1e-3)
