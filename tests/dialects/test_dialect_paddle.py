"""ampkit.paddle: auto_cast (O1/OD/O2, Paddle's lists and names), decorate, GradScaler."""

from __future__ import annotations

import glob
import re
from collections.abc import Iterator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers_models import on_forward

import ampkit.paddle as amp
from ampkit.apex import master_params
from ampkit.dialects.paddle import region as paddle_region

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.fixture(autouse=True)
def _fresh_global_amp_dtype(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # Paddle's global AMP dtype outlives each auto_cast; every test starts from float16.
    monkeypatch.setattr(paddle_region, "_amp_dtype", "float16")
    yield


# -- the seed's example (004), translated to torch ------------------------------------------

def seed_example() -> None:
    """The seed's code, with paddle.nn.Conv2D -> nn.Conv2d, paddle.rand -> torch.rand."""
    conv2d = nn.Conv2d(3, 2, 3, bias=False)
    data = torch.rand([10, 3, 32, 32])
    with amp.auto_cast():
        conv = conv2d(data)
        print(conv.dtype)
    with amp.auto_cast(enable=False):
        conv = conv2d(data)
        print(conv.dtype)
    with amp.auto_cast(custom_black_list={"conv2d"}):
        conv = conv2d(data)
        print(conv.dtype)
    a = torch.rand([2, 3])
    b = torch.rand([2, 3])
    with amp.auto_cast(custom_white_list={"elementwise_add"}):
        c = a + b
        print(c.dtype)
    with amp.auto_cast(custom_white_list={"elementwise_add"}, level="O2"):
        d = a + b
        print(d.dtype)


SEED_PRINTS = ["FP16", "FP32", "FP32", "FP16", "FP16"]  # the seed's "# FP16" comments


def test_copied_prints_equal_the_seed_file() -> None:
    paths = glob.glob("/work/shared/seeds/004_*.txt")
    if not paths:
        pytest.skip("the seed file is outside the repository and not present here")
    with open(paths[0], encoding="utf-8") as f:
        assert re.findall(r"print\(\w+\.dtype\) # (FP16|FP32)", f.read()) == SEED_PRINTS


def test_seed_example_prints_what_the_seed_prints(capsys: pytest.CaptureFixture[str]) -> None:
    seed_example()
    printed = capsys.readouterr().out.split()
    names = {"torch.float16": "FP16", "torch.float32": "FP32"}
    assert [names[p] for p in printed] == SEED_PRINTS


# -- documented errors ----------------------------------------------------------------------

@pytest.mark.parametrize("level", ["O3", "o1", "", None])
def test_bad_level_is_a_value_error(level: object) -> None:
    with pytest.raises(ValueError, match=r"level should be one of \['O0', 'OD', 'O1', 'O2'\]"):
        amp.auto_cast(level=level)


@pytest.mark.parametrize("dtype", ["float32", "fp16", torch.float32, None])
def test_bad_dtype_is_a_value_error(dtype: object) -> None:
    with pytest.raises(ValueError, match="dtype should be 'float16' or 'bfloat16'"):
        amp.auto_cast(dtype=dtype)


def test_op_in_both_custom_lists_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="in both custom_white_list and custom_black_list"):
        amp.auto_cast(custom_white_list={"elementwise_add"}, custom_black_list=["add"])


def test_unknown_op_name_gets_did_you_mean() -> None:
    with pytest.raises(ValueError, match=r"custom_white_list: unknown op name "
                                         r"'elementwise_ad'.*did you mean.*'elementwise_add'"):
        amp.auto_cast(custom_white_list={"elementwise_ad"})


def test_non_bool_flags_are_type_errors() -> None:
    with pytest.raises(TypeError, match="enable must be a bool"):
        amp.auto_cast(enable=1)
    with pytest.raises(TypeError, match="use_promote must be a bool"):
        amp.auto_cast(use_promote="yes")
    with pytest.raises(TypeError, match="custom_black_list: expected a set, list or tuple"):
        amp.auto_cast(custom_black_list="conv2d")


# -- the level table: which dtype each kind of op runs in ------------------------------------

def _op_dtypes(**kwargs: object) -> dict[str, torch.dtype]:
    x32 = torch.rand(4, 8)
    x16 = x32.half()
    emb = nn.Embedding(5, 8)
    ids = torch.tensor([1, 2])
    with amp.auto_cast(**kwargs):
        return {
            "white fp32 in": torch.matmul(x32, torch.rand(8, 3)).dtype,  # matmul_v2
            "black fp16 in": torch.softmax(x16, -1).dtype,                # softmax
            "extra black": emb(ids).dtype,                                # lookup_table_v2
            "gray fp32 in": torch.relu(x32).dtype,
            "gray fp16 in": torch.relu(x16).dtype,
            "gray mixed in": (x16 + x32).dtype,
        }


LEVEL_TABLE = {
    # level, use_promote: white, black, extra black, gray(fp32), gray(fp16), gray(mixed)
    ("O1", True): (FP16, FP32, FP32, FP32, FP16, FP32),
    ("OD", True): (FP16, FP32, FP32, FP32, FP32, FP32),
    ("O2", True): (FP16, FP16, FP32, FP32, FP16, FP32),
    ("O2", False): (FP16, FP16, FP32, FP16, FP16, FP16),
    ("O0", True): (FP32, FP16, FP32, FP32, FP16, FP32),
}


@pytest.mark.parametrize(("level", "use_promote"), list(LEVEL_TABLE))
def test_level_table(level: str, use_promote: bool) -> None:
    got = _op_dtypes(level=level, use_promote=use_promote)
    assert tuple(got.values()) == LEVEL_TABLE[level, use_promote]


def test_paddle_and_torch_names_reach_the_same_ops() -> None:
    x = torch.rand(2, 3)
    ids = torch.tensor([0, 1])
    emb = nn.Embedding(3, 4)
    for names in ({"softmax_with_cross_entropy", "lookup_table_v2", "elementwise_mul"},
                  {F.cross_entropy, nn.Embedding, torch.mul}):
        with amp.auto_cast(custom_white_list=names):
            assert F.cross_entropy(x, ids).dtype == FP16
            assert emb(ids).dtype == FP16
            assert (x * x).dtype == FP16


def test_paddle_mul_is_the_matrix_product() -> None:
    # Paddle's "mul" op is the fully-connected matmul; its elementwise op is elementwise_mul.
    x = torch.rand(2, 3)
    with amp.auto_cast(level="OD", custom_white_list={"mul"}):
        assert (x * x).dtype == FP32
        assert torch.mm(x, x.T).dtype == FP16


def test_custom_white_entry_leaves_the_default_black_list() -> None:
    x = torch.rand(3, 4)
    with amp.auto_cast():
        assert torch.exp(x.half()).dtype == FP32
    with amp.auto_cast(custom_white_list=["exp"]):
        assert torch.exp(x).dtype == FP16


def test_bfloat16_and_values_equal_an_explicit_cast() -> None:
    w, x = torch.rand(8, 5), torch.rand(4, 8)
    with amp.auto_cast(dtype="bfloat16"):
        got = torch.matmul(x, w)
    assert got.dtype == BF16
    assert torch.equal(got, torch.matmul(x.to(BF16), w.to(BF16)))


# -- decorate -------------------------------------------------------------------------------

def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.LayerNorm(8), nn.Linear(8, 3))


def test_decorate_o1_changes_nothing() -> None:
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    out_net, out_opt = amp.decorate(net, opt, level="O1")
    assert out_net is net and out_opt is opt
    assert {p.dtype for p in net.parameters()} == {FP32}


@pytest.mark.parametrize(("dtype", "layer_norm"), [("float16", FP32), ("bfloat16", BF16)])
def test_decorate_o2_parameter_dtypes(dtype: str, layer_norm: torch.dtype) -> None:
    net = _net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    net, opt = amp.decorate(net, opt, level="O2", dtype=dtype)
    low = FP16 if dtype == "float16" else BF16
    # master_weight (the default): the fp32 parameters are the truth; each layer
    # computes with copies in Paddle's O2 dtypes (see docs/migration.md).
    assert {p.dtype for p in net.parameters()} == {FP32}
    assert net[1].running_mean.dtype == FP32
    assert {p.dtype for p in master_params(opt)} == {FP32}
    seen = {}
    for i in (0, 1, 2, 3):
        on_forward(net[i], lambda m, a, i=i: seen.__setitem__(i, m.weight.dtype))
    with amp.auto_cast(level="O2", dtype=dtype):
        out = net(torch.rand(4, 8))
    assert seen == {0: low, 1: FP32, 2: layer_norm, 3: low}
    assert out.dtype == low  # Paddle's O2 output is what the last op computed


def test_decorate_options() -> None:
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net, opt = amp.decorate([net], [opt], level="O2", master_weight=False,
                            save_dtype="float32", excluded_layers=[net[3]])
    assert isinstance(net, list) and isinstance(opt, list)
    assert net[0][0].weight.dtype == FP16 and net[0][3].weight.dtype == FP32
    assert {p.dtype for p in opt[0].param_groups[0]["params"]} == {FP16, FP32}
    assert {v.dtype for v in net[0].state_dict().values() if v.is_floating_point()} == {FP32}


def test_decorate_errors() -> None:
    with pytest.raises(ValueError, match="level should be 'O1', 'OD' or 'O2'"):
        amp.decorate(_net(), level="O3")
    with pytest.raises(ValueError, match="dtype should be 'float16' or 'bfloat16'"):
        amp.decorate(_net(), level="O2", dtype="float64")
    with pytest.raises(TypeError, match="models must be"):
        amp.decorate("model", level="O2")
    with pytest.raises(ValueError, match="save_dtype should be None or one of"):
        amp.decorate(_net(), level="O2", save_dtype="int8")
    with pytest.raises(TypeError, match="master_weight must be a bool"):
        amp.decorate(_net(), level="O2", master_weight="yes")
    with pytest.raises(ValueError, match="expects an fp32 model"):
        amp.decorate(_net().half(), level="O2")


# -- GradScaler -----------------------------------------------------------------------------

def test_grad_scaler_defaults_are_paddles() -> None:
    s = amp.GradScaler()
    assert (s.is_enable(), s.get_init_loss_scaling(), s.get_incr_ratio(), s.get_decr_ratio(),
            s.get_incr_every_n_steps(), s.get_decr_every_n_nan_or_inf(),
            s.is_use_dynamic_loss_scaling()) == (True, 65536.0, 2.0, 0.5, 2000, 1, True)


def _param_opt() -> tuple[nn.Parameter, torch.optim.Optimizer]:
    w = nn.Parameter(torch.ones(2))
    return w, torch.optim.SGD([w], lr=0.5)


def test_grad_scaler_state_machine_errors() -> None:
    w, opt = _param_opt()
    scaler = amp.GradScaler()
    scaler.scale(w.sum()).backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="unscale_"):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="step"):
        scaler.step(opt)
    scaler.update()


def test_grad_scaler_errors_use_paddles_names() -> None:
    with pytest.raises(ValueError, match="incr_ratio must be > 1"):
        amp.GradScaler(incr_ratio=1.0)
    with pytest.raises(ValueError, match="decr_ratio must be in"):
        amp.GradScaler(decr_ratio=2.0)
    with pytest.raises(ValueError, match="incr_every_n_steps must be an int >= 1"):
        amp.GradScaler(incr_every_n_steps=0)
    with pytest.raises(ValueError, match="decr_every_n_nan_or_inf must be an int >= 1"):
        amp.GradScaler(decr_every_n_nan_or_inf=0)
    with pytest.raises(RuntimeError, match="empty"):
        amp.GradScaler().load_state_dict({})
    with pytest.raises(ValueError, match=r"missing keys \['incr_ratio', 'decr_ratio'"):
        amp.GradScaler().load_state_dict({"scale": 2.0})


def _overflow_step(scaler: amp.GradScaler, w: nn.Parameter, opt: torch.optim.Optimizer,
                   overflow: bool) -> None:
    opt.zero_grad()
    scaled = scaler.scale(w.sum() * (float("inf") if overflow else 1.0))
    scaled.backward()
    scaler.minimize(opt, scaled)


def test_decr_every_n_nan_or_inf_and_the_floor_of_one() -> None:
    w, opt = _param_opt()
    scaler = amp.GradScaler(init_loss_scaling=4.0, decr_every_n_nan_or_inf=2)
    scales = []
    for _ in range(6):
        _overflow_step(scaler, w, opt, overflow=True)
        scales.append(scaler.state_dict()["scale"])
    assert scales == [4.0, 2.0, 2.0, 1.0, 1.0, 1.0]  # every second overflow halves, >= 1
    assert w.tolist() == [1.0, 1.0]  # every overflowing step was skipped


def test_grad_scaler_matches_torch_with_its_defaults() -> None:
    w_ref, opt_ref = _param_opt()
    w, opt = _param_opt()
    ref = torch.amp.GradScaler("cpu", growth_interval=2)
    mine = amp.GradScaler(incr_every_n_steps=2)
    for overflow in (False, False, True, False, False, False):
        _overflow_step(mine, w, opt, overflow)
        opt_ref.zero_grad()
        ref.scale(w_ref.sum() * (float("inf") if overflow else 1.0)).backward()
        ref.step(opt_ref)
        ref.update()
        assert mine.state_dict()["scale"] == ref.get_scale()
        assert torch.equal(w, w_ref)


def test_grad_scaler_state_dict_round_trip_and_setters() -> None:
    w, opt = _param_opt()
    a = amp.GradScaler(init_loss_scaling=64.0, incr_every_n_steps=3)
    _overflow_step(a, w, opt, overflow=False)
    saved = a.state_dict()
    assert saved == {"scale": 64.0, "incr_ratio": 2.0, "decr_ratio": 0.5,
                     "incr_every_n_steps": 3, "decr_every_n_nan_or_inf": 1, "incr_count": 1,
                     "decr_count": 0, "use_dynamic_loss_scaling": True}
    b = amp.GradScaler()
    b.load_state_dict(saved)
    assert b.state_dict() == saved
    b.set_init_loss_scaling(8.0)
    b.set_decr_every_n_nan_or_inf(3)
    assert b.get_init_loss_scaling() == 8.0 and b.state_dict()["scale"] == 8.0
    assert b.get_decr_every_n_nan_or_inf() == 3
    assert amp.GradScaler(enable=False).state_dict() == {}


# -- a short training run through Paddle's API only -----------------------------------------

def test_training_on_digits_o2_with_an_injected_overflow() -> None:
    from helpers_models import digits_split

    x_train, y_train, _, _ = digits_split()
    x_train = x_train.flatten(1)
    model = nn.Sequential(nn.Linear(64, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = amp.decorate(model, opt, level="O2", dtype="float16")
    scaler = amp.GradScaler(init_loss_scaling=1024.0)
    losses = []
    for step in range(30):
        idx = torch.arange(step * 32, step * 32 + 32) % len(y_train)
        with amp.auto_cast(level="O2"):
            logits = model(x_train[idx])
            loss = F.cross_entropy(logits.float(), y_train[idx])
        if step == 5:
            loss = loss * float("inf")
        before = [p.detach().clone() for p in [*model.parameters(), *master_params(opt)]]
        scaled = scaler.scale(loss)
        scaled.backward()
        scaler.minimize(opt, scaled)
        opt.zero_grad()
        after = [*model.parameters(), *master_params(opt)]
        if step == 5:
            assert all(torch.equal(p, b) for p, b in zip(after, before))
            assert scaler.state_dict()["scale"] == 512.0
        else:
            assert not all(torch.equal(p, b) for p, b in zip(after, before))
            losses.append(loss.item())
    assert model[0].weight.dtype == FP32  # the truth; fp16 copies are made on use
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5


# -- the device: Paddle's global place is torch's default device ----------------------------

def test_auto_cast_casts_cpu_ops_when_cuda_is_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    # On a CUDA machine the default device is still the CPU: a model there is cast.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    region = amp.auto_cast()
    assert region.device_type == "cpu"
    conv = nn.Conv2d(3, 2, 3, bias=False)
    with region:
        assert conv(torch.rand(1, 3, 8, 8)).dtype == FP16


def test_auto_cast_follows_the_default_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "get_default_device", lambda: torch.device("cuda", 0))
    assert amp.auto_cast().device_type == "cuda"
    assert amp.auto_cast(device_type="cpu").device_type == "cpu"  # an explicit one wins


# -- behaviours Paddle's own tests check ------------------------------------------------------

def test_grad_scaler_turns_itself_off_after_a_bfloat16_auto_cast() -> None:
    model = nn.Conv2d(3, 2, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = amp.GradScaler()
    with amp.auto_cast(custom_black_list=["conv2d"], dtype="bfloat16"):
        loss = model(torch.rand(1, 3, 8, 8)).mean()
    with pytest.warns(UserWarning, match="bfloat16"):
        scaled = scaler.scale(loss)
    assert scaled is loss  # no scaling at all
    assert (scaler.is_enable(), scaler.is_use_dynamic_loss_scaling()) == (False, False)
    scaled.backward()
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    before = [p.detach().clone() for p in model.parameters()]
    scaler.minimize(opt, scaled)
    for p, b, g in zip(model.parameters(), before, grads):  # the unscaled gradients
        torch.testing.assert_close(p.detach(), b - 0.01 * g, rtol=0, atol=1e-7)
    # a float16 auto_cast leaves a new scaler on
    with amp.auto_cast():
        loss = model(torch.rand(1, 3, 8, 8)).float().mean()
    assert amp.GradScaler(init_loss_scaling=4.0).scale(loss).item() == 4.0 * loss.item()


def test_linear_runs_paddles_own_linear_op_on_no_list() -> None:
    conv = nn.Conv2d(1, 6, 3, bias=False)
    linear = nn.Linear(4, 4)
    with amp.auto_cast(level="OD"):
        out1 = conv(torch.rand(1, 1, 6, 6))
        out2 = out1 + torch.rand(out1.shape, dtype=FP16)
        out3 = linear(out2)
    assert (out1.dtype, out2.dtype, out3.dtype) == (FP16, FP32, FP32)
    with amp.auto_cast(level="O2"):  # use_promote: an fp32 weight makes it fp32
        assert linear(torch.rand(2, 4, dtype=FP16)).dtype == FP32
    with amp.auto_cast(level="O2", use_promote=False):
        assert linear(torch.rand(2, 4, dtype=FP16)).dtype == FP16
    with amp.auto_cast(custom_white_list={"matmul_v2"}, level="OD"):
        assert linear(torch.rand(2, 4)).dtype == FP32  # matmul_v2 is not linear


def test_load_state_dict_makes_the_loaded_scale_the_initial_one() -> None:
    saved = amp.GradScaler(init_loss_scaling=14, incr_ratio=233.0, decr_ratio=0.523,
                           incr_every_n_steps=1090, decr_every_n_nan_or_inf=20).state_dict()
    scaler = amp.GradScaler()
    scaler.load_state_dict(saved)
    assert scaler.get_init_loss_scaling() == 14.0
    assert (scaler.get_incr_ratio(), scaler.get_decr_ratio(), scaler.get_incr_every_n_steps(),
            scaler.get_decr_every_n_nan_or_inf()) == (233.0, 0.523, 1090, 20)


def test_minimize_returns_optimize_ops_and_params_grads() -> None:
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = amp.GradScaler(init_loss_scaling=1024)
    scaled = scaler.scale(model(torch.rand(4, 3)).sum())
    scaled.backward()
    ops, params_grads = scaler.minimize(opt, scaled)
    assert ops == []
    assert [p for p, _ in params_grads] == list(model.parameters())
    assert all(g is p.grad for p, g in params_grads)
    assert params_grads[1][1].tolist() == [4.0, 4.0]  # the bias gradient, unscaled
    opt.zero_grad()
    scaled = scaler.scale(model(torch.rand(4, 3)).sum() * float("nan"))
    scaled.backward()
    assert scaler.minimize(opt, scaled) == (None, None)  # skipped


def test_white_list_and_black_list_are_paddles_defaults() -> None:
    white, black = amp.white_list(), amp.black_list()
    assert set(white) == set(black) == {"float16", "bfloat16"}
    assert set(white["float16"]) == set(black["float16"]) == {"OD", "O1", "O2"}
    assert {"conv2d", "matmul_v2", "mul", "einsum"} <= white["float16"]["O1"]
    assert black["float16"]["OD"] == set()
    assert {"softmax", "layer_norm", "exp", "linear_interp_v2"} <= black["float16"]["O1"]
    assert "softmax" not in black["float16"]["O2"]
    assert "lookup_table_v2" in black["float16"]["O2"]
    white["float16"]["O1"].add("log")  # a copy: the lists stay as they were
    assert "log" not in amp.white_list()["float16"]["O1"]
    assert amp.is_float16_supported("cpu") and amp.is_bfloat16_supported("cpu")
