"""The autocast engine: custom lists, eligibility, nesting, threads, autograd, compile."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampkit
from ampkit.policies.policy import Policy

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


# -- Paddle's auto_cast example (seed 004), translated to torch ---------------------------

def test_paddle_seed_example_translated() -> None:
    conv2d = nn.Conv2d(3, 2, 3, bias=False)
    data = torch.rand(10, 3, 32, 32)
    with ampkit.autocast("cpu", F16):
        assert conv2d(data).dtype == F16
    with ampkit.autocast("cpu", F16, enabled=False):
        assert conv2d(data).dtype == F32
    with ampkit.autocast("cpu", F16, custom_black_list={"conv2d"}):
        assert conv2d(data).dtype == F32
    a, b = torch.rand(2, 3), torch.rand(2, 3)
    with ampkit.autocast("cpu", F16, custom_white_list={"add"}):
        assert (a + b).dtype == F16
    # native autocast leaves a + b alone: the white list is what changed it
    with torch.autocast("cpu", F16):
        assert (a + b).dtype == F32


@pytest.mark.parametrize("entry", ["add", torch.add, torch.Tensor.add, torch.Tensor.__add__])
def test_list_entries_by_name_or_callable(entry: object) -> None:
    a, b = torch.rand(3), torch.rand(3)
    with ampkit.autocast("cpu", BF16, custom_white_list=[entry]):
        for out in (a + b, torch.add(a, b), a.add(b), b.__radd__(a)):
            assert out.dtype == BF16


def test_module_class_and_functional_entries() -> None:
    lin = nn.Linear(4, 4)
    x = torch.rand(2, 4)
    with ampkit.autocast("cpu", BF16, custom_black_list=[nn.Linear]):
        assert lin(x).dtype == F32
    with ampkit.autocast("cpu", BF16, custom_black_list=[F.linear]):
        assert lin(x).dtype == F32
    with ampkit.autocast("cpu", BF16, custom_white_list={"softmax"}):
        assert F.softmax(x, -1).dtype == BF16
        assert x.softmax(-1).dtype == BF16
        assert torch.softmax(x, -1).dtype == BF16


def test_black_list_values_equal_fp32_computation() -> None:
    lin = nn.Linear(8, 8)
    x = torch.rand(4, 8)
    with ampkit.autocast("cpu", BF16, custom_black_list={"linear"}):
        out = lin(x)
    torch.testing.assert_close(out, F.linear(x, lin.weight, lin.bias), rtol=0, atol=0)


def test_white_list_values_equal_manual_low_precision() -> None:
    a, b = torch.rand(16), torch.rand(16)
    with ampkit.autocast("cpu", F16, custom_white_list={"mul"}):
        out = a * b
    assert torch.equal(out, a.half() * b.half())


def test_op_in_both_lists_is_value_error() -> None:
    with pytest.raises(ValueError, match="both custom_white_list and custom_black_list"):
        ampkit.autocast("cpu", custom_white_list={"add"}, custom_black_list=[torch.add])


def test_custom_entry_leaves_the_opposite_list() -> None:
    base = ampkit.get_policy("conservative")
    assert base.rule_for("softmax") == "fp32" and base.rule_for("linear") == "lower"
    p = base.with_lists(custom_white_list={"softmax"}, custom_black_list={"linear"})
    assert "softmax" in p.lower_precision_ops and "softmax" not in p.fp32_ops
    assert "linear" in p.fp32_ops and "linear" not in p.lower_precision_ops
    assert p.rule_for("add") == "promote"


# -- eligibility -----------------------------------------------------------------------------

def test_float64_and_integer_inputs_untouched() -> None:
    with ampkit.autocast("cpu", BF16, custom_white_list={"add", "mm"}):
        assert (torch.rand(3, dtype=torch.float64) + torch.rand(3, dtype=torch.float64)
                ).dtype == torch.float64
        assert (torch.arange(3) + torch.arange(3)).dtype == torch.int64
        assert torch.mm(torch.rand(2, 2).double(), torch.rand(2, 2).double()).dtype == (
            torch.float64)


def test_in_place_and_out_calls_not_autocast() -> None:
    a, b = torch.rand(3), torch.rand(3)
    expected = a + b  # fp32, computed outside any region
    with ampkit.autocast("cpu", BF16, custom_white_list={"add"}):
        out = torch.empty(3)
        torch.add(a, b, out=out)
        c = a.clone()
        c += b
        a.add_(b)
    for t in (out, c, a):
        assert t.dtype == F32
        assert torch.equal(t, expected)


@pytest.mark.parametrize("op", ["mm", "addmm", "matmul", "bmm"])
def test_listed_out_calls_match_native_autocast(op: str) -> None:
    # out= is never cast under native autocast; torch.compile's generated code calls
    # its matmuls that way on every step, inside the region (the engine's fast path).
    shapes = {"mm": [(3, 4), (4, 5)], "addmm": [(3, 5), (3, 4), (4, 5)],
              "matmul": [(3, 4), (4, 5)], "bmm": [(2, 3, 4), (2, 4, 5)]}[op]
    args = [torch.rand(*s) for s in shapes]
    fn = getattr(torch, op)

    def run(region: contextlib.AbstractContextManager) -> torch.Tensor:
        out = torch.empty(fn(*args).shape)
        with region:
            result = fn(*args, out=out)
        assert result is out
        return out

    native = run(torch.autocast("cpu", BF16))
    ours = run(ampkit.autocast("cpu", BF16, custom_white_list=[op]))
    assert ours.dtype == native.dtype == F32
    assert torch.equal(ours, native)
    assert torch.equal(ours, fn(*args))  # computed in fp32, as outside any region


def test_explicit_dtype_argument_wins() -> None:
    x = torch.rand(4, 4)
    with ampkit.autocast("cpu", BF16, custom_white_list={"softmax", "sum"}):
        assert torch.softmax(x, -1, dtype=torch.float64).dtype == torch.float64
        assert x.sum(dtype=F32).dtype == F32
        assert x.sum().dtype == BF16


def test_in_place_names_rejected_clearly() -> None:
    with pytest.raises(ValueError, match="in-place"):
        ampkit.autocast("cpu", custom_white_list={"add_"})


# -- promote -----------------------------------------------------------------------------------

def test_promote_list_casts_to_widest() -> None:
    p = Policy(promote_ops={"add"})
    lo, hi = torch.rand(3, dtype=BF16), torch.rand(3)
    with ampkit.autocast("cpu", BF16, policy=p):
        assert (lo + lo).dtype == BF16
        assert (lo + hi).dtype == F32
    # half + bfloat16 has no common 16-bit type: promote widens to fp32
    with ampkit.autocast("cpu", BF16, policy=p):
        assert (lo + lo.half()).dtype == F32


# -- nesting and threads ----------------------------------------------------------------------

def test_inner_region_overrides_outer_and_restores() -> None:
    a, b = torch.rand(3), torch.rand(3)
    lin, x = nn.Linear(3, 3), torch.rand(2, 3)
    with ampkit.autocast("cpu", BF16, custom_white_list={"add"}):
        assert (a + b).dtype == BF16
        with ampkit.autocast("cpu", BF16, custom_black_list={"add"}):
            assert (a.bfloat16() + b).dtype == F32
        with ampkit.autocast("cpu", BF16, enabled=False):
            assert (a + b).dtype == F32
            assert lin(x).dtype == F32
        with torch.autocast("cpu", enabled=False):  # native switch-off is honoured too
            assert (a + b).dtype == F32
        with ampkit.autocast("cpu", F16):  # default policy inside: native rules only
            assert (a + b).dtype == F32
            # torch.autocast raises here (its weight cache ignores the dtype); ampkit not
            assert lin(x).dtype == F16
        assert (a + b).dtype == BF16
        assert lin(x).dtype == BF16
    assert (a + b).dtype == F32
    assert lin(x).dtype == F32
    assert ampkit.current_policy("cpu") is None


def test_decorator_form() -> None:
    @ampkit.autocast("cpu", F16, custom_white_list={"mul"})
    def f(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a * b

    assert f(torch.rand(2), torch.rand(2)).dtype == F16
    assert (torch.rand(2) * torch.rand(2)).dtype == F32


def test_two_threads_with_different_policies() -> None:
    barrier = threading.Barrier(2)
    results: dict[str, list[torch.dtype]] = {}
    errors: list[BaseException] = []

    def run(name: str, white: set[str], black: set[str]) -> None:
        try:
            a, b = torch.rand(3), torch.rand(3)
            with ampkit.autocast("cpu", BF16, custom_white_list=white, custom_black_list=black):
                seen = []
                for _ in range(50):
                    barrier.wait()  # interleave the two threads' ops
                    seen.append((a + b).dtype)
                    seen.append(torch.mm(a[None], b[:, None]).dtype)
                results[name] = seen
        except BaseException as e:  # surfaced below
            errors.append(e)

    t1 = threading.Thread(target=run, args=("white", {"add"}, set()))
    t2 = threading.Thread(target=run, args=("black", set(), {"mm"}))
    t1.start(), t2.start()
    t1.join(), t2.join()
    assert not errors, errors
    assert set(results["white"][0::2]) == {BF16} and set(results["white"][1::2]) == {BF16}
    assert set(results["black"][0::2]) == {F32} and set(results["black"][1::2]) == {F32}


# -- autograd, no_grad, inference_mode, cache -------------------------------------------------

def test_gradients_come_back_in_each_parameters_dtype() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model[2].double()
    x = torch.rand(3, 4)
    with ampkit.autocast("cpu", BF16, custom_white_list={"add", "relu"},
                         custom_black_list={"log_softmax"}):
        h = model[1](model[0](x) + 1.0)
        out = model[2](h.double())
        loss = F.log_softmax(out, -1).sum()
    loss.backward()
    assert model[0].weight.grad.dtype == F32
    assert model[2].weight.grad.dtype == torch.float64
    assert torch.isfinite(model[0].weight.grad).all()


def test_no_grad_and_inference_mode() -> None:
    lin, x = nn.Linear(4, 4), torch.rand(2, 4)
    with torch.no_grad(), ampkit.autocast("cpu", BF16, custom_white_list={"add"}):
        assert (lin(x) + x).dtype == BF16
    with torch.inference_mode(), ampkit.autocast("cpu", BF16, custom_black_list={"linear"}):
        assert lin(x).dtype == F32


def test_weight_cast_cache_shares_one_cast_per_region() -> None:
    w = nn.Parameter(torch.rand(4, 4))
    x = torch.rand(4, 4)
    with ampkit.autocast("cpu", BF16, custom_white_list={"mul"}):
        a, b = x * w, w * x
        # one cached cast node feeds both products
        assert a.grad_fn.next_functions[1][0] is b.grad_fn.next_functions[0][0]
    with ampkit.autocast("cpu", BF16, custom_white_list={"mul"}, cache_enabled=False):
        a, b = x * w, w * x
        assert a.grad_fn.next_functions[1][0] is not b.grad_fn.next_functions[0][0]
    (a.float().sum() + b.float().sum()).backward()
    assert w.grad.dtype == F32


# -- policies by name ------------------------------------------------------------------------

def test_conservative_preset_behaviour() -> None:
    lin, x = nn.Linear(4, 4), torch.rand(2, 4)
    with ampkit.autocast("cpu", BF16, policy="conservative"):
        h = lin(x)
        assert h.dtype == BF16
        assert F.softmax(h, -1).dtype == F32
        assert (h + x).dtype == F32  # promote: widest input
        assert torch.relu(h).dtype == BF16  # unlisted: inputs' dtype
        # prelu: native autocast runs it in bf16 on CPU, this preset leaves it unlisted
        # ("keep"), so it runs in its inputs' dtype
        assert F.prelu(x, torch.rand(1)).dtype == F32
    with torch.autocast("cpu", BF16):
        assert F.prelu(x, torch.rand(1)).dtype == BF16


def test_policy_files_round_trip(tmp_path: object) -> None:
    p = ampkit.get_policy("conservative").with_lists(custom_white_list={"exp"})
    path = f"{tmp_path}/p.json"
    p.save(path)
    assert Policy.load(path) == p


# -- bad input ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, "int8", 3])
def test_bad_dtype(dtype: object) -> None:
    with pytest.raises(ValueError, match=r"dtype must be torch.float16 or torch.bfloat16"):
        ampkit.autocast("cpu", dtype)  # type: ignore[arg-type]


def test_bad_device_lists_accepted() -> None:
    with pytest.raises(ValueError, match=r"device_type must be .*'cpu'"):
        ampkit.autocast("gpu")


def test_unknown_preset_lists_accepted() -> None:
    with pytest.raises(ValueError, match=r"unknown preset 'torhc' \(did you mean 'torch'\?\)"):
        ampkit.autocast("cpu", policy="torhc")


def test_unknown_op_name_suggests() -> None:
    with pytest.raises(ValueError, match=r"custom_white_list: unknown op name 'sofmax'.*'softmax'"):
        ampkit.autocast("cpu", custom_white_list={"sofmax"})


def test_non_op_entry_is_type_error() -> None:
    with pytest.raises(TypeError, match="custom_black_list"):
        ampkit.autocast("cpu", custom_black_list=[print])
    with pytest.raises(TypeError, match="custom_black_list"):
        ampkit.autocast("cpu", custom_black_list=[3.0])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="custom_white_list"):
        ampkit.autocast("cpu", custom_white_list="add")  # a bare string is not a list


def test_enabled_must_be_bool() -> None:
    with pytest.raises(TypeError, match="enabled"):
        ampkit.autocast("cpu", enabled="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("unlisted", ["lower", "fp32", "promote"])
def test_unlisted_rules_leave_queries_and_data_movement_alone(unlisted: str) -> None:
    p = Policy(name=f"all-{unlisted}", unlisted=unlisted)  # type: ignore[arg-type]
    x = torch.rand(4, 4)
    sparse = torch.eye(2).to_sparse()
    with ampkit.autocast("cpu", BF16, policy=p):
        assert x.view(16).data_ptr() == x.data_ptr()  # still a view, not a cast copy
        assert x.reshape(2, 8).dtype == F32
        assert x.new_zeros(2).dtype == F32
        assert x.is_pinned() is False and x.is_floating_point()
        assert sparse.to_dense().dtype == F32
        assert x.float().dtype == F32 and x.double().dtype == torch.float64
    with ampkit.autocast("cpu", BF16, policy=p):
        expected = {"lower": BF16, "fp32": F32, "promote": F32}[unlisted]
        assert torch.tanh(x).dtype == expected  # a compute op does follow the rule
