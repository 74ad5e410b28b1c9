"""ampkit hears of optimizer steps through one global step pre-hook
(:mod:`ampkit.common.step_hooks`), whatever features registered checks: O2's parameters cast on
use, pure low-precision training and FSDP2 sharding each check an optimizer's first step
through it."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.optim import optimizer as torch_optimizer

import ampkit
from ampkit.common.step_hooks import check_at_first_step
from ampkit.conversion.parameter_owners import record_owners
from ampkit.pure import mark_pure_models

BF16 = torch.bfloat16


def _ampkit_step_hooks() -> list[object]:
    return [hook for hook in torch_optimizer._global_optimizer_pre_hooks.values()
            if getattr(hook, "__module__", "").startswith("ampkit")]


def test_every_feature_checks_through_one_global_step_hook():
    # Each feature that checks optimizers at their first step, used once here.
    ampkit.initialize(nn.Sequential(nn.Linear(2, 2)), level="O2", dtype=BF16)
    mark_pure_models([nn.Linear(2, 2).to(BF16)], "kahan", 0)
    record_owners(nn.Linear(2, 2))  # what fully_shard records before it shards
    assert len(_ampkit_step_hooks()) == 1


def test_a_check_runs_until_an_optimizer_passes_it_then_never_again():
    calls: list[int] = []
    fail = [True]

    def check(optimizer: torch.optim.Optimizer) -> None:
        calls.append(id(optimizer))
        if fail[0]:
            raise RuntimeError("refused")

    handle = check_at_first_step(check)
    try:
        assert check_at_first_step(check).check is check  # registered once
        w = nn.Parameter(torch.ones(1))
        opt = torch.optim.SGD([w], lr=1.0)
        w.grad = torch.ones(1)
        with pytest.raises(RuntimeError, match="refused"):
            opt.step()
        assert w.item() == 1.0  # a refused step changes nothing
        fail[0] = False
        opt.step()
        opt.step()
        assert w.item() == -1.0 and calls == [id(opt)] * 2
    finally:
        handle.remove()
    opt2 = torch.optim.SGD([w], lr=1.0)
    opt2.step()
    assert len(calls) == 2  # removed: not run for a new optimizer
