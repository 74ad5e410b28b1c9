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
