"""What docs/levels.md says of a loss computed outside an O1 model: bit for bit native
autocast's loss inside its region for losses on native's fp32 list; for others native
computes in bf16 and O1 (whose outputs come back in fp32) in fp32.

Oracle: native ``torch.autocast`` with the loss inside its region, same weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampkit

BF16 = torch.bfloat16


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 10))


X = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
Y = torch.randint(0, 10, (8,), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("loss", [lambda o: F.cross_entropy(o, Y),
                                  lambda o: F.mse_loss(o, torch.ones_like(o))],
                         ids=["cross_entropy", "mse_loss"])
def test_a_loss_on_natives_fp32_list_equals_native_inside_bit_for_bit(loss):
    with torch.autocast("cpu", BF16):
        native = loss(_net()(X))
    o1 = loss(ampkit.initialize(_net(), level="O1", dtype="bfloat16")(X))
    assert native.dtype is torch.float32 and o1.dtype is torch.float32
    assert torch.equal(o1, native)


@pytest.mark.parametrize("loss", [lambda o: o.square().mean(),
                                  lambda o: torch.logsumexp(o, -1).mean()],
                         ids=["square-mean", "logsumexp"])
def test_a_loss_off_the_list_is_bf16_in_native_and_fp32_outside_o1(loss):
    with torch.autocast("cpu", BF16):
        logits = _net()(X)
        native = loss(logits)
    o1 = loss(ampkit.initialize(_net(), level="O1", dtype="bfloat16")(X))
    assert native.dtype is BF16 and o1.dtype is torch.float32
    # O1's loss is the fp32 loss of native's own (bf16) logits
    assert torch.equal(o1, loss(logits.float()))
