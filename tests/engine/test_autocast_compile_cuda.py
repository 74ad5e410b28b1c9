"""CUDA variants of the torch.compile checks; skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch._dynamo.testing import CompileCounterWithBackend

import ampkit

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

DEV = "cuda"


def _counted(fn, backend: str = "eager"):  # type: ignore[no-untyped-def]
    counter = CompileCounterWithBackend(backend)
    return torch.compile(fn, backend=counter, fullgraph=True), counter


def test_cuda_training_loop_compiles_once() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)).to(DEV)
    compiled, counter = _counted(model)
    torch._dynamo.reset()
    for _ in range(4):
        x = torch.randn(2, 8, device=DEV)
        with ampkit.autocast(DEV, torch.float16, custom_white_list=["gelu"],
                             custom_black_list=["softmax"]):
            y = compiled(x)
            with torch.no_grad():
                eager = model(x)
        torch.testing.assert_close(y, eager, rtol=0, atol=0)
        y.float().sum().backward()
    assert counter.frame_count == 1
    for p in model.parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32


def test_cuda_alternating_and_nested_policies() -> None:
    a, b = torch.rand(4, device=DEV), torch.rand(4, device=DEV)
    fn, counter = _counted(lambda x, y: x + y)
    torch._dynamo.reset()
    for _ in range(3):
        with ampkit.autocast(DEV, torch.float16, custom_white_list=["add"]):
            assert fn(a, b).dtype == torch.float16
            with ampkit.autocast(DEV, torch.float16, custom_black_list=["add"]):
                assert fn(a.half(), b).dtype == torch.float32
    assert counter.frame_count == 2
    assert fn(a, b).dtype == torch.float32


def test_cuda_region_inside_compiled_function() -> None:
    lin = nn.Linear(8, 8).to(DEV)
    x = torch.randn(2, 8, device=DEV)

    def fn(t: torch.Tensor) -> torch.Tensor:
        with ampkit.autocast(DEV, torch.float16, custom_white_list=["add"]):
            return lin(t) + t

    torch._dynamo.reset()
    eager = fn(x)
    compiled = torch.compile(fn, backend="aot_eager")(x)
    assert compiled.dtype == eager.dtype == torch.float16
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


def test_cuda_inductor_backward_gives_parameter_dtype_grads() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(16, 16).to(DEV)
    ref = nn.Linear(16, 16).to(DEV)
    ref.load_state_dict(lin.state_dict())
    x = torch.randn(4, 16, device=DEV)
    torch._dynamo.reset()
    fn = torch.compile(lambda m, t: m(t).softmax(-1) + t, backend="inductor", fullgraph=True)
    with ampkit.autocast(DEV, torch.float16, custom_white_list=["add"],
                         custom_black_list=["softmax"]):
        out = fn(lin, x)
        eager = ref(x).softmax(-1) + x
    out.float().sum().backward()
    eager.float().sum().backward()
    assert out.dtype == eager.dtype == torch.float16
    torch.testing.assert_close(out, eager, rtol=2e-3, atol=2e-3)
    for p, q in zip(lin.parameters(), ref.parameters(), strict=True):
        assert p.grad is not None and p.grad.dtype == torch.float32
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-2, atol=1e-2)
