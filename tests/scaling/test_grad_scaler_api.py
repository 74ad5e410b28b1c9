"""GradScaler's API: torch compatibility, bad input, the extras (hysteresis, bounds,
static mode, float16/bfloat16 gradients, master-gradient hook), reporting, pickling."""

from __future__ import annotations

import math
import pickle
import warnings

import pytest
import torch

import ampkit
from ampkit import GradScaler
from ampkit.scaling import overflow as overflow_module


def _one_step(scaler: GradScaler, opt: torch.optim.Optimizer, w: torch.Tensor,
              factor: float = 1.0) -> None:
    opt.zero_grad()
    scaler.scale((w * factor).sum()).backward()
    scaler.step(opt)
    scaler.update()


def _param_and_opt(dtype: torch.dtype = torch.float32
                   ) -> tuple[torch.nn.Parameter, torch.optim.Optimizer]:
    w = torch.nn.Parameter(torch.ones(3, dtype=dtype))
    return w, torch.optim.SGD([w], lr=0.1)


# -- bad input -----------------------------------------------------------------------------

@pytest.mark.parametrize(("kwargs", "argument"), [
    ({"init_scale": 0.0}, "init_scale"),
    ({"init_scale": -2.0}, "init_scale"),
    ({"init_scale": math.inf}, "init_scale"),
    ({"init_scale": math.nan}, "init_scale"),
    ({"growth_factor": 1.0}, "growth_factor"),
    ({"growth_factor": 0.5}, "growth_factor"),
    ({"growth_factor": math.inf}, "growth_factor"),
    ({"backoff_factor": 0.0}, "backoff_factor"),
    ({"backoff_factor": 1.0}, "backoff_factor"),
    ({"backoff_factor": -0.5}, "backoff_factor"),
    ({"growth_interval": 0}, "growth_interval"),
    ({"hysteresis": 0}, "hysteresis"),
    ({"min_scale": 0.0}, "min_scale"),
    ({"max_scale": math.inf}, "max_scale"),
    ({"min_scale": 4.0, "max_scale": 2.0, "init_scale": 3.0}, "min_scale"),
    ({"max_scale": 2.0 ** 10}, "init_scale"),  # init 2**16 above the ceiling
    ({"min_scale": 2.0 ** 20}, "init_scale"),
    ({"device": "gpu0"}, "device"),
])
def test_bad_values_raise_value_error_naming_the_argument(kwargs: dict, argument: str) -> None:
    with pytest.raises(ValueError, match=argument):
        GradScaler(**kwargs)


@pytest.mark.parametrize(("kwargs", "argument"), [
    ({"growth_interval": 2.5}, "growth_interval"),
    ({"hysteresis": True}, "hysteresis"),
    ({"init_scale": "big"}, "init_scale"),
    ({"enabled": "yes"}, "enabled"),
    ({"dynamic": 1}, "dynamic"),
])
def test_wrong_types_raise_type_error(kwargs: dict, argument: str) -> None:
    with pytest.raises(TypeError, match=argument):
        GradScaler("cpu", **kwargs)


def test_setters_validate() -> None:
    scaler = GradScaler("cpu")
    with pytest.raises(ValueError, match="growth_factor"):
        scaler.set_growth_factor(0.9)
    with pytest.raises(ValueError, match="backoff_factor"):
        scaler.set_backoff_factor(2.0)
    with pytest.raises(ValueError, match="growth_interval"):
        scaler.set_growth_interval(0)
    assert scaler.get_growth_factor() == 2.0 and scaler.get_growth_interval() == 2000


def test_call_order_errors_say_what_to_call() -> None:
    w, opt = _param_and_opt()
    scaler = GradScaler("cpu")
    with pytest.raises(RuntimeError, match=r"scale\(loss\)"):
        scaler.step(opt)
    scaler.scale(w.sum()).backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match=r"call scaler.step\(optimizer\) and then "
                                           r"scaler.update\(\)"):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match=r"call scaler.update\(\)"):
        scaler.step(opt)
    with pytest.raises(RuntimeError, match=r"call scaler.update\(\)"):
        scaler.unscale_(opt)
    scaler.update()
    with pytest.raises(RuntimeError, match=r"scaler.step\(optimizer\)"):
        scaler.update()  # nothing checked in this iteration
    with pytest.raises(RuntimeError, match="closure"):
        scaler.step(opt, closure=lambda: 0.0)


def test_update_new_scale_is_validated() -> None:
    scaler = GradScaler("cpu")
    scaler.scale(torch.ones(1))
    for bad in (0.0, -1.0, math.inf):
        with pytest.raises(ValueError, match="new_scale"):
            scaler.update(new_scale=bad)
    with pytest.raises(ValueError, match="new_scale"):
        scaler.update(new_scale=torch.ones(2))
    scaler.update(new_scale=torch.tensor(32.0))
    assert scaler.get_scale() == 32.0


# -- compatibility with torch --------------------------------------------------------------

def test_constructor_matches_torch_positionally() -> None:
    ours = GradScaler("cpu", 2.0 ** 10, 3.0, 0.25, 7, True)
    theirs = torch.amp.GradScaler("cpu", 2.0 ** 10, 3.0, 0.25, 7, True)
    assert {k: ours.state_dict()[k] for k in theirs.state_dict()} == theirs.state_dict()
    assert ours.is_enabled() and ampkit.GradScaler is GradScaler


def test_state_dicts_load_both_ways() -> None:
    theirs = torch.amp.GradScaler("cpu", init_scale=512.0, growth_interval=3)
    w, opt = _param_and_opt()
    for factor in (1.0, 1.0, math.inf, 1.0):
        _one_step(theirs, opt, w, factor)  # type: ignore[arg-type]
    ours = GradScaler("cpu", hysteresis=2)
    ours.load_state_dict(theirs.state_dict())
    assert {k: ours.state_dict()[k] for k in theirs.state_dict()} == theirs.state_dict()
    assert ours.state_dict()["hysteresis"] == 2  # absent from torch's: kept
    back = torch.amp.GradScaler("cpu")
    back.load_state_dict(ours.state_dict())  # torch ignores ampkit's extra keys
    assert back.state_dict() == theirs.state_dict()


def test_load_state_dict_names_missing_and_unknown_keys() -> None:
    scaler = GradScaler("cpu")
    state = scaler.state_dict()
    del state["growth_factor"]
    state["loss_scale"] = 1.0
    with pytest.raises(ValueError, match=r"missing keys \['growth_factor'\].*unknown keys "
                                         r"\['loss_scale'\]"):
        scaler.load_state_dict(state)
    with pytest.raises(RuntimeError, match="empty"):
        scaler.load_state_dict({})
    bad = {**scaler.state_dict(), "scale": -1.0}
    with pytest.raises(ValueError, match="scale"):
        scaler.load_state_dict(bad)
    assert scaler.get_scale() == 2.0 ** 16  # nothing half-loaded


@pytest.mark.parametrize("make_outputs", [
    lambda: torch.ones(2),
    lambda: [torch.ones(1), (torch.ones(2), torch.full((1,), 3.0))],
])
def test_scale_matches_torch(make_outputs: object) -> None:
    ours = GradScaler("cpu", init_scale=8.0).scale(make_outputs())  # type: ignore[operator]
    theirs = torch.amp.GradScaler("cpu", init_scale=8.0).scale(make_outputs())  # type: ignore[operator]
    assert repr(ours) == repr(theirs)
    generated = GradScaler("cpu", init_scale=8.0).scale(t for t in [torch.ones(1)])
    assert [t.item() for t in generated] == [8.0]
    with pytest.raises(ValueError, match="outputs"):
        GradScaler("cpu").scale([torch.ones(1), "loss"])  # type: ignore[list-item]


def test_two_optimizers_skip_independently_like_torch() -> None:
    def run(scaler: object) -> tuple[list[float], list[torch.Tensor]]:
        a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
        opt_a, opt_b = torch.optim.SGD([a], lr=0.1), torch.optim.SGD([b], lr=0.1)
        scales = []
        for factor in (1.0, math.inf, 1.0):
            opt_a.zero_grad()
            opt_b.zero_grad()
            scaler.scale(a.sum() + (b * factor).sum()).backward()  # type: ignore[attr-defined]
            scaler.step(opt_a)  # type: ignore[attr-defined]
            scaler.step(opt_b)  # type: ignore[attr-defined]
            scaler.update()  # type: ignore[attr-defined]
            scales.append(scaler.get_scale())  # type: ignore[attr-defined]
        return scales, [a.detach(), b.detach()]

    ours, theirs = run(GradScaler("cpu")), run(torch.amp.GradScaler("cpu"))
    assert ours[0] == theirs[0] == [65536.0, 32768.0, 32768.0]
    assert all(torch.equal(x, y) for x, y in zip(ours[1], theirs[1]))
    assert not torch.equal(ours[1][0], ours[1][1])  # a stepped 3 times, b twice


def test_sparse_gradients_match_torch() -> None:
    def run(scaler: object) -> torch.Tensor:
        torch.manual_seed(0)
        emb = torch.nn.Embedding(5, 2, sparse=True)
        opt = torch.optim.SGD(emb.parameters(), lr=0.1)
        for ids in ([1, 1, 3], [0, 4, 4]):
            opt.zero_grad()
            scaler.scale(emb(torch.tensor(ids)).sum()).backward()  # type: ignore[attr-defined]
            scaler.step(opt)  # type: ignore[attr-defined]
            scaler.update()  # type: ignore[attr-defined]
        return emb.weight.detach()

    assert torch.equal(run(GradScaler("cpu")), run(torch.amp.GradScaler("cpu")))


def test_disabled_scaler_is_a_pass_through() -> None:
    w, opt = _param_and_opt()
    scaler = GradScaler("cpu", enabled=False)
    loss = w.sum()
    assert scaler.scale(loss) is loss
    loss.backward()
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    assert torch.allclose(w, torch.full((3,), 0.9))
    assert scaler.state_dict() == {} and scaler.get_scale() == 1.0
    assert scaler.skipped_steps == 0 and scaler.last_step_skipped is False


def test_device_default_and_cuda_without_cuda() -> None:
    scaler = GradScaler()
    assert scaler.is_enabled()
    assert ("device='cuda'" if torch.cuda.is_available() else "device='cpu'") in repr(scaler)
    if not torch.cuda.is_available():
        with pytest.warns(UserWarning, match="CUDA is not available"):
            assert not GradScaler("cuda").is_enabled()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GradScaler(torch.device("cpu"))


# -- the extras ------------------------------------------------------------------------

def _scales(scaler: GradScaler, overflows: list[bool]) -> list[float]:
    w, opt = _param_and_opt()
    out = []
    for overflow in overflows:
        _one_step(scaler, opt, w, math.inf if overflow else 1.0)
        out.append(scaler.get_scale())
    return out


def test_hysteresis_backs_off_after_n_consecutive_overflows() -> None:
    scaler = GradScaler("cpu", init_scale=64.0, hysteresis=3, growth_interval=100)
    #        overflow  overflow  clean  overflow overflow overflow overflow overflow overflow
    got = _scales(scaler, [True, True, False, True, True, True, True, True, True])
    assert got == [64.0, 64.0, 64.0, 64.0, 64.0, 32.0, 32.0, 32.0, 16.0]
    assert scaler.skipped_steps == 8  # every overflow skipped, hysteresis or not


def test_min_and_max_scale_bound_the_trajectory() -> None:
    scaler = GradScaler("cpu", init_scale=4.0, min_scale=1.0, max_scale=16.0,
                        growth_interval=1)
    got = _scales(scaler, [True, True, True, False, False, False, False, False])
    assert got == [2.0, 1.0, 1.0, 2.0, 4.0, 8.0, 16.0, 16.0]
    odd = GradScaler("cpu", init_scale=10.0, max_scale=12.0, growth_interval=1)
    assert _scales(odd, [False, False]) == [12.0, 12.0]  # apex: min(max, scale * 2)


def test_static_scale_never_moves_but_still_skips() -> None:
    scaler = GradScaler("cpu", init_scale=128.0, dynamic=False, growth_interval=1)
    assert _scales(scaler, [False, True, False, True]) == [128.0] * 4
    assert scaler.skipped_steps == 2
    assert scaler.state_dict()["dynamic"] is False


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_gradients_are_unscaled(dtype: torch.dtype) -> None:
    w, opt = _param_and_opt(dtype)
    scaler = GradScaler("cpu", init_scale=2.0 ** 10)
    scaler.scale((w.float() * torch.tensor([1.0, 2.0, 3.0])).sum()).backward()
    scaler.unscale_(opt)
    assert w.grad is not None and w.grad.dtype is dtype
    assert w.grad.tolist() == [1.0, 2.0, 3.0]
    if dtype is torch.float16:  # torch refuses what ampkit accepts
        w2, opt2 = _param_and_opt(dtype)
        theirs = torch.amp.GradScaler("cpu")
        theirs.scale(w2.float().sum()).backward()
        with pytest.raises(ValueError, match="FP16"):
            theirs.unscale_(opt2)


def test_fallback_unscale_path_matches_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    # The tensor-op path used where torch's kernel refuses a dtype (bf16 on some builds).
    def grads() -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(0)
        out = [(torch.randn(50, generator=gen) * 1e4).to(torch.bfloat16),
               torch.randn(7, generator=gen).to(torch.float16)]
        return out

    inv = torch.tensor(2.0 ** -13)
    for poison in (None, float("inf"), float("nan")):
        results = []
        for kernel in (True, False):
            monkeypatch.setattr(overflow_module, "_kernel_accepts",
                                lambda device, dtype, k=kernel: k)
            gs = grads()
            if poison is not None:
                gs[1][3] = poison
            found = torch.zeros(())
            overflow_module.unscale_grads_(gs, inv, found)
            results.append((gs, found))
        (a, found_a), (b, found_b) = results
        assert torch.equal(found_a, found_b) and found_a.item() == (poison is not None)
        assert all(torch.equal(x, y) or (x.isnan().any() and torch.equal(
            x.nan_to_num(), y.nan_to_num())) for x, y in zip(a, b))


def test_reporting_attributes() -> None:
    w, opt = _param_and_opt()
    scaler = GradScaler("cpu")
    assert (scaler.skipped_steps, scaler.last_step_skipped) == (0, False)
    scaler.scale((w * math.inf).sum()).backward()
    scaler.step(opt)
    # the current iteration counts as soon as it has been checked
    assert (scaler.skipped_steps, scaler.last_step_skipped) == (1, True)
    scaler.update()
    assert (scaler.skipped_steps, scaler.last_step_skipped) == (1, True)
    _one_step(scaler, opt, w)
    assert (scaler.skipped_steps, scaler.last_step_skipped) == (1, False)
    assert scaler.state_dict()["skipped_steps"] == 1
    with pytest.raises(AttributeError):
        scaler.skipped_steps = 0  # type: ignore[misc]


def test_pickle_between_iterations() -> None:
    w, opt = _param_and_opt()
    scaler = GradScaler("cpu", init_scale=256.0, hysteresis=2, growth_interval=5)
    for factor in (1.0, math.inf, 1.0):
        _one_step(scaler, opt, w, factor)
    clone = pickle.loads(pickle.dumps(scaler))
    assert clone.state_dict() == scaler.state_dict()
    scaler.scale(w.sum()).backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="pickled"):
        pickle.dumps(scaler)


# -- torch's contract with optimizers that scale themselves ---------------------------------

class _SelfScalingSGD(torch.optim.Optimizer):
    """A fused-style SGD of the user's own: it declares ``_step_supports_amp_scaling``,
    so the scaler leaves unscaling and skipping to it (torch's custom-optimizer
    contract)."""

    def __init__(self, params: list[torch.nn.Parameter], lr: float) -> None:
        super().__init__(params, {"lr": lr})
        self._step_supports_amp_scaling = True
        self.seen: list[tuple[float, float, list[float]]] = []

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        grad_scale, found_inf = self.grad_scale, self.found_inf  # set by the scaler
        for group in self.param_groups:
            for p in group["params"]:
                self.seen.append((float(grad_scale), float(found_inf), p.grad.tolist()))
                self.state[p]["steps"] = self.state[p].get("steps", 0) + 1
                if not found_inf:
                    p.add_(p.grad / grad_scale, alpha=-group["lr"])


def test_an_optimizer_that_scales_itself_gets_grad_scale_and_found_inf_from_its_first_step(
) -> None:
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = _SelfScalingSGD([w], lr=0.5)
    scaler = GradScaler("cpu", init_scale=8.0)
    scaler.scale((3 * w).sum()).backward()
    scaler.step(opt)      # no state yet: the first step
    scaler.update()
    # The gradients reach it still scaled (3 * 8), with the scale to divide them by.
    assert opt.seen == [(8.0, 0.0, [24.0, 24.0])]
    assert w.tolist() == [1.0 - 0.5 * 3, 2.0 - 0.5 * 3]
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")


def test_an_optimizer_whose_step_takes_grad_scaler_is_passed_the_scaler() -> None:
    calls: list[tuple[object, bool, bool]] = []

    class TakesScaler(torch.optim.Optimizer):
        def __init__(self, params: list[torch.nn.Parameter]) -> None:
            super().__init__(params, {})
            self._step_supports_amp_scaling = True

        def step(self, closure: None = None, *,  # type: ignore[override]
                 grad_scaler: GradScaler | None = None) -> None:
            calls.append((grad_scaler, hasattr(self, "grad_scale"),
                           hasattr(self, "found_inf")))

    w = torch.nn.Parameter(torch.ones(2))
    opt = TakesScaler([w])
    scaler = GradScaler("cpu", init_scale=2.0)
    scaler.scale(w.sum()).backward()
    with pytest.warns(FutureWarning, match="grad_scaler"):
        scaler.step(opt)
    assert calls == [(scaler, False, False)]
    assert w.grad is not None and w.grad.tolist() == [2.0, 2.0]  # left to the optimizer
