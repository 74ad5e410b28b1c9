"""ampkit.mxnet: amp_cast / amp_multicast, init and its lists, model conversion, and the
trainer's loss scaling."""

from __future__ import annotations

import glob
import re
import threading
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampkit.mxnet as amp
from ampkit.policies.presets import MXNET_CONDITIONAL_FP32_FUNCS, MXNET_CONDITIONAL_FP32_OPS

BF16, FP16, FP32, FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64


@pytest.fixture(autouse=True)
def _fresh_init() -> Iterator[None]:
    amp.deinit()
    yield
    amp.deinit()


# -- amp_cast: the seed (000) -----------------------------------------------------------------

SEED_DTYPES = ["float16", "float32", "float64", "int32", "int64", "int8", "uint8"]


def test_copied_dtypes_equal_the_seed_file() -> None:
    paths = glob.glob("/work/shared/seeds/000_*.txt")
    if not paths:
        pytest.skip("the seed file is outside the repository and not present here")
    with open(paths[0], encoding="utf-8") as f:
        text = f.read()
    block = text[text.index("``dtype``"):text.index("required")]
    assert re.findall(r"'(\w+)'", block) == SEED_DTYPES


TORCH = {"float16": FP16, "float32": FP32, "float64": FP64, "int32": torch.int32,
         "int64": torch.int64, "int8": torch.int8, "uint8": torch.uint8, "bfloat16": BF16}


@pytest.mark.parametrize("target", [*SEED_DTYPES, "bfloat16"])
@pytest.mark.parametrize("source", [*SEED_DTYPES, "bfloat16"])
def test_amp_cast_only_casts_between_low_precision_and_fp32(source: str, target: str) -> None:
    data = torch.tensor([1.5, 2.0]).to(TORCH[source])
    out = amp.amp_cast(data, target)
    amp_pair = {source, target} in ({"float16", "float32"}, {"bfloat16", "float32"})
    assert out.dtype == (TORCH[target] if amp_pair else TORCH[source])
    assert torch.equal(out.double(), data.double())


def test_amp_cast_accepts_torch_and_numpy_dtypes() -> None:
    x = torch.ones(2)
    assert amp.amp_cast(x, torch.float16).dtype == FP16
    assert amp.amp_cast(x, np.float16).dtype == FP16
    assert amp.amp_cast(x.half(), np.dtype("float32")).dtype == FP32


def test_amp_cast_errors() -> None:
    with pytest.raises(ValueError, match=r"dtype must be one of \['float16', 'float32', "
                                         r"'float64', 'int32', 'int64', 'int8', 'uint8', "
                                         r"'bfloat16'\]"):
        amp.amp_cast(torch.ones(1), "float8")
    with pytest.raises(TypeError, match=r"data must be a torch\.Tensor"):
        amp.amp_cast(1.0, "float16")


def test_amp_multicast() -> None:
    h, f, b = torch.ones(1, dtype=FP16), torch.ones(1), torch.ones(1, dtype=BF16)
    i = torch.ones(1, dtype=torch.int64)
    assert [t.dtype for t in amp.amp_multicast(h, f, i, num_outputs=3)] == [FP32, FP32,
                                                                            torch.int64]
    assert [t.dtype for t in amp.amp_multicast(h, f, num_outputs=2, cast_narrow=True)] == [
        FP16, FP16]
    assert [t.dtype for t in amp.amp_multicast(h, b, num_outputs=2)] == [FP32, FP32]
    single = amp.amp_multicast(h, num_outputs=1)
    assert isinstance(single, torch.Tensor) and single.dtype == FP16
    with pytest.raises(ValueError, match=r"num_outputs must equal the number of inputs \(2\)"):
        amp.amp_multicast(h, f, num_outputs=3)
    with pytest.raises(ValueError, match="cast_narrow: inputs mix float16 and bfloat16"):
        amp.amp_multicast(h, b, num_outputs=2, cast_narrow=True)


# -- init: MXNet's lists, process-wide in the calling thread ----------------------------------

def _dtypes_under_init() -> dict[str, torch.dtype]:
    x16, x32 = torch.rand(2, 4, dtype=FP16), torch.rand(2, 4)
    img = torch.rand(1, 2, 5, 5)
    return {
        "FullyConnected": F.linear(x32, torch.rand(3, 4)).dtype,
        "Convolution": F.conv2d(img, torch.rand(2, 2, 3, 3)).dtype,
        "RNN": nn.LSTM(4, 3)(x32.unsqueeze(1))[0].dtype,
        "exp": torch.exp(x16).dtype,
        "softmax": torch.softmax(x16, -1).dtype,
        "Activation softrelu": F.softplus(x16).dtype,
        "LeakyReLU elu": F.elu(x16).dtype,
        "relu (untouched)": torch.relu(x16).dtype,
        "dot fp16": (x16 @ x16.T).dtype,
        "dot mixed": torch.matmul(x16, x32.T).dtype,
        "concat mixed": torch.cat([x16, x32]).dtype,
        "elemwise_add mixed": (x16 + x32).dtype,
    }


def test_init_float16_lists() -> None:
    amp.init("float16", device_type="cpu")
    assert _dtypes_under_init() == {
        "FullyConnected": FP16, "Convolution": FP16, "RNN": FP16, "exp": FP32,
        "softmax": FP32, "Activation softrelu": FP32, "LeakyReLU elu": FP32,
        "relu (untouched)": FP16, "dot fp16": FP16, "dot mixed": FP32, "concat mixed": FP32,
        "elemwise_add mixed": FP32}


def test_init_bfloat16_lists_move_rnn_to_fp32() -> None:
    amp.init("bfloat16", device_type="cpu")
    got = _dtypes_under_init()
    assert got["FullyConnected"] == BF16 and got["Convolution"] == BF16
    assert got["RNN"] == FP32


def test_default_conditional_ops_translate_to_torch_ops() -> None:
    assert {amp.CONDITIONAL_OPS[(op, p, v)] for op, p, values in MXNET_CONDITIONAL_FP32_FUNCS
            for v in values} == set(MXNET_CONDITIONAL_FP32_OPS) == {"softplus", "elu", "selu"}


def test_init_lists_replace_the_defaults() -> None:
    amp.init("float16", target_precision_ops=["relu"], fp32_ops=["FullyConnected"],
             conditional_fp32_ops=[("Activation", "act_type", ["tanh"])], device_type="cpu")
    x = torch.rand(2, 4)
    assert torch.relu(x).dtype == FP16
    assert F.linear(x, torch.rand(3, 4)).dtype == FP32
    assert torch.tanh(x.half()).dtype == FP32
    assert torch.exp(x.half()).dtype == FP16  # no longer on the fp32 list
    assert F.conv2d(torch.rand(1, 1, 3, 3), torch.rand(1, 1, 2, 2)).dtype == FP32


def test_init_covers_the_calling_thread_only_and_is_idempotent() -> None:
    amp.init(device_type="cpu")
    amp.init(device_type="cpu")  # same arguments: nothing happens, as in MXNet
    seen: list[torch.dtype] = []
    worker = threading.Thread(target=lambda: seen.append(
        F.linear(torch.rand(2, 3), torch.rand(4, 3)).dtype))
    worker.start()
    worker.join()
    assert seen == [FP32]
    assert F.linear(torch.rand(2, 3), torch.rand(4, 3)).dtype == FP16
    amp.deinit()
    assert F.linear(torch.rand(2, 3), torch.rand(4, 3)).dtype == FP32


def test_init_region_sees_weights_changed_by_the_optimizer() -> None:
    amp.init(device_type="cpu")
    lin = nn.Linear(4, 2)
    x = torch.rand(3, 4)
    lin(x).sum().backward()
    torch.optim.SGD(lin.parameters(), lr=1.0).step()
    expected = F.linear(x.half(), lin.weight.detach().half(), lin.bias.detach().half())
    assert torch.equal(lin(x), expected)


def test_init_errors() -> None:
    with pytest.raises(ValueError, match="target_dtype must be 'float16' or 'bfloat16'"):
        amp.init("float32")
    with pytest.raises(ValueError, match=r"target_precision_ops: unknown op name "
                                         r"'FullyConected'.*did you mean.*'FullyConnected'"):
        amp.init(target_precision_ops=["FullyConected"])
    with pytest.raises(ValueError, match=r"\('Activation', 'act_type', 'swish'\) has no "
                                         r"torch counterpart"):
        amp.init(conditional_fp32_ops=[("Activation", "act_type", ["swish"])])
    with pytest.raises(TypeError, match="each entry must be"):
        amp.init(conditional_fp32_ops=[("Activation", "softrelu")])
    with pytest.raises(ValueError, match="in both target_precision_ops and fp32_ops"):
        amp.init(target_precision_ops=["exp"], fp32_ops=["exp"])
    amp.init("float16", device_type="cpu")
    with pytest.raises(RuntimeError, match="already called with other arguments"):
        amp.init("bfloat16", device_type="cpu")


def test_deinit_refuses_while_a_nested_region_is_open() -> None:
    import ampkit

    amp.init(device_type="cpu")
    with ampkit.autocast("cpu", BF16), pytest.raises(RuntimeError, match="another autocast"):
        amp.deinit()


# -- convert_model / convert_hybrid_block ---------------------------------------------------

def _block() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6), nn.Linear(6, 3))


def test_convert_hybrid_block_outputs_fp32_and_keeps_parameters() -> None:
    net = _block()
    seen = {}
    for name in ("0", "2"):
        net.get_submodule(name).register_forward_hook(
            lambda m, i, o, name=name: seen.__setitem__(name, o.dtype))
    out = amp.convert_hybrid_block(net, "float16")(torch.rand(4, 6))
    assert out.dtype == FP32
    assert seen == {"0": FP16, "2": FP16}
    assert {p.dtype for p in net.parameters()} == {FP32}


def test_excluded_sym_names_run_in_fp32() -> None:
    net = _block()
    x = torch.rand(4, 6)
    first = F.linear(x.half(), net[0].weight.half(), net[0].bias.half())
    expected = net[2](net[1](first.float()))  # layer 2 excluded: fp32
    net = amp.convert_hybrid_block(net, "float16", excluded_sym_names=["2"])
    assert torch.allclose(net(x), expected, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="no module named '5'"):
        amp.convert_hybrid_block(_block(), excluded_sym_names=["5"])


def test_cast_optional_params_casts_only_low_precision_ops_parameters() -> None:
    net = amp.convert_model(_block(), "bfloat16", cast_optional_params=True)
    assert [p.dtype for p in net.parameters()] == [BF16, BF16, FP32, FP32, BF16, BF16]
    assert net(torch.rand(2, 6)).dtype == FP32


class _SharedParams(nn.Module):
    """MXNet's test_amp_offline_casting_shared_params: two low-precision layers share a
    weight, and the second shares its bias with a layer excluded to fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.lp16_op1 = nn.Linear(4, 4)
        self.lp16_op2 = nn.Linear(4, 4)
        self.lp16_op2.weight = self.lp16_op1.weight
        self.fp32_op = nn.Linear(4, 4)
        self.fp32_op.bias = self.lp16_op2.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.lp16_op1(x)
        return torch.cat((self.lp16_op2(x), self.fp32_op(x)), dim=1)


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_offline_cast_keeps_a_parameter_shared_with_an_excluded_layer_fp32(name: str) -> None:
    # MXNet casts a parameter offline only when every op that reads it is low
    # precision: the shared bias stays fp32, the excluded layer computes with it in
    # fp32 and the low-precision layer with a low-precision copy (ampkit refused the
    # conversion with a ValueError before).
    low = {"float16": FP16, "bfloat16": BF16}[name]
    torch.manual_seed(0)
    net = _SharedParams()
    x = torch.empty(3, 4).uniform_(-1, 1)
    w, b1 = net.lp16_op1.weight.detach(), net.lp16_op1.bias.detach()
    w3 = net.fp32_op.weight.detach()
    shared = net.fp32_op.bias.detach().clone().requires_grad_()
    h = F.linear(x.to(low), w.to(low), b1.to(low))
    expected = torch.cat((F.linear(h, w.to(low), shared.to(low)).float(),
                          F.linear(h.float(), w3, shared)), dim=1)
    expected.sum().backward()

    lp = amp.convert_hybrid_block(net, x, name, cast_params_offline=True,
                                  excluded_sym_names=["fp32_op"])
    assert lp.lp16_op2.weight is lp.lp16_op1.weight and lp.fp32_op.bias is lp.lp16_op2.bias
    assert (lp.lp16_op1.weight.dtype, lp.lp16_op1.bias.dtype) == (low, low)
    assert (lp.fp32_op.weight.dtype, lp.fp32_op.bias.dtype) == (FP32, FP32)
    out = lp(x)
    assert out.dtype == FP32 and torch.equal(out, expected)
    out.sum().backward()
    assert lp.fp32_op.bias.grad.dtype == FP32
    assert torch.allclose(lp.fp32_op.bias.grad, shared.grad, rtol=0, atol=1e-6)
    assert lp.fp32_op.bias.dtype == FP32  # the copy was put back after the forward
    assert net.lp16_op1.weight.dtype == FP32  # the given block is as it was


def test_offline_cast_tied_embedding_and_head() -> None:
    # A tied embedding and output layer: Embedding is not on MXNet's low-precision
    # list, so its weight stays fp32, and the head computes with an fp16 copy of it.
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.embed(ids))

    torch.manual_seed(0)
    net = Tied()
    ids = torch.tensor([[1, 2, 3]])
    w = net.embed.weight.detach()
    expected = F.linear(F.embedding(ids, w).half(), w.half()).float()
    lp = amp.convert_model(net, "float16", cast_optional_params=True)
    assert lp.head.weight is lp.embed.weight and lp.embed.weight.dtype == FP32
    out = lp(ids)
    assert out.dtype == FP32 and torch.equal(out, expected)


def test_convert_errors() -> None:
    with pytest.raises(TypeError, match=r"block must be a torch\.nn\.Module"):
        amp.convert_hybrid_block("net")
    with pytest.raises(ValueError, match="in both target_dtype_ops and fp32_ops"):
        amp.convert_hybrid_block(_block(), target_dtype_ops=["FullyConnected"],
                                 fp32_ops=["FullyConnected"])


# -- loss scaling ---------------------------------------------------------------------------

def test_loss_scaler_numbers_are_mxnets() -> None:
    w = nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([w], lr=0.0)
    scaler = amp.LossScaler(device="cpu")
    assert scaler.loss_scale == 2.0 ** 16
    state = scaler.state_dict()
    scaler.load_state_dict({**state, "scale": 2.0 ** 24, "_growth_tracker": 1999})
    for finite in (True, False):
        scaler.scale(w.sum() * (1.0 if finite else float("inf"))).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    # the 2000th clean step would double the scale: the cap keeps it at 2**24; then halving
    assert scaler.loss_scale == 2.0 ** 23


def test_trainer_errors() -> None:
    w = nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([w], lr=0.1)
    with pytest.raises(RuntimeError, match=r"call amp.init\(\) first"):
        amp.init_trainer(opt)
    amp.init(device_type="cpu")
    with pytest.raises(TypeError, match=r"must be a torch\.optim\.Optimizer"):
        amp.init_trainer(object())
    with (pytest.raises(RuntimeError, match=r"did you forget to call amp\.init_trainer"),
          amp.scale_loss(w.sum(), opt)):
        pass
    amp.init_trainer(opt)
    with pytest.raises(RuntimeError, match="already called for this optimizer"):
        amp.init_trainer(opt)


def test_first_trainer_gets_the_init_scaler_later_ones_their_own() -> None:
    amp.init(device_type="cpu")
    opts = [torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1) for _ in range(2)]
    for opt in opts:
        amp.init_trainer(opt)
    assert opts[0]._amp_loss_scaler is not opts[1]._amp_loss_scaler


def test_scale_loss_list_and_unscale() -> None:
    amp.init(device_type="cpu")
    w = nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([w], lr=0.5)
    amp.init_trainer(opt)
    with amp.scale_loss([w.sum(), 2 * w.sum()], opt) as scaled:
        assert [s.item() for s in scaled] == [2.0 ** 16, 2.0 ** 17]
        (scaled[0] + scaled[1]).backward()
    amp.unscale(opt)
    assert w.grad.item() == 3.0
    torch.nn.utils.clip_grad_norm_([w], 1.0)
    expected = (torch.ones(1) - 0.5 * w.grad).item()
    opt.step()  # applies the clipped gradient; does not divide again
    assert w.item() == expected and expected < 0.51


def test_training_on_digits_with_an_injected_overflow() -> None:
    from helpers_models import digits_split

    x_train, y_train, _, _ = digits_split()
    x_train = x_train.flatten(1)
    amp.init("float16", device_type="cpu")
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    amp.init_trainer(opt)
    losses = []
    for step in range(30):
        idx = torch.arange(step * 32, step * 32 + 32) % len(y_train)
        loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
        if step == 4:
            loss = loss * float("inf")
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        unchanged = all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
        assert unchanged == (step == 4)
        if step == 4:
            assert opt._amp_loss_scaler.loss_scale == 2.0 ** 15
        else:
            losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5


def test_init_casts_cpu_ops_when_cuda_is_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    # MXNet's default context is the CPU; ampkit's is torch's default device, also when
    # CUDA is present, so a model on the CPU is cast.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    amp.init("bfloat16")
    try:
        assert F.linear(torch.rand(2, 3), torch.rand(4, 3)).dtype == torch.bfloat16
    finally:
        amp.deinit()


# -- what MXNet's own AMP suites call ---------------------------------------------------------

LIST_FUNCTIONS = ("list_lp16_ops", "list_lp16_fp32_ops", "list_fp32_ops",
                  "list_widest_type_cast")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_list_api_of_mxnet_1_9_and_2_0_is_complete_and_disjoint(dtype: str) -> None:
    # Both versions' mxnet.contrib.amp / mxnet.amp __all__: every list function exists,
    # each name is on one list only (their coverage tests), and each is a torch op.
    from ampkit.policies.registry import resolve_ops

    lists = [getattr(amp, name)(dtype) for name in LIST_FUNCTIONS]
    lists.append([op for op, _, _ in amp.list_conditional_fp32_ops(dtype)])
    names = [name for names in lists for name in names]
    assert len(names) == len(set(names))
    for name in names:
        assert resolve_ops([name], framework="mxnet"), name
    for name in amp.list_loss_output_functions(dtype):
        assert resolve_ops([name], framework="mxnet"), name


def test_lp16_fp32_ops_run_in_their_inputs_dtype() -> None:
    # MXNet: these run in fp16 or fp32 alike, so init leaves them uncast.
    assert {"reshape", "relu", "flatten", "sqrt"} <= set(amp.list_lp16_fp32_ops("float16"))
    amp.init("float16", device_type="cpu")
    x = torch.rand(2, 3)
    assert torch.sqrt(x).dtype == FP32 and torch.sqrt(x.half()).dtype == FP16
    assert F.relu(x.half()).dtype == FP16 and x.reshape(3, 2).dtype == FP32


def test_loss_outputs_and_fp32_params_lists() -> None:
    assert amp.list_loss_output_functions("float16") == [
        "SoftmaxOutput", "LinearRegressionOutput", "LogisticRegressionOutput",
        "MAERegressionOutput"]
    assert amp.list_lp16_use_fp32_params("float16") is None
    params = amp.list_lp16_use_fp32_params("bfloat16")
    assert params == {"BatchNorm": ["weight", "bias", "running_mean", "running_var"]}
    # ... and convert_model keeps exactly those fp32 beside bfloat16 conv parameters.
    net = amp.convert_model(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)), "bfloat16",
                            cast_optional_params=True)
    assert net[0].weight.dtype == BF16
    assert {getattr(net[1], n).dtype for n in params["BatchNorm"]} == {FP32}
    with pytest.raises(ValueError, match="target_dtype must be"):
        amp.list_lp16_fp32_ops("int8")


def test_bfloat16_deconvolution_as_mxnet_2_and_native_autocast() -> None:
    x, w = torch.rand(1, 3, 5, 5), torch.rand(3, 2, 3, 3)
    amp.init("bfloat16", device_type="cpu")
    ours = F.conv_transpose2d(x, w)
    amp.deinit()
    with torch.autocast("cpu", torch.bfloat16):
        native = F.conv_transpose2d(x, w)
    assert ours.dtype == BF16 and torch.equal(ours, native)


def test_convert_hybrid_block_mxnet_2_form() -> None:
    # mxnet.amp.convert_hybrid_block(block, data_example, target_dtype, ...,
    # excluded_sym_names, device, cast_params_offline)
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    x = torch.rand(3, 4)
    lp = amp.convert_hybrid_block(net, x, "bfloat16", cast_params_offline=True,
                                  excluded_sym_names=["1"], device="cpu")
    assert lp[0].weight.dtype == BF16 and lp[1].weight.dtype == FP32
    assert lp(x).dtype == FP32
    lp = amp.convert_hybrid_block(net, [x], "float16", None, None, None, ["0"])
    assert lp[1](x).dtype == FP32 and lp[0].weight.dtype == FP32  # 0 excluded, output fp32
    with pytest.raises(TypeError, match="data_example must be a tensor"):
        amp.convert_hybrid_block(net, data_example=3, target_dtype="float16")
    with pytest.raises(ValueError, match="disagree"):
        amp.convert_hybrid_block(net, "float16", cast_optional_params=True,
                                 cast_params_offline=False)


def test_convert_hybrid_block_returns_a_new_block_and_leaves_the_given_one() -> None:
    # MXNet returns a new block: its suites convert one block twice with other lists
    # and compare against the fp32 original.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.rand(3, 4)
    fp32 = net(x)
    first = amp.convert_hybrid_block(net, "float16", cast_optional_params=True)
    second = amp.convert_hybrid_block(net, "float16", target_dtype_ops=["Convolution"])
    assert first is not net and second is not net
    assert first[0].weight.dtype == FP16 and net[0].weight.dtype == FP32
    assert torch.equal(net(x), fp32)            # the given block is as it was
    assert torch.equal(second(x), fp32)         # no Linear on its list: fp32 throughout


def test_mxnet_list_rules_on_op_names() -> None:
    # MXNet's convert_symbol/init: a conditional op's name on another list, or a
    # widest-type op on a list, is an error (ampkit translated them silently).
    with pytest.raises(ValueError, match="in both fp32_ops and conditional_fp32_ops"):
        amp.convert_hybrid_block(nn.Linear(2, 2), "float16", ["FullyConnected"],
                                 ["Activation"], [("Activation", "act_type", ["selu"])])
    with pytest.raises(ValueError, match=r"fp32_ops: \['elemwise_add'\] run in the widest"):
        amp.convert_hybrid_block(nn.Linear(2, 2), "float16", ["FullyConnected"],
                                 ["elemwise_add"])
    with pytest.raises(ValueError, match=r"target_precision_ops: \['Concat'\] run in the widest"):
        amp.init("float16", target_precision_ops=["Concat"], device_type="cpu")
    assert torch.rand(2).exp().dtype == FP32  # the refused init opened no region


def test_init_trainer_scale_loss_step_is_the_plain_step() -> None:
    # MXNet's documented loop (init, init_trainer, scale_loss, trainer.step): the
    # loss-scaled step updates exactly as the unscaled one under the same region (the
    # scale, 2**16, is a power of two: scaling and unscaling are exact in range).
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    net.load_state_dict(ref.state_dict())
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    amp.init("float16", device_type="cpu")
    amp.init_trainer(opt)
    for _ in range(3):
        x, y = torch.rand(4, 4) * 0.5, torch.randint(0, 3, (4,))
        opt_ref.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        opt_ref.step()
        opt.zero_grad()
        with amp.scale_loss(F.cross_entropy(net(x), y), opt) as scaled:
            assert scaled.item() == pytest.approx(F.cross_entropy(net(x), y).item() * 2 ** 16)
            scaled.backward()
        assert net[0].weight.grad.abs().max() > 100  # scaled until the step
        opt.step()
    assert opt._amp_loss_scaler.loss_scale == 2.0 ** 16  # no overflow: unchanged
    for a, b in zip(net.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)
