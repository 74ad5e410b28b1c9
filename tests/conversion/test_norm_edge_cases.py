"""Edge cases of the O2 kept-fp32 norms that take the low-precision activation as it
is (:data:`ampkit.conversion.MIXED_INPUT_NORMS`, LayerNorm on CPU): modes, options,
layouts, autograd variants, checkpoints, subclasses and torch.compile.

Oracle everywhere: an unconverted copy of the same norm run in float32 on an fp32
copy of the input (rounded once to the low dtype afterwards), or in float64; never
the code under test."""

import copy

import pytest
import torch
import torch.nn as nn

from ampkit.front_door import convert_model

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
DTYPES = [BF16, FP16]


def _randomize(norm):
    with torch.no_grad():
        for p in norm.parameters():
            p.copy_(torch.randn_like(p))
        if getattr(norm, "running_mean", None) is not None:
            norm.running_mean.normal_()
            norm.running_var.uniform_(0.5, 2.0)
    return norm


def _pair(make, dtype, train=True):
    """(converted norm, fp32 reference copy); the converted one through its own
    boundary, as in a model."""
    torch.manual_seed(2)
    norm = _randomize(make())
    reference = copy.deepcopy(norm)
    norm.train(train), reference.train(train)
    convert_model(nn.Sequential(norm), "O2", dtype)
    return norm, reference


def _run(norm, reference, x, dtype, *, input_grad=True):
    """Forward and backward of both; returns (out, expected, x grads)."""
    grad = torch.randn(x.shape).to(dtype)
    xa = x.detach().clone().requires_grad_(input_grad)
    xb = x.detach().clone().requires_grad_(input_grad)
    out = norm(xa)
    expected = reference(xb.float()).to(dtype)
    out.backward(grad)
    expected.backward(grad)
    return out, expected, xa.grad, xb.grad


def _assert_matches(norm, reference, out, expected, ga, gb, dtype):
    assert out.dtype is dtype
    # Rounded once from fp32 either way (a rare last-bit difference where the kernels
    # sum in another order): the dtype's default tolerances.
    torch.testing.assert_close(out, expected)
    if gb is None:
        assert ga is None
    else:
        assert ga.dtype is dtype
        torch.testing.assert_close(ga, gb)
    for (name, mine), theirs in zip(norm.named_parameters(), reference.parameters()):
        assert mine.dtype is FP32, name
        assert theirs.grad is not None, name
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-5, atol=1e-5)
    for (name, mine), theirs in zip(norm.named_buffers(), reference.buffers()):
        assert mine.dtype is theirs.dtype, name
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-6)


CASES = {
    "bn1d-NC": (lambda: nn.BatchNorm1d(4), (16, 4)),
    "bn1d-NCL": (lambda: nn.BatchNorm1d(4), (6, 4, 5)),
    "bn2d-no-affine": (lambda: nn.BatchNorm2d(3, affine=False), (4, 3, 3, 3)),
    "bn2d-no-stats": (lambda: nn.BatchNorm2d(3, track_running_stats=False), (4, 3, 3, 3)),
    "bn2d-bare": (lambda: nn.BatchNorm2d(3, affine=False, track_running_stats=False),
                  (4, 3, 3, 3)),
    "bn2d-cumulative": (lambda: nn.BatchNorm2d(3, momentum=None), (4, 3, 3, 3)),
    "bn3d": (lambda: nn.BatchNorm3d(3), (2, 3, 2, 3, 3)),
    "gn-no-affine": (lambda: nn.GroupNorm(2, 4, affine=False), (3, 4, 5)),
    "in1d-stats-no-affine": (lambda: nn.InstanceNorm1d(3, track_running_stats=True),
                             (2, 3, 7)),
    "in1d": (lambda: nn.InstanceNorm1d(3), (2, 3, 7)),
    "in2d-affine": (lambda: nn.InstanceNorm2d(3, affine=True), (2, 3, 4, 4)),
    "in3d-stats": (lambda: nn.InstanceNorm3d(3, affine=True, track_running_stats=True),
                   (2, 3, 2, 3, 3)),
    "ln-no-affine": (lambda: nn.LayerNorm(6, elementwise_affine=False), (4, 6)),
    "ln-no-bias": (lambda: nn.LayerNorm(6, bias=False), (4, 6)),
    "ln-2d-shape": (lambda: nn.LayerNorm((3, 4)), (5, 3, 4)),
}


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_options_and_modes_match_fp32(case, dtype, train):
    make, shape = CASES[case]
    norm, reference = _pair(make, dtype, train)
    x = (torch.randn(shape) * 3 + 1).to(dtype)
    for _ in range(2):  # two steps: running statistics and num_batches_tracked move twice
        out, expected, ga, gb = _run(norm, reference, x, dtype)
    _assert_matches(norm, reference, out, expected, ga, gb, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_norm_eval_batch_of_one_and_train_refuses_it_like_torch(dtype):
    norm, reference = _pair(lambda: nn.BatchNorm1d(5), dtype, train=False)
    x = torch.randn(1, 5).to(dtype)
    _assert_matches(norm, reference, *_run(norm, reference, x, dtype), dtype)
    norm.train()
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        norm(x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_num_batches_tracked_and_running_stat_dtypes_after_steps(dtype):
    norm, reference = _pair(lambda: nn.BatchNorm2d(3, momentum=None), dtype)
    for step in range(3):
        x = (torch.randn(4, 3, 2, 2) * (step + 1)).to(dtype)
        _run(norm, reference, x, dtype)
    assert norm.num_batches_tracked.dtype is torch.int64
    assert norm.num_batches_tracked.item() == 3
    assert norm.running_mean.dtype is FP32 and norm.running_var.dtype is FP32
    torch.testing.assert_close(norm.running_mean, reference.running_mean, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(norm.running_var, reference.running_var, rtol=1e-6, atol=1e-6)


LAYOUTS = {
    "channels_last": (lambda: nn.BatchNorm2d(4), (3, 4, 5, 5),
                      lambda x: x.contiguous(memory_format=torch.channels_last)),
    "channels_last_3d": (lambda: nn.BatchNorm3d(4), (2, 4, 2, 3, 3),
                         lambda x: x.contiguous(memory_format=torch.channels_last_3d)),
    "bn-transposed": (lambda: nn.BatchNorm1d(4), (3, 5, 4),  # (N, L, C) -> (N, C, L)
                      lambda x: x.transpose(1, 2)),
    "bn1d-NC-transposed": (lambda: nn.BatchNorm1d(4), (4, 16), lambda x: x.t()),
    "gn-transposed": (lambda: nn.GroupNorm(2, 4), (3, 5, 4), lambda x: x.transpose(1, 2)),
    "in-sliced": (lambda: nn.InstanceNorm1d(4, affine=True), (2, 4, 12),
                  lambda x: x[..., ::2]),
    "ln-transposed": (lambda: nn.LayerNorm(4), (4, 6), lambda x: x.t()),
    "ln-sliced": (lambda: nn.LayerNorm(4), (5, 8), lambda x: x[:, ::2]),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_channels_last_and_non_contiguous_inputs_match_fp32(layout, dtype):
    make, shape, view = LAYOUTS[layout]
    norm, reference = _pair(make, dtype)
    x = view((torch.randn(shape) * 3 + 1).to(dtype))
    assert not x.is_contiguous()
    _assert_matches(norm, reference, *_run(norm, reference, x, dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["bn1d-NCL", "in2d-affine", "ln-2d-shape"])
def test_weight_needs_grad_while_the_input_does_not(case, dtype):
    make, shape = CASES[case]
    norm, reference = _pair(make, dtype)
    x = (torch.randn(shape) * 3 + 1).to(dtype)
    out, expected, ga, gb = _run(norm, reference, x, dtype, input_grad=False)
    _assert_matches(norm, reference, out, expected, ga, gb, dtype)


@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["bn2d-cumulative", "gn-no-affine", "in3d-stats",
                                  "ln-no-bias"])
def test_no_grad_and_inference_mode_forward(case, dtype, grad_mode):
    make, shape = CASES[case]
    norm, reference = _pair(make, dtype)
    x = (torch.randn(shape) * 3 + 1).to(dtype)
    with grad_mode():
        out = norm(x)
        expected = reference(x.float()).to(dtype)
    assert out.dtype is dtype and not out.requires_grad
    torch.testing.assert_close(out, expected)
    for mine, theirs in zip(norm.buffers(), reference.buffers()):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-6)


def _double_backward(module, x):
    """A loss with a gradient penalty, the usual reason for create_graph=True:
    loss = sum(r * out) + sum(s * d(sum(r * out))/dx); its gradients with respect to
    the input and the weight."""
    torch.manual_seed(5)
    r, s = torch.randn(x.shape, dtype=torch.float64), torch.randn(x.shape, dtype=torch.float64)
    x = x.detach().clone().requires_grad_()
    task = (module(x).double() * r).sum()
    (gx,) = torch.autograd.grad(task, x, create_graph=True)
    return torch.autograd.grad(task + (gx.double() * s).sum(), [x, module.weight])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["bn1d-NCL", "gn", "in2d-affine", "ln", "ln-2d-shape"])
def test_double_backward_matches_float64_or_refuses(case, dtype):
    # "ln": the incoming gradient is a constant (the task loss is linear in the
    # output), where a once_differentiable backward returns a gradient without history:
    # the penalty then silently contributes nothing to the weight and input gradients.
    make, shape = {"bn1d-NCL": CASES["bn1d-NCL"],
                   "gn": (lambda: nn.GroupNorm(2, 4), (3, 4, 5)),
                   "in2d-affine": CASES["in2d-affine"],
                   "ln": (lambda: nn.LayerNorm(6), (4, 6)),
                   "ln-2d-shape": CASES["ln-2d-shape"]}[case]
    norm, reference = _pair(make, dtype)
    exact = copy.deepcopy(reference).double()
    x = (torch.randn(shape) * 3 + 1).to(dtype)
    try:
        gx, gw = _double_backward(norm, x)
    except RuntimeError as error:  # refusing is acceptable; silently wrong is not
        assert "differentiable" in str(error), error
        return
    ex, ew = _double_backward(exact, x.double())
    assert gx.dtype is dtype and gw.dtype is FP32
    # The first gradient is rounded to the low dtype before the second one sees it:
    # a few of its ulps, far from a missing term or a low-precision sum.
    for mine, truth in ((gx, ex), (gw, ew)):
        assert ((mine.double() - truth).abs().max() / truth.abs().max()).item() < 0.03


@pytest.mark.parametrize(("model_dtype", "input_dtype"), [(BF16, FP16), (FP16, BF16)])
def test_an_input_in_the_other_low_dtype_is_rounded_once(model_dtype, input_dtype):
    # Called directly with the other low dtype, the norm must not compute in that
    # dtype and round again to the model's: fp16 would overflow here, and bf16 would
    # lose fp16's 3 extra bits.
    norm, reference = _pair(lambda: nn.BatchNorm1d(4), model_dtype, train=False)
    with torch.no_grad():
        for module in (norm, reference):
            module.running_var.fill_(1e-9)
            module.eps = 1e-12
    x = (torch.randn(8, 4) * 3).to(input_dtype)
    scale = 1e3 if model_dtype is BF16 else 1e-3  # BF16 model: out of fp16's range
    with torch.no_grad():
        norm.weight.mul_(scale), reference.weight.mul_(scale)
        out = norm(x)
        expected = reference(x.float()).to(model_dtype)
    assert out.dtype is model_dtype
    torch.testing.assert_close(out, expected)


def test_state_dict_round_trip_keeps_fp32_norm_state():
    import ampkit

    torch.manual_seed(6)
    model = ampkit.convert_model(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4),
                                               nn.LayerNorm(4)), "O2", BF16)
    for _ in range(2):
        model(torch.randn(8, 4)).float().sum().backward()
    state = model.state_dict()
    assert state["1.running_mean"].dtype is FP32 and state["1.running_var"].dtype is FP32
    assert state["1.num_batches_tracked"].item() == 2
    assert state["1.weight"].dtype is FP32 and state["2.weight"].dtype is FP32
    fresh = ampkit.convert_model(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4),
                                               nn.LayerNorm(4)), "O2", BF16)
    fresh.load_state_dict(state)
    for (name, mine), theirs in zip(fresh.state_dict().items(), state.values()):
        assert mine.dtype is theirs.dtype and torch.equal(mine, theirs), name
    plain = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.LayerNorm(4))
    plain.load_state_dict(state)  # an O2 checkpoint loads into an fp32 model
    x = torch.randn(8, 4)
    model.eval(), fresh.eval(), plain.eval()
    torch.testing.assert_close(fresh(x), model(x), rtol=0, atol=0)


class _SubInstanceNorm(nn.InstanceNorm1d):
    pass


class _SubLayerNorm(nn.LayerNorm):
    pass


class _SubGroupNorm(nn.GroupNorm):
    pass


class _OwnNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return torch.nn.functional.layer_norm(x, (4,), self.weight)


@pytest.mark.parametrize("make", [lambda: _SubInstanceNorm(4, affine=True),
                                  lambda: _SubLayerNorm(4), lambda: _SubGroupNorm(2, 4),
                                  _OwnNorm], ids=["instance", "layer", "group", "own"])
def test_subclasses_and_own_kept_modules_get_an_fp32_input(make):
    import ampkit

    seen = []
    model = nn.Sequential(nn.Linear(4, 4), make())
    model[1].register_forward_pre_hook(lambda m, a: seen.append(a[0].dtype))
    ampkit.convert_model(model, "O2", BF16, keep_fp32_modules=(type(model[1]),))
    assert model[1].weight.dtype is FP32
    out = model(torch.randn(3, 4, 4))
    assert seen == [FP32] and out.dtype is FP32


def test_torch_compile_of_an_o2_model_with_these_norms_matches_eager():
    import ampkit

    def make():
        torch.manual_seed(7)
        return ampkit.convert_model(
            nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.LayerNorm(6),
                          nn.GroupNorm(2, 6), nn.Linear(6, 2)), "O2", BF16)

    eager, inner = make(), make()
    compiled = torch.compile(inner, backend="aot_eager")
    x = torch.randn(8, 4)
    for _ in range(2):  # the second step sees the first one's running statistics
        out, expected = compiled(x), eager(x)
        out.float().pow(2).sum().backward()
        expected.float().pow(2).sum().backward()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    for (name, mine), theirs in zip(inner.named_parameters(), eager.parameters()):
        assert mine.dtype is theirs.dtype, name
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-6, atol=1e-6)
    for (name, mine), theirs in zip(inner.named_buffers(), eager.buffers()):
        assert mine.dtype is theirs.dtype, name
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
