"""The output rule: a converted model's outputs come back as the model built them,
except that low-precision floating tensors become fp32.

Oracle: native ``torch.autocast`` around the same model (O1 computes what it computes,
bit for bit), and the model's own output types: a float64 output stays float64, a
container keeps its type and behaviour and is rebuilt without running the user's code
again (a dataclass's ``__post_init__``, a class's ``__init__``), and an input handed
back untouched is the same object."""

from __future__ import annotations

import collections
import dataclasses
import re
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn as nn

import ampkit

BF16 = torch.bfloat16


class _Net(nn.Module):
    """A Linear whose output ``wrap`` packs into the container under test."""

    def __init__(self, wrap: Any) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 4)
        self.wrap = wrap

    def forward(self, x: torch.Tensor) -> Any:
        return self.wrap(self.lin(x), x)


def _native(wrap: Any, x: torch.Tensor) -> Any:
    with torch.autocast("cpu", BF16):
        return _Net(wrap)(x)


def _converted(wrap: Any, level: str) -> nn.Module:
    return ampkit.initialize(_Net(wrap), level=level, dtype="bfloat16")


X = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_float64_output_stays_float64_as_native(level):
    def wrap(y, x):
        # float64 on the way out, values near 1e6 (float32 keeps ~7 digits of them)
        return y.double() * 1e6 + 1e6, y

    big, low = _converted(wrap, level)(X)
    assert big.dtype is torch.float64 and low.dtype is torch.float32
    if level == "O1":
        ref_big, ref_low = _native(wrap, X)
        assert torch.equal(big, ref_big)
        assert torch.equal(low, ref_low.float())


@dataclasses.dataclass
class _Scaled:
    logits: torch.Tensor
    scale: float = 2.0
    calls: int = 0

    def __post_init__(self) -> None:
        # user code that transforms a field: run twice, it scales twice
        self.logits = self.logits * self.scale
        self.calls += 1


@dataclasses.dataclass(frozen=True)
class _Frozen:
    logits: torch.Tensor
    norm: torch.Tensor = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "norm", self.logits.float().norm())


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_dataclass_output_is_not_rebuilt_through_its_init(level):
    out = _converted(lambda y, x: _Scaled(y), level)(X)
    assert type(out) is _Scaled and out.calls == 1 and out.logits.dtype is torch.float32
    if level == "O1":
        ref = _native(lambda y, x: _Scaled(y), X)
        assert torch.equal(out.logits, ref.logits.float())
    frozen = _converted(lambda y, x: _Frozen(y), level)(X)
    assert type(frozen) is _Frozen and frozen.logits.dtype is torch.float32
    assert frozen.norm.dtype is torch.float32


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_defaultdict_output_keeps_its_factory(level):
    out = _converted(lambda y, x: collections.defaultdict(list, logits=y), level)(X)
    assert type(out) is collections.defaultdict and out.default_factory is list
    assert out["logits"].dtype is torch.float32
    assert out["not there"] == []


class _Pair(NamedTuple):
    logits: torch.Tensor
    tag: str


class _Tagged(collections.OrderedDict):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.inits = getattr(self, "inits", 0) + 1


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_named_tuples_ordered_dicts_and_subclasses_keep_type_and_state(level):
    pair = _converted(lambda y, x: _Pair(y, "a"), level)(X)
    assert type(pair) is _Pair and pair.tag == "a" and pair.logits.dtype is torch.float32
    od = _converted(lambda y, x: collections.OrderedDict(b=1, logits=y), level)(X)
    assert type(od) is collections.OrderedDict and list(od) == ["b", "logits"]
    od.move_to_end("b")  # an OrderedDict's own behaviour works on the rebuilt one
    assert list(od) == ["logits", "b"]
    tagged = _converted(lambda y, x: _Tagged(logits=y), level)(X)
    assert type(tagged) is _Tagged and tagged.inits == 1  # its __init__ ran once


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_hugging_face_model_output_keeps_type_and_behaviour(level):
    from transformers.modeling_outputs import CausalLMOutputWithPast

    out = _converted(lambda y, x: CausalLMOutputWithPast(logits=y), level)(X)
    assert type(out) is CausalLMOutputWithPast and out.logits.dtype is torch.float32
    assert out["logits"] is out.logits and out[0] is out.logits and out.loss is None
    assert out.to_tuple() == (out.logits,)


def test_input_handed_back_untouched_is_the_same_object():
    batch = {"x": X, "mask": torch.ones(2, dtype=torch.bool)}

    class _Echo(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 4)

        def forward(self, batch: dict) -> Any:
            return self.lin(batch["x"]), batch

    model = ampkit.initialize(_Echo(), level="O1", dtype="bfloat16")
    y, back = model(batch)
    assert y.dtype is torch.float32
    assert back is batch  # not a rebuilt copy
    same = ampkit.initialize(_Net(lambda y, x: (y, x)), level="O1", dtype="bfloat16")
    assert same(X)[1] is X


def test_input_handed_back_at_o2_is_the_callers_tensor():
    # O2 casts the model's inputs to bf16 on the way in; handing one back untouched
    # gives the caller's tensor, not a float32 copy of its rounded bf16 view.
    model = _converted(lambda y, x: (y, x), "O2")
    y, back = model(X)
    assert back is X and y.dtype is torch.float32


# -- compiled code that calls the model: the same rule ------------------------------------

@dataclasses.dataclass
class _Derived:
    logits: torch.Tensor
    shifted: torch.Tensor = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        # a field left out of __init__, computed from another: recomputed from the cast
        # field, it would differ
        self.shifted = self.logits + 100


@dataclasses.dataclass(slots=True)
class _Slotted:
    logits: torch.Tensor


# Whether this torch's compiled code rebuilds a dataclass instance that has a __dict__
# inside the graph (from 2.12: dynamo lists the instance's attributes)
_DATACLASS_IN_GRAPH = tuple(map(int, torch.__version__.split(".")[:2])) >= (2, 12)


def _compiled_call(model: nn.Module, fullgraph: bool = True) -> Any:
    torch._dynamo.reset()
    return torch.compile(lambda t: model(t), backend="aot_eager", fullgraph=fullgraph)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_compiled_function_calling_the_model_rebuilds_outputs_without_user_code(level):
    # The traced output cast rebuilt a dataclass through dataclasses.replace (its
    # __post_init__ ran again: the logits scaled twice; an init=False field recomputed
    # from the cast field) and a defaultdict through its type (the factory lost).
    # (torch 2.11's compiled code cannot list an instance's __dict__: a dataclass with
    # one is rebuilt outside the graph there, a graph break that fullgraph=True names)
    scaled = _compiled_call(_converted(lambda y, x: _Scaled(y), level),
                            fullgraph=_DATACLASS_IN_GRAPH)(X)
    ref = _native(lambda y, x: _Scaled(y), X)
    assert type(scaled) is _Scaled and scaled.calls == 1
    assert torch.equal(scaled.logits, ref.logits.float())
    derived = _compiled_call(_converted(lambda y, x: _Derived(y), level),
                             fullgraph=_DATACLASS_IN_GRAPH)(X)
    if not _DATACLASS_IN_GRAPH:
        with pytest.raises(Exception, match="cannot list the attributes of a dataclass"):
            _compiled_call(_converted(lambda y, x: _Derived(y), level))(X)
    ref_derived = _native(lambda y, x: _Derived(y), X)
    assert torch.equal(derived.shifted, ref_derived.shifted.float())
    # (a slotted dataclass has no __dict__ to list: one graph on every release)
    slotted = _compiled_call(_converted(lambda y, x: _Slotted(y), level))(X)
    assert type(slotted) is _Slotted and slotted.logits.dtype is torch.float32
    factory = _compiled_call(_converted(
        lambda y, x: collections.defaultdict(list, logits=y), level))(X)
    assert type(factory) is collections.defaultdict and factory.default_factory is list
    assert factory["not there"] == []
    pair = _compiled_call(_converted(lambda y, x: _Pair(y, "a"), level))(X)
    assert type(pair) is _Pair and pair.tag == "a"
    tied = _compiled_call(_converted(lambda y, x: (y, y), level))(X)
    assert tied[0] is tied[1] and tied[0].dtype is torch.float32


def test_compiled_function_rebuilds_a_subclass_container_outside_the_graph():
    # A dict subclass of the user's cannot be rebuilt inside a graph without its own
    # code: it is rebuilt as in eager mode (a graph break), and fullgraph=True names it.
    model = _converted(lambda y, x: _Tagged(logits=y), "O2")
    tagged = _compiled_call(model, fullgraph=False)(X)
    assert type(tagged) is _Tagged and tagged.inits == 1
    assert tagged["logits"].dtype is torch.float32
    with pytest.raises(Exception, match="cannot rebuild without running its class"):
        _compiled_call(model)(X)


# -- inputs edited or viewed by the forward -----------------------------------------------

class _Edits(nn.Module):
    """Edits its input in place (a whole tensor, a row through a view, a keyword's)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.how = how

    def forward(self, x: torch.Tensor, extra: dict | None = None) -> Any:
        if self.how == "whole":
            x.add_(1)
            return x
        if self.how == "row":
            x[0].mul_(2)
            return self.lin(x)
        assert extra is not None
        extra["scale"].add_(1)
        return self.lin(x) * extra["scale"]


@pytest.mark.parametrize("level", ["O2", "O3"])
@pytest.mark.parametrize(("how", "named"), [("whole", "'x'"), ("row", "'x'"),
                                            ("keyword", "\"extra['scale']\"")])
def test_an_input_edited_in_place_is_refused_naming_it(level, how, named):
    # Native autocast's forward edits the caller's tensor; at O2/O3 the edit landed on
    # the boundary's low-precision copy and the caller's tensor stayed as it was.
    native_x, native_scale = X.clone(), torch.zeros(4)
    with torch.autocast("cpu", BF16):
        _Edits(how)(native_x, {"scale": native_scale})
    assert not torch.equal(native_x, X) or native_scale.sum() == 4  # native edits them
    model = ampkit.initialize(_Edits(how), level=level, dtype="bfloat16")
    x = X.clone()
    with pytest.raises(RuntimeError, match=rf"edited its input {re.escape(named)} in "
                                           r"place.*(?s:.*)out of place"):
        model(x, extra={"scale": torch.zeros(4)})
    assert torch.equal(x, X)


def test_an_input_edited_in_place_at_o1_reaches_the_caller_as_native():
    native_x, x = X.clone(), X.clone()
    with torch.autocast("cpu", BF16):
        ref = _Edits("whole")(native_x)
    out = ampkit.initialize(_Edits("whole"), level="O1", dtype="bfloat16")(x)
    assert out is x and torch.equal(x, native_x) and torch.equal(out, ref)


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
@pytest.mark.parametrize("view", ["row", "transpose", "gapped"])
def test_a_view_of_an_input_comes_back_exact_as_native(level, view):
    # At O2/O3 a view of the input came back rounded to bf16 (a view of the cast copy),
    # while the input itself came back as the caller's tensor.
    def take(y, x):
        if view == "row":
            return y, x[0]
        if view == "transpose":
            return y, x.t()
        return y, x[1:, ::2]

    base = torch.randn(3, 16, generator=torch.Generator().manual_seed(2))
    x = (base[:, ::2] if view == "gapped" else base[:, :8].contiguous()).requires_grad_()
    with torch.autocast("cpu", BF16):
        _, ref_view = _Net(take)(x)
    (ref_view.sum() * 3).backward()
    ref_grad, x.grad = x.grad, None
    y, got = _converted(take, level)(x)
    assert y.dtype is torch.float32 and got.dtype is torch.float32
    assert torch.equal(got, ref_view)
    if view != "gapped":  # a view of the caller's tensor, as native's is
        assert got._base is x or got._base is x._base
    (got.sum() * 3).backward()
    assert torch.equal(x.grad, ref_grad)


# -- full backward hooks ------------------------------------------------------------------

class _Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _hooked(model: nn.Module) -> list[tuple[str, Any, Any]]:
    """Each module's full backward hook records (name, grad_input[0], the dtype of the
    input it was called with)."""
    seen: list[tuple[str, Any, Any]] = []
    called: dict[str, torch.dtype] = {}
    for name, module in (("model", model), ("a", model.a)):
        module.register_forward_pre_hook(
            lambda m, args, name=name: called.__setitem__(name, args[0].dtype))
        module.register_full_backward_hook(
            lambda m, gi, go, name=name: seen.append((name, gi[0], called[name])))
    return seen


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_the_models_full_backward_hook_gets_the_callers_input_gradient(level):
    # At O2/O3 the model's grad_input was bf16 (the gradient of the boundary's cast
    # copy); native autocast's is the fp32 gradient of the caller's tensor.
    x = X.clone().requires_grad_()
    native = _Two()
    ref = _hooked(native)
    with torch.autocast("cpu", BF16):
        native(x).float().sum().backward()
    model = ampkit.initialize(_Two(), level=level, dtype="bfloat16")
    got = _hooked(model)
    model(x).sum().backward()
    ref_root = next(g for n, g, _ in ref if n == "model")
    root = next(g for n, g, _ in got if n == "model")
    assert root.dtype is ref_root.dtype is torch.float32
    if level == "O1":
        assert torch.equal(root, ref_root)
    # one rule for every module: a gradient has the dtype of the tensor the module was
    # called with (inside an O2/O3 model, the level's low-precision activations)
    assert all(g.dtype is dtype for _, g, dtype in got)
    assert "forward" not in model.__dict__  # the deferred cast leaves nothing behind


def test_a_compiled_model_with_a_full_backward_hook_compiles_once():
    from torch._dynamo.testing import CompileCounter

    model = ampkit.initialize(_Two(), level="O2", dtype="bfloat16")
    got: list[torch.dtype] = []
    model.register_full_backward_hook(lambda m, gi, go: got.append(gi[0].dtype))
    counter = CompileCounter()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=counter)
    for _ in range(3):
        compiled(X.clone().requires_grad_()).sum().backward()
    assert counter.frame_count == 1
    assert got == [torch.float32] * 3
