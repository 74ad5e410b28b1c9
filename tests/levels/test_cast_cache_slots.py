"""O2's cast cache keeps one slot per parameter across optimizer steps (the step drops
only the copy), so a steady training loop makes no new bookkeeping per parameter per
step; the slot still goes with its parameter."""

from __future__ import annotations

import gc
import weakref

import torch
import torch.nn as nn

import ampkit
from ampkit.parameter_casts import is_cached

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


def test_a_step_makes_no_new_weak_references_to_the_parameters() -> None:
    model, opt = _trained()
    _step(model, opt)
    x = torch.ones(3, 4, device="cpu")
    model(x).sum().backward()  # copies held: the cache's references are there
    before = {id(p): weakref.getweakrefs(p) for p in model.parameters()}
    opt.step()
    opt.zero_grad(set_to_none=True)
    model(x).sum().backward()
    after = {id(p): weakref.getweakrefs(p) for p in model.parameters()}
    for ident, refs in before.items():
        assert len(after[ident]) == len(refs)
        assert all(a is b for a, b in zip(after[ident], refs))


def test_the_step_still_drops_every_copy_and_the_next_forward_recasts() -> None:
    model, opt = _trained()
    _step(model, opt)
    model(torch.ones(3, 4, device="cpu")).sum().backward()
    assert all(is_cached(p) for p in model.parameters())
    first = model[0].weight.detach().to(BF16)
    opt.step()
    assert not any(is_cached(p) for p in model.parameters())
    seen: list[torch.Tensor] = []
    model[0].register_forward_pre_hook(lambda m, a: seen.append(m._parameters["weight"]))
    model(torch.ones(3, 4, device="cpu")).sum().backward()
    assert torch.equal(seen[0], model[0].weight.detach().to(BF16))
    assert not torch.equal(seen[0], first)  # the step changed it: a new copy


def test_a_discarded_stepped_model_takes_its_slots_with_it() -> None:
    from ampkit import parameter_casts

    data = parameter_casts._CACHE.data
    model, opt = _trained()
    _step(model, opt)
    _step(model, opt)
    idents = [id(p) for p in model.parameters()]
    assert all(data[i].ref() is p for i, p in zip(idents, model.parameters()))
    gone = weakref.ref(model[0].weight)
    del model, opt
    gc.collect()
    assert gone() is None  # the slots hold their parameters weakly
    # and went with them (an id reused since by a live tensor may have a slot of its own)
    assert all(i not in data or data[i].ref() is not None for i in idents)
