"""torch.compile traces through ampkit.autocast regions without graph breaks."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn as nn

import ampkit

LISTS = {"custom_white_list": {"add"}, "custom_black_list": {"softmax", "gelu"}}


def _mlp() -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]:
    mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    return (lambda x: mlp(x) + x), torch.randn(2, 4, 8)


def _transformer_block() -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]:
    block = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True,
                                       activation="gelu")
    return (lambda x: block(x).softmax(-1)), torch.randn(2, 4, 16)


@pytest.mark.parametrize("make", [_mlp, _transformer_block], ids=["mlp", "transformer"])
def test_compile_without_graph_breaks_and_same_result(make: Callable) -> None:
    fn, x = make()
    torch._dynamo.reset()
    with ampkit.autocast("cpu", torch.bfloat16, **LISTS):
        explained = torch._dynamo.explain(fn)(x)
        eager = fn(x)
        compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)(x)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    assert compiled.dtype == eager.dtype
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


def test_compiled_function_follows_the_active_policy() -> None:
    """A graph traced under one policy is not reused under another (dynamo guards)."""
    a, b = torch.rand(3), torch.rand(3)
    torch._dynamo.reset()
    add = torch.compile(lambda x, y: x + y, backend="aot_eager", fullgraph=True)
    with ampkit.autocast("cpu", torch.bfloat16, custom_white_list={"add"}):
        assert add(a, b).dtype == torch.bfloat16
    with ampkit.autocast("cpu", torch.bfloat16):
        assert add(a, b).dtype == torch.float32
    assert add(a, b).dtype == torch.float32


def test_compiled_backward_gives_parameter_dtype_grads() -> None:
    mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    x = torch.randn(2, 4, 8)
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: mlp(t) + t, backend="aot_eager", fullgraph=True)
    with ampkit.autocast("cpu", torch.bfloat16, **LISTS):
        out = compiled(x)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    for p in mlp.parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32
        assert torch.isfinite(p.grad).all()


def test_region_inside_a_compiled_function_is_correct() -> None:
    """Entering a region inside compiled code works (dynamo breaks the graph at the
    region's entry and exit instead of tracing ampkit's own bookkeeping)."""
    mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    x = torch.randn(2, 8)

    def fn(t: torch.Tensor) -> torch.Tensor:
        with ampkit.autocast("cpu", torch.bfloat16, **LISTS):
            return mlp(t) + t

    torch._dynamo.reset()
    eager = fn(x)
    compiled = torch.compile(fn, backend="aot_eager")(x)
    assert eager.dtype == compiled.dtype == torch.bfloat16
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    assert ampkit.current_policy("cpu") is None  # the region was left behind properly


# --- equal policies reuse the graph; the training-loop case ----------------------------

def _counted(fn: Callable, backend: str | None = None) -> tuple[Callable, object]:
    from torch._dynamo.testing import CompileCounterWithBackend
    counter = CompileCounterWithBackend(backend or "eager")
    return torch.compile(fn, backend=counter, fullgraph=True), counter


def test_training_loop_with_inline_lists_compiles_once() -> None:
    """A training loop with lists written inline (new objects every step): one policy."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    compiled, counter = _counted(model)
    torch._dynamo.reset()
    for _ in range(6):
        x = torch.randn(2, 8)
        with ampkit.autocast("cpu", torch.bfloat16, custom_white_list=["gelu"],
                             custom_black_list=["softmax"]):
            y = compiled(x)
            with torch.no_grad():
                eager = model(x)
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y, eager, rtol=0, atol=0)
        y.float().sum().backward()
    assert counter.frame_count == 1
    for p in model.parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32


def test_alternating_policies_compile_exactly_twice() -> None:
    a, b = torch.rand(3), torch.rand(3)
    add, counter = _counted(lambda x, y: (x + y).exp())
    torch._dynamo.reset()
    for step in range(6):
        white = ["add"] if step % 2 == 0 else ["exp"]
        with ampkit.autocast("cpu", torch.bfloat16, custom_white_list=list(white)):
            out = add(a, b)
        # add in bf16 then exp keeps bf16; exp alone in bf16 gives bf16 too, but the
        # add's rounding differs: compare with the eager region's result bit for bit.
        with ampkit.autocast("cpu", torch.bfloat16, custom_white_list=list(white)):
            eager = (a + b).exp()
        torch.testing.assert_close(out, eager, rtol=0, atol=0)
    assert counter.frame_count == 2


def test_changed_list_recompiles_and_uses_the_new_lists() -> None:
    a, b = torch.rand(4), torch.rand(4)
    fn, counter = _counted(lambda x, y: x * y + x)
    torch._dynamo.reset()
    with ampkit.autocast("cpu", torch.bfloat16, custom_white_list=["mul"]):
        first = fn(a, b)
    with ampkit.autocast("cpu", torch.bfloat16, custom_white_list=["mul", "add"]):
        second = fn(a, b)
    assert counter.frame_count == 2
    assert first.dtype == torch.float32  # bf16 product promoted by the fp32 add
    assert second.dtype == torch.bfloat16
    expected = (a.bfloat16() * b.bfloat16()) + a.bfloat16()
    torch.testing.assert_close(second, expected, rtol=0, atol=0)
    # Outside any region the compiled function computes natively, in fp32.
    outside = fn(a, b)
    assert outside.dtype == torch.float32
    torch.testing.assert_close(outside, a * b + a, rtol=0, atol=0)


def test_nested_regions_under_compile() -> None:
    a, b = torch.rand(4), torch.rand(4)
    fn, counter = _counted(lambda x, y: x + y)
    torch._dynamo.reset()
    for _ in range(3):
        with ampkit.autocast("cpu", torch.bfloat16, custom_white_list=["add"]):
            assert fn(a, b).dtype == torch.bfloat16
            with ampkit.autocast("cpu", torch.bfloat16, custom_black_list=["add"]):
                assert fn(a.bfloat16(), b).dtype == torch.float32
            with ampkit.autocast("cpu", enabled=False):
                assert fn(a, b).dtype == torch.float32
            assert fn(a, b).dtype == torch.bfloat16
    assert counter.frame_count == 3  # one graph per distinct (policy, enabled) state


def test_preset_with_unlisted_rule_traces_fullgraph_and_matches_eager() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.Softmax(-1))
    x = torch.randn(2, 8)
    compiled, counter = _counted(model)
    torch._dynamo.reset()
    for _ in range(2):
        with ampkit.autocast("cpu", torch.bfloat16, policy="paddle-OD"):
            out = compiled(x)
            with torch.no_grad():
                eager = model(x)
        torch.testing.assert_close(out, eager, rtol=0, atol=0)
    assert counter.frame_count == 1


def test_inductor_compiles_once_and_matches_eager() -> None:
    """Inductor (not only aot_eager): a tiny inference graph so the CPU compile stays
    short; backward through compiled graphs is covered with aot_eager above."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    fn, counter = _counted(lambda t: lin(t).softmax(-1) + t, backend="inductor")
    torch._dynamo.reset()
    with torch.no_grad():
        for _ in range(3):
            with ampkit.autocast("cpu", torch.bfloat16, custom_white_list=["add"],
                                 custom_black_list=["softmax"]):
                out = fn(x)
                eager = lin(x).softmax(-1) + x
        native = fn(x)
    assert counter.frame_count == 1 + 1  # the region's graph, then the native one
    assert out.dtype == eager.dtype == torch.bfloat16
    # The same casts written out, compiled by inductor too: on a CPU without native bf16
    # inductor's bf16 linear is not eager's (torch 2.13 on AVX2: 0.22 apart on this
    # Linear, with or without ampkit), so the compiled region is held to torch's own
    # compiled computation; inductor may fuse the casts: equal within one bf16 rounding.
    def by_hand(t: torch.Tensor) -> torch.Tensor:
        low = nn.functional.linear(t.bfloat16(), lin.weight.bfloat16(), lin.bias.bfloat16())
        return low.float().softmax(-1).bfloat16() + t.bfloat16()

    with torch.no_grad():
        reference = torch.compile(by_hand, backend="inductor")(x)
        eager_by_hand = by_hand(x)
    torch.testing.assert_close(out, reference, rtol=8e-3, atol=8e-3)
    # and the eager region computes exactly what the same casts do eagerly
    torch.testing.assert_close(eager, eager_by_hand, rtol=0, atol=0)
    assert native.dtype == torch.float32
    torch.testing.assert_close(native, lin(x).softmax(-1) + x)


def test_in_place_call_keeps_its_effect_under_compile() -> None:
    """An in-place call is never run on a cast copy, traced or not."""
    fn, counter = _counted(lambda t: torch.nn.functional.relu(t * 2, inplace=True) + t)
    x = torch.tensor([-1.0, 2.0, -3.0])
    torch._dynamo.reset()
    with ampkit.autocast("cpu", torch.bfloat16, custom_white_list=["relu"]):
        out = fn(x)
        eager = torch.nn.functional.relu(x * 2, inplace=True) + x
    assert counter.frame_count == 1
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
    torch.testing.assert_close(out, torch.tensor([-1.0, 6.0, -3.0]), rtol=0, atol=0)
