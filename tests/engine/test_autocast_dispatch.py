"""Listed ops are intercepted by kernels on the dispatcher's Autocast keys, not
by a Python mode; compiled graphs never run under a policy other than their own."""

from __future__ import annotations

import threading

import torch
from torch._dynamo.testing import CompileCounterWithBackend

import ampkit
from ampkit.engine import kernels

BF16, F32 = torch.bfloat16, torch.float32
POLICY_A = {"custom_white_list": ["add"]}  # mm native (bf16), add in bf16
POLICY_B = {"custom_black_list": ["mm"]}  # mm in fp32, add native (fp32 stays fp32)


def _by_hand(x: torch.Tensor, y: torch.Tensor, policy: dict) -> torch.Tensor:
    """What each policy computes, written out without autocast."""
    if policy is POLICY_A:
        return (x.bfloat16() @ y.bfloat16()) + x.bfloat16()
    return x @ y + x


def test_alternating_policies_a_b_a_compile_twice_each_call_its_own_policy() -> None:
    """The no-stale-graph rule, with inductor (whose AOTAutograd cache is keyed by the
    dynamo graph, the same under both policies)."""
    x, y = torch.rand(4, 4), torch.rand(4, 4)
    counter = CompileCounterWithBackend("inductor")
    fn = torch.compile(lambda a, b: torch.mm(a, b) + a, backend=counter)
    torch._dynamo.reset()
    with torch.no_grad():
        for policy in (POLICY_A, POLICY_B, POLICY_A, POLICY_B):
            with ampkit.autocast("cpu", BF16, **policy):  # a new region object each time
                out = fn(x, y)
            expected = _by_hand(x, y, policy)
            assert out.dtype == expected.dtype
            torch.testing.assert_close(out, expected, rtol=8e-3, atol=8e-3)
    assert counter.frame_count == 2


def test_graph_compiled_under_native_autocast_is_not_reused_under_a_policy() -> None:
    x, y = torch.rand(4, 4), torch.rand(4, 4)
    counter = CompileCounterWithBackend("aot_eager")
    fn = torch.compile(lambda a, b: torch.mm(a, b) + a, backend=counter)
    torch._dynamo.reset()
    with torch.autocast("cpu", BF16):
        native = fn(x, y)
    with ampkit.autocast("cpu", BF16, **POLICY_B):
        listed = fn(x, y)
    with ampkit.autocast("cpu", BF16):  # the default policy is native: same graph
        default = fn(x, y)
    assert native.dtype == default.dtype == F32  # bf16 product + fp32 input: promoted
    torch.testing.assert_close(native, (x.bfloat16() @ y.bfloat16()) + x, rtol=0, atol=0)
    torch.testing.assert_close(listed, x @ y + x, rtol=0, atol=0)
    assert counter.frame_count == 2


def test_listed_ops_push_no_python_mode_eager_or_compiled() -> None:
    """The speed: unlisted ops never leave C++ (no TorchFunctionMode on the stack)."""
    seen = []
    fn = torch.compile(lambda a: (a + a, torch._C._len_torch_function_stack()),
                       backend="aot_eager")
    with ampkit.autocast("cpu", BF16, custom_white_list=["add"],
                         custom_black_list=["softmax", "gelu", "layer_norm", "mul"]):
        seen.append(torch._C._len_torch_function_stack())
        out, in_graph = fn(torch.rand(3))
    assert seen == [0] and in_graph == 0
    assert out.dtype == BF16


def test_kernels_follow_the_calling_thread_only() -> None:
    x, y = torch.rand(4), torch.rand(4)
    entered, done = threading.Event(), threading.Event()
    other: list[torch.dtype] = []

    def outside_any_region() -> None:
        entered.wait()
        with torch.autocast("cpu", BF16):  # native autocast only: add is not cast
            other.append((x + y).dtype)
        done.set()

    thread = threading.Thread(target=outside_any_region)
    thread.start()
    with ampkit.autocast("cpu", BF16, custom_white_list=["add"]):
        entered.set()
        done.wait()
        here = (x + y).dtype
    thread.join()
    assert ("AutocastCPU", "aten::add.Tensor") in kernels.registered()
    assert here == BF16 and other == [F32]


def test_native_equal_policy_registers_nothing() -> None:
    before = kernels.registered()
    for policy in ("torch", ampkit.policies.policy.Policy()):
        with ampkit.autocast("cpu", BF16, policy=policy):
            assert torch._C._len_torch_function_stack() == 0
            assert kernels._active.table is None
            torch.bmm(torch.rand(1, 2, 2), torch.rand(1, 2, 2))
    assert kernels.registered() == before


def test_ops_inside_python_composites_follow_the_lists() -> None:
    """A listed dispatcher op applies wherever it runs, inside a Python composite too
    (as native autocast's lists do): MultiheadAttention's projections are linear."""
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    q = torch.rand(1, 3, 8)
    with torch.no_grad(), ampkit.autocast("cpu", BF16, custom_black_list=[torch.nn.Linear]):
        out, _ = mha(q, q, q, need_weights=False)
    with torch.no_grad(), torch.autocast("cpu", BF16):
        native, _ = mha(q, q, q, need_weights=False)
    assert native.dtype == BF16 and out.dtype == F32


def test_tensor_list_arguments_are_cast_and_torchscript_only_names_still_apply() -> None:
    """``lstm_cell``'s hidden state is a ``Tensor[]`` argument; ``aten::cpu`` exists
    only for TorchScript (no dispatcher op): the mode takes ``Tensor.cpu``."""
    cell = torch.nn.LSTMCell(4, 4)
    x, state = torch.rand(3, 4), (torch.zeros(3, 4), torch.zeros(3, 4))
    with ampkit.autocast("cpu", BF16, custom_white_list=["lstm_cell"]):
        h, c = cell(x, state)
    assert (h.dtype, c.dtype) == (BF16, BF16)
    with ampkit.autocast("cpu", BF16, custom_black_list=["cpu"]):
        assert torch.rand(2).bfloat16().cpu().dtype == F32


def test_a_registered_kernel_is_not_compiled_as_a_frame_of_its_own() -> None:
    """Kernels stay registered after their region. A listed op later run from a frame
    that compiled code executes eagerly (here a block compiled with fullgraph=True
    inside an O2 model, under native autocast) calls the kernel from C++ with dynamo's
    frame callback on: its frame must run as plain Python, not be traced."""
    x = torch.randn(3, 16)
    with ampkit.autocast("cpu", BF16, custom_black_list=["relu"]):
        torch.relu(x)  # registers relu's kernel
    assert ("AutocastCPU", "aten::relu") in kernels.registered()

    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        block = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU())
        return ampkit.initialize(torch.nn.Sequential(
            torch.nn.Linear(16, 32), block, torch.nn.LayerNorm(32), torch.nn.Linear(32, 8)),
            level="O2", dtype=BF16)

    eager, compiled = make(), make()
    compiled[1].compile(backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), eager(x), rtol=0, atol=0)
