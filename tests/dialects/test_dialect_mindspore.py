"""ampkit.mindspore: auto_mixed_precision's levels and lists (seed 001), its errors,
custom_mixed_precision, loss scalers, build_train_network."""

from __future__ import annotations

import glob
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampkit.mindspore as amp

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


# -- the seed's lists (001) -----------------------------------------------------------------

SEED_WHITE = ["nn.Conv1d", "nn.Conv2d", "nn.Conv3d", "nn.Conv1dTranspose", "nn.Conv2dTranspose",
              "nn.Conv3dTranspose", "nn.Dense", "nn.LSTMCell", "nn.RNNCell", "nn.GRUCell",
              "ops.Conv2D", "ops.Conv3D", "ops.Conv2DTranspose", "ops.Conv3DTranspose",
              "ops.MatMul", "ops.BatchMatMul", "ops.PReLU", "ops.ReLU", "ops.Ger"]
SEED_BLACK = ["nn.BatchNorm1d", "nn.BatchNorm2d", "nn.BatchNorm3d", "nn.LayerNorm"]

# docs/migration.md: MindSpore's names -> torch's.
TO_TORCH = {
    "nn.Conv1d": nn.Conv1d, "nn.Conv2d": nn.Conv2d, "nn.Conv3d": nn.Conv3d,
    "nn.Conv1dTranspose": nn.ConvTranspose1d, "nn.Conv2dTranspose": nn.ConvTranspose2d,
    "nn.Conv3dTranspose": nn.ConvTranspose3d, "nn.Dense": nn.Linear,
    "nn.LSTMCell": nn.LSTMCell, "nn.RNNCell": nn.RNNCell, "nn.GRUCell": nn.GRUCell,
    "ops.Conv2D": F.conv2d, "ops.Conv3D": F.conv3d, "ops.Conv2DTranspose": F.conv_transpose2d,
    "ops.Conv3DTranspose": F.conv_transpose3d, "ops.MatMul": torch.matmul,
    "ops.BatchMatMul": torch.bmm, "ops.PReLU": F.prelu, "ops.ReLU": F.relu,
    "ops.Ger": torch.outer, "nn.BatchNorm1d": nn.BatchNorm1d,
    "nn.BatchNorm2d": nn.BatchNorm2d, "nn.BatchNorm3d": nn.BatchNorm3d,
    "nn.LayerNorm": nn.LayerNorm,
}


def test_copied_lists_equal_the_seed_file() -> None:
    paths = glob.glob("/work/shared/seeds/001_*.txt")
    if not paths:
        pytest.skip("the seed file is outside the repository and not present here")
    with open(paths[0], encoding="utf-8") as f:
        text = f.read()
    lists = re.findall(r"\[(:class:`mindspore\..*?)\]", text, flags=re.DOTALL)
    names = [re.findall(r"mindspore\.(\w+\.\w+)`", block) for block in lists]
    assert names == [SEED_WHITE, SEED_BLACK]


def test_white_and_black_lists_are_the_seeds_translated() -> None:
    assert amp.get_white_list() == [TO_TORCH[n] for n in SEED_WHITE]
    assert amp.get_black_list() == [TO_TORCH[n] for n in SEED_BLACK]


def test_lists_are_copies() -> None:
    amp.get_white_list().append(nn.Softmax)
    amp.get_black_list().clear()
    assert nn.Softmax not in amp.get_white_list() and len(amp.get_black_list()) == 4


# -- the seed's errors ------------------------------------------------------------------------

def test_network_that_is_not_a_module_is_a_type_error() -> None:
    with pytest.raises(TypeError, match=r"network must be a torch\.nn\.Module"):
        amp.auto_mixed_precision(lambda x: x, "O1")


@pytest.mark.parametrize("level", ["O4", "o1", "Auto", None])
def test_unsupported_level_is_a_value_error(level: object) -> None:
    with pytest.raises(ValueError,
                       match=r"amp_level must be one of \['O0', 'O1', 'O2', 'O3', 'auto'\]"):
        amp.auto_mixed_precision(nn.Linear(2, 2), level)


@pytest.mark.parametrize("dtype", [FP32, "float32", torch.float64, 16])
def test_dtype_other_than_float16_or_bfloat16_is_a_value_error(dtype: object) -> None:
    with pytest.raises(ValueError, match=r"dtype must be torch\.float16 or torch\.bfloat16"):
        amp.auto_mixed_precision(nn.Linear(2, 2), "O2", dtype)


# -- the levels: parameter, module-output and network-output dtypes --------------------------

class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(36, 8)
        self.ln = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn(self.conv(x))).flatten(1)
        self.sum_dtype = h.sum().dtype  # an op on no list
        return self.head(self.ln(self.fc(h)))


def _run(level: str, dtype: torch.dtype = FP16) -> tuple[_Net, dict[str, torch.dtype],
                                                         torch.Tensor]:
    torch.manual_seed(0)
    net = _Net().eval()
    seen: dict[str, torch.dtype] = {}
    for name in ("conv", "bn", "fc", "ln", "head"):
        getattr(net, name).register_forward_hook(
            lambda m, i, o, name=name: seen.__setitem__(name, o.dtype))
    returned = amp.auto_mixed_precision(net, level, dtype)
    assert returned is net
    out = net(torch.rand(2, 1, 5, 5))
    return net, {**seen, "sum": net.sum_dtype, "output": out.dtype}, out


LEVELS = {
    "O0": {"conv": FP32, "bn": FP32, "fc": FP32, "ln": FP32, "head": FP32, "sum": FP32,
           "output": FP32},
    # white cells compute low and hand back fp32; everything else fp32
    "O1": {"conv": FP32, "bn": FP32, "fc": FP32, "ln": FP32, "head": FP32, "sum": FP32,
           "output": FP32},
    # black cells compute fp32 and hand back low; the network output is fp32
    "O2": {"conv": FP16, "bn": FP16, "fc": FP16, "ln": FP16, "head": FP16, "sum": FP16,
           "output": FP32},
    "O3": {"conv": FP16, "bn": FP16, "fc": FP16, "ln": FP16, "head": FP16, "sum": FP16,
           "output": FP32},
}


@pytest.mark.parametrize("level", list(LEVELS))
def test_level_table(level: str) -> None:
    net, seen, _ = _run(level)
    assert seen == LEVELS[level]
    assert {p.dtype for p in net.parameters()} == {FP32}  # cast where used, as MindSpore


def test_o1_white_cells_compute_in_low_precision() -> None:
    net, _, _ = _run("O1")
    x = torch.rand(2, 1, 5, 5)
    h = F.conv2d(x.half(), net.conv.weight.half(), net.conv.bias.half()).float()
    h = F.relu(net.bn(h).half()).float().flatten(1)  # ReLU is a white op
    h = F.linear(h.half(), net.fc.weight.half(), net.fc.bias.half()).float()
    h = net.ln(h)
    expected = F.linear(h.half(), net.head.weight.half(), net.head.bias.half()).float()
    assert torch.equal(net(x), expected)


def test_o2_black_cells_compute_in_fp32_and_o3_does_not() -> None:
    x = torch.rand(2, 8)
    for level, bn_dtype in (("O2", FP32), ("O3", FP16)):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
        amp.auto_mixed_precision(net, level)
        h = F.linear(x.half(), net[0].weight.half(), net[0].bias.half())
        w, b = net[1].weight.to(bn_dtype), net[1].bias.to(bn_dtype)
        expected = F.layer_norm(h.to(bn_dtype), (8,), w, b).half().float()
        assert torch.equal(net(x), expected), level


def test_bfloat16() -> None:
    _, seen, _ = _run("O3", BF16)
    assert seen["conv"] == BF16 and seen["output"] == FP32


# -- custom_mixed_precision -------------------------------------------------------------------

def test_custom_mixed_precision_needs_a_list() -> None:
    # Both lists together are MindSpore 2.3's two-list mode
    # (tests/dialects/test_dialect_mindspore_current.py).
    with pytest.raises(ValueError, match="needs white_list, black_list or both"):
        amp.custom_mixed_precision(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="network must be"):
        amp.custom_mixed_precision("net", white_list=[nn.Linear])


def test_custom_white_list_with_mindspore_and_torch_names() -> None:
    for white in (["Dense", "MatMul"], [nn.Linear, torch.matmul]):
        net = nn.Sequential(nn.Linear(4, 4), nn.Conv1d(1, 1, 1))
        amp.custom_mixed_precision(net, white_list=white)
        seen = {}
        net[1].register_forward_hook(lambda m, i, o, seen=seen: seen.update(conv=i[0].dtype))
        x = torch.rand(2, 1, 4)
        net(x)
        assert seen == {"conv": FP32}  # Linear output cast back; Conv1d not listed
        with pytest.raises(ValueError, match="unknown op name 'MatMull'"):
            amp.custom_mixed_precision(nn.Linear(2, 2), white_list=["MatMull"])


def test_custom_black_list_ops_run_in_fp32() -> None:
    net = nn.Sequential(nn.Linear(4, 4), nn.Softmax(-1))
    amp.custom_mixed_precision(net, black_list=[torch.softmax, "Softmax"])
    seen = {}
    net[1].register_forward_hook(lambda m, i, o: seen.update(softmax=o.dtype))
    net(torch.rand(2, 4))
    assert seen == {"softmax": FP32}


# -- loss scalers ---------------------------------------------------------------------------

def test_dynamic_loss_scaler_rule() -> None:
    scaler = amp.DynamicLossScaler(scale_value=8, scale_factor=4, scale_window=2)
    scales = []
    for finite in (True, True, False, False, False, True):
        assert scaler.adjust(torch.tensor(finite)) is True
        scales.append(float(scaler.scale_value))
    # window 2: grow after 2 finite steps; overflow: max(1, scale / 4)
    assert scales == [8.0, 32.0, 8.0, 2.0, 1.0, 1.0]


def test_scale_unscale_and_all_finite() -> None:
    scaler = amp.DynamicLossScaler(1024, 2, 1000)
    grads = (torch.tensor([1024.0, 2048.0]), torch.tensor([512.0], dtype=FP16))
    out = scaler.unscale(grads)
    assert [t.tolist() for t in out] == [[1.0, 2.0], [0.5]] and out[1].dtype == FP16
    assert scaler.scale(torch.tensor(0.5)).item() == 512.0
    assert bool(amp.all_finite(out)) is True
    assert bool(amp.all_finite([torch.tensor([float("inf")])])) is False


def test_loss_scaler_errors() -> None:
    with pytest.raises(ValueError, match="scale_value must be a finite number >= 1"):
        amp.DynamicLossScaler(0.5, 2, 10)
    with pytest.raises(ValueError, match="scale_value must be a finite number >= 1"):
        amp.StaticLossScaler(0.5)
    with pytest.raises(ValueError, match="scale_factor must be a finite number > 1"):
        amp.DynamicLossScaler(8, 1, 10)
    with pytest.raises(ValueError, match="scale_window must be an int >= 1"):
        amp.DynamicLossScaler(8, 2, 0)
    static = amp.StaticLossScaler(4)
    assert static.adjust(False) is False and float(static.scale_value) == 4.0


# -- build_train_network ----------------------------------------------------------------------

def test_build_train_network_levels() -> None:
    x, y = torch.rand(8, 4), torch.randint(0, 3, (8,))
    for level, returns_tuple, param in (("O0", False, FP32), ("O1", False, FP32),
                                        ("O2", True, FP32), ("O3", False, FP32)):
        net = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 3))
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        step = amp.build_train_network(net, opt, nn.CrossEntropyLoss(), level)
        result = step(x, y)
        assert isinstance(result, tuple) == returns_tuple, level
        if returns_tuple:  # MindSpore's O2 manager: dynamic, starting at 2**24
            _, overflow, scale = result
            assert overflow.dtype == torch.bool and float(scale) == 2.0 ** 24
            assert step.scaler.get_scale() == (2.0 ** 23 if overflow else 2.0 ** 24)
        assert {p.dtype for p in net.parameters()} == {param}


def test_build_train_network_o0_is_a_plain_training_step() -> None:
    torch.manual_seed(0)
    ref = nn.Linear(4, 3)
    net = nn.Linear(4, 3)
    net.load_state_dict(ref.state_dict())
    x, y = torch.rand(8, 4), torch.randint(0, 3, (8,))
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    F.cross_entropy(ref(x), y).backward()
    opt_ref.step()
    step = amp.build_train_network(net, torch.optim.SGD(net.parameters(), lr=0.1),
                                   nn.CrossEntropyLoss())
    loss = step(x, y)
    assert loss.dtype == FP32
    assert torch.equal(net.weight, ref.weight) and torch.equal(net.bias, ref.bias)


def test_fixed_loss_scale_manager_without_dropping_applies_the_step() -> None:
    net = nn.Linear(2, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    manager = amp.FixedLossScaleManager(128.0, drop_overflow_update=False)
    w = nn.Parameter(torch.ones(1))

    class WithLoss(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (net(x) * w).sum()

    ref = net.weight.detach().clone()
    x = torch.ones(1, 2)
    step = amp.build_train_network(WithLoss(), opt, None, "O0", loss_scale_manager=manager)
    result = step(x)
    assert isinstance(result, torch.Tensor)
    assert torch.allclose(net.weight, ref - 0.1, atol=1e-6)  # d/dw = 1, unscaled


def test_build_train_network_errors() -> None:
    net = nn.Linear(2, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="level must be one of"):
        amp.build_train_network(net, opt, level="O5")
    with pytest.raises(ValueError, match=r"unsupported keyword\(s\) \['keep_bn'\]"):
        amp.build_train_network(net, opt, level="O2", keep_bn=True)
    with pytest.raises(ValueError, match="boost_level: only 'O0'"):
        amp.build_train_network(net, opt, boost_level="O1")
    with pytest.raises(TypeError, match="loss_scale_manager must be None"):
        amp.build_train_network(net, opt, loss_scale_manager=128.0)
    with pytest.raises(ValueError, match="cast_model_type must be"):
        amp.build_train_network(net, opt, level="O2", cast_model_type=torch.int8)
    with pytest.raises(ValueError, match="loss_scale must be a finite number >= 1"):
        amp.FixedLossScaleManager(0.5)


def test_training_on_digits_with_an_injected_overflow() -> None:
    from helpers_models import digits_split

    x_train, y_train, _, _ = digits_split()
    x_train = x_train.flatten(1)
    model = nn.Sequential(nn.Linear(64, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    manager = amp.DynamicLossScaleManager(init_loss_scale=2.0 ** 10)
    step = amp.build_train_network(model, opt, nn.CrossEntropyLoss(), "O2",
                                   loss_scale_manager=manager)
    losses = []
    for i in range(30):
        idx = torch.arange(i * 32, i * 32 + 32) % len(y_train)
        x = x_train[idx].clone()
        if i == 3:
            x[0, 0] = float("inf")  # an injected overflow
        before = [p.detach().clone() for p in model.parameters()]
        loss, overflow, scale = step(x, y_train[idx])
        unchanged = all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
        assert bool(overflow) == unchanged == (i == 3)
        if i == 3:
            assert float(scale) == 2.0 ** 10
        else:
            losses.append(loss.item())
    assert step.scaler.get_scale() == 2.0 ** 9
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5


def test_o2_follows_the_models_device_when_cuda_is_visible(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # No "CUDA when available" default: a CPU model's ops are cast on a CUDA machine too.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    net = amp.auto_mixed_precision(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), "O2", FP16)
    seen = []
    net[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    net(torch.rand(2, 4))
    assert seen == [FP16]


# -- what MindSpore's own AMP suites do ------------------------------------------------------

def test_dynamic_loss_scaler_counter_and_scale_value_are_assignable() -> None:
    # tests/st/mix_precision assigns both (as Parameters) between adjust() calls.
    scaler = amp.DynamicLossScaler(scale_value=2 ** 10, scale_factor=2, scale_window=50)
    scaler.counter = nn.Parameter(torch.tensor(49, dtype=torch.int32), requires_grad=False)
    scaler.adjust(amp.all_finite((torch.ones(2, dtype=FP16),)))
    assert float(scaler.scale_value) == 2048.0 and int(scaler.counter) == 0  # window full
    scaler.scale_value = nn.Parameter(torch.tensor(2.0 ** 10))
    scaler.adjust(torch.tensor(True))
    assert float(scaler.scale_value) == 1024.0 and int(scaler.counter) == 1
    static = amp.StaticLossScaler(8)
    static.scale_value = 16
    assert float(static.scale(torch.tensor(1.0))) == 16.0
    with pytest.raises(ValueError, match="scale_value must be a finite number >= 1"):
        scaler.scale_value = 0.5
    with pytest.raises(ValueError, match="counter must be >= 0"):
        scaler.counter = -1
    with pytest.raises(TypeError, match="counter must be an int"):
        scaler.counter = 1.5
    assert float(scaler.scale_value) == 1024.0 and int(scaler.counter) == 1  # unchanged


class _PerSampleCE(nn.Module):
    """MindSpore's SoftmaxCrossEntropyWithLogits: one loss per sample (reduction 'none')."""

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, labels, reduction="none")


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_per_sample_loss_back_propagates_its_sum(level: str) -> None:
    # MindSpore starts the backward from a sensitivity of ones: the gradient of the sum.
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    net.load_state_dict(ref.state_dict())
    x, y = torch.rand(6, 4), torch.randint(0, 3, (6,))
    low = {"cast_model_type": BF16} if level in ("O2", "O3") else {}
    step = amp.build_train_network(net, torch.optim.SGD(net.parameters(), lr=0.1),
                                   _PerSampleCE(), level, loss_scale_manager=None, **low)
    loss = step(x, y)
    assert loss.shape == (6,)  # returned per sample, as MindSpore does
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    if level in ("O2", "O3"):  # the same network computing in bfloat16, plain torch
        with torch.autocast("cpu", BF16):
            out = ref(x.to(BF16))
        F.cross_entropy(out.float(), y, reduction="none").sum().backward()
    else:  # O1 only casts its white list: fp16 Linear
        F.cross_entropy(ref(x), y, reduction="none").sum().backward()
    opt_ref.step()
    tol = {"O0": 0.0, "O1": 2e-3, "O2": 1e-2, "O3": 1e-2}[level]
    for a, b in zip(net.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_o3_casts_every_floating_input_float64_included() -> None:
    # MindSpore's O3 is to_float on the whole network: a float64 input is cast too, so
    # BatchNorm does not meet float64 data with low-precision parameters.
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    twin = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    twin.load_state_dict(net.state_dict())
    amp.auto_mixed_precision(net, "O3", BF16)
    amp.auto_mixed_precision(twin, "O3", BF16)
    x = torch.rand(2, 3, 8, 8)
    out64 = net(x.double())
    assert out64.dtype == FP32
    assert torch.equal(out64, twin(x))  # float64 and float32 inputs: the same bf16 run
    o2 = amp.auto_mixed_precision(nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3)), "O2", BF16)
    assert o2(torch.rand(2, 3, dtype=torch.float64)).dtype == FP32


class _PlainSGD(torch.optim.Optimizer):
    """A user's own optimizer: a step without a closure."""

    def __init__(self, params: object, lr: float) -> None:
        super().__init__(params, {"lr": lr})  # type: ignore[arg-type]

    @torch.no_grad()
    def step(self, closure: object = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


OPTIMIZERS = {
    "SGD-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "Adam-fused": lambda p: torch.optim.Adam(p, lr=0.01, fused=True),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=0.01),
    "RMSprop": lambda p: torch.optim.RMSprop(p, lr=0.01),
    "own": lambda p: _PlainSGD(p, 0.1),
    "LBFGS": lambda p: torch.optim.LBFGS(p, lr=0.5, max_iter=3),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_any_torch_optimizer_trains_as_the_plain_torch_loop(name: str) -> None:
    torch.manual_seed(0)
    ref = nn.Linear(4, 3)
    net = nn.Linear(4, 3)
    net.load_state_dict(ref.state_dict())
    batches = [(torch.rand(8, 4), torch.randint(0, 3, (8,))) for _ in range(3)]
    opt_ref = OPTIMIZERS[name](ref.parameters())
    for x, y in batches:
        def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            opt_ref.zero_grad()
            loss = F.cross_entropy(ref(x), y)
            loss.backward()
            return loss
        if name == "LBFGS":
            opt_ref.step(closure)
        else:
            closure()
            opt_ref.step()
    step = amp.build_train_network(net, OPTIMIZERS[name](net.parameters()),
                                   nn.CrossEntropyLoss(), "O0")
    for x, y in batches:
        step(x, y)
    assert not torch.equal(net.weight, ref.weight.new_zeros(()).expand_as(ref.weight))
    for a, b in zip(net.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b), name


def test_closure_optimizer_with_a_skipping_loss_scale_is_a_clear_error() -> None:
    net = nn.Linear(4, 3)
    opt = torch.optim.LBFGS(net.parameters())
    with pytest.raises(ValueError, match=r"LBFGS.step needs a closure.*loss_scale_manager"):
        amp.build_train_network(net, opt, nn.CrossEntropyLoss(), "O2")
    # A fixed scale that never drops a step can drive it.
    step = amp.build_train_network(
        net, opt, nn.CrossEntropyLoss(), "O0",
        loss_scale_manager=amp.FixedLossScaleManager(128.0, drop_overflow_update=False))
    before = net.weight.detach().clone()
    step(torch.rand(8, 4), torch.randint(0, 3, (8,)))
    assert not torch.equal(net.weight, before)
