"""Cases where ampkit.autocast gave another result than native autocast or fp32.

Weight casts under no_grad / inference_mode / in-place updates, views under an unlisted
rule, an explicit dtype given by position, nesting a torch.autocast of the other dtype,
and activation checkpointing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import ampkit
import ampkit.paddle as paddle_amp

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32

# Every kind of region that lists a weight-taking op (linear) as low precision.
REGIONS: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
    "white-list": lambda: ampkit.autocast("cpu", BF16, custom_white_list=["linear"]),
    "conservative": lambda: ampkit.autocast("cpu", BF16, policy="conservative"),
    "paddle-O1": lambda: ampkit.autocast("cpu", BF16, policy="paddle-O1"),
    "mxnet-bfloat16": lambda: ampkit.autocast("cpu", policy="mxnet-bfloat16"),
    "paddle-dialect": lambda: paddle_amp.auto_cast(dtype="bfloat16", device_type="cpu"),
}
NO_GRAD = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


def _grads(region: Callable[[], contextlib.AbstractContextManager],
           before: Callable[[], contextlib.AbstractContextManager] | None) -> list[torch.Tensor]:
    torch.manual_seed(0)
    lin = nn.Linear(4, 3)
    x = torch.rand(2, 4, requires_grad=True)
    with region():
        if before is not None:
            with before():  # a target network / teacher / EMA forward
                lin(x)
        out = lin(x)
    out.float().sum().backward()
    assert lin.weight.grad is not None and lin.bias.grad is not None and x.grad is not None
    return [lin.weight.grad, lin.bias.grad, x.grad]


# -- the weight-cast cache ---------------------------------------------------------------------

@pytest.mark.parametrize("grad_off", list(NO_GRAD), ids=list(NO_GRAD))
@pytest.mark.parametrize("region", list(REGIONS), ids=list(REGIONS))
def test_no_grad_forward_does_not_steal_the_weights_gradient(region: str,
                                                             grad_off: str) -> None:
    expected = _grads(REGIONS[region], None)
    got = _grads(REGIONS[region], NO_GRAD[grad_off])
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


def test_no_grad_passes_in_between_keep_every_gradient() -> None:
    # no_grad, grad, no_grad, grad inside one region (torch's own test of its cache)
    lin = nn.Linear(2, 2)
    x = torch.randn(8, 2)
    with ampkit.autocast("cpu", BF16, custom_white_list=["linear"]):
        with torch.no_grad():
            assert not lin(x).requires_grad
        first = lin(x)
        with torch.no_grad():
            assert not lin(x).requires_grad
        second = lin(x)
        assert first.grad_fn is not None and second.grad_fn is not None
        (first.float().mean() + second.float().mean()).backward()
    assert lin.weight.grad is not None and lin.bias.grad is not None


def test_region_inside_inference_mode_computes_without_grad() -> None:
    lin, x = nn.Linear(2, 2), torch.randn(8, 2)
    with torch.inference_mode(), ampkit.autocast("cpu", BF16, custom_white_list=["linear"]):
        out = lin(x)
    assert out.dtype == BF16 and not out.requires_grad


def test_weight_updated_in_place_is_cast_again() -> None:
    # ampkit's own weight cache (an op ampkit's kernel lowers: native CPU autocast leaves
    # embedding alone). A white-listed linear is native's own rule: it takes no kernel,
    # so native's kernel and native's cache apply, as in a region with the default policy.
    emb = nn.Embedding(5, 3)
    idx = torch.tensor([1, 2, 4])
    with ampkit.autocast("cpu", BF16, custom_white_list=["embedding"]):
        emb(idx)
        with torch.no_grad():
            emb.weight.add_(1.0)  # an optimizer step inside one long region
        out = emb(idx)
    expected = F.embedding(idx, emb.weight.detach().bfloat16())
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


# -- views stay views --------------------------------------------------------------------------

VIEWS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "vsplit": lambda t: t.vsplit(2)[0],
    "hsplit": lambda t: t.hsplit(2)[0],
    "split_with_sizes": lambda t: t.split_with_sizes([2, 2])[0],
    "adjoint": lambda t: t.adjoint(),
    "conj": lambda t: t.conj(),
    "positive": lambda t: t.positive(),
    "resolve_neg": lambda t: t.resolve_neg(),
}
CASTING_UNLISTED = {"paddle-O2-no-promote": lambda: ampkit.get_policy("paddle-O2-no-promote"),
                    "tuned": lambda: ampkit.Policy(name="tuned", dtype=BF16, unlisted="lower")}


@pytest.mark.parametrize("policy", list(CASTING_UNLISTED), ids=list(CASTING_UNLISTED))
@pytest.mark.parametrize("view", list(VIEWS), ids=list(VIEWS))
def test_views_stay_views_under_a_casting_unlisted_rule(view: str, policy: str) -> None:
    x = torch.zeros(4, 4)
    with ampkit.autocast("cpu", BF16, policy=CASTING_UNLISTED[policy]()):
        v = VIEWS[view](x)
        v.add_(1)
    assert v.dtype == F32
    assert x.sum() > 0  # the write went through the view into x


@pytest.mark.parametrize("policy", list(CASTING_UNLISTED), ids=list(CASTING_UNLISTED))
def test_view_as_complex_under_a_casting_unlisted_rule(policy: str) -> None:
    x = torch.rand(3, 2)
    with ampkit.autocast("cpu", BF16, policy=CASTING_UNLISTED[policy]()):
        c = torch.view_as_complex(x)
    assert c.dtype == torch.complex64
    assert c.data_ptr() == x.data_ptr()


def test_listing_a_view_op_still_applies_the_list() -> None:
    x = torch.rand(4, 4)
    with ampkit.autocast("cpu", BF16, custom_white_list=["vsplit"]):
        assert x.vsplit(2)[0].dtype == BF16


# -- an explicit dtype, by keyword or by position -----------------------------------------------

DTYPE_CALLS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "torch.log_softmax": lambda x: torch.log_softmax(x, -1, torch.float32),
    "Tensor.log_softmax": lambda x: x.log_softmax(-1, torch.float32),
    "F.log_softmax": lambda x: F.log_softmax(x, -1, 3, torch.float32),
    "torch.softmax": lambda x: torch.softmax(x, -1, torch.float32),
    "Tensor.softmax": lambda x: x.softmax(-1, torch.float32),
    "F.softmax": lambda x: F.softmax(x, -1, 3, torch.float32),
    "keyword": lambda x: torch.log_softmax(x, -1, dtype=torch.float32),
}


@pytest.mark.parametrize("call", list(DTYPE_CALLS), ids=list(DTYPE_CALLS))
def test_explicit_dtype_given_by_position_wins(call: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(8, 16) * 4
    expected = DTYPE_CALLS[call](x)  # outside any region: fp32
    with ampkit.autocast("cpu", BF16, custom_white_list=["log_softmax", "softmax"]):
        got = DTYPE_CALLS[call](x)
    assert got.dtype == F32
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_without_a_dtype_the_list_still_applies() -> None:
    x = torch.randn(8, 16)
    with ampkit.autocast("cpu", BF16, custom_white_list=["log_softmax"]):
        assert torch.log_softmax(x, -1).dtype == BF16
        assert F.log_softmax(x, -1, 3).dtype == BF16  # a positional non-dtype argument


# -- nesting a torch.autocast region -----------------------------------------------------------

@pytest.mark.parametrize("outer,inner", [(F16, BF16), (BF16, F16)])
def test_torch_autocast_inside_sets_the_dtype_the_lists_use(outer: torch.dtype,
                                                             inner: torch.dtype) -> None:
    a, b = torch.rand(4, 4), torch.rand(4, 4)
    with ampkit.autocast("cpu", outer, custom_white_list=["add"], custom_black_list=["mm"]):
        with torch.autocast("cpu", inner):
            # one dtype for everything low precision: the inner region's
            assert (a + b).dtype == inner  # white list, in the inner dtype
            assert torch.mm(a, b).dtype == F32  # black list still applies
            assert (a @ b).dtype == inner  # unlisted: native autocast, inner dtype
        with torch.autocast("cpu", enabled=False):
            assert (a + b).dtype == F32 and (a @ b).dtype == F32
        assert (a + b).dtype == outer and (a @ b).dtype == outer
    assert (a + b).dtype == F32


def test_inner_ampkit_region_replaces_the_outer_policy() -> None:
    a, b = torch.rand(4, 4), torch.rand(4, 4)
    outer = ampkit.autocast("cpu", F16, custom_white_list=["add"], custom_black_list=["mm"])
    with outer, ampkit.autocast("cpu", BF16):  # default policy inside: native rules only
        assert (a + b).dtype == F32 and torch.mm(a, b).dtype == BF16


# -- activation checkpointing -------------------------------------------------------------------

class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)) * torch.sigmoid(x))


def _checkpointed_grads(use_reentrant: bool | None) -> list[torch.Tensor]:
    torch.manual_seed(0)
    block = _Block()
    x = torch.randn(4, 8, requires_grad=True)
    with ampkit.autocast("cpu", BF16, custom_white_list=["tanh", "sigmoid", "mul"],
                         custom_black_list=["linear"]):
        out = block(x) if use_reentrant is None else checkpoint(
            block, x, use_reentrant=use_reentrant)
    out.float().sum().backward()
    return [*(p.grad for p in block.parameters()), x.grad]


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint_recomputes_under_the_regions_policy(use_reentrant: bool) -> None:
    expected = _checkpointed_grads(None)
    got = _checkpointed_grads(use_reentrant)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    assert not torch.is_autocast_enabled("cpu") and ampkit.current_policy("cpu") is None


def _nested_grads(use_reentrant: bool | None) -> list[torch.Tensor]:
    """Nested regions: an outer policy, an inner one around the checkpoint call, a third
    entered inside the checkpointed function, and the backward pass run under yet
    another region (which the recomputation must not pick up)."""
    torch.manual_seed(0)
    block, head = _Block(), nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)

    def fn(t: torch.Tensor) -> torch.Tensor:
        with ampkit.autocast("cpu", F16, custom_black_list=["tanh"]):
            t = block(t)
        return torch.softmax(head(t), -1)

    with ampkit.autocast("cpu", BF16, custom_black_list=["linear"]), \
            ampkit.autocast("cpu", BF16, custom_white_list=["softmax", "sigmoid"]):
        out = fn(x) if use_reentrant is None else checkpoint(
            fn, x, use_reentrant=use_reentrant)
    with ampkit.autocast("cpu", BF16, custom_black_list=["softmax", "mul"]):
        out.float().sum().backward()
    return [*(p.grad for p in block.parameters()), *(p.grad for p in head.parameters()),
            x.grad]


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint_recomputes_under_nested_regions_policies(use_reentrant: bool) -> None:
    expected = _nested_grads(None)
    got = _nested_grads(use_reentrant)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    assert not torch.is_autocast_enabled("cpu") and ampkit.current_policy("cpu") is None


def test_checkpoint_outside_any_region_is_untouched() -> None:
    torch.manual_seed(0)
    block = _Block()
    x = torch.randn(4, 8, requires_grad=True)
    with ampkit.autocast("cpu", BF16, custom_white_list=["tanh"]):
        pass  # the engine is set up; plain checkpointing must stay plain
    checkpoint(block, x, use_reentrant=False).sum().backward()
    expected = [p.grad.clone() for p in block.parameters()]
    block.zero_grad()
    block(x).sum().backward()
    for p, e in zip(block.parameters(), expected):
        torch.testing.assert_close(p.grad, e, rtol=0, atol=0)
