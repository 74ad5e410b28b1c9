"""The compiled pure step (``compile_step=True``): the update against torch's own fp32
step of the same state, the random bits (unbiased, reproducible, independent of
chunking and of the other parameters), the eager fallback, the refusals, and the
machinery it meets (checkpoints, skipped steps, groups added later, frozen and fp32
parameters, ``initialize``).

Every parameter here has at least two elements and the same few optimizer settings
recur, so that the whole module compiles few graphs (torch.compile on a CPU takes
seconds per graph)."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch

import ampkit
from ampkit import AmpConfig
from ampkit.pure import PureLowPrecisionOptimizer
from ampkit.pure.compiled_step import CompiledStepFallbackWarning

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:torch")

ADAMW = dict(lr=1e-2, weight_decay=0.1)
SGD = dict(lr=1e-2, momentum=0.9, weight_decay=0.01)


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g).to(torch.bfloat16))
            for shape in ((64, 48), (3000,), (5,))]


def _grads(params, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * 0.1).to(torch.bfloat16)


def _reference(cls, kwargs, params, opt, rounding):
    """torch's own eager fp32 step (the plain optimizer class) of the pure optimizer's
    current state: fp32 weight (plus its Kahan compensation), gradient and moments.
    Returns the fp32 weights and state after it."""
    ws = []
    for p in params:
        w = p.detach().float()
        if rounding == "kahan" and "kahan_compensation" in opt.state[p]:
            w = w + opt.state[p]["kahan_compensation"].float()
        w = torch.nn.Parameter(w)
        w.grad = p.grad.float()
        ws.append(w)
    ref = cls(ws, **kwargs)
    for p, w in zip(params, ws):
        own = {k: v for k, v in opt.state[p].items()
               if k not in ("kahan_compensation", "rounding_step")}
        if own:
            ref.state[w] = {k: (v.float().clone() if isinstance(v, torch.Tensor) else v)
                            for k, v in own.items()}
    ref.step()
    return [(w.detach(), ref.state[w]) for w in ws]


def _ulp(x: torch.Tensor) -> torch.Tensor:
    """The gap between consecutive bf16 numbers at |x| (normal range), plus what the
    fp32 update itself may differ by from torch's eager kernels where it cancels
    (inductor fuses the arithmetic: a last fp32 bit of the operands, about 2**-20 of
    the tensor's largest value)."""
    exponent = torch.floor(torch.log2(x.abs().clamp_min(2.0 ** -120)))
    return torch.exp2(exponent - 7) + x.abs().max() * 2.0 ** -20


@pytest.mark.parametrize("rounding", ["kahan", "stochastic"])
@pytest.mark.parametrize("cls,kwargs", [(torch.optim.AdamW, ADAMW), (torch.optim.SGD, SGD)],
                         ids=["AdamW", "SGD"])
def test_the_compiled_step_is_torchs_fp32_step_rounded(cls, kwargs, rounding) -> None:
    params = _params()
    opt = PureLowPrecisionOptimizer(cls(params, **kwargs), rounding, seed=0,
                                    compile_step=True)
    for step in range(3):
        _grads(params, step)
        expected = _reference(cls, kwargs, params, opt, rounding)
        opt.step()
        for p, (w, state) in zip(params, expected):
            own = opt.state[p]
            got = p.detach().float()
            if rounding == "kahan":
                # the weight is the reference rounded to nearest (half a gap, with room
                # for the last fp32 bit of the update), the compensation what it lost
                assert ((got - w).abs() <= _ulp(w) * 0.5001 + 1e-30).all()
                total = got + own["kahan_compensation"].float()
                assert ((total - w).abs() <= w.abs() * 2.0 ** -14
                        + w.abs().max() * 2.0 ** -20).all()
            else:  # stochastic: one of the two bf16 neighbours
                assert ((got - w).abs() < _ulp(w) + 1e-30).all()
            for name, ref in state.items():
                if name == "step":
                    assert float(own["step"]) == float(ref)
                    continue
                mine = own[name]
                assert mine.dtype is torch.bfloat16
                assert ((mine.float() - ref).abs() < _ulp(ref) + 1e-30).all(), name
            assert own["rounding_step"] == step + 1
            assert sorted(own) == sorted(set(state) | {"rounding_step"} | (
                {"kahan_compensation"} if rounding == "kahan" else set()))


def _sgd_to(target: torch.Tensor, rounding: str = "stochastic", seed: int = 0,
            **extra) -> torch.Tensor:
    """One compiled SGD step (lr 1, no momentum) from 1.0 to ``target`` (fp32 values
    between bf16 numbers): the rounded result."""
    w = torch.nn.Parameter(torch.ones_like(target, dtype=torch.bfloat16))
    opt = PureLowPrecisionOptimizer(torch.optim.SGD([w], lr=1.0), rounding, seed=seed,
                                    compile_step=True, **extra)
    w.grad = (1.0 - target).to(torch.bfloat16)
    assert torch.equal(1.0 - w.grad.float(), target)  # the update is exact
    opt.step()
    return w.detach().float()


def test_compiled_stochastic_rounding_is_unbiased() -> None:
    n = 1 << 16
    gap = 2.0 ** -7  # between 1 and the next bf16 number
    for fraction in (0.25, 0.5, 0.125 + 0.0625):
        target = torch.full((n,), 1.0 + fraction * gap)
        out = _sgd_to(target)
        assert set(out.unique().tolist()) == {1.0, 1.0 + gap}
        up = (out > 1.0).double().mean().item()
        sigma = math.sqrt(fraction * (1 - fraction) / n)
        assert abs(up - fraction) < 5 * sigma, (fraction, up)
    # the same below zero: away from zero with the same probability
    down = 1.0 - 2.0 * 2.0 ** -8  # 1 - 2^-7, where the gap is 2^-8
    target = torch.full((n,), down - 0.25 * 2.0 ** -8)
    out = _sgd_to(target)
    assert abs((out < down).double().mean().item() - 0.25) < 5 * math.sqrt(0.1875 / n)


def test_compiled_bits_are_reproducible_and_follow_the_seed() -> None:
    target = torch.full((4096,), 1.0 + 0.5 * 2.0 ** -7)
    first, again = _sgd_to(target, seed=3), _sgd_to(target, seed=3)
    assert torch.equal(first, again)
    assert not torch.equal(first, _sgd_to(target, seed=4))


def test_compiled_bits_do_not_depend_on_chunking_nor_other_parameters() -> None:
    def run(chunk_bytes, with_other):
        params = _params()
        if not with_other:
            params[1].requires_grad_(False)
        opt = PureLowPrecisionOptimizer(torch.optim.AdamW(params, **ADAMW), "stochastic",
                                        seed=0, chunk_bytes=chunk_bytes, compile_step=True)
        for step in range(2):
            _grads(params, step)
            if not with_other:
                params[1].grad = None
            opt.step()
        return [params[0].detach().clone(), opt.state[params[0]]["exp_avg"].clone()]

    base = run(None, True)
    for got in (run(4096, True), run(None, False)):
        assert all(torch.equal(a, b) for a, b in zip(base, got))


def test_an_optimizer_without_a_functional_form_steps_eagerly_said_once() -> None:
    def run(compile_step):
        params = _params()
        opt = PureLowPrecisionOptimizer(torch.optim.Adagrad(params, lr=0.1), "stochastic",
                                        seed=0, compile_step=compile_step)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for step in range(2):
                _grads(params, step)
                opt.step()
        return params, [w for w in seen if issubclass(w.category,
                                                      CompiledStepFallbackWarning)]

    params, said = run(True)
    assert len(said) == 1
    assert "Adagrad" in str(said[0].message) and "eager" in str(said[0].message)
    eager, none = run(False)
    assert not none
    assert all(torch.equal(a, b) for a, b in zip(params, eager))


def test_compile_step_is_refused_where_it_means_nothing() -> None:
    with pytest.raises(ValueError, match=r"compile_step=True compiles the pure bfloat16 "
                                         r"optimizer step, which needs master_weights="
                                         r"'stochastic' or 'kahan'"):
        AmpConfig(level="O2", dtype="bfloat16", compile_step=True)
    with pytest.raises(ValueError, match="compile_step=True"):
        ampkit.initialize(torch.nn.Linear(2, 2), level="O1", dtype="bfloat16",
                          compile_step=True)
    with pytest.raises(TypeError, match="compile_step must be True or False"):
        AmpConfig(level="O2", dtype="bfloat16", master_weights="kahan", compile_step="yes")
    w = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"rounding='nearest' has none"):
        PureLowPrecisionOptimizer(torch.optim.SGD([w], lr=0.1), "nearest", compile_step=True)
    opt = PureLowPrecisionOptimizer(torch.optim.SGD([w], lr=0.1), "kahan")
    with pytest.raises(ValueError, match="already pure with compile_step=False"):
        PureLowPrecisionOptimizer(opt, "kahan", compile_step=True)


def test_initialize_and_the_config_carry_compile_step() -> None:
    cfg = AmpConfig(level="O2", dtype="bfloat16", master_weights="stochastic",
                    compile_step=True)
    assert AmpConfig.from_dict(cfg.to_dict()) == cfg
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    opt = torch.optim.AdamW(net.parameters(), **ADAMW)
    net, opt = ampkit.initialize(net, opt, config=cfg)
    assert opt._ampkit_pure.compile_step is True
    net(torch.randn(4, 8)).float().sum().backward()
    norm = net[1].weight
    norm_before = norm.detach().clone()
    opt.step()
    # the fp32 LayerNorm steps by the optimizer's own step, as in the eager pure step
    ref = torch.nn.Parameter(norm_before.clone())
    ref.grad = norm.grad.clone()
    torch.optim.AdamW([ref], **ADAMW).step()
    assert norm.dtype is torch.float32 and torch.equal(norm.detach(), ref.detach())
    assert opt.state[net[0].weight]["rounding_step"] == 1


def test_a_checkpoint_resumes_bit_for_bit() -> None:
    params = _params()
    opt = PureLowPrecisionOptimizer(torch.optim.AdamW(params, **ADAMW), "kahan", seed=1,
                                    compile_step=True)
    for step in range(2):
        _grads(params, step)
        opt.step()
    saved, weights = copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in params]
    assert copy.deepcopy(opt)._ampkit_pure.compile_step is True  # pickled with it
    _grads(params, 2)
    opt.step()
    after = [p.detach().clone() for p in params]
    again = [torch.nn.Parameter(w.clone()) for w in weights]
    resumed = PureLowPrecisionOptimizer(torch.optim.AdamW(again, **ADAMW), "kahan",
                                        compile_step=True)
    resumed.load_state_dict(saved)
    _grads(again, 2)
    resumed.step()
    assert all(torch.equal(a, b) for a, b in zip(after, again))
    for p, q in zip(params, again):
        for k, v in opt.state[p].items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(resumed.state[q][k])), k


def test_a_skipped_step_changes_nothing() -> None:
    params = _params()
    opt = PureLowPrecisionOptimizer(torch.optim.AdamW(params, **ADAMW), "kahan",
                                    compile_step=True)
    _grads(params, 0)
    opt.step()
    _grads(params, 1)
    before = copy.deepcopy((params, opt.state_dict()))
    opt.step(found_inf=torch.ones(()))
    for p, q in zip(params, before[0]):
        assert torch.equal(p, q)
    for key, state in before[1]["state"].items():
        for k, v in state.items():
            now = opt.state_dict()["state"][key][k]
            assert torch.equal(torch.as_tensor(now), torch.as_tensor(v)), k


def test_groups_added_later_and_frozen_parameters() -> None:
    params = _params()
    frozen = torch.nn.Parameter(torch.ones(7, dtype=torch.bfloat16), requires_grad=False)
    opt = PureLowPrecisionOptimizer(torch.optim.SGD([*params[:2], frozen], **SGD),
                                    "stochastic", seed=0, compile_step=True)
    _grads(params[:2], 0)
    opt.step()
    opt.add_param_group({"params": [params[2]], "lr": 0.5})
    for step in (1, 2):
        _grads(params, step)
        expected = _reference(torch.optim.SGD, dict(SGD, lr=0.5), params[2:], opt,
                              "stochastic")
        opt.step()
        (w, state), = expected
        got = params[2].detach().float()
        assert ((got - w).abs() < _ulp(w) + 1e-30).all()
        buf = opt.state[params[2]]["momentum_buffer"].float()
        assert ((buf - state["momentum_buffer"]).abs()
                < _ulp(state["momentum_buffer"]) + 1e-30).all()
    assert opt.state[params[2]]["rounding_step"] == 2
    assert opt.state[params[0]]["rounding_step"] == 3
    assert torch.equal(frozen, torch.ones(7, dtype=torch.bfloat16))
    assert frozen not in opt.state


def _graphs() -> int:
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


@pytest.mark.parametrize("make,schedule", [
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
     lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (s + 1))),
    (lambda ps: torch.optim.Adam(ps, lr=1e-2),
     lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=10)),
], ids=["SGD-LambdaLR", "Adam-OneCycleLR"])
def test_a_schedule_compiles_no_new_graph_and_takes_effect(make, schedule) -> None:
    # the schedules change lr (and OneCycleLR Adam's beta1) at every step: the compiled
    # update reads them as data, so after SGD's first two steps (momentum buffer made,
    # then updated) no step compiles a graph; the weights follow the eager pure step's
    ps = [torch.nn.Parameter(torch.linspace(-1, 1, 100).to(torch.bfloat16))]
    eager = [torch.nn.Parameter(ps[0].detach().clone())]
    opts = [PureLowPrecisionOptimizer(make(q), "kahan", compile_step=c)
            for q, c in ((ps, True), (eager, False))]
    scheds = [schedule(o) for o in opts]
    counts = []
    for step in range(5):
        for q, o, s in zip((ps, eager), opts, scheds):
            q[0].grad = torch.linspace(1, 2, 100).to(torch.bfloat16) * (step + 1)
            o.step()
            s.step()
        counts.append(_graphs())
    assert counts[2] == counts[-1], counts
    got = ps[0].float() + opts[0].state[ps[0]]["kahan_compensation"].float()
    ref = eager[0].float() + opts[1].state[eager[0]]["kahan_compensation"].float()
    # the moments round differently (hash vs generator bits): within a bf16 gap
    assert (got - ref).abs().max() < 2.0 ** -8 * ref.abs().max()
    assert not torch.equal(ps[0].detach(), torch.linspace(-1, 1, 100).to(torch.bfloat16))


def test_amsgrad_switched_on_later_fails_as_torchs_adam_and_kept_entries_stay() -> None:
    # torch's Adam makes its moments on a parameter's first step only: amsgrad switched
    # on later is its KeyError, before anything changes
    def started(cls_kwargs, compile_step=None):
        w = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16 if compile_step is not None
                                          else torch.float32))
        opt = torch.optim.Adam([w], **cls_kwargs)
        opt.state[w] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(w),
                        "exp_avg_sq": torch.zeros_like(w)}
        if compile_step is not None:
            opt = PureLowPrecisionOptimizer(opt, "kahan", compile_step=compile_step)
        opt.param_groups[0]["amsgrad"] = True
        w.grad = torch.ones_like(w)
        return w, opt

    for compile_step in (None, False, True):
        w, opt = started({"lr": 0.1}, compile_step)
        with pytest.raises(KeyError, match="max_exp_avg_sq"):
            opt.step()
        assert torch.equal(w.detach().float(), torch.ones(4))
    # an SGD momentum buffer stays when momentum is switched off, as torch keeps it
    w = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = PureLowPrecisionOptimizer(torch.optim.SGD([w], lr=1.0), "stochastic",
                                    compile_step=True)
    buf = torch.full((4,), 3.0, dtype=torch.bfloat16)
    opt.state[w]["momentum_buffer"] = buf
    w.grad = torch.full((4,), 0.5, dtype=torch.bfloat16)
    opt.step()
    assert opt.state[w]["momentum_buffer"] is buf and torch.equal(w.detach().float(),
                                                                   torch.full((4,), 0.5))


def test_lbfgs_takes_the_eager_step_said_once() -> None:
    def run(compile_step: bool):
        w = torch.nn.Parameter(torch.linspace(-1, 1, 8).to(torch.bfloat16))
        opt = PureLowPrecisionOptimizer(torch.optim.LBFGS([w], lr=0.5, max_iter=2),
                                        "kahan", compile_step=compile_step)

        def closure():
            opt.zero_grad()
            loss = (w.float() ** 2).sum()
            loss.backward()
            return loss

        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for _ in range(2):
                opt.step(closure)
        return w.detach().clone(), [x for x in seen
                                    if issubclass(x.category, CompiledStepFallbackWarning)]

    compiled, said = run(True)
    eager, none = run(False)
    assert len(said) == 1 and "LBFGS" in str(said[0].message) and not none
    assert torch.equal(compiled, eager)


def test_the_step_inside_an_outer_torch_compile_runs_as_outside() -> None:
    # a whole training step compiled around opt.step(): the same bits as uncompiled
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)

    def make():
        torch.manual_seed(0)
        m = torch.nn.Linear(8, 4).to(torch.bfloat16)
        return m, PureLowPrecisionOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-2),
                                            "kahan", compile_step=True)

    def train(m, opt):
        loss = (m(x).float() ** 2).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()

    outer, opt = make()
    whole = torch.compile(train)
    plain, ref = make()
    for _ in range(2):
        whole(outer, opt)
        train(plain, ref)
    start = make()[0]
    for a, b, c in zip(outer.parameters(), plain.parameters(), start.parameters()):
        assert torch.equal(a, b) and not torch.equal(b, c)


def test_an_update_torch_compile_gave_up_on_is_said_once() -> None:
    # past dynamo's recompile limit the update runs as plain Python: still right, but
    # the promised speed is gone, which the user is told (a limit of 1 gets there fast)
    w = torch.nn.Parameter(torch.ones(6, dtype=torch.bfloat16))
    opt = PureLowPrecisionOptimizer(torch.optim.SGD([w], lr=1.0), "stochastic",
                                    compile_step=True)
    with torch._dynamo.config.patch(recompile_limit=1), \
            warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for options in ({}, {"maximize": True}, {"nesterov": True, "momentum": 0.5},
                        {"maximize": True}):
            opt.param_groups[0].update(options)
            w.grad = torch.full((6,), 0.25, dtype=torch.bfloat16)
            opt.step()
    said = [x for x in seen if issubclass(x.category, CompiledStepFallbackWarning)]
    assert len(said) == 1 and "recompile limit" in str(said[0].message)
    assert "SGD" in str(said[0].message)
