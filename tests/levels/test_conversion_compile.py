"""torch.compile of converted models: one graph, no graph break, the eager numbers;
and a forward that ends in a KeyboardInterrupt leaves nothing switched on or swapped."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch._dynamo.testing import CompileCounter

import ampkit
from ampkit.autocast_mode import current_policy
from ampkit.parameter_casts import swap_depth


class _Net(nn.Module):
    """A user-defined model: Linear, LayerNorm, GELU, Linear, BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.b = nn.Linear(16, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.b(nn.functional.gelu(self.norm(self.a(x)))))


def _sequential() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4),
                         nn.BatchNorm1d(4))


def _pair(make, level: str, **overrides):
    torch.manual_seed(0)
    first = make()
    second = make()
    second.load_state_dict(first.state_dict())
    return [ampkit.initialize(m, level=level, dtype=torch.bfloat16, **overrides)
            for m in (first, second)]


@pytest.mark.parametrize("make", [_Net, _sequential], ids=["user-class", "sequential"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_converted_model_compiles_fullgraph_once_and_matches_eager(make, level: str) -> None:
    eager_model, compiled_model = _pair(make, level)
    x = torch.randn(6, 8, device="cpu")
    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(compiled_model, backend=counter, fullgraph=True)
    for _ in range(3):  # training steps: same graph each time
        expected = eager_model(x)
        got = compiled(x)
        assert got.dtype == expected.dtype
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        expected.float().square().mean().backward()
        got.float().square().mean().backward()
    assert counter.frame_count == 1
    for (name, p), q in zip(eager_model.named_parameters(), compiled_model.parameters()):
        assert q.dtype == torch.float32, name
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=1e-6, msg=name)
    assert swap_depth() == 0 and current_policy("cpu") is None


def test_policy_with_lists_compiles_fullgraph_when_the_model_is_compiled() -> None:
    """The model's region is entered outside the graph, so a policy with lists is in
    effect (traced, guarded) while dynamo traces the forward."""
    lists = {"custom_white_list": ["add"], "custom_black_list": ["gelu"]}
    eager_model, compiled_model = _pair(_Net, "O2", **lists)
    x = torch.randn(6, 8, device="cpu")
    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(compiled_model, backend=counter, fullgraph=True)
    for _ in range(2):
        torch.testing.assert_close(compiled(x), eager_model(x), rtol=0, atol=0)
    assert counter.frame_count == 1
    with torch.no_grad():  # a step's in-place change: the same graph, new weights
        for p in compiled_model.parameters():
            p.add_(0.01)
        for p in eager_model.parameters():
            p.add_(0.01)
    torch.testing.assert_close(compiled(x), eager_model(x), rtol=0, atol=0)
    assert counter.frame_count == 1


def test_converted_model_called_inside_a_compiled_function_has_no_graph_break() -> None:
    eager_model, compiled_model = _pair(_sequential, "O2")
    x = torch.randn(6, 8, device="cpu")

    def loss(model: nn.Module, t: torch.Tensor) -> torch.Tensor:
        return model(t).square().mean()

    torch._dynamo.reset()
    explained = torch._dynamo.explain(loss)(compiled_model, x)
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(compiled_model, x), loss(eager_model, x),
                               rtol=0, atol=0)


class _Interrupting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.armed = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            raise KeyboardInterrupt
        return self.lin(x)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_keyboard_interrupt_in_forward_leaves_no_region_and_no_swapped_parameter(
        level: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), _Interrupting())
    weights = {name: p for name, p in model.named_parameters()}
    model = ampkit.initialize(model, level=level, dtype=torch.bfloat16,
                              custom_black_list=["softmax"])
    with pytest.raises(KeyboardInterrupt):
        model(torch.randn(2, 4, device="cpu"))
    # The parameters are the fp32 truth again, the very same objects.
    for name, p in model.named_parameters():
        assert p is weights[name], name
        assert model.get_submodule(name.rpartition(".")[0])._parameters[
            name.rpartition(".")[2]] is weights[name]
    assert swap_depth() == 0
    # No region is left on: plain code runs in fp32 again.
    assert current_policy("cpu") is None
    assert not torch.is_autocast_enabled("cpu")
    a = torch.randn(3, 3, device="cpu")
    assert (a @ a).dtype == torch.float32
    # And the model itself runs again, at its level.
    model[2].armed = False
    out = model(torch.randn(2, 4, device="cpu"))
    assert out.dtype == (torch.float32 if level == "O2" else torch.bfloat16)
