"""A tuned policy decides only the ops ampkit.tune measured (the model's
forward); put around forward and loss, the loss runs as under torch.autocast."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import ampkit

BF16 = torch.bfloat16


def _classifier() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 10))


def test_tuned_policy_around_forward_and_loss_runs_the_loss_as_native_autocast() -> None:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 16, generator=g), torch.randint(0, 10, (64,), generator=g)

    def accuracy(model: nn.Module) -> float:  # the search measures the forward only
        with torch.no_grad():
            return float((model(x).argmax(-1) == y).float().mean())

    result = ampkit.tune(_classifier(), accuracy, BF16, tolerance=0.05,
                         higher_is_better=True)
    assert result.within_tolerance
    model = _classifier()
    with ampkit.autocast("cpu", BF16, policy=result.policy):
        logits = model(x)
        loss = F.cross_entropy(logits, y)
    with torch.autocast("cpu", BF16):
        native_loss = F.cross_entropy(logits.detach(), y)
    assert logits.dtype == BF16  # the measured forward runs as tuned
    assert loss.dtype == native_loss.dtype == torch.float32
    torch.testing.assert_close(loss.detach(), native_loss, rtol=0, atol=0)
    # how: the lower rule is written out for the measured ops, all else is native
    assert result.policy.unlisted == "native"
    assert {"linear", "relu"} <= result.policy.lower_precision_ops
    assert "cross_entropy" not in (result.policy.lower_precision_ops
                                   | result.policy.fp32_ops | result.policy.promote_ops)
