"""The NaN/Inf checker names the first op (and module) that overflowed."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import ampkit
from ampkit.tools.ops.numerics_checker import CheckMode, NonFiniteError, NumericsChecker


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encoder(x)
        return self.head(torch.exp(h))  # exp overflows fp16 for h > ~11


def _big_model() -> Net:
    net = Net()
    with torch.no_grad():
        net.encoder[0].weight.fill_(3.0)
        net.encoder[0].bias.zero_()
    return net


def test_fp16_overflow_is_traced_to_the_op_and_module() -> None:
    net, x = _big_model(), torch.ones(2, 4)  # h = 12 -> exp(12) = 162755 > 65504
    with ampkit.autocast("cpu", torch.float16, custom_white_list={"exp"}), \
            NumericsChecker(net, CheckMode.CHECK_NAN_INF) as checker:
        net(x)
    origin = checker.origin
    assert origin is not None and origin is checker.first_bad
    assert origin.op == "exp" and origin.phase == "forward" and origin.module == ""
    assert origin.dtype == torch.float16 and origin.num_inf == origin.numel == 8
    # the inf then flows into the head's matmul: recorded, but not as an origin
    in_head = checker.first_bad_in("head")
    assert in_head is not None and not in_head.introduced and in_head.index > origin.index
    assert checker.suggest_fp32_ops() == ["exp"]
    # exp back in fp32: now the checker pinpoints the next overflow, the cast of exp's
    # fp32 output into the head's fp16 linear
    with ampkit.autocast("cpu", torch.float16, custom_black_list=checker.suggest_fp32_ops()), \
            NumericsChecker(net, CheckMode.CHECK_NAN_INF) as second:
        net(x)
    assert (second.origin.op, second.origin.module) == ("_to_copy", "head")
    # keeping the head in fp32 too leaves nothing non-finite
    with ampkit.autocast("cpu", torch.float16, custom_black_list={"exp", "linear"}), \
            NumericsChecker(net, CheckMode.CHECK_NAN_INF) as third:
        out = net(x)
    assert third.first_bad is None and torch.isfinite(out).all()


def test_abort_mode_raises_at_the_first_nan_with_module_name() -> None:
    net = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2)))
    with torch.no_grad():
        net[1][0].weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match=r"\(forward, module '1.0'\) produced [1-9]") as err, \
            NumericsChecker(net):
        net(torch.ones(1, 2))
    assert err.value.record.num_nan >= 1 and err.value.record.module == "1.0"


def test_backward_overflow_names_the_autograd_node() -> None:
    x = torch.ones(3, dtype=torch.float16, requires_grad=True)
    with NumericsChecker(mode="nan_inf") as checker:
        y = (x * 4).sum()  # forward is finite
        y.backward(torch.tensor(30000.0, dtype=torch.float16))  # 4 * 30000 > fp16 max
    assert {r.phase for r in checker.bad_records()} == {"backward"}
    assert checker.origin.grad_fn == "MulBackward0"
    assert checker.origin.where == "backward of MulBackward0"


def test_overflow_mode_flags_fp32_values_beyond_fp16_range() -> None:
    with NumericsChecker(mode=CheckMode.CHECK_ALL_FOR_OVERFLOW) as checker:
        torch.exp(torch.tensor([1.0, 12.0]))
        torch.exp(torch.tensor([1.0]))
    assert len(checker.records) == 1
    assert checker.records[0].finite and checker.records[0].max > 65504
    assert checker.suggest_fp32_ops() == ["exp"]


def test_check_all_records_statistics() -> None:
    with NumericsChecker(mode="all") as checker:
        torch.tensor([0.0, -2.0, 4.0]) * 1.0
    r = checker.records[-1]
    assert (r.op, r.numel, r.num_zero, r.max, r.min, r.mean) == ("mul", 3, 1, 4.0, -2.0, 2 / 3)
    assert "mul" in checker.table()


def test_hooks_are_removed_after_exit() -> None:
    net = Net()
    with NumericsChecker(net, "all"):
        pass
    assert not net.encoder[0]._forward_pre_hooks and not net.encoder[0]._forward_hooks


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"mode must be a CheckMode or one of \['abort'"):
        NumericsChecker(mode="everything")
    with pytest.raises(TypeError, match=r"model must be an nn\.Module"):
        NumericsChecker(model="net")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_records"):
        NumericsChecker(max_records=0)


def test_meta_tensors_are_a_clear_error_not_an_item_failure() -> None:
    # (once: "Tensor.item() cannot be called on meta tensors", from the checker's own code);
    # the first op of Linear's forward is the weight's transpose
    net = nn.Linear(4, 4, device="meta")
    x = torch.ones(2, 4, device="meta")
    with pytest.raises(ValueError, match=r"^NumericsChecker: op 't' gave a meta tensor "
                                         r"\(no data\): there are no values to check; run "
                                         r"the model on a device with data"), \
            NumericsChecker(net, mode="all"):
        net(x)


def test_a_nested_checker_records_the_programs_ops_not_the_inner_checkers() -> None:
    x = torch.tensor([1.0, 2.0])
    with NumericsChecker(mode="all") as outer:
        with NumericsChecker(mode="all") as inner:
            y = torch.exp(x)
        z = y * 2
    assert [r.op for r in inner.records] == ["exp"]
    # the outer saw the program's two ops, and none of the inner's isnan/isinf/sum/...
    assert [r.op for r in outer.records] == ["exp", "mul"]
    assert torch.equal(z, torch.exp(x) * 2)
