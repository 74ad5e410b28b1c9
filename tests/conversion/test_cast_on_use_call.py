"""O2's cast on use done in a module's own call (the hooks' work without the hooks'
cost): the same parameters seen by everything around the forward, the parameters back
after any exception, the class name kept, copies working."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
import torch.nn as nn

import ampkit
from ampkit.conversion.parameter_casts import swap_depth

BF16 = torch.bfloat16


class _OwnWeight(nn.Module):
    """A module with a parameter of its own (cast on use) whose forward can be made to
    raise KeyboardInterrupt."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4, device="cpu"))
        self.armed = False
        self.seen: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(self.w.dtype)
        if self.armed:
            raise KeyboardInterrupt
        return x * self.w


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4, device="cpu"), _OwnWeight())
    return ampkit.initialize(model, level="O2", dtype=BF16)


def test_keyboard_interrupt_in_a_submodule_called_alone_puts_its_parameter_back() -> None:
    """No model boundary around the call: torch's always-call forward hooks do not run
    on a KeyboardInterrupt, so with the hook pair the bf16 copy stayed in place."""
    model = _model()
    leaf = model[1]
    w = leaf.w
    leaf.armed = True
    with pytest.raises(KeyboardInterrupt):
        leaf(torch.ones(2, 4, dtype=BF16, device="cpu"))
    assert leaf.seen == [BF16]  # the forward did run with the copy
    assert leaf._parameters["w"] is w and w.dtype == torch.float32
    assert swap_depth() == 0
    leaf.armed = False
    assert leaf(torch.ones(2, 4, dtype=BF16, device="cpu")).dtype == BF16


def test_cast_hooks_are_not_called_when_they_are_a_modules_only_hooks() -> None:
    """Host cost: a module whose only hooks are its cast pair swaps in its own call,
    with no Python hook call (and no trip through nn.Module's slow hook path)."""
    model = _model()
    lin = model[0]
    calls = []
    for hooks in (lin._forward_pre_hooks, lin._forward_hooks):
        for key, hook in list(hooks.items()):
            def counted(*args, _hook=hook):
                calls.append(_hook)
                return _hook(*args)
            hooks[key] = counted
    out = model(torch.randn(2, 4, device="cpu"))
    assert calls == []
    assert out.dtype == torch.float32 and lin.weight.dtype == torch.float32
    out.square().mean().backward()
    assert lin.weight.grad.dtype == torch.float32


def test_other_hooks_see_what_they_saw_with_the_hook_pair() -> None:
    """A user's pre-hook runs before the swap (so it sees the fp32 truth, as in
    fp32 training), a user's forward hook after the parameters are back; a global
    pre-hook runs before the module's own hooks."""
    model = _model()
    lin = model[0]
    seen: list[tuple[str, torch.dtype, bool]] = []

    def record(where: str):
        def hook(module, *rest):
            w = module._parameters["weight"]
            seen.append((where, w.dtype, isinstance(w, nn.Parameter)))
        return hook

    handles = [lin.register_forward_pre_hook(record("pre")),
               lin.register_forward_hook(record("post")),
               nn.modules.module.register_module_forward_pre_hook(record("global"))]
    try:
        lin(torch.randn(2, 4, dtype=BF16, device="cpu"))
    finally:
        for handle in handles:
            handle.remove()
    assert seen == [("global", torch.float32, True), ("pre", torch.float32, True),
                    ("post", torch.float32, True)]
    seen.clear()
    lin(torch.randn(2, 4, dtype=BF16, device="cpu"))  # hooks gone: its own call again
    assert seen == []


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_copies_keep_the_class_name_and_compute_at_o2(how: str) -> None:
    model = _model()
    if how == "deepcopy":
        clone = copy.deepcopy(model)
    elif how == "pickle":
        clone = pickle.loads(pickle.dumps(model))
    else:
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        clone = torch.load(buffer, weights_only=False)
    for original, copied in zip(model.modules(), clone.modules()):
        assert type(copied) is type(original)
    assert type(clone[0]).__name__ == "Linear" and isinstance(clone[0], nn.Linear)
    x = torch.randn(2, 4, device="cpu")
    assert torch.equal(clone(x), model(x))
    assert clone[1].seen[-1] == BF16
    assert clone[0](x.to(BF16)).dtype == BF16
    assert clone[0].weight.dtype == torch.float32
