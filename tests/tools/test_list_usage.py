"""List entries that match no op call are reported (ampkit.tools.ops.list_usage)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampkit
from ampkit.tools import list_usage


class _SdpaAttention(nn.Module):
    """Attention the way GPT-2's default (SDPA) path computes it: no softmax call."""

    def __init__(self, d: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.qkv, self.out, self.heads = nn.Linear(d, 3 * d), nn.Linear(d, d), heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


def test_softmax_black_listed_on_sdpa_attention_is_reported() -> None:
    model, x = _SdpaAttention(), torch.rand(2, 5, 8)
    with list_usage() as usage, ampkit.autocast("cpu", torch.bfloat16,
                                                custom_black_list={"softmax", "linear"}):
        model(x)
    assert [(e.list, e.op, e.calls) for e in usage.unmatched()] == [
        ("fp32_ops", "softmax", 0)]
    calls = {e.op: e.calls for e in usage.entries()}
    assert calls == {"softmax": 0, "linear": 2}
    assert usage.report() == ("policy 'torch+custom': 1 of 2 listed ops matched no op call\n"
                              "  fp32_ops: softmax")


def test_calls_count_for_the_innermost_region_only() -> None:
    x = torch.rand(3)
    with list_usage() as usage, ampkit.autocast("cpu", custom_white_list={"exp"}):
        with ampkit.autocast("cpu", enabled=False):
            torch.exp(x)  # under no policy: not a match for the outer one
        with ampkit.autocast("cpu", policy="conservative"):
            torch.exp(x)  # conservative lists exp as fp32: its match
    by_policy = {(e.policy, e.op): e.calls for e in usage.entries()}
    assert by_policy[("torch+custom", "exp")] == 0
    assert by_policy[("conservative", "exp")] == 1
    assert not any(e.policy == "torch" for e in usage.entries())  # nothing listed


def test_a_region_with_no_op_calls_reports_all_its_entries() -> None:
    with list_usage() as usage, ampkit.autocast("cpu", custom_white_list={"add", "mul"}):
        pass
    assert {e.op for e in usage.unmatched()} == {"add", "mul"}


def test_report_is_entered_once_and_leaves_no_mode_behind() -> None:
    usage = list_usage()
    with usage:
        pass
    assert torch._C._len_torch_function_stack() == 0
    assert usage.report() == "no ampkit.autocast region with a policy was entered"
    with pytest.raises(RuntimeError, match="only once"), usage:
        pass
