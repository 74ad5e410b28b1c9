"""At O2 the ops native autocast keeps in float32 run in float32.

O2's activations are low precision end to end, so without this an op on native
autocast's float32 list (softmax, log_softmax, exp, pow, norms, ...) that CPU autocast
does not list would run in bf16 at O2, where native autocast on CUDA (and O1, wherever an fp32
input promotes it) runs it in float32. The dialects keep their frameworks' semantics:
apex's O2 patches no op, Paddle's O2 has only its extra black list.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import ampkit
from ampkit.policies.registry import AUTOCAST_FP32_OPS, all_op_names, native_op_names, resolve_ops

BF16, FP32 = torch.bfloat16, torch.float32


class _SoftmaxDtypes(TorchDispatchMode):
    """The input dtype of every softmax the dispatcher runs (below autocast's casts)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[torch.dtype] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._softmax.default, torch.ops.aten._log_softmax.default):
            self.seen.append(args[0].dtype)
        return func(*args, **(kwargs or {}))


def _gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2,
                                     n_head=2, attn_implementation="eager")
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


def test_gpt2_attention_softmax_runs_in_fp32_at_o2_as_under_native_autocast():
    model = _gpt2()
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    with _SoftmaxDtypes() as native, torch.no_grad(), torch.autocast("cpu", BF16):
        model(ids)
    o2 = ampkit.initialize(copy.deepcopy(model), level="O2", dtype=BF16)
    with _SoftmaxDtypes() as seen, torch.no_grad():
        o2(ids)
    assert native.seen == [FP32, FP32]  # one attention softmax per layer, fp32 natively
    assert seen.seen == [FP32, FP32]  # before: [bf16, bf16]
    # The policy lifts it: a custom white list runs softmax in bf16 again.
    lifted = ampkit.initialize(copy.deepcopy(model), level="O2", dtype=BF16,
                               custom_white_list=["softmax"])
    with _SoftmaxDtypes() as low, torch.no_grad():
        lifted(ids)
    assert low.seen == [BF16, BF16]


class _Then(nn.Module):
    """A Linear (bf16 output at O2), then ``op`` on its output."""

    def __init__(self, op) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.op = op
        self.hidden: torch.Tensor | None = None

    def forward(self, x):
        self.hidden = self.lin(x)
        return self.op(self.hidden)


FP32_LISTED = {
    "softmax": lambda y: F.softmax(y, -1),
    "log_softmax": lambda y: F.log_softmax(y, -1),
    "exp": torch.exp,
    "pow": lambda y: y.pow(3),
    "sum": lambda y: y.sum(-1),
    "cumsum": lambda y: y.cumsum(-1),
    "logsumexp": lambda y: y.logsumexp(-1),
    "layer_norm": lambda y: F.layer_norm(y, (16,)),
}


@pytest.mark.parametrize("name", sorted(FP32_LISTED))
def test_o2_runs_the_fp32_listed_op_in_fp32_on_its_low_precision_input(name):
    # Native autocast's fp32 rule: the op computes in float32 from its input as given
    # (here the bf16 activation), so the result is op(input.float()) bit for bit.
    torch.manual_seed(0)
    model = ampkit.initialize(_Then(FP32_LISTED[name]), level="O2", dtype=BF16)
    x = torch.randn(4, 16) * 4
    with torch.no_grad():
        out = model(x)
        hidden = model.hidden
        expected = FP32_LISTED[name](hidden.float())
    assert hidden.dtype == BF16
    assert torch.equal(out, expected)  # before: the op in bf16, its result rounded


@pytest.mark.parametrize("name", ["cross_entropy", "mse_loss"])
def test_o2_keeps_cpu_autocasts_own_fp32_ops_bit_for_bit(name):
    # Regression guard (passes before and after): ops CPU autocast itself runs in fp32
    # still compute exactly what torch.autocast computes on the same bf16 input.
    target = torch.randint(0, 16, (4,))
    ops = {"cross_entropy": lambda y: F.cross_entropy(y, target),
           "mse_loss": lambda y: F.mse_loss(y, torch.ones_like(y))}
    torch.manual_seed(0)
    model = ampkit.initialize(_Then(ops[name]), level="O2", dtype=BF16)
    with torch.no_grad():
        out = model(torch.randn(4, 16))
        with torch.autocast("cpu", BF16):
            native = ops[name](model.hidden)
    assert out.dtype == native.dtype == FP32 and torch.equal(out, native)


def test_o2_log_probabilities_are_closer_to_fp32_than_with_log_softmax_in_bf16():
    # A classifier head returning log-probabilities: at O2 its log_softmax runs in fp32
    # (native's list), where in bf16 (the old O2, or the white list) the log-probs are
    # rounded to 8 bits of mantissa.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 100),
                          nn.LogSoftmax(-1))
    x = torch.randn(64, 32)
    with torch.no_grad():
        reference = model(x)
        o2 = ampkit.initialize(copy.deepcopy(model), level="O2", dtype=BF16)(x)
        low = ampkit.initialize(copy.deepcopy(model), level="O2", dtype=BF16,
                                custom_white_list=["log_softmax"])(x)
    error_o2 = (o2 - reference).abs().mean().item()
    error_low = (low - reference).abs().mean().item()
    assert error_o2 < 0.5 * error_low  # before: the same run, equal errors


def test_the_fp32_list_is_what_native_autocast_changes_on_cuda():
    # The dispatcher has no word for the cast policy, only for which ops native autocast
    # registers on a device (on every build). The list is CUDA's fp32 list over the
    # supported releases, and a release may not register one of its ops (torch 2.11's
    # CUDA autocast has no rms_norm): there O2 keeps that op fp32 where native leaves
    # it alone, more conservative than native, never less. So the claim is conditional
    # on the running torch: what CUDA registers here is listed or real ops left alone.
    cuda = native_op_names("cuda")
    left_alone_here = AUTOCAST_FP32_OPS - cuda
    assert left_alone_here <= all_op_names(), left_alone_here  # real ops, no typo
    assert len(left_alone_here) < len(AUTOCAST_FP32_OPS & cuda) // 10, left_alone_here
    assert {"softmax", "log_softmax", "exp", "log", "pow", "layer_norm", "sum",
            "mse_loss", "nll_loss"} <= AUTOCAST_FP32_OPS
    # CPU autocast lists none of these: O2 would run them in its low-precision inputs'.
    assert not {"softmax", "log_softmax", "exp", "pow", "layer_norm"} & native_op_names("cpu")


def test_apex_o2_patches_no_op():
    # apex's O2 casts the model and patches nothing: softmax runs in the model's dtype.
    import ampkit.apex as amp

    model = _Then(lambda y: F.softmax(y, -1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", cast_model_type=BF16,
                                verbosity=0)
    with _SoftmaxDtypes() as seen, torch.no_grad():
        model(torch.randn(4, 16))
    assert seen.seen == [BF16]


def test_paddle_o2_black_list_is_paddles_extra_black_list():
    # Paddle's O2 black list (python/paddle/amp/amp_lists.py, black_list()[dtype]["O2"])
    # is EXTRA_BLACK_LIST only: softmax is not on it, and stays low precision there.
    import ampkit.paddle as amp
    from ampkit.policies.presets import PADDLE_EXTRA_BLACK_LIST, get_policy

    assert get_policy("paddle-O2").fp32_ops == resolve_ops(PADDLE_EXTRA_BLACK_LIST,
                                                           framework="paddle")
    net = amp.decorate(_Then(lambda y: F.softmax(y, -1)), level="O2", dtype="bfloat16")
    with _SoftmaxDtypes() as seen, torch.no_grad(), amp.auto_cast(level="O2",
                                                                   dtype="bfloat16"):
        net(torch.randn(4, 16).bfloat16())
    assert seen.seen == [BF16]
