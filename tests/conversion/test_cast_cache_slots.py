"""O2's cast cache holds copies for one forward of the converted model and nothing
between forwards (it used to keep a slot per parameter across optimizer steps and copies
across micro-batches): a steady training loop makes no bookkeeping per
parameter that outlives a forward, and a discarded model is freed at once."""

from __future__ import annotations

import gc
import weakref

import torch
import torch.nn as nn

import ampkit
from ampkit.conversion.parameter_casts import cached_casts, is_cached

BF16 = torch.bfloat16


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4, device="cpu"), nn.Linear(4, 2, device="cpu"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ampkit.initialize(model, opt, level="O2", dtype=BF16)
    return model, opt


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.ones(3, 4, device="cpu")).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_a_step_makes_no_weak_references_to_the_parameters() -> None:
    model, opt = _trained()
    before = {id(p): len(weakref.getweakrefs(p)) for p in model.parameters()}
    _step(model, opt)
    _step(model, opt)
    assert {id(p): len(weakref.getweakrefs(p)) for p in model.parameters()} == before


def test_copies_are_held_during_the_forward_only() -> None:
    model, _ = _trained()
    during: list[bool] = []
    model[1].register_forward_pre_hook(
        lambda m, a: during.append(all(is_cached(p) for p in model[0].parameters())))
    model(torch.ones(3, 4, device="cpu")).sum().backward()
    assert during == [True]
    assert cached_casts() == 0 and not any(is_cached(p) for p in model.parameters())


def test_a_discarded_trained_model_is_freed() -> None:
    model, opt = _trained()
    _step(model, opt)
    model(torch.ones(3, 4, device="cpu")).sum().backward()  # a forward after the step
    gone = weakref.ref(model[0].weight)
    del model, opt
    gc.collect()
    assert gone() is None
