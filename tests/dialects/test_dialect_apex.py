"""ampkit.apex: initialize with apex's opt_level table and checks, scale_loss, state_dict,
user functions, disable_casts; differential against torch.autocast + GradScaler."""

from __future__ import annotations

import types
from collections.abc import Iterator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers_models import on_forward

import ampkit
import ampkit.apex as amp
from ampkit.dialects.apex import handle as apex_handle
from ampkit.dialects.apex import state as apex_state
from ampkit.engine.function_patching import CastRule, register_function, unregister_function
from ampkit.scaling.loss_scaling import configure_loss_scaling

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.fixture(autouse=True)
def _fresh_loss_scaling() -> Iterator[None]:
    yield
    configure_loss_scaling("dynamic")  # undo what amp.initialize configured
    for handle in list(apex_handle._active_handles):  # apex's refusals
        handle._deactivate()


# -- the seed's example (002), on CPU -------------------------------------------------------

def test_seed_example_runs() -> None:
    d_in, d_out = 8, 4
    model = torch.nn.Linear(d_in, d_out)  # the seed's .cuda() dropped: CPU here
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    before = model.weight.detach().clone()
    loss = model(torch.rand(16, d_in)).float().pow(2).mean()
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
    assert not torch.equal(model.weight, before)


def test_seed_example_with_half_model_is_refused_as_apex_did() -> None:
    # The seed's example calls .half() on the model, which its own text forbids; apex
    # refused such a model, and so does ampkit.apex.
    model = torch.nn.Linear(8, 4).half()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with pytest.raises(RuntimeError, match=r"do not call \.half\(\) on it first"):
        amp.initialize(model, optimizer, opt_level="O1", verbosity=0)


# -- the opt_level table --------------------------------------------------------------------

def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.LayerNorm(6), nn.Linear(6, 3))


# level: first Linear, BatchNorm, LayerNorm, optimizer params, output, loss scale.
# These are the *stored* dtypes: at O2 ampkit keeps the fp32 parameters as the truth
# and each layer computes with fp16 copies made on use (apex showed the fp16 copies as
# the model's parameters; docs/migration.md), see test_o2_computes_with_fp16_weights.
OPT_LEVEL_TABLE = {
    "O0": (FP32, FP32, FP32, {FP32}, FP32, 1.0),
    # O1's output: fp32 (so a loss outside the model, apex's patched fp32 loss
    # functions, is then fp32; apex itself hands back the fp16 the last op computed)
    "O1": (FP32, FP32, FP32, {FP32}, FP32, 65536.0),
    "O2": (FP32, FP32, FP32, {FP32}, FP32, 65536.0),
    "O3": (FP16, FP16, FP16, {FP16}, FP32, 1.0),
}


@pytest.mark.parametrize("opt_level", list(OPT_LEVEL_TABLE))
def test_opt_level_table(opt_level: str) -> None:
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net, opt = amp.initialize(net, opt, opt_level=opt_level, verbosity=0)
    out = net(torch.rand(4, 6))
    got = (net[0].weight.dtype, net[1].weight.dtype, net[2].weight.dtype,
           {p.dtype for g in opt.param_groups for p in g["params"]}, out.dtype,
           amp.state_dict()["loss_scaler0"]["loss_scale"])
    assert got == OPT_LEVEL_TABLE[opt_level]


def test_o2_computes_with_fp16_weights() -> None:
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net, opt = amp.initialize(net, opt, opt_level="O2", verbosity=0)
    seen = {}
    for i in range(4):
        on_forward(net[i], lambda m, a, i=i: seen.__setitem__(i, m.weight.dtype))
    net(torch.rand(4, 6))
    # apex O2: fp16 weights, BatchNorm fp32 (keep_batchnorm_fp32); LayerNorm is not a
    # batch norm, so apex casts it to fp16 too
    assert seen == {0: FP16, 1: FP32, 2: FP16, 3: FP16}


def test_properties_table_is_apexs() -> None:
    rows = {level: (p.cast_model_type, p.patch_torch_functions, p.keep_batchnorm_fp32,
                    p.master_weights, p.loss_scale) for level, p in amp.OPT_LEVELS.items()}
    assert rows == {"O0": (FP32, False, None, False, 1.0),
                    "O1": (None, True, None, None, "dynamic"),
                    "O2": (FP16, False, True, True, "dynamic"),
                    "O3": (FP16, False, False, False, 1.0)}


def test_o2_does_not_patch_ops_and_o1_does() -> None:
    x = torch.rand(3, 4)

    class Probe(nn.Module):
        def forward(self, h: torch.Tensor) -> torch.Tensor:
            self.seen = (torch.mm(h.float(), h.float().T).dtype, torch.prod(h).dtype)
            return h

    for level, expected in (("O1", (FP16, FP32)), ("O2", (FP32, FP16))):
        net = nn.Sequential(nn.Linear(4, 4), Probe())
        amp.initialize(net, opt_level=level, verbosity=0)
        net(x)
        assert net[1].seen == expected, level


def test_bfloat16_on_cpu() -> None:
    net = _net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    net, opt = amp.initialize(net, opt, opt_level="O2", cast_model_type=BF16, verbosity=0)
    assert net[0].weight.dtype == FP32 and net[1].weight.dtype == FP32
    with amp.scale_loss(net(torch.rand(4, 6)).sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert {p.dtype for p in amp.master_params(opt)} == {FP32}
    lin = amp.initialize(nn.Sequential(nn.Linear(3, 3)), opt_level="O1", dtype=BF16,
                         verbosity=0)
    seen = []
    lin[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    assert lin(torch.rand(2, 3)).dtype == FP32 and seen == [BF16]  # handed back fp32


def test_overrides_and_verbosity(capsys: pytest.CaptureFixture[str]) -> None:
    net = amp.initialize(_net(), opt_level="O3", keep_batchnorm_fp32="True", loss_scale="128",
                         cast_model_outputs=FP16)
    assert net[1].weight.dtype == FP32 and net[2].weight.dtype == FP16
    assert net(torch.rand(4, 6)).dtype == FP16
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 128.0
    printed = capsys.readouterr().out
    assert "opt_level O3" in printed and "keep_batchnorm_fp32    : True" in printed


# -- apex's errors --------------------------------------------------------------------------

@pytest.mark.parametrize(("kwargs", "match"), [
    ({"opt_level": "O4"}, "unexpected opt_level 'O4'"),
    ({"opt_level": "00"}, "the letter O, not the digit zero"),
    # the core's refusals, in apex's names and exception type
    ({"opt_level": "O1", "cast_model_type": FP16}, "opt_level O1 .* cast_model_type must"),
    ({"opt_level": "O3", "patch_torch_functions": True},
     "patch_torch_functions=True casts each op .* opt_level O3"),
    ({"opt_level": "O1", "keep_batchnorm_fp32": True}, "keep_batchnorm_fp32 must be None"),
    ({"opt_level": "O1", "master_weights": True}, "opt_level O1 .* master_weights"),
])
def test_nonsensical_overrides_are_runtime_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(RuntimeError, match=match) as raised:
        amp.initialize(_net(), verbosity=0, **kwargs)
    assert "keep_norms_fp32" not in str(raised.value) and "patch_ops" not in str(raised.value)


def test_wrapped_model_is_a_runtime_error() -> None:
    with pytest.raises(RuntimeError, match="DataParallel"):
        amp.initialize(nn.DataParallel(_net()), opt_level="O2", verbosity=0)


def test_bad_values_are_value_errors() -> None:
    with pytest.raises(ValueError, match="loss_scale must be 'dynamic' or a positive number"):
        amp.initialize(_net(), opt_level="O1", loss_scale=-1, verbosity=0)
    with pytest.raises(ValueError, match=r"dtype \(.*\) contradicts cast_model_type"):
        amp.initialize(_net(), opt_level="O2", cast_model_type=FP16, dtype=BF16, verbosity=0)


def test_scale_loss_before_initialize_is_a_runtime_error(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    monkeypatch.setattr(apex_state, "_state", None)
    w = nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([w], lr=0.1)
    with (pytest.raises(RuntimeError, match=r"before amp\.initialize"),
          amp.scale_loss(w.sum(), opt)):
        pass
    with pytest.raises(RuntimeError, match=r"before amp\.initialize"):
        amp.state_dict()


def test_disabled_changes_nothing() -> None:
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    out = amp.initialize(net, opt, enabled=False, opt_level="O2")
    assert out == (net, opt) and net[0].weight.dtype == FP32
    loss = net(torch.rand(4, 6)).sum()
    with amp.scale_loss(loss, opt) as scaled:
        assert scaled is loss


# -- several losses, checkpoints ------------------------------------------------------------

def test_num_losses_and_state_dict_round_trip() -> None:
    net = nn.Linear(2, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net, opt = amp.initialize(net, opt, opt_level="O1", num_losses=2, verbosity=0)
    x = torch.rand(3, 2)
    with amp.scale_loss(net(x).float().mean(), opt, loss_id=0) as scaled:
        scaled.backward()
    with amp.scale_loss(net(x).float().mean() * float("inf"), opt, loss_id=1) as scaled:
        scaled.backward()
    before = net.weight.detach().clone()
    opt.step()  # loss 1 overflowed: skipped
    assert torch.equal(net.weight, before)
    saved = amp.state_dict()
    assert saved == {"loss_scaler0": {"loss_scale": 65536.0, "unskipped": 1},
                     "loss_scaler1": {"loss_scale": 32768.0, "unskipped": 0}}
    amp.initialize(nn.Linear(2, 2), opt_level="O1", num_losses=2, verbosity=0)
    amp.load_state_dict(saved)
    assert amp.state_dict() == saved
    with pytest.raises(RuntimeError, match="unexpected key"):
        amp.load_state_dict({**saved, "optimizer": {}})
    with pytest.raises(RuntimeError, match="holds 1 loss scaler"):
        amp.load_state_dict({"loss_scaler0": saved["loss_scaler0"]})


def test_master_params_are_the_fp32_masters_at_o2() -> None:
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net, opt = amp.initialize(net, opt, opt_level="O2", verbosity=0)
    masters = list(amp.master_params(opt))
    assert len(masters) == len(list(net.parameters()))
    assert {p.dtype for p in masters} == {FP32}
    assert masters[0] is net[0].weight  # the fp32 parameters are apex's masters


# -- user functions and disable_casts -------------------------------------------------------

def test_register_functions() -> None:
    ext = types.SimpleNamespace(
        half=lambda x: x * 2, float=lambda x: x.sum(), promote=lambda a, b: a + b)
    amp.register_half_function(ext, "half")
    amp.register_float_function(ext, "float")
    amp.register_promote_function(ext, "promote")
    try:
        x16, x32 = torch.ones(2, dtype=FP16), torch.ones(2)
        net = nn.Linear(2, 2)
        amp.initialize(net, opt_level="O1", verbosity=0)
        with ampkit.autocast("cpu", FP16):
            assert ext.half(x32).dtype == FP16
            assert ext.float(x16).dtype == FP32
            assert ext.promote(x16, x32).dtype == FP32
            assert ext.promote(x16, x16).dtype == FP16
            with amp.disable_casts():
                assert ext.half(x32).dtype == FP32
                assert torch.mm(x32[None], x32[:, None]).dtype == FP32
        assert ext.half(x32).dtype == FP32  # outside autocast: the plain function
    finally:
        for name in ("half", "float", "promote"):
            unregister_function(ext, name)
    with pytest.raises(ValueError, match="no function named 'missing'"):
        amp.register_half_function(ext, "missing")


def test_registered_function_inside_an_o1_model_forward() -> None:
    helpers = types.SimpleNamespace(norm=lambda h: h / h.norm())

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return helpers.norm(self.lin(x))

    amp.register_float_function(helpers, "norm")
    try:
        net = amp.initialize(Net(), opt_level="O1", verbosity=0)
        assert net(torch.rand(2, 4)).dtype == FP32
    finally:
        unregister_function(helpers, "norm")


# -- differential: O1 is torch.autocast + GradScaler (with apex's 2**24 cap) -----------------

def test_o1_training_equals_torch_autocast_and_grad_scaler() -> None:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    mine = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    mine.load_state_dict(ref.state_dict())
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    opt = torch.optim.SGD(mine.parameters(), lr=0.05, momentum=0.9)
    mine, opt = amp.initialize(mine, opt, opt_level="O1", verbosity=0)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(6):
        x, y = torch.rand(5, 8), torch.randint(0, 4, (5,))
        blow_up = float("inf") if step == 3 else 1.0
        with torch.autocast("cpu", FP16):
            out_ref = ref(x)
        loss_ref = F.cross_entropy(out_ref.float(), y) * blow_up
        opt_ref.zero_grad()
        scaler.scale(loss_ref).backward()
        scaler.step(opt_ref)
        scaler.update()
        loss = F.cross_entropy(mine(x).float(), y) * blow_up
        opt.zero_grad()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        for p, q in zip(mine.parameters(), ref.parameters()):
            assert torch.equal(p, q), step
        assert amp.state_dict()["loss_scaler0"]["loss_scale"] == scaler.get_scale()


# -- a short training run through apex's API only -------------------------------------------

def test_training_on_digits_o2_with_an_injected_overflow() -> None:
    from helpers_models import digits_split

    x_train, y_train, _, _ = digits_split()
    x_train = x_train.flatten(1)
    model = nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    losses = []
    for step in range(30):
        idx = torch.arange(step * 32, step * 32 + 32) % len(y_train)
        loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
        if step == 6:
            loss = loss * float("inf")
        before = [p.detach().clone() for p in [*model.parameters(),
                                               *amp.master_params(optimizer)]]
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        after = [*model.parameters(), *amp.master_params(optimizer)]
        unchanged = all(torch.equal(p, b) for p, b in zip(after, before))
        assert unchanged == (step == 6)
        if step != 6:
            losses.append(loss.item())
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 32768.0, "unskipped": 23}
    assert model[0].weight.dtype == FP32  # the truth; fp16 copies are made on use
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5


def test_o1_follows_the_models_device_when_cuda_is_visible(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # No "CUDA when available" default: a CPU model is cast on a CUDA machine too.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    model = amp.initialize(nn.Sequential(nn.Linear(4, 4)), opt_level="O1", verbosity=0)
    seen = []
    model[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    model(torch.rand(2, 4))
    assert seen == [torch.float16]


# -- apex's own O1 lists, on every device ----------------------------------------------------

class _Computed(nn.Module):
    """Runs ``fn`` and records the dtype it computed (the O1 model hands its floating
    outputs back in fp32: the dtype inside is the one the lists chose)."""

    def __init__(self, fn: object) -> None:
        super().__init__()
        self.fn = fn
        self.seen: list[torch.dtype] = []

    def forward(self, *args: object) -> object:
        out = self.fn(*args)  # type: ignore[operator]
        self.seen += [t.dtype for t in (out if isinstance(out, tuple) else (out,))]
        return out


def _o1_probe(fn: object) -> nn.Module:
    class Probe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = _Computed(fn)

        def forward(self, *args: object) -> object:
            return self.inner(*args)
    return amp.initialize(Probe(), opt_level="O1", verbosity=0)


@pytest.mark.parametrize(("fn", "expected"), [
    (lambda x: torch.softmax(x, -1), FP32),
    (lambda x: F.group_norm(x[None], 2), FP32),
    (lambda x: x ** 2.0, FP32),
    (lambda x: x.sum(), FP32),
    (lambda x: F.layer_norm(x, (4,)), FP32),
    (lambda x: x.cpu(), FP32),             # apex: to float32 before a move to the CPU
])
def test_o1_casts_by_apexs_lists(fn: object, expected: torch.dtype) -> None:
    # apex's lists hold on the CPU too: softmax, norms, pow and reductions in float32,
    # where torch's own CPU autocast list leaves a float16 input as it is.
    probe = _o1_probe(fn)
    probe(torch.rand(4, 4, dtype=FP16))
    assert probe.inner.seen == [expected]


def test_o1_casts_rnn_cells_to_half() -> None:
    lstm = _o1_probe(nn.LSTMCell(4, 4))
    lstm(torch.rand(3, 4), (torch.zeros(3, 4), torch.zeros(3, 4)))
    assert lstm.inner.seen == [FP16, FP16]
    gru = _o1_probe(nn.GRUCell(4, 4))
    gru(torch.rand(3, 4, dtype=FP16), torch.zeros(3, 4))
    assert gru.inner.seen == [FP16]


def test_binary_cross_entropy_is_banned_on_half_inputs() -> None:
    target = torch.rand(3, 4)
    model = _o1_probe(lambda x: F.binary_cross_entropy(x, target))
    with pytest.raises(NotImplementedError, match="BCEWithLogitsLoss"):
        model(torch.rand(3, 4, dtype=FP16))
    assert model(torch.rand(3, 4)).dtype == FP32  # a float32 input is fine
    # allowed through the legacy API (with no other apex handle active): float32
    amp._amp_state.handle._deactivate()
    handle = amp.init(allow_banned=True, device_type="cpu")
    assert nn.BCELoss()(torch.rand(3, 4, dtype=FP16), target).dtype == FP32
    handle._deactivate()


def test_the_newest_handle_decides_whether_banned_functions_run() -> None:
    """apex patched the banned functions again at each amp.init: a handle made with
    allow_banned=True runs them in float32 even while an older one is active."""
    target = torch.rand(3, 4)
    older = amp.init(device_type="cpu")
    newer = amp.init(allow_banned=True, device_type="cpu")
    try:
        assert nn.BCELoss()(torch.rand(3, 4, dtype=FP16), target).dtype == FP32
    finally:
        newer._deactivate()
    try:
        with pytest.raises(NotImplementedError, match="BCEWithLogitsLoss"):
            F.binary_cross_entropy(torch.rand(3, 4, dtype=FP16), target)
    finally:
        older._deactivate()


def test_in_place_float32_list_ops_refuse_half_tensors_under_o1() -> None:
    model = _o1_probe(lambda x: x.clone().exp_())
    with pytest.raises(NotImplementedError, match="in-place exp_"):
        model(torch.rand(4, dtype=FP16))
    assert model(torch.rand(4)).dtype == FP32
    # outside apex's O1 regions in-place ops are torch's own
    with ampkit.autocast("cpu", FP16):
        assert torch.ones(2, dtype=FP16).exp_().dtype == FP16
    assert torch.ones(2, dtype=FP16).exp_().dtype == FP16


# -- the pre-1.0 API: amp.init and its handle ------------------------------------------------

def test_init_opens_o1_until_the_handle_is_deactivated() -> None:
    x = torch.rand(4, 4)
    handle = amp.init(device_type="cpu")
    assert handle.is_active()
    assert ((x @ x).dtype, torch.softmax(x.half(), 0).dtype) == (FP16, FP32)
    with handle._disable_casts():
        assert (x @ x).dtype == FP32
    handle._deactivate()
    handle._deactivate()  # a second call changes nothing
    assert not handle.is_active() and (x @ x).dtype == FP32
    assert amp.init(enabled=False).is_active() is False


def test_legacy_handle_scale_loss_skips_on_overflow() -> None:
    w = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.5)
    handle = amp.init(loss_scale=8.0, device_type="cpu")
    with handle.scale_loss(w.sum(), opt) as scaled:
        assert scaled.item() == 16.0
        scaled.backward()
    assert w.grad is not None and w.grad.tolist() == [1.0, 1.0]
    opt.step()
    assert w.tolist() == [0.5, 0.5]
    opt.zero_grad()
    with handle.scale_loss(w.sum() * float("inf"), opt) as scaled:
        scaled.backward()
    opt.step()  # skipped
    assert w.tolist() == [0.5, 0.5]


def test_wrap_optimizer_scales_each_loss_and_skips_when_any_overflowed() -> None:
    w = nn.Parameter(torch.ones(2))
    handle = amp.init(device_type="cpu")
    opt = handle.wrap_optimizer(torch.optim.SGD([w], lr=0.5), num_loss=2)
    with opt.scale_loss(w.sum()) as scaled:
        scaled.backward()
    with opt.scale_loss(2 * w.sum()) as scaled:
        scaled.backward()
    assert w.grad is not None and w.grad.tolist() == [3.0, 3.0]
    opt.step()
    assert w.tolist() == [-0.5, -0.5]
    opt.zero_grad()
    with opt.scale_loss(w.sum()) as scaled:
        scaled.backward()
    with opt.scale_loss(w.sum() * float("inf")) as scaled:
        scaled.backward()
    opt.step()  # the second loss overflowed
    assert w.tolist() == [-0.5, -0.5]
    assert opt.param_groups[0]["lr"] == 0.5  # everything else is the optimizer's
    with pytest.raises(RuntimeError, match="wrap_optimizer"), handle.scale_loss(
            w.sum(), opt._optimizer):
        pass


# -- arguments apex accepts ------------------------------------------------------------------

class _Larc:
    """apex.parallel.LARC's shape: a wrapper keeping the optimizer as ``.optim``."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optim = optimizer

    @property
    def param_groups(self) -> list[dict]:
        return self.optim.param_groups

    def zero_grad(self) -> None:
        self.optim.zero_grad()

    def step(self) -> None:
        self.optim.step()


@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2", "O3"])
def test_larc_wrapped_optimizers_are_accepted(opt_level: str) -> None:
    net = nn.Linear(2, 1)
    larc = _Larc(torch.optim.SGD(net.parameters(), lr=0.25, momentum=0.125))
    net, opt = amp.initialize(net, larc, opt_level=opt_level, verbosity=0)
    assert opt is larc
    before = [p.detach().clone() for p in amp.master_params(opt)]
    with amp.scale_loss(net(torch.ones(1, 2)).float().sum() * float("inf"), opt) as scaled:
        scaled.backward()
    opt.step()  # an overflow skips the step of the optimizer inside
    if opt_level in ("O1", "O2"):  # dynamic scaling
        assert all(torch.equal(p, b) for p, b in zip(amp.master_params(opt), before))
    opt.zero_grad()
    with amp.scale_loss(net(torch.ones(1, 2)).float().sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert not all(torch.equal(p, b) for p, b in zip(amp.master_params(opt), before))


@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2", "O3"])
def test_a_float16_parameter_is_taken_as_given_when_apex_allows_it(opt_level: str) -> None:
    """_amp_state.allow_incoming_model_not_fp32 with cast_model_type=False (apex's
    multi-model tests): the float16 parameter stays float16 and trains; without the
    switch apex's own check refuses the model."""
    net = nn.Sequential(nn.Linear(2, 3).half())
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match=r"expected torch\.float32"):
        amp.initialize(net, opt, opt_level=opt_level, cast_model_type=False, verbosity=0)
    amp._amp_state.allow_incoming_model_not_fp32 = True
    try:
        net, opt = amp.initialize(net, opt, opt_level=opt_level, cast_model_type=False,
                                  loss_scale=128.0, verbosity=0)
    finally:
        amp._amp_state.allow_incoming_model_not_fp32 = False
    assert net[0].weight.dtype == FP16
    before = net[0].weight.detach().clone()
    with amp.scale_loss(net(torch.ones(1, 2, dtype=FP16)).float().sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert net[0].weight.dtype == FP16 and not torch.equal(net[0].weight, before)
    if amp._amp_state.handle is not None:
        amp._amp_state.handle._deactivate()


def test_o3_state_dict_holds_float32_as_apex_did() -> None:
    """apex's state_dict holds float32 wherever it casts the model (O2, O3); at O2 the
    fp32 parameters are the truth anyway."""
    net = amp.initialize(_net(), opt_level="O3", verbosity=0)
    assert {v.dtype for k, v in net.state_dict().items() if v.is_floating_point()} == {FP32}
    assert {p.dtype for p in net.parameters()} == {FP16}  # the truth stays float16


@pytest.mark.parametrize("opt_level", ["O0", "O1", "O3"])
def test_cast_model_type_false_leaves_the_model_as_it_is(opt_level: str) -> None:
    net = _net()
    net = amp.initialize(net, opt_level=opt_level, cast_model_type=False, verbosity=0)
    assert {p.dtype for p in net.parameters()} == {FP32}
    assert amp._amp_state.opt_properties.cast_model_type is False


# -- amp._amp_state ---------------------------------------------------------------------------

def test_amp_state_shows_the_loss_scalers_under_apexs_names() -> None:
    net = nn.Linear(2, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net, opt = amp.initialize(net, opt, opt_level="O1", num_losses=2, verbosity=0)
    scalers = amp._amp_state.loss_scalers
    assert [s.loss_scale() for s in scalers] == [65536.0, 65536.0]
    scalers[1]._loss_scale = 16.0  # apex's own tests set it this way
    assert amp.state_dict()["loss_scaler1"]["loss_scale"] == 16.0
    assert amp._amp_state.opt_properties.loss_scale == "dynamic"
    assert isinstance(amp._amp_state.handle, amp.AmpHandle)
    amp._amp_state.handle._deactivate()
    assert amp._amp_state.handle is None


# -- the core pieces apex's refusals use -----------------------------------------------------

def test_refuse_low_rule_holds_only_under_its_policy() -> None:
    ns = types.SimpleNamespace(f=lambda x: x * 2)
    register_function(ns, "f", CastRule.REFUSE_LOW, message="no half here",
                      policy="apex-O1")
    try:
        half = torch.ones(2, dtype=FP16)
        with ampkit.autocast("cpu", FP16, policy="apex-O1"):
            with pytest.raises(NotImplementedError, match="no half here"):
                ns.f(half)
            assert ns.f(torch.ones(2)).dtype == FP32  # nothing is cast
        with (ampkit.autocast("cpu", FP16, policy="apex-O1", custom_black_list={"mm"}),
              pytest.raises(NotImplementedError)):
            ns.f(half)
        with ampkit.autocast("cpu", FP16):  # another policy
            assert ns.f(half).dtype == FP16
    finally:
        unregister_function(ns, "f")
    with pytest.raises(ValueError, match="message is the error text of"):
        register_function(ns, "f", CastRule.FP32, message="why")


def test_initialize_replaces_the_loss_scalers_as_apex_does() -> None:
    # apex's loss scalers are process-wide: a second amp.initialize resets them, and
    # scale_loss uses the latest ones even with the first run's optimizer. (The core's
    # initialize keeps each run's own: the dialect asks for apex's behaviour.)
    nets = [_net(), _net()]
    opts = [torch.optim.SGD(n.parameters(), lr=0.1) for n in nets]
    amp.initialize(nets[0], opts[0], opt_level="O2", verbosity=0)

    def overflow() -> None:
        opts[0].zero_grad()
        loss = nets[0](torch.rand(2, 6)).float().sum() * float("inf")
        with amp.scale_loss(loss, opts[0]) as scaled:
            scaled.backward()
        opts[0].step()

    overflow()
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 2.0 ** 15
    amp.initialize(nets[1], opts[1], opt_level="O2", verbosity=0)
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 2.0 ** 16  # reset, as apex
    overflow()  # the first run's optimizer, the new (latest) scaler
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 2.0 ** 15
    assert amp._amp_state.loss_scalers[0].loss_scale() == 2.0 ** 15
