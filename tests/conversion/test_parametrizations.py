"""O2 under torch's reparametrizations: a parametrized module
computes its weight from the fp32 truth, in fp32, and only the op that uses the weight
sees a low-precision copy; buffers the parametrization keeps (spectral norm's u/v)
keep their dtype.

Oracle: native ``torch.autocast(bfloat16)`` over the fp32 model, on the same batches.
Tolerance: the two differ only in where bf16 rounding happens (native autocast also
rounds the matmuls inside a parametrization, O2 computes those in fp32), so losses are
compared at rtol 1e-2 and each gradient at 3e-2 of its largest entry: a few bf16 steps
(2**-8 = 0.4% each) through two layers. Old O2 was far outside it (NaN, or an error),
and computed the parametrization from bf16 copies, which the dtype checks catch."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrizations, parametrize

import ampkit

BF16, FP32 = torch.bfloat16, torch.float32


class _Scaled(nn.Module):
    """A user parametrization with a parameter of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.triu() + x.triu(1).transpose(0, 1)) * self.scale


def _legacy_spectral(lin: nn.Module) -> nn.Module:
    return torch.nn.utils.spectral_norm(lin)


def _legacy_weight(lin: nn.Module) -> nn.Module:
    return torch.nn.utils.weight_norm(lin)


def _user(lin: nn.Module) -> nn.Module:
    parametrize.register_parametrization(lin, "weight", _Scaled())
    return lin


KINDS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "orthogonal": parametrizations.orthogonal,
    "weight_norm": parametrizations.weight_norm,
    "spectral_norm": parametrizations.spectral_norm,
    "legacy_spectral_norm": _legacy_spectral,
    "legacy_weight_norm": _legacy_weight,
    "user": _user,
}


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(KINDS[kind](nn.Linear(8, 8)), nn.ReLU(), nn.Linear(8, 4))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(64, 8, generator=gen), torch.randint(0, 4, (64,), generator=gen)


def _train(model: nn.Module, native: bool, steps: int
           ) -> tuple[list[float], list[torch.Tensor]]:
    """Losses of ``steps`` Adam steps, and the gradients of the first backward pass."""
    x, y = _data()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses: list[float] = []
    first: list[torch.Tensor] = []
    for _ in range(steps):
        if native:
            with torch.autocast("cpu", BF16):
                out = model(x)
        else:
            out = model(x)
        loss = F.cross_entropy(out.float(), y)
        opt.zero_grad()
        loss.backward()
        if not first:
            first = [p.grad.clone() for p in model.parameters()]
        opt.step()
        losses.append(loss.item())
    return losses, first


def _seen_by_parametrizations(model: nn.Module) -> list[torch.dtype]:
    """Records the dtype of what each parametrization (new style) computes from, and of
    the parameters a legacy hook computes from, as the forward runs."""
    seen: list[torch.dtype] = []
    for module in model.modules():
        if isinstance(module, parametrize.ParametrizationList):
            for p in module:
                p.register_forward_pre_hook(
                    lambda m, args: seen.extend(a.dtype for a in args if torch.is_tensor(a)))
        elif hasattr(module, "weight_orig") or hasattr(module, "weight_g"):
            # appended: runs after the legacy hook (and after ampkit's swap)
            module.register_forward_pre_hook(lambda m, args: seen.extend(
                t.dtype for n, t in m._parameters.items() if n.startswith("weight_")))
    return seen


@pytest.mark.filterwarnings("ignore:.*torch.nn.utils.weight_norm.* is deprecated")
@pytest.mark.parametrize("kind", list(KINDS))
def test_o2_trains_like_native_autocast_from_the_fp32_truth(kind: str) -> None:
    fp32 = _model(kind)
    o2 = ampkit.initialize(_model(kind), level="O2", dtype=BF16)  # (weight_norm: no deepcopy)
    seen = _seen_by_parametrizations(o2)
    want_losses, want_grads = _train(fp32, native=True, steps=3)
    got_losses, got_grads = _train(o2, native=False, steps=3)
    assert seen and set(seen) == {FP32}, seen  # computed from the fp32 parameters
    assert all(p.dtype is FP32 for p in o2.parameters())
    assert all(b.dtype is FP32 for b in o2.buffers())  # spectral norm's u, v
    torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(want_losses),
                               rtol=1e-2, atol=0)
    for got, want in zip(got_grads, want_grads):
        assert got.dtype is FP32
        torch.testing.assert_close(got, want, rtol=0, atol=3e-2 * want.abs().max().item())


def test_spectral_norm_buffers_follow_native_autocast() -> None:
    fp32 = _model("spectral_norm")
    o2 = ampkit.initialize(copy.deepcopy(fp32), level="O2", dtype=BF16)
    _train(fp32, native=True, steps=2)
    _train(o2, native=False, steps=2)
    for (name, got), want in zip(o2.named_buffers(), fp32.buffers()):
        assert got.dtype is FP32, name
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_orthogonal_linear_under_adam_does_not_go_nan() -> None:
    # orthogonal Linear, Adam lr 1e-2, 30 steps: fp32 and native autocast end
    # at the same loss; O2 was NaN from step 1.
    fp32 = _model("orthogonal")
    o2 = ampkit.initialize(copy.deepcopy(fp32), level="O2", dtype=BF16)
    want, _ = _train(fp32, native=True, steps=30)
    got, _ = _train(o2, native=False, steps=30)
    assert all(torch.isfinite(torch.tensor(got)))
    assert abs(got[-1] - want[-1]) < 1e-2 * want[-1]


def test_the_parametrized_module_keeps_its_parametrize_class() -> None:
    model = ampkit.initialize(_model("orthogonal"), level="O2", dtype=BF16)
    assert parametrize.type_before_parametrizations(model[0]) is nn.Linear
    assert model[0].weight.dtype is FP32  # read outside a forward: the fp32 value
    with torch.no_grad():
        want = model[0].weight.clone()
    parametrize.remove_parametrizations(model[0], "weight")
    assert type(model[0]) is nn.Linear
    assert torch.equal(model[0].weight, want)
    assert model(torch.randn(2, 8)).dtype is FP32


def test_legacy_hooks_can_still_be_removed() -> None:
    model = ampkit.initialize(_model("legacy_spectral_norm"), level="O2", dtype=BF16)
    model(torch.randn(2, 8))
    torch.nn.utils.remove_spectral_norm(model[0])
    assert isinstance(model[0]._parameters["weight"], nn.Parameter)
    assert model(torch.randn(2, 8)).dtype is FP32


# -- O3 and pure bf16: the parameters are stored low -------------------------------------
#
# There too a parametrization computes from fp32 sources (as norms with statistics keep
# fp32 parameters): torch's parametrizations cannot compute in bf16 (orthogonal's
# matrix_exp refuses it; spectral norm's power iteration meets its fp32 u and v), and
# its result, the weight, is handed on in bf16, read from anywhere (a checkpoint's
# recompute included). Oracle: the fp32 model, at bf16 weights' tolerance (5e-2 on the
# loss after 3 AdamW steps: every weight the Linears use is rounded to bf16 once).

@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("mode", [{"level": "O3"},
                                  {"level": "O2", "master_weights": "stochastic"}])
def test_o3_and_pure_compute_the_parametrization_in_fp32(kind: str, mode: dict) -> None:
    def build() -> nn.Module:  # (torch refuses to deepcopy a legacy weight_norm)
        torch.manual_seed(0)
        return nn.Sequential(KINDS[kind](nn.Linear(8, 8)), nn.ReLU(), nn.Linear(8, 4))

    ref, low = build(), ampkit.initialize(build(), dtype=BF16, **mode)
    sources = {n: p.dtype for n, p in low[0].named_parameters()
               if n.startswith("parametrizations.") or n.endswith(("_orig", "_g", "_v"))}
    assert sources and set(sources.values()) == {FP32}, sources
    assert {b.dtype for b in low[0].buffers()} <= {FP32}  # u/v, base: their dtype
    assert low[2].weight.dtype == BF16
    x, y = torch.randn(16, 8, generator=torch.Generator().manual_seed(1)), \
        torch.randn(16, 4, generator=torch.Generator().manual_seed(2))
    losses = []
    for model in (ref, low):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if "master_weights" in mode and model is low:
            opt = ampkit.fsdp.prepare_optimizer(model, opt)
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            loss = F.mse_loss(model(x).float(), y)
            loss.backward()
            opt.step()
        losses.append(loss.item())
    assert torch.isfinite(torch.tensor(losses)).all()
    assert losses[1] == pytest.approx(losses[0], rel=5e-2)


def test_o3_parametrized_weight_in_a_checkpoint_recompute() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(parametrizations.orthogonal(nn.Linear(8, 8)), nn.ReLU())
    model = ampkit.initialize(model, level="O3", dtype=BF16)
    x = torch.randn(4, 8, dtype=BF16, requires_grad=True)
    out = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False)
    out.float().sum().backward()  # the recompute runs outside the model's forward
    assert model[0].parametrizations.weight.original.grad.dtype == FP32
