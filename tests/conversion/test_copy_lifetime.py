"""O2's low-precision copy of a parameter lives for one forward of the converted model:
no change made between two forwards is missed, whatever its route, even those that bump
no version counter (``.data`` edits, ``.data =`` swaps to the same
address, edits of a base tensor that parameters view).

Oracle: fp32 training of the same model on the same work, the same edits made to it.
Tolerance: the O2 forward rounds weights and activations to bfloat16 (8 significant
bits, a relative step of 2**-8 = 0.4%) through two layers, so a loss or an output is
compared at rtol 2e-2; a stale copy is off by far more (each test says by how much)."""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers_models import on_forward
from torch.nn.utils import parameters_to_vector, vector_to_parameters

import ampkit
from ampkit.conversion.parameter_casts import cached_casts, reuse_casts

BF16 = torch.bfloat16
RTOL = 2e-2


def _pair(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """(fp32 model, the same model at O2 bf16)."""
    torch.manual_seed(seed)
    fp32 = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    o2 = ampkit.initialize(copy.deepcopy(fp32), level="O2", dtype=BF16)
    return fp32, o2


def _batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(32, 8, generator=gen), torch.randint(0, 4, (32,), generator=gen)


def _sgd_step(model: nn.Module, lr: float = 0.5) -> None:
    """One torch.optim.SGD step (old O2 kept copies of stepped parameters until the
    next step of a torch optimizer)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    x, y = _batch()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a.float(), b.float(), rtol=RTOL, atol=RTOL * b.abs().max().item())


def test_a_hand_written_update_after_a_torch_step_trains_like_fp32() -> None:
    x, y = _batch()
    curves = []
    for model in _pair():
        _sgd_step(model)
        losses = []
        for _ in range(5):
            loss = F.cross_entropy(model(x), y)
            losses.append(loss.item())
            loss.backward()
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-0.5)  # no version bump
                p.grad = None
        curves.append(torch.tensor(losses))
    fp32, o2 = curves
    assert fp32[-1] < 0.95 * fp32[0]  # fp32 learns (stale O2 copies: flat)
    torch.testing.assert_close(o2, fp32, rtol=RTOL, atol=0)


def test_weights_zeroed_after_an_eval_give_what_fp32_gives() -> None:
    x, _ = _batch(2)
    for model in _pair():
        _sgd_step(model)
        with torch.no_grad():
            model(x)  # an eval forward (EMA swap, validation)
        for p in model.parameters():
            p.data.mul_(0)
        with torch.no_grad():
            assert torch.equal(model(x), torch.zeros(32, 4))  # stale: up to ~0.5
        assert torch.equal(model(x), torch.zeros(32, 4))


def test_a_data_swap_to_the_same_address_is_seen() -> None:
    x, _ = _batch(2)
    outs = []
    for model in _pair():
        _sgd_step(model)
        model(x).sum().backward()
        weight = model[0].weight
        # A new tensor over the parameter's own storage: same address, same version.
        alias = torch.empty(0).set_(weight.data.untyped_storage(), weight.storage_offset(),
                                    weight.shape, weight.stride())
        alias.copy_(torch.linspace(-1, 1, weight.numel()).view_as(weight))
        weight.data = alias
        assert weight.data_ptr() == alias.data_ptr()
        outs.append(model(x).detach())
    fp32, o2 = outs
    assert _close(o2, fp32), (o2 - fp32).abs().max()


def test_data_swaps_between_forwards_are_seen_every_time() -> None:
    x, _ = _batch(2)
    fp32, o2 = _pair()
    for model in (fp32, o2):
        _sgd_step(model)
    gen = torch.Generator().manual_seed(5)
    for _ in range(20):
        values = torch.randn(fp32[0].weight.shape, generator=gen)
        outs = []
        for model in (fp32, o2):
            model(x).sum().backward()
            model[0].weight.data = torch.empty_like(values)  # may land at the old address
            model[0].weight.data = values.clone()
            outs.append(model(x).detach())
        assert _close(outs[1], outs[0]), (outs[1] - outs[0]).abs().max()


def test_parameters_that_view_a_flat_vector_see_its_edits() -> None:
    x, _ = _batch(2)
    outs = []
    for model in _pair():
        _sgd_step(model)
        vec = parameters_to_vector(model.parameters())
        vector_to_parameters(vec, model.parameters())  # each parameter views vec now
        model(x).sum().backward()
        vec.mul_(3)  # changes every parameter; bumps no parameter's version
        outs.append(model(x).detach())
    fp32, o2 = outs
    assert _close(o2, fp32), (o2 - fp32).abs().max()


def _sam_gradients(model: nn.Module, rho: float) -> list[torch.Tensor]:
    """SAM's second gradient: at the weights perturbed through ``.data`` along the
    first gradient, between the two forwards of one step."""
    x, y = _batch(3)
    F.cross_entropy(model(x), y).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    norm = torch.stack([g.norm() for g in grads]).norm()
    eps = [g * (rho / norm) for g in grads]
    for p, e in zip(model.parameters(), eps):
        p.data.add_(e)
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    for p, e in zip(model.parameters(), eps):
        p.data.sub_(e)
    return [p.grad.clone() for p in model.parameters()]


def test_sam_perturbation_between_two_forwards_is_seen() -> None:
    fp32, o2 = _pair()
    for model in (fp32, o2):
        _sgd_step(model)
    unperturbed = copy.deepcopy(fp32)
    x, y = _batch(3)
    F.cross_entropy(unperturbed(x), y).backward()
    plain = [p.grad for p in unperturbed.parameters()]
    want = _sam_gradients(fp32, rho=1.0)
    got = _sam_gradients(o2, rho=1.0)
    for g, w, u in zip(got, want, plain):
        # what the perturbation changes in the gradient, against O2's rounding error
        assert (g - w).abs().max() < 0.2 * (w - u).abs().max()


def test_load_state_dict_between_forwards_is_seen() -> None:
    # A route users change weights by. (The old cache saw this one: load_state_dict copies in
    # place under no_grad, which bumps the version. Kept so no cache may regress on it.)
    x, _ = _batch(2)
    torch.manual_seed(7)
    other = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).state_dict()
    outs = []
    for model in _pair():
        _sgd_step(model)
        model(x).sum().backward()
        model.load_state_dict(other)
        outs.append(model(x).detach())
    fp32, o2 = outs
    assert _close(o2, fp32), (o2 - fp32).abs().max()


def test_reuse_casts_shares_copies_across_its_forwards_and_drops_them_after() -> None:
    # The opt-in lifetime: one block, one copy per weight; gradients as without it.
    x, y = _batch(4)
    grads = []
    for reuse in (False, True):
        _, o2 = _pair()
        casts: list[torch.Tensor] = []
        on_forward(o2[0], lambda m, a, casts=casts: casts.append(m._parameters["weight"]))
        with reuse_casts() if reuse else contextlib.nullcontext():
            for half in (slice(0, 16), slice(16, 32)):
                F.cross_entropy(o2(x[half]), y[half]).backward()
            held = cached_casts()
        assert (casts[0] is casts[1]) is reuse
        assert held == (4 if reuse else 0) and cached_casts() == 0
        grads.append([p.grad for p in o2.parameters()])
    for plain, reused in zip(*grads):
        assert torch.equal(plain, reused)
