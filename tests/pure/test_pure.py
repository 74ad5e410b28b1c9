"""Pure low-precision training (master_weights="stochastic" / "kahan"): rounding,
checkpoints, skipped steps and memory against plain fp32 training (convergence on the
demo's tasks: tests/tools/test_pure_curves.py)."""

from __future__ import annotations

import copy
import io
import itertools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers_models import TinyTransformer

import ampkit
from ampkit.pure import (
    PureLowPrecisionOptimizer,
    pure_low_precision,
    pure_rounding,
    stochastic_round,
)

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


# -- torch's fused kernel for the working copies (ampkit.pure.fused) ---------------------

def _fused_ops(opt: torch.optim.Optimizer) -> set[str]:
    """The names of torch's fused Adam/AdamW operators one step of ``opt`` runs."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.step()
    return {e.name for e in prof.events() if e.name.startswith("aten::_fused_adam")}


@pytest.mark.parametrize("cls, op", [(torch.optim.Adam, "aten::_fused_adam_"),
                                     (torch.optim.AdamW, "aten::_fused_adamw_")])
def test_a_group_that_leaves_the_implementation_to_torch_steps_fused_on_the_cpu(cls, op):
    """Where a group's ``foreach`` and ``fused`` are both None, the eager pure step runs
    torch's fused kernel on the CPU for bf16 parameters of at least 512 elements, in
    whole chunks and in slices: the update is torch's ``fused=True`` one, rounded to
    nearest, and the group's flags are as the user left them. Smaller parameters, and
    an fp32 parameter beside the bf16 ones, are stepped as torch would step them (its
    loop); a group that names its implementation keeps it."""
    torch.manual_seed(0)
    shapes = [(600, 700), (129, 255), (511,), (5,)]  # sliced, chunked, two small ones
    weights = [torch.randn(s, device=DEVICE).to(BF16) for s in shapes]
    grads = [[torch.randn(s, device=DEVICE).to(BF16) for s in shapes] for _ in range(2)]

    def pure(extra: list[torch.Tensor] = (), **kwargs: Any) -> PureLowPrecisionOptimizer:
        ps = [torch.nn.Parameter(w.clone()) for w in weights] + list(extra)
        return PureLowPrecisionOptimizer(cls(ps, lr=1e-2, weight_decay=0.1, **kwargs),
                                         "nearest", chunk_bytes=16 * 40_000)  # slices too

    opt = pure()
    ps = opt.param_groups[0]["params"]
    ref = [torch.nn.Parameter(w.float()) for w in weights]
    ref_opts = [cls([r], lr=1e-2, weight_decay=0.1, **{"fused": True} if r.numel() >= 512
                    else {"foreach": False}) for r in ref]
    for step, gs in enumerate(grads):
        for p, r, g in zip(ps, ref, gs):
            p.grad, r.grad = g.clone(), g.float()
        assert op in _fused_ops(opt)
        for p, r, ref_opt in zip(ps, ref, ref_opts):
            # the oracle: torch's step on fp32 copies, rounded
            ref_opt.step()
            r.data = r.data.to(BF16).float()
            for k in ("exp_avg", "exp_avg_sq"):
                ref_opt.state[r][k] = ref_opt.state[r][k].to(BF16).float()
                assert torch.equal(opt.state[p][k].float(), ref_opt.state[r][k]), (step, k)
            assert torch.equal(p.detach().float(), r.detach()), step
    group = opt.param_groups[0]
    assert group["fused"] is None and group["foreach"] is None
    named = pure(foreach=False)
    for p, g in zip(named.param_groups[0]["params"], grads[0]):
        p.grad = g.clone()
    assert _fused_ops(named) == set()
    # an fp32 parameter in the group is stepped as torch steps it there: its loop
    f0, fgrads = torch.randn(4099, device=DEVICE), torch.randn(3, 4099, device=DEVICE)
    fp32 = torch.nn.Parameter(f0.clone())
    mixed = pure([fp32])
    results = {}
    for kind in ("fused", "loop"):
        r = torch.nn.Parameter(f0.clone())
        ref_opt = cls([r], lr=1e-2, weight_decay=0.1, **{kind: True} if kind == "fused"
                      else {"foreach": False})
        for g in fgrads:
            r.grad = g.clone()
            ref_opt.step()
        results[kind] = r.detach()
    assert not torch.equal(results["fused"], results["loop"])  # they differ somewhere
    for g in fgrads:
        for p, bg in zip(mixed.param_groups[0]["params"], grads[0]):
            p.grad = bg.clone()
        fp32.grad = g.clone()
        assert op in _fused_ops(mixed)  # (the bf16 parameters)
    assert torch.equal(fp32.detach(), results["loop"])


@pytest.mark.parametrize("threads", [1, 3])
def test_padded_copies_give_each_element_the_same_bits_however_a_parameter_is_cut(threads):
    """torch's fused CPU kernel steps the last elements of each thread's part in a
    scalar loop that computes in double: unpadded, a tensor cut in two (as by an FSDP2
    shard) gets other bits for an element or two near the cut than the whole tensor.
    Padded with zeros to a multiple of ``lanes()`` elements, as the pure step pads its
    working copies, every element is a vector lane and the cut changes no bit."""
    from ampkit.pure.fused import lanes, padded_length
    from ampkit.pure.step import stand_ins

    n, cuts = 100_003, (33_331, 66_667)
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(n, generator=gen).to(BF16)
    grads = [torch.randn(n, generator=gen).to(BF16) for _ in range(3)]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        def stepped(bounds: tuple[int, ...], pad: int | None) -> torch.Tensor:
            out = []
            for a, b in itertools.pairwise(bounds):
                p = torch.nn.Parameter(w0[a:b].clone())
                holder = PureLowPrecisionOptimizer(torch.optim.AdamW([p]), "nearest")
                p.grad = grads[0][a:b].clone()
                ((_, w),) = stand_ins(holder, [p], pad)  # the pure step's working copy
                assert w.shape == (b - a if pad is None else padded_length(b - a, pad),)
                assert torch.equal(w.detach()[:b - a], p.detach().float())
                assert not w.detach()[b - a:].any() and not w.grad[b - a:].any()
                inner = torch.optim.AdamW([w], lr=1e-2, weight_decay=0.1, fused=True)
                for g in grads:
                    w.grad[:b - a] = g[a:b].float()
                    inner.step()
                st = inner.state[w]
                out.append(torch.stack([w.detach()[:b - a], st["exp_avg"][:b - a],
                                        st["exp_avg_sq"][:b - a]]))
            return torch.cat(out, 1)

        padded = lanes()
        assert torch.equal(stepped((0, n), padded), stepped((0, *cuts, n), padded))
        # unpadded (flat copies the size of the pieces): some element near a cut differs
        assert not torch.equal(stepped((0, n), 1), stepped((0, *cuts, n), 1))
    finally:
        torch.set_num_threads(before)


# -- skipped steps and checkpoints ----------------------------------------------------

def _snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[Any]:
    """The parameters and every state entry (tensors cloned; the rounding counts as
    they are)."""
    out: list[Any] = [p.detach().clone() for p in model.parameters()]
    for state in opt.state.values():
        out += [v.clone() if isinstance(v, torch.Tensor) else v
                for _, v in sorted(state.items())]
    return out


def _same(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x, y) and x.dtype == y.dtype if isinstance(x, torch.Tensor) else x == y
        for x, y in zip(a, b))


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
        before = _snapshot(model, opt)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        assert _same(before, _snapshot(model, opt)) is poison
        assert scaler.last_step_skipped is poison


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
    return TinyTransformer(vocab=16, dim=16, heads=2, layers=1, max_len=8).to(DEVICE)


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
    def setup(rounding_seed):
        model = _char_gpt()
        return ampkit.initialize(model, make_opt(model.parameters()), level="O2",
                                 dtype=BF16, master_weights=mode,
                                 rounding_seed=rounding_seed)

    model, opt = setup(3)
    _train(model, opt, 3, 0)
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    for name, p in model.named_parameters():  # the model saves its weights: the truth
        assert torch.equal(saved[0][name].float(), p.detach().float()), name
    _train(model, opt, 3, 3)

    resumed, resumed_opt = setup(11)  # the checkpoint's rounding seed wins
    resumed.load_state_dict(saved[0])
    resumed_opt.load_state_dict(saved[1])
    assert [g["rounding_seed"] for g in resumed_opt.param_groups] == [3]
    _train(resumed, resumed_opt, 3, 3)
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert _same(_snapshot(model, opt), _snapshot(resumed, resumed_opt))


def test_kahan_compensation_is_optimizer_state_and_the_model_saves_its_weights():
    def setup(rounding_seed):
        model = _char_gpt()
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)  # updates below half an ulp
        return ampkit.initialize(model, opt, level="O2", dtype=BF16,
                                 master_weights="kahan", rounding_seed=rounding_seed)

    model, opt = setup(0)
    _train(model, opt, 2, 0)
    w = model.blocks[0].qkv.weight
    comp = opt.state[w]["kahan_compensation"]
    assert comp.dtype is BF16 and bool(comp.ne(0).any())  # the compensation holds a lot
    # The model's state_dict holds the weights themselves, not weight + compensation.
    assert torch.equal(model.state_dict()["blocks.0.qkv.weight"].float(), w.detach().float())
    # The compensation travels in the optimizer's state_dict, through torch.save and
    # torch.load(weights_only=True), and with no ampkit entry at the top (Distributed
    # Checkpoint keeps only "state" and "param_groups").
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    on_disk = torch.load(buffer, weights_only=True)
    bare = copy.deepcopy({k: v for k, v in opt.state_dict().items()  # (torch would share
                          if k in ("state", "param_groups")})       # a live one's tensors)
    twins = []
    for saved in (on_disk, bare):
        twin, twin_opt = setup(5)
        twin.load_state_dict(model.state_dict())
        twin_opt.load_state_dict(saved)
        assert torch.equal(twin_opt.state[twin.blocks[0].qkv.weight]["kahan_compensation"],
                           comp)
        twins.append((twin, twin_opt))
    _train(model, opt, 2, 2)
    for twin, twin_opt in twins:
        _train(twin, twin_opt, 2, 2)
        assert _same(_snapshot(model, opt), _snapshot(twin, twin_opt))


# -- replicas, the global RNG and the parameters' identity ----------------------------

@pytest.mark.parametrize("mode", ["stochastic", "kahan"])
def test_replicas_round_alike_whatever_the_global_rng_does_and_it_is_untouched(mode):
    # Two "replicas" of one model (as DDP ranks hold them), each process's global RNG
    # seeded differently and drawn from between steps. No rounding_seed is given.
    runs = []
    for global_seed in (1, 2):
        model = _char_gpt()
        torch.manual_seed(global_seed)
        rng = torch.get_rng_state()
        model, opt = ampkit.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                       level="O2", dtype=BF16, master_weights=mode)
        assert torch.equal(torch.get_rng_state(), rng)
        for s in range(3):
            torch.rand(global_seed)  # the replicas' global RNGs drift apart
            ids = torch.randint(0, 16, (4, 9), generator=torch.Generator().manual_seed(s))
            F.cross_entropy(model(ids[:, :-1]).float().flatten(0, 1),
                            ids[:, 1:].flatten()).backward()
            rng = torch.get_rng_state()
            opt.step()
            assert torch.equal(torch.get_rng_state(), rng)  # never read nor advanced
            opt.zero_grad()
        runs.append(_snapshot(model, opt))
    assert _same(runs[0], runs[1])


def test_a_step_rounds_unbiased_over_elements_and_steps():
    # SGD with lr 1/3 from zero: the fp32 update -g/3 is rarely a bf16 number. Each of
    # 64 values of g fills 4096 elements; the share rounded up must be the fp32
    # result's distance from the bf16 number below, in units of the gap.
    torch.manual_seed(0)
    g = (torch.randn(64) * 10.0 ** torch.randint(-4, 3, (64,))).to(BF16)
    grad = g.repeat_interleave(4096)
    exact = torch.zeros(grad.numel()).add_(grad.float(), alpha=-1 / 3)  # SGD's own math
    lo, hi = _neighbours(exact)
    w = torch.nn.Parameter(torch.zeros(grad.numel(), dtype=BF16))
    opt = PureLowPrecisionOptimizer(torch.optim.SGD([w], lr=1 / 3), "stochastic", seed=0)
    draws = []
    for _ in range(4):
        with torch.no_grad():
            w.zero_()
        w.grad = grad.clone()
        opt.step()
        draws.append(w.detach().float())
    for out in draws:
        assert bool(((out == lo) | (out == hi)).all())
    assert not torch.equal(draws[0], draws[1])  # each step draws new bits
    up = torch.stack([(d == hi) & (hi != lo) for d in draws]).double()
    share = up.view(4, 64, 4096).mean(dim=(0, 2))
    gap = (hi - lo).view(64, 4096)[:, 0]
    expected = torch.where(gap > 0, (exact.view(64, 4096)[:, 0] - lo.view(64, 4096)[:, 0])
                           / gap.clamp_min(torch.finfo(torch.float32).tiny), 0.0).double()
    assert (share - expected).abs().max().item() < 0.02  # ~5 sigma at n = 16384


def test_a_parameters_bits_do_not_depend_on_which_other_parameters_step():
    # A parameter's rounding is keyed by its own index, count and elements: one that
    # steps before it (or does not, when it got no gradient) changes nothing for it.
    results = []
    for other_steps in (False, True):
        other = torch.nn.Parameter(torch.ones(4096, dtype=BF16))
        w = torch.nn.Parameter(torch.ones(4096, dtype=BF16))
        opt = PureLowPrecisionOptimizer(torch.optim.SGD([other, w], lr=1e-3),
                                        "stochastic", seed=0)
        for _ in range(3):
            other.grad = torch.ones_like(other) if other_steps else None
            w.grad = torch.full_like(w, 0.5)
            opt.step()
        assert torch.equal(other, torch.ones_like(other)) is not other_steps
        results.append(w.detach().clone())
    assert torch.equal(results[0], results[1])
    assert 0.998 < results[0].float().mean().item() < 0.999  # 1 - 3 * 5e-4, unbiased


@pytest.mark.parametrize("mode", ["stochastic", "kahan"])
def test_a_step_keeps_each_parameter_its_storage_and_its_autograd_node(mode):
    # DDP hooks each parameter's AccumulateGrad node once, at construction: a step that
    # replaced the node (reassigning .data to another dtype does) silences the hooks.
    w = torch.nn.Parameter(torch.linspace(-1, 1, 8).to(BF16))
    view = w[2:4]
    node = w.view_as(w).grad_fn.next_functions[0][0]
    fired = []
    node.register_hook(lambda *args: fired.append(1))
    storage = w.data_ptr()
    opt = PureLowPrecisionOptimizer(torch.optim.AdamW([w], lr=1e-2), mode, seed=0)
    for _ in range(3):
        (w.float() * torch.arange(8.0)).sum().backward()
        opt.step()
        opt.zero_grad()
    assert fired == [1, 1, 1]
    assert w.view_as(w).grad_fn.next_functions[0][0] is node
    assert w.data_ptr() == storage and w.dtype is BF16
    assert torch.equal(view, w.detach()[2:4])  # views see the update
    assert not torch.equal(w.detach(), torch.linspace(-1, 1, 8).to(BF16))


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
    assert PureLowPrecisionOptimizer(opt, "kahan") is opt and pure_rounding(opt).value == "kahan"
    with pytest.raises(ValueError, match="already"):
        PureLowPrecisionOptimizer(opt, "stochastic")
    with pytest.raises(TypeError, match=r"rounding_seed must be an int or None, got 'x'"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2, dtype=BF16))],
                             "rounding_seed": "x"})
    with pytest.raises(TypeError, match=r"optimizer must be a torch.optim.Optimizer"):
        pure_low_precision(torch.nn.Linear(2, 2), "kahan")  # type: ignore[arg-type]
    assert pure_low_precision(opt, "kahan") is opt  # again: unchanged


# -- memory ---------------------------------------------------------------------------

def _held_and_peak(mode: str, **adamw) -> tuple[float, int]:
    """(bytes per parameter held between steps, peak bytes of one step)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = TinyTransformer(vocab=64, dim=64, heads=2, layers=4, max_len=16).to(DEVICE)
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
    # lr 2**-12 with gradient 1: every fp32 update is exact, so equal results mean
    # equal random bits. CUDA's generator is not the CPU's: the bits differ from a CPU
    # run's, the expected weights do not.
    def run(device):
        w = torch.nn.Parameter(torch.ones(4096, dtype=BF16, device=device))
        opt = PureLowPrecisionOptimizer(torch.optim.SGD([w], lr=2 ** -12), "stochastic",
                                        seed=0)
        for _ in range(100):
            w.grad = torch.ones_like(w)
            opt.step()
        return w.detach().float().cpu()

    cuda = run("cuda")
    assert torch.equal(cuda, run("cuda"))
    assert cuda.mean().item() == pytest.approx(1 - 100 * 2 ** -12, abs=1e-3)
    assert run("cpu").mean().item() == pytest.approx(1 - 100 * 2 ** -12, abs=1e-3)
