"""ampkit.initialize: shapes, several models and optimizers, overrides and refusals, loss
scaling set-up, wrapped models, checkpoint and resume bit for bit."""

import copy
import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers_models import DigitsCNN, TinyTransformer

import ampkit
from ampkit.conversion import NORM_MODULES, get_conversion
from ampkit.front_door import INITIALIZE_OVERRIDES, initialize
from ampkit.scaling import loss_scaling

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.fixture(autouse=True)
def _fresh_loss_scaling():
    loss_scaling.configure_loss_scaling("dynamic")  # undo what a test configured
    yield
    loss_scaling.configure_loss_scaling("dynamic")


def test_public_name():
    assert ampkit.initialize is initialize


def test_returns_models_and_optimizers_in_the_shape_given():
    model = nn.Linear(2, 2)
    assert initialize(model, level="O0") is model
    model, opt = nn.Linear(2, 2), None
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = initialize(model, opt, level="O1", dtype=BF16)
    assert isinstance(out, tuple) and out[0] is model and out[1] is opt
    models = [nn.Linear(2, 2), nn.Linear(2, 2)]
    opts = (torch.optim.SGD(models[0].parameters(), lr=0.1),
            torch.optim.Adam(models[1].parameters(), lr=0.1))
    got_models, got_opts = initialize(models, opts, level="O2", dtype=BF16)
    assert isinstance(got_models, list) and isinstance(got_opts, tuple)
    assert all(a is b for a, b in zip(got_models, models))
    assert all(a is b for a, b in zip(got_opts, opts))
    # the parameters are the truth at O2: the optimizers come back untouched
    assert [type(o) for o in got_opts] == [torch.optim.SGD, torch.optim.Adam]


def test_one_optimizer_over_several_models():
    encoder, decoder = nn.Linear(3, 4), nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 2))
    opt = torch.optim.AdamW([*encoder.parameters(), *decoder.parameters()], lr=1e-3)
    (encoder, decoder), opt = initialize([encoder, decoder], opt, level="O2", dtype=BF16)
    params = [p for g in opt.param_groups for p in g["params"]]
    assert [p.dtype for p in params] == [FP32] * 6
    assert params[0] is encoder.weight and params[2] is decoder[0].weight
    before = encoder.weight.detach().clone()
    out = decoder(encoder(torch.rand(5, 3)))
    assert out.dtype is FP32
    out.sum().backward()
    assert encoder.weight.grad.dtype is FP32
    opt.step()
    assert not torch.equal(encoder.weight, before)


@pytest.mark.parametrize("level", ["O0", "O1", "O3"])
def test_levels_without_master_weights_leave_the_optimizer(level):
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = initialize(model, opt, level=level, dtype=BF16)
    assert type(opt) is torch.optim.SGD
    assert opt.param_groups[0]["params"][0] is model.weight


def test_o1_forward_is_native_autocast_bit_for_bit_and_trains():
    torch.manual_seed(0)
    model = DigitsCNN()
    reference = copy.deepcopy(model)
    x = torch.rand(6, 1, 8, 8)
    model = initialize(model, level="O1", dtype=BF16)
    with torch.autocast("cpu", BF16):
        expected = reference(x)
    got = model(x)
    assert torch.equal(got, expected)
    got.float().sum().backward()
    expected.float().sum().backward()
    for p, r in zip(model.parameters(), reference.parameters()):
        assert p.grad.dtype is FP32 and torch.equal(p.grad, r.grad)


def test_overrides_reach_the_conversion():
    model = DigitsCNN()
    with pytest.warns(FutureWarning, match="keep_batchnorm_fp32 is deprecated; pass "
                                           "keep_norms_fp32"):
        initialize(model, level="O2", dtype=BF16, keep_batchnorm_fp32=False,
                   keep_fp32_modules=["classifier.3"], cast_model_outputs=BF16,
                   custom_black_list=["relu"])
    config = get_conversion(model)
    assert NORM_MODULES[0] not in config.keep_fp32_modules  # the apex spelling was honoured
    assert "classifier.3" in config.keep_fp32_modules
    assert config.policy.rule_for("relu") == "fp32"
    assert model(torch.rand(2, 1, 8, 8)).dtype is BF16


def test_patch_torch_functions_alias():
    with pytest.warns(FutureWarning, match="pass patch_ops"):
        model = initialize(nn.Linear(2, 2), level="O2", dtype=BF16,
                           patch_torch_functions=False)
    assert get_conversion(model).policy is None


def test_alias_and_name_together_is_an_error():
    with pytest.raises(ValueError, match="keep_batchnorm_fp32 and keep_norms_fp32 are the same"):
        initialize(nn.Linear(2, 2), level="O2", keep_batchnorm_fp32=True, keep_norms_fp32=True)


def test_unknown_override_is_named_and_the_accepted_listed():
    with pytest.raises(TypeError, match=r"unknown overrides \['opt_level'\]; accepted: "
                                        r"\['policy', "):
        initialize(nn.Linear(2, 2), level="O2", opt_level="O2")
    assert "keep_batchnorm_fp32" in INITIALIZE_OVERRIDES and "num_losses" in INITIALIZE_OVERRIDES


@pytest.mark.parametrize(("level", "overrides", "message"), [
    ("O1", {"cast_model_type": FP16}, "O1 keeps fp32 parameters"),
    ("O1", {"keep_norms_fp32": True}, "keep_norms_fp32 must be None"),
    ("O1", {"master_weights": True}, "nothing for master_weights to copy"),
    ("O3", {"patch_ops": True}, "use level O2"),
    ("O0", {"patch_ops": True}, "use level O1"),
    ("O3", {"policy": "conservative"}, "patch_ops=False does not do"),
    ("O2", {"loss_scale": "auto"}, "loss_scale must be 'dynamic'"),
])
def test_nonsensical_overrides_are_refused_and_nothing_changes(level, overrides, message):
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=message):
        initialize(model, opt, level=level, dtype=FP16, **overrides)
    assert model.weight.dtype is FP32 and get_conversion(model) is None
    assert type(opt) is torch.optim.SGD


def test_unknown_level_and_dtype():
    with pytest.raises(ValueError, match=r"level must be one of \['O0', 'O1', 'O2', 'O3'\]"):
        initialize(nn.Linear(2, 2), level="O9")
    with pytest.raises(ValueError, match=r"dtype must be torch.float16 or torch.bfloat16"):
        initialize(nn.Linear(2, 2), level="O2", dtype="float64")


@pytest.mark.parametrize("bad", [None, "model", [nn.Linear(2, 2), 3], [], torch.ones(1)])
def test_models_must_be_modules(bad):
    with pytest.raises(TypeError, match=r"models must be a torch.nn.modules.module.Module"):
        initialize(bad, level="O2")


def test_optimizers_must_be_optimizers():
    with pytest.raises(TypeError, match=r"optimizers must be a torch.optim.optimizer.Optimizer"):
        initialize(nn.Linear(2, 2), [object()], level="O2")


def test_optimizer_over_parameters_outside_the_models_is_refused():
    model, other = nn.Linear(2, 2), nn.Linear(2, 2)
    opt = torch.optim.SGD([*model.parameters(), *other.parameters()], lr=0.1)
    with pytest.raises(ValueError, match=r"param_groups\[0\] holds a parameter of shape "
                                         r"\(2, 2\) that is in none of the models given"):
        initialize(model, opt, level="O2", dtype=BF16)
    assert model.weight.dtype is FP32 and type(opt) is torch.optim.SGD


def test_second_model_failing_leaves_the_first_unconverted():
    good, bad = nn.Linear(2, 2), nn.Linear(2, 2).half()
    with pytest.raises(ValueError, match="expects an fp32 model"):
        initialize([good, bad], level="O2", dtype=BF16)
    assert good.weight.dtype is FP32 and get_conversion(good) is None


def test_wrapped_model_says_to_initialize_first():
    with pytest.raises(RuntimeError, match=r"models\[1\] is wrapped in DataParallel; call "
                                           r"ampkit.initialize"):
        initialize([nn.Linear(2, 2), nn.DataParallel(nn.Linear(2, 2))], level="O2")


def test_ddp_wrapped_model_says_to_initialize_first(tmp_path):
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel(nn.Linear(2, 2))
        with pytest.raises(RuntimeError, match=r"wrapped in DistributedDataParallel; call "
                                               r"ampkit.initialize / convert_model on the bare "
                                               r"model first, then wrap"):
            initialize(ddp, level="O2", dtype=BF16)
    finally:
        dist.destroy_process_group()


def test_fsdp2_sharded_model_says_to_initialize_first(tmp_path):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = nn.Sequential(nn.Linear(2, 2))
        fully_shard(model)
        with pytest.raises(RuntimeError, match=r"wrapped in FSDP2 \(fully_shard\); call "
                                               r"ampkit.initialize / convert_model on the "
                                               r"bare model first, then shard the result "
                                               r"\(ampkit.fsdp.fully_shard"):
            initialize(model, level="O2", dtype=BF16)
    finally:
        dist.destroy_process_group()


def test_calling_again_with_the_same_settings_changes_nothing():
    model = DigitsCNN()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model, opt = initialize(model, opt, level="O2", dtype=BF16)
    groups = [list(g["params"]) for g in opt.param_groups]
    model2, opt2 = initialize(model, opt, level="O2", dtype=BF16)
    assert model2 is model and opt2 is opt
    assert [list(g["params"]) for g in opt.param_groups] == groups
    with pytest.raises(RuntimeError, match="already converted with different settings"):
        initialize(model, level="O3", dtype=BF16)


# -- loss scaling ---------------------------------------------------------------------------

def test_fp16_levels_configure_dynamic_loss_scaling():
    initialize(nn.Linear(2, 2), level="O2", dtype=FP16, num_losses=2, min_scale=4.0,
               max_scale=2.0 ** 20)
    config = loss_scaling._current_state().config
    assert config.loss_scale == "dynamic" and config.num_losses == 2
    assert config.min_scale == 4.0 and config.max_scale == 2.0 ** 20
    assert loss_scaling.loss_scaler(1).get_scale() == 2.0 ** 16


def test_static_loss_scale_override():
    initialize(nn.Linear(2, 2), level="O1", dtype=FP16, loss_scale=128.0)
    assert loss_scaling.loss_scaler(0).get_scale() == 128.0
    assert loss_scaling._current_state().config.loss_scale == 128.0


def test_bf16_levels_do_not_configure_loss_scaling():
    loss_scaling.configure_loss_scaling(64.0)
    initialize(nn.Linear(2, 2), level="O2", dtype=BF16)
    assert loss_scaling._current_state().config.loss_scale == 64.0  # left as it was
    initialize(nn.Linear(2, 2), level="O2", dtype=BF16, num_losses=3)
    config = loss_scaling._current_state().config
    assert config.loss_scale is None and config.num_losses == 3


def test_fp16_o2_trains_with_scale_loss():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = initialize(model, opt, level="O2", dtype=FP16)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    losses = []
    for _ in range(20):
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        with ampkit.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]
    assert model[0].weight.dtype is FP32  # the truth; fp16 copies are made on use


# -- checkpoint and resume -------------------------------------------------------------------

def _batches(steps):
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, 64, (4, 13), generator=gen) for _ in range(steps)]


def _step(model, opt, ids, dtype):
    logits = model(ids[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    opt.zero_grad()
    if dtype is FP16:
        with ampkit.scale_loss(loss, opt) as scaled:
            scaled.backward()
    else:
        loss.backward()
    opt.step()
    return loss.detach()


def _fresh(seed, dtype):
    torch.manual_seed(seed)
    model = TinyTransformer()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    model, opt = initialize(model, opt, level="O2", dtype=dtype)
    return model, opt, sched


def _save(model, opt, sched):
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                "sched": sched.state_dict(),
                "scaling": loss_scaling.loss_scaling_state_dict()}, buffer)
    buffer.seek(0)
    return buffer


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_save_at_step_k_reload_and_continue_bit_for_bit(dtype):
    batches, k = _batches(6), 3
    model, opt, sched = _fresh(0, dtype)
    straight = []
    for ids in batches:
        straight.append(_step(model, opt, ids, dtype))
        sched.step()
    final = ({n: t.clone() for n, t in model.state_dict().items()},
             [p.detach().clone() for p in model.parameters()])

    model, opt, sched = _fresh(0, dtype)
    resumed = []
    for ids in batches[:k]:
        resumed.append(_step(model, opt, ids, dtype))
        sched.step()
    checkpoint = torch.load(_save(model, opt, sched))
    assert checkpoint["model"]["embed.weight"].dtype is FP32  # the parameters, exact
    model, opt, sched = _fresh(123, dtype)  # a different init, all overwritten by the load
    model.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["opt"])
    sched.load_state_dict(checkpoint["sched"])
    loss_scaling.load_loss_scaling_state_dict(checkpoint["scaling"])
    for ids in batches[k:]:
        resumed.append(_step(model, opt, ids, dtype))
        sched.step()
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed))
    for name, value in model.state_dict().items():
        assert torch.equal(value, final[0][name]), name
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), final[1]))


def test_o2_checkpoint_loads_into_a_plain_fp32_model_and_back():
    model, opt, _ = _fresh(0, BF16)
    for ids in _batches(2):
        _step(model, opt, ids, BF16)
    plain = TinyTransformer()
    plain.load_state_dict(model.state_dict())
    for name, p in plain.named_parameters():
        assert torch.equal(p, model.get_parameter(name)), name
    again, _, _ = _fresh(5, BF16)
    again.load_state_dict(plain.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(),
                                                plain.state_dict().values()))


# -- deferred initialisation: a model on the meta device ------------------------------------

def _meta_net() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 4),
                         nn.LayerNorm(4))


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_meta_model_with_dtype_none_converts_then_materialises(level):
    # dtype=None on a meta model used to fail inside torch ("unsupported scalarType").
    # It takes the default of the device a None device means (CPU here), and after
    # to_empty() + load_state_dict it is the model initialised normally, bit for bit.
    torch.manual_seed(0)
    ref = initialize(_meta_net(), level=level, dtype=None)
    with torch.device("meta"):
        deferred = _meta_net()
    deferred = initialize(deferred, level=level, dtype=None)
    deferred.to_empty(device="cpu")
    deferred.load_state_dict(ref.state_dict())
    assert [(n, t.dtype) for n, t in deferred.state_dict().items()] == [
        (n, t.dtype) for n, t in ref.state_dict().items()]
    x = torch.randn(5, 6)
    outs = []
    for model in (ref, deferred):
        out = model(x)
        out.float().square().sum().backward()
        outs.append((out, [p.grad for p in model.parameters()]))
    (a, ga), (b, gb) = outs
    assert a.dtype == b.dtype and torch.equal(a, b)
    assert all(torch.equal(g, h) for g, h in zip(ga, gb))


# -- each run's loss scalers are its own -----------------------------------------------------

def _overflowing_step(net, opt):
    # An fp16 O1 step whose loss is inf: every gradient overflows, the step is skipped.
    opt.zero_grad()
    loss = net(torch.ones(2, 4)).float().sum() * float("inf")
    with ampkit.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()


def test_a_second_initialize_leaves_the_first_runs_scalers_alone():
    # Native reference: torch's GradScaler over the same two overflowing steps.
    ref = torch.amp.GradScaler("cpu")
    w = nn.Parameter(torch.ones(1))
    ref_opt = torch.optim.SGD([w], lr=0.1)
    for _ in range(2):
        ref.scale(w.sum() * float("inf")).backward()
        ref.step(ref_opt)
        ref.update()
        ref_opt.zero_grad()
    nets = [nn.Linear(4, 4), nn.Linear(4, 4)]
    opts = [torch.optim.SGD(n.parameters(), lr=0.1) for n in nets]
    initialize(nets[0], opts[0], level="O1", dtype=FP16)
    _overflowing_step(nets[0], opts[0])
    initialize(nets[1], opts[1], level="O1", dtype=FP16)  # a second run: its own scalers
    _overflowing_step(nets[0], opts[0])
    # The first run's scale went on from where it was (two back-offs, as torch's).
    first = loss_scaling.loss_scaler(0, optimizer=opts[0]).get_scale()
    assert first == ref.get_scale() == 2.0 ** 14
    assert loss_scaling.loss_scaler(0, optimizer=opts[1]).get_scale() == 2.0 ** 16
    # Without the optimizer, the latest set-up's scale (2**16) would be a scale the first
    # run's training does not use (2**14): which one is meant cannot be told.
    with pytest.raises(ValueError, match=r"^loss_scaler\(0\): 2 loss-scaling set-ups are "
                                         r"live .* loss_scaler\(0, optimizer=opt\)$"):
        loss_scaling.loss_scaler(0)
    loss = nets[0](torch.ones(2, 4)).float().sum() + nets[1](torch.ones(2, 4)).float().sum()
    with pytest.raises(ValueError, match=r"different ampkit\.initialize"), \
            ampkit.scale_loss(loss, opts):
        pass


def test_a_dropped_set_up_in_a_reference_cycle_is_not_live_for_loss_scaler() -> None:
    # An optimizer the program no longer holds, kept only by a reference cycle until the
    # collector runs, must not make loss_scaler(i) refuse as if two runs were training.
    import gc

    def train_once_and_drop() -> None:
        net = nn.Linear(2, 2)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        opt.cycle = opt  # freed only by the collector
        initialize(net, opt, level="O1", dtype=FP16, init_scale=64.0)

    gc.disable()
    try:
        train_once_and_drop()
        net = nn.Linear(2, 2)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        initialize(net, opt, level="O1", dtype=FP16, init_scale=128.0)
        assert loss_scaling.loss_scaler(0).get_scale() == 128.0
    finally:
        gc.enable()
