"""collect_op_stats: op calls counted by the precision they really ran in.

The oracle is native torch: the dtype a tensor produced by torch.autocast (or by a plain
low-precision op) actually has, read outside the counting region.
"""

import threading

import pytest
import torch
import torch.nn.functional as F

import ampkit
from ampkit.tools.ops.op_stats import OpCallCounts, OpStats, collect_op_stats


def test_linear_under_native_bf16_autocast_counts_its_matmul_as_bf16() -> None:
    lin = torch.nn.Linear(8, 4)
    x = torch.rand(3, 8)
    with collect_op_stats() as stats, torch.autocast("cpu", torch.bfloat16):
        y = lin(x)
    assert y.dtype == torch.bfloat16  # what native autocast produced
    assert stats.counts["addmm"] == OpCallCounts(bfloat16=1)
    # the casts autocast inserted are counted too, as bf16 calls
    assert stats.counts["_to_copy"].bfloat16 >= 2


def test_fp32_softmax_and_autocast_fp32_list_count_as_fp32() -> None:
    logits = torch.rand(4, 10)
    target = torch.tensor([1, 2, 3, 4])
    with collect_op_stats() as stats:
        logits.softmax(-1)
    assert stats.counts["_softmax"] == OpCallCounts(float32=1)
    lin = torch.nn.Linear(10, 10)
    with collect_op_stats() as stats, torch.autocast("cpu", torch.bfloat16):
        out = lin(logits)
        loss = F.cross_entropy(out, target)
    assert out.dtype == torch.bfloat16 and loss.dtype == torch.float32
    # cross_entropy is on native CPU autocast's fp32 list
    assert stats.counts["nll_loss_forward"] == OpCallCounts(float32=1)
    assert stats.counts["_log_softmax"] == OpCallCounts(float32=1)
    assert stats.low_precision_share == pytest.approx(
        stats.total.low_precision / stats.total.floating)


def test_backward_ops_are_counted_in_the_dtype_autograd_ran_them() -> None:
    conv = torch.nn.Conv2d(2, 3, 3)
    x = torch.rand(1, 2, 6, 6)
    with collect_op_stats() as stats:
        with torch.autocast("cpu", torch.bfloat16):
            out = conv(x)
        out.float().sum().backward()
    assert out.dtype == torch.bfloat16
    assert stats.counts["convolution"].bfloat16 == 1
    assert stats.counts["convolution_backward"].bfloat16 == 1
    # weight.grad is fp32 (the cast back to the parameter's dtype is in the count)
    assert conv.weight.grad is not None and conv.weight.grad.dtype == torch.float32


def test_ampkit_custom_white_list_op_counts_as_low_precision() -> None:
    a, b = torch.rand(5), torch.rand(5)
    with collect_op_stats() as stats, ampkit.autocast("cpu", torch.float16,
                                                      custom_white_list={"add"}):
        c = a + b
    assert c.dtype == torch.float16
    assert stats.counts["add"] == OpCallCounts(float16=1)


@pytest.mark.parametrize("dtype,column", [(torch.float32, "float32"),
                                          (torch.bfloat16, "bfloat16"),
                                          (torch.float16, "float16")])
def test_in_place_foreach_optimizer_ops_count_by_the_tensors_they_write(
        dtype: torch.dtype, column: str) -> None:
    # _foreach_add_ and friends return nothing; the schema says what they write.
    params = [torch.nn.Parameter(torch.rand(4, dtype=dtype)) for _ in range(2)]
    for p in params:
        p.grad = torch.rand(4, dtype=dtype)
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=True)
    with collect_op_stats() as stats:
        opt.step()
    foreach = {name: c for name, c in stats.counts.items() if name.startswith("_foreach")}
    assert foreach, stats.table()
    for name, counts in foreach.items():
        assert getattr(counts, column) == counts.total, (name, counts)


def test_integer_bool_float64_and_scalar_results_are_other() -> None:
    x = torch.rand(6)
    with collect_op_stats() as stats:
        x.argmax()
        torch.gt(x, 0.5)
        x.double()
        x.sum().item()
    assert stats.counts["argmax"] == OpCallCounts(other=1)
    assert stats.counts["gt"] == OpCallCounts(other=1)
    assert stats.counts["_to_copy"] == OpCallCounts(other=1)  # to float64
    assert stats.counts["_local_scalar_dense"] == OpCallCounts(other=1)


def test_low_precision_share_is_over_floating_calls() -> None:
    with collect_op_stats() as stats:
        h = torch.ones(3, dtype=torch.float16)  # fp16
        h * 2  # fp16
        torch.zeros(3)  # fp32
        torch.arange(3)  # int64: other, not in the denominator
    assert stats.total == OpCallCounts(float16=2, float32=1, other=1)
    assert stats.low_precision_share == pytest.approx(2 / 3)
    with collect_op_stats() as empty:
        pass
    assert empty.low_precision_share == 0.0
    assert empty.total == OpCallCounts()


def test_table_has_paddle_columns_one_row_per_op_and_a_consistent_total() -> None:
    w = torch.rand(4, 4, requires_grad=True)
    with collect_op_stats() as stats:
        (w.bfloat16() @ w.bfloat16()).float().sum().backward()
    lines = stats.table().splitlines()
    assert [c.strip() for c in lines[0].split("|")] == [
        "Op Name", "FP16 Calls", "BF16 Calls", "FP32 Calls", "Other Calls"]
    body = lines[2:-2]
    assert [line.split("|")[0].strip() for line in body] == sorted(stats.counts)
    cells = [[int(c) for c in line.split("|")[1:]] for line in body]
    total = [int(c) for c in lines[-1].split("|")[1:]]
    assert lines[-1].startswith("Total")
    assert [sum(col) for col in zip(*cells)] == total
    assert stats.counts["mm"].bfloat16 == 3  # forward and two backward matmuls


def test_counting_stops_at_exit_and_a_region_is_entered_once() -> None:
    stats = collect_op_stats()
    assert isinstance(stats, OpStats)
    with stats:
        torch.ones(2) + 1
    before = stats.total
    torch.ones(2) + 1
    assert stats.total == before
    with pytest.raises(RuntimeError, match="entered only once"), stats:
        pass


def test_other_threads_are_not_counted() -> None:
    done = threading.Event()

    def work() -> None:
        torch.ones(10, dtype=torch.float16) * 3
        done.set()

    with collect_op_stats() as stats:
        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
        torch.ones(1)
    assert done.is_set()
    assert "mul" not in stats.counts
    assert stats.counts["ones"] == OpCallCounts(float32=1)


def test_profiler_markers_are_not_counted() -> None:
    with (collect_op_stats() as stats, torch.profiler.profile(),
          torch.profiler.record_function("region")):
        torch.ones(1)
    assert not [name for name in stats.counts if name.startswith("profiler::")]
    assert stats.counts["ones"] == OpCallCounts(float32=1)
