"""ampkit.mindspore against MindSpore 2.3+'s AMP API: the "auto" level (networks and
plain functions), custom lists with one of them empty, networks that already hold a
float16 parameter, and build_train_network's refusal of an optimizer that trains
nothing of the network: what MindSpore's current releases do."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampkit.mindspore as amp
from ampkit.policies.presets import MINDSPORE_AUTO

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


class _Probe(nn.Module):
    """Matmul (white), then softmax (black), then relu (on no list), then addcmul with an
    fp32 tensor (promote): records each result's dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.rand(4, 4))
        self.seen: dict[str, torch.dtype] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.matmul(x, self.w)
        self.seen["matmul"] = y.dtype
        s = torch.softmax(y, -1)
        self.seen["softmax"] = s.dtype
        r = F.relu(y)
        self.seen["relu"] = r.dtype
        c = torch.addcmul(torch.zeros(4), r, r)
        self.seen["addcmul"] = c.dtype
        return c


@pytest.mark.parametrize("dtype", [FP16, BF16, "float16"])
def test_auto_level_runs_mindsporess_lists(dtype: object) -> None:
    net = _Probe()
    converted = amp.auto_mixed_precision(net, "auto", dtype)  # type: ignore[arg-type]
    assert converted is net
    low = FP16 if dtype == "float16" else dtype
    out = net(torch.rand(2, 4))
    assert net.seen == {"matmul": low, "softmax": FP32, "relu": low, "addcmul": FP32}
    assert out.dtype == FP32  # the promoted addcmul: nothing casts the output at "auto"
    assert net.w.dtype == FP32


def test_auto_level_matmul_matches_a_low_precision_matmul() -> None:
    torch.manual_seed(0)
    a, b = torch.rand(8, 8), torch.rand(8, 8)
    net = nn.Linear(8, 8, bias=False)
    expected = a.half() @ net.weight.detach().half().t()
    amp.auto_mixed_precision(net, "auto")
    assert torch.equal(net(a), expected)
    assert torch.equal(torch.matmul(a, b), a @ b)  # outside the network: untouched


def test_auto_level_takes_a_plain_function() -> None:
    def attention(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return torch.softmax(q @ k.t(), -1)

    q, k = torch.rand(3, 4), torch.rand(5, 4)
    scores = amp.auto_mixed_precision(attention, "auto")
    assert scores.__name__ == "attention"
    inner: list[torch.dtype] = []

    def recording(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        prod = x @ y
        inner.append(prod.dtype)
        return prod

    assert scores(q, k).dtype == FP32  # softmax: black list
    assert torch.allclose(scores(q, k), attention(q, k), atol=2e-3)
    assert amp.auto_mixed_precision(recording, "auto", BF16)(q, k.t()).dtype == BF16
    assert inner == [BF16]
    assert (q @ k.t()).dtype == FP32  # the function outside its wrapper is unchanged


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_a_function_is_a_network_only_at_the_auto_level(level: str) -> None:
    with pytest.raises(TypeError, match=r"network must be a torch\.nn\.Module"):
        amp.auto_mixed_precision(lambda x: x, level)


def test_auto_level_refuses_other_objects() -> None:
    with pytest.raises(TypeError, match="or, at amp_level 'auto', a function"):
        amp.auto_mixed_precision(42, "auto")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dtype must be"):
        amp.auto_mixed_precision(lambda x: x, "auto", FP32)


def test_auto_level_batch_norm_computes_in_fp32_and_returns_the_input_dtype() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).eval()
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        conv = F.conv2d(x.half(), net[0].weight.half(), net[0].bias.half())
        expected = net[1](conv.float()).half()  # fp32 BatchNorm, rounded once
    amp.auto_mixed_precision(net, "auto")
    out = net(x)
    assert out.dtype == FP16
    assert torch.equal(out, expected)


def test_auto_preset_lists() -> None:
    assert {"matmul", "conv2d", "linear", "einsum", "addmm"} <= MINDSPORE_AUTO.lower_precision_ops
    assert {"softmax", "layer_norm", "exp", "nll_loss", "sum"} <= MINDSPORE_AUTO.fp32_ops
    assert {"addcmul", "dot", "index_put", "grid_sample"} <= MINDSPORE_AUTO.promote_ops
    assert MINDSPORE_AUTO.unlisted == "keep"


# -- custom_mixed_precision -------------------------------------------------------------------

def _first_layer_dtype(net: nn.Sequential) -> list[torch.dtype]:
    seen: list[torch.dtype] = []
    net[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    net(torch.rand(2, 4))
    return seen


def test_custom_one_list_keeps_the_o1_and_o2_meanings() -> None:
    white = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    amp.custom_mixed_precision(white, white_list=[nn.Linear])
    black = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    amp.custom_mixed_precision(black, black_list=[nn.ReLU])
    # O1: the white module computes low and hands float32 on; O2: the rest computes low.
    assert _first_layer_dtype(white) == [FP32]
    assert _first_layer_dtype(black) == [FP16]
    everything = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    amp.custom_mixed_precision(everything, black_list=[])  # O2 with no exception
    assert _first_layer_dtype(everything) == [FP16]


@pytest.mark.parametrize(("white", "black", "expected"), [
    (["MatMul"], [], FP16), ([], ["MatMul"], FP32), ((nn.Linear,), (), FP16),
    ([torch.matmul, "Dense"], ["Softmax"], FP32)])
def test_custom_two_lists_run_ops_by_the_auto_rule(
        white: list[object], black: list[object], expected: torch.dtype) -> None:
    net = nn.Sequential(nn.Linear(4, 4), nn.Softmax(-1) if black == ["Softmax"] else nn.ReLU())
    amp.custom_mixed_precision(net, white_list=white, black_list=black)  # type: ignore[arg-type]
    # Outputs are not cast back: the last op's dtype is what comes out.
    assert net(torch.rand(2, 4)).dtype == expected
    assert net[0].weight.dtype == FP32


@pytest.mark.parametrize(("white", "black", "message"), [
    (None, None, "needs white_list, black_list or both"),
    ([], [], "both empty"), ([], None, "white_list is empty"),
    (["MatMul"], ["MatMul"], "")])
def test_custom_lists_that_would_do_nothing_or_contradict_are_refused(
        white: object, black: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        amp.custom_mixed_precision(nn.Linear(2, 2), white_list=white,  # type: ignore[arg-type]
                                   black_list=black)  # type: ignore[arg-type]


def test_custom_list_that_is_not_a_list_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="white_list must be a list"):
        amp.custom_mixed_precision(nn.Linear(2, 2), white_list="Dense")  # type: ignore[arg-type]


# -- a network that already holds a float16 parameter ------------------------------------------

class _HalfWeightMatmul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.full((4, 4), 0.5, dtype=FP16))
        self.b = nn.Parameter(torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(x, self.w) + self.b


@pytest.mark.parametrize(("level", "out_dtype"), [
    ("O1", FP32), ("O2", FP32), ("O3", FP32), ("auto", FP32)])
def test_a_float16_parameter_is_converted_and_kept(level: str, out_dtype: torch.dtype) -> None:
    net = _HalfWeightMatmul()
    amp.auto_mixed_precision(net, level)
    assert (net.w.dtype, net.b.dtype) == (FP16, FP32)  # as the user set them
    x = torch.ones(2, 4)
    out = net(x)
    assert out.dtype == out_dtype
    assert torch.equal(out, torch.full((2, 4), 2.0))
    out.sum().backward()
    assert net.w.grad is not None and net.w.grad.dtype == FP16


def test_a_float16_parameter_under_custom_lists() -> None:
    net = _HalfWeightMatmul()
    amp.custom_mixed_precision(net, white_list=["MatMul"])  # O1: the white op hands fp32 on
    assert net.w.dtype == FP16
    assert net(torch.ones(1, 4)).dtype == FP32
    net = _HalfWeightMatmul()
    amp.custom_mixed_precision(net, white_list=[], black_list=["MatMul"])
    assert net(torch.ones(1, 4)).dtype == FP32  # the fp16 weight cast up for the matmul


def test_a_float16_parameter_trains_with_build_train_network() -> None:
    net = _HalfWeightMatmul()
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    step = amp.build_train_network(net, opt, nn.MSELoss(), "O3")  # O3: no loss scale
    loss = step(torch.ones(2, 4), torch.zeros(2, 4))
    assert loss.item() == 4.0
    # y = 2 everywhere: d(mean(y^2))/dy = 0.5, so w and b each get a gradient of 1 per
    # element (w in float16, its step in float16)
    assert net.w.dtype == FP16 and torch.equal(net.w, torch.zeros(4, 4, dtype=FP16))
    assert torch.equal(net.b, torch.full((4,), -0.5))


def test_a_float16_parameter_overflows_the_o2_scale_and_backs_off() -> None:
    # MindSpore's O2 starts at 2**24: a gradient of 1 that stays in float16 overflows
    # until the scale fits float16, and those steps are skipped.
    net = _HalfWeightMatmul()
    step = amp.build_train_network(net, torch.optim.SGD(net.parameters(), lr=0.5),
                                   nn.MSELoss(), "O2")
    overflows = [bool(step(torch.ones(2, 4), torch.zeros(2, 4))[1]) for _ in range(10)]
    assert overflows == [True] * 9 + [False]
    assert torch.equal(net.w, torch.zeros(4, 4, dtype=FP16))


# -- build_train_network: an optimizer that trains nothing of the network -----------------------

@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_an_optimizer_over_other_parameters_is_refused(level: str) -> None:
    net, other = nn.Linear(3, 1), nn.Linear(3, 1)
    opt = torch.optim.SGD(other.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"optimizer: the SGD holds none of the network's 2 "
                                         r"parameters"):
        amp.build_train_network(net, opt, nn.MSELoss(), level)


def test_an_optimizer_over_part_of_the_network_is_accepted() -> None:
    net = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    opt = torch.optim.SGD(net[1].parameters(), lr=0.1)
    frozen = net[0].weight.detach().clone()
    before = net[1].weight.detach().clone()
    step = amp.build_train_network(net, opt, nn.MSELoss(), "O0")
    step(torch.rand(4, 3), torch.rand(4, 1))
    assert torch.equal(net[0].weight, frozen)
    assert not torch.equal(net[1].weight, before)
