"""torch.compile of converted models: one graph, no graph break, the eager numbers;
and a forward that ends in a KeyboardInterrupt leaves nothing switched on or swapped."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch._dynamo.testing import CompileCounter

import ampkit
from ampkit.conversion.parameter_casts import swap_depth
from ampkit.engine.regions import current_policy


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
    seen = []
    model[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    out = model(torch.randn(2, 4, device="cpu"))
    # (the Linear computes in bf16 at both levels; both hand back fp32, so a loss outside
    # the model computes in fp32)
    assert out.dtype == torch.float32 and seen == [torch.bfloat16]


# -- torch.nn containers, with and without lists: one graph, equal to eager ---------------

# A black-listed linear: the whole forward is fp32 arithmetic on what the level hands
# it, so the reference is plain fp32 torch (below), not the code under test.
BLACK_LINEAR = {"custom_black_list": ["linear"]}


class _InModuleList(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class _InModuleDict(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({"a": nn.Linear(8, 16), "act": nn.GELU(),
                                     "b": nn.Linear(16, 4)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return x


def _plain_sequential() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


CONTAINERS = {"sequential": _plain_sequential, "module-list": _InModuleList,
              "module-dict": _InModuleDict}


def _fp32_reference(model: nn.Module, x: torch.Tensor, level: str) -> torch.Tensor:
    """What the level computes with linear black-listed, written in plain fp32 torch:
    O1 is the fp32 model; O2 feeds it the bf16 input and bf16 copies of the weights."""
    reference = _plain_sequential()
    with torch.no_grad():
        for ours, theirs in zip(reference.parameters(), model.parameters()):
            ours.copy_(theirs if level == "O1" else theirs.bfloat16().float())
        return reference(x if level == "O1" else x.bfloat16().float())


def _converted(make, level: str, **lists) -> nn.Module:
    torch.manual_seed(0)
    return ampkit.initialize(make(), level=level, dtype=torch.bfloat16, **lists)


@pytest.mark.parametrize("lists", [BLACK_LINEAR, {}], ids=["black-list", "no-lists"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_compiling_a_converted_sequential_gives_one_graph_equal_to_eager(level, lists):
    # Before: with lists (and at O2 since its fp32 list), "Skip inlining
    # torch.compiler.disable()'d function": torch.compile traced the Sequential's
    # boundary and met the ampkit region. (no-lists at O1: a guard, it compiled before.)
    model = _converted(_plain_sequential, level, **lists)
    x = torch.randn(6, 8)
    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    out = compiled(x)
    assert counter.frame_count == 1
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)
    if lists:
        torch.testing.assert_close(out, _fp32_reference(model, x, level), rtol=0, atol=0)
    else:  # native autocast's own result for O1 (O2: fp32 at the model's boundary)
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
            native = model[2](model[1](model[0](x)))
        if level == "O1":  # (handed back in fp32, as O1 hands back every output)
            torch.testing.assert_close(out, native.float(), rtol=0, atol=0)


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("container", sorted(CONTAINERS))
def test_converted_container_with_lists_inside_a_compiled_function_is_one_graph(
        container, level):
    # Before: the region of a model called from compiled code, with lists, was an
    # ampkit.autocast inside the trace: fullgraph=True failed for every container.
    model = _converted(CONTAINERS[container], level, **BLACK_LINEAR)
    x = torch.randn(6, 8)
    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(lambda t: model(t).square(), backend=counter, fullgraph=True)
    out = compiled(x)
    assert counter.frame_count == 1
    torch.testing.assert_close(out, model(x).square(), rtol=0, atol=0)
    torch.testing.assert_close(out, _fp32_reference(model, x, level).square(), rtol=0,
                               atol=0)
    assert current_policy("cpu") is None


def test_traced_region_bakes_its_casts_into_the_graph_and_trains_like_eager():
    # AOTAutograd traces through the region's graph nodes: the compiled forward and
    # backward (the nodes are not run by the compiled graph) equal eager's.
    eager_model = _converted(_plain_sequential, "O2", **BLACK_LINEAR)
    compiled_model = _converted(_plain_sequential, "O2", **BLACK_LINEAR)
    x = torch.randn(6, 8)
    torch._dynamo.reset()
    compiled = torch.compile(lambda m, t: m(t).square().mean(), backend="aot_eager",
                             fullgraph=True)
    compiled(compiled_model, x).backward()
    eager_model(x).square().mean().backward()
    for p, q in zip(eager_model.parameters(), compiled_model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0)


def test_a_graph_break_inside_a_traced_region_leaves_nothing_entered():
    # Regression guard for the traced region: a trace that stops in the middle (here a
    # data-dependent branch) runs the region eagerly and leaves no region behind.
    class Breaks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.a(x)
            if y.sum().item() > -1e9:
                y = y + 1
            return torch.softmax(y, -1)

    model = _converted(lambda: nn.Sequential(Breaks(), nn.Linear(8, 4)), "O2")
    x = torch.randn(3, 8)
    torch._dynamo.reset()
    out = torch.compile(lambda t: model(t).square(), backend="eager")(x)
    torch.testing.assert_close(out, model(x).square(), rtol=0, atol=0)
    assert current_policy("cpu") is None and not torch.is_autocast_enabled("cpu")


class _Upsample(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.interpolate(x.unsqueeze(1), scale_factor=2.0).squeeze(1)


def test_a_region_compiled_code_cannot_enter_is_named_and_compiling_the_model_works():
    # interpolate is a Python-level composite: its rule is the Python mode's, which a
    # graph cannot enter. Compiling the converted Sequential itself runs its region
    # outside the graph (one graph; before: fullgraph failed); called from a compiled
    # function, fullgraph=True fails with ampkit's reason.
    model = _converted(lambda: nn.Sequential(nn.Linear(8, 8), _Upsample()), "O1",
                       custom_black_list=["interpolate"])
    x = torch.randn(3, 8)
    torch._dynamo.reset()
    counter = CompileCounter()
    out = torch.compile(model, backend=counter, fullgraph=True)(x)
    assert counter.frame_count == 1
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="ampkit: a converted module's region") as error:
        torch.compile(lambda t: model(t).sum(), backend="eager", fullgraph=True)(x)
    assert "interpolate" in str(error.value)
    assert current_policy("cpu") is None


def test_a_pickled_boundary_makes_its_graph_keys_again_where_it_is_loaded():
    # The keys index a table of this process: a pickle carries the device types only.
    import pickle

    from ampkit.conversion.classes import _BOUNDARY
    from ampkit.engine.regions import in_graph_key

    model = _converted(_plain_sequential, "O2", **BLACK_LINEAR)
    boundary = model.__dict__[_BOUNDARY]
    assert boundary.__getstate__()["graph_keys"] == ["cpu"]
    loaded = pickle.loads(pickle.dumps(model)).__dict__[_BOUNDARY]
    assert loaded.graph_keys == {"cpu": in_graph_key("cpu", boundary.policy)}
