"""O2 moves fewer cast bytes than native autocast, and the kept-fp32 norms
that take the low-precision activation as it is keep fp32 numerics.

Oracles: native ``torch.autocast`` training of the same model (cast traffic), and the
norm computed the old way, on an fp32 copy of the input (numerics), and float64."""

import contextlib
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers_models import DigitsCNN, TinyTransformer

import ampkit
from ampkit.conversion import MIXED_INPUT_NORMS
from ampkit.conversion.parameter_casts import reuse_casts
from ampkit.front_door import convert_model
from ampkit.tools.ops.cast_traffic import count_casts

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _batch(model):
    torch.manual_seed(1)
    if isinstance(model, DigitsCNN):
        y = torch.randint(0, 10, (16,))
        return torch.rand(16, 1, 8, 8), lambda out: F.cross_entropy(out.float(), y)
    ids = torch.randint(0, 64, (4, 17))
    return ids[:, :-1], lambda out: F.cross_entropy(out.float().flatten(0, 1),
                                                    ids[:, 1:].flatten())


def _step_traffic(make, mode, dtype, accumulate=1, reuse=False):
    """(cast traffic of the forwards alone, of one whole training step) after a warm-up
    step: ``accumulate`` micro-batches, each a forward and a backward (scaled for
    float16), then one AdamW step and zero_grad; ``reuse``: the forwards in one
    :func:`~ampkit.conversion.parameter_casts.reuse_casts` block."""
    torch.manual_seed(0)
    model = make()
    x, loss_fn = _batch(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = None
    if mode == "native":
        def forward(x):
            with torch.autocast("cpu", dtype):
                return model(x)
        if dtype is FP16:
            scaler = torch.amp.GradScaler("cpu")
    else:
        model, optimizer = ampkit.initialize(model, optimizer, level="O2", dtype=dtype)

        def forward(x):
            return model(x)

    def step():
        with count_casts() as fwd, reuse_casts() if reuse else contextlib.nullcontext():
            outs = [forward(x) for _ in range(accumulate)]
        for i, out in enumerate(outs):
            loss = loss_fn(out) / accumulate
            if scaler is not None:
                scaler.scale(loss).backward()
            elif dtype is FP16:
                with ampkit.scale_loss(loss, optimizer,
                                       delay_unscale=i < accumulate - 1) as scaled:
                    scaled.backward()
            else:
                loss.backward()
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return fwd

    step()
    with count_casts() as whole:
        fwd = step()
    return fwd, whole


def _tensor_bytes(traffic):
    # The loss scaler's scalar bookkeeping (a float64 reciprocal, a step counter) moves
    # a few bytes in both; the comparison is about activations and parameters.
    return traffic.bytes - traffic.scalar_bytes


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_o2_moves_no_more_cast_bytes_than_native_autocast_in_one_micro_batch(dtype):
    # A BN CNN: native casts each weight down and its gradient up once a step; O2 casts
    # each parameter down on first use and its gradient up, plus the model's input and
    # output. (A model that adds an fp32 buffer to its activations, like
    # TinyTransformer's position table, promotes them to fp32 at O2 as under native
    # autocast, since buffers keep their dtype: there O2 measured 1.02x native's bytes,
    # see benchmarks/RESULTS.md.)
    _, native = _step_traffic(DigitsCNN, "native", dtype)
    o2_fwd, o2 = _step_traffic(DigitsCNN, "O2", dtype)
    assert _tensor_bytes(o2) <= _tensor_bytes(native)
    n_params = len(list(DigitsCNN().parameters()))
    # one cast per parameter (the kept BatchNorms' excepted) plus input and output
    assert o2_fwd.casts <= n_params + 2, dict(o2_fwd.by_op())
    assert o2.bytes > 0 and native.bytes > 0  # both really were counted


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_each_micro_batch_casts_the_weights_afresh_at_parity_with_native(dtype):
    # A copy lives for one forward, so with two micro-batches per step O2
    # casts every weight in each forward, as native autocast does (it used to reuse
    # the first micro-batch's copies, which missed .data edits in between). On a BN
    # CNN native casts no activation, so the two stay at parity.
    _, native = _step_traffic(DigitsCNN, "native", dtype, accumulate=2)
    o2_fwd, o2 = _step_traffic(DigitsCNN, "O2", dtype, accumulate=2)
    single_fwd, _ = _step_traffic(DigitsCNN, "O2", dtype, accumulate=1)
    assert o2_fwd.casts == 2 * single_fwd.casts
    assert o2_fwd.bytes == 2 * single_fwd.bytes
    assert _tensor_bytes(o2) <= _tensor_bytes(native)


@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("make", [DigitsCNN, TinyTransformer])
def test_reuse_casts_casts_each_weight_once_per_step(make, dtype):
    # The opt-in (ampkit.conversion.parameter_casts.reuse_casts around the micro-batches): each
    # weight is cast once per step, where native autocast casts it in every forward.
    _, native = _step_traffic(make, "native", dtype, accumulate=2)
    reused_fwd, reused = _step_traffic(make, "O2", dtype, accumulate=2, reuse=True)
    plain_fwd, plain = _step_traffic(make, "O2", dtype, accumulate=2)
    single_fwd, single = _step_traffic(make, "O2", dtype, accumulate=1)
    # The second forward casts no weight: only what the first made besides the weights
    # (input, output, activations).
    weights = sum(p.numel() for p in make().parameters())
    second = reused_fwd.bytes - single_fwd.bytes
    assert plain_fwd.bytes - reused_fwd.bytes >= 4 * weights  # >= fp32 read, bf16 written
    assert second < single_fwd.bytes
    assert _tensor_bytes(reused) < _tensor_bytes(native)
    assert _tensor_bytes(reused) < _tensor_bytes(plain) <= 2 * _tensor_bytes(single)


NORM_CASES = [
    (lambda: nn.BatchNorm2d(6), (8, 6, 5, 5)),
    (lambda: nn.BatchNorm1d(6), (32, 6)),
    (lambda: nn.GroupNorm(2, 6), (8, 6, 9)),
    (lambda: nn.InstanceNorm2d(6, affine=True, track_running_stats=True), (8, 6, 5, 5)),
    (lambda: nn.LayerNorm(16), (8, 7, 16)),
]


@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize(("make_norm", "shape"), NORM_CASES)
def test_kept_norms_take_the_low_precision_input_with_fp32_numerics(make_norm, shape,
                                                                    dtype):
    torch.manual_seed(2)
    norm = make_norm()
    with torch.no_grad():
        for p in norm.parameters():
            p.copy_(torch.randn_like(p))
    reference = copy.deepcopy(norm)  # the old way: fp32 copy of the input, rounded back
    convert_model(nn.Sequential(norm), "O2", dtype)  # the norm's own boundary is used
    x = (torch.randn(shape) * 3 + 1).to(dtype)
    grad = torch.randn(shape).to(dtype)

    xa = x.clone().requires_grad_()
    with count_casts() as traffic:
        out = norm(xa)
        out.backward(grad)
    xb = x.clone().requires_grad_()
    expected = reference(xb.float()).to(dtype)
    expected.backward(grad)

    assert out.dtype is dtype and norm.weight.dtype is FP32 and norm.weight.grad.dtype is FP32
    if isinstance(norm, nn.LayerNorm):
        # Only the weight and bias gradients need fp32 copies (of input and gradient).
        assert traffic.casts == 2
    else:
        assert traffic.casts == 0
    # Output and input gradient: rounded once from fp32 either way (a rare last-bit
    # difference where the kernels sum in another order); dtype-default tolerances.
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(xa.grad, xb.grad)
    for mine, theirs in zip(norm.parameters(), reference.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-5, atol=1e-5)
    for mine, theirs in zip(norm.buffers(), reference.buffers()):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-6)


def test_layer_norm_parameter_gradients_are_fp32_accurate():
    # torch's mixed-dtype CPU kernel sums them in bf16 (1-2% off); ampkit's must not.
    torch.manual_seed(3)
    norm = nn.LayerNorm(64)
    with torch.no_grad():
        norm.weight.normal_(), norm.bias.normal_()
    exact = copy.deepcopy(norm).double()
    convert_model(nn.Sequential(norm), "O2", BF16, patch_ops=False)
    x = (torch.randn(256, 64) * 3 + 1).to(BF16)
    grad = torch.randn(256, 64).to(BF16)
    norm(x).backward(grad)
    exact(x.double()).backward(grad.double())
    for mine, truth in ((norm.weight.grad, exact.weight.grad), (norm.bias.grad, exact.bias.grad)):
        assert ((mine.double() - truth).abs().max() / truth.abs().max()).item() < 1e-5


def test_subclasses_and_other_input_dtypes_still_get_an_fp32_input():
    class MyNorm(nn.BatchNorm1d):  # may override forward: not trusted with bf16 input
        pass

    seen = []
    model = convert_model(nn.Sequential(nn.Linear(4, 4), MyNorm(4), nn.BatchNorm1d(4)),
                          "O2", BF16)
    for module in model[1:]:
        module.register_forward_pre_hook(lambda m, a: seen.append(a[0].dtype))
    model(torch.rand(3, 4))
    assert seen == [FP32, BF16]


def test_kept_norms_with_fp32_outputs_still_compute_from_an_fp32_copy():
    # kept_output_dtype=None (MindSpore's O2): outputs stay fp32, so the input is cast.
    from ampkit.conversion import ConversionConfig

    seen = []
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    model[1].register_forward_pre_hook(lambda m, a: seen.append(a[0].dtype))
    convert_model(model, ConversionConfig(param_dtype=BF16, keep_fp32_modules=(nn.BatchNorm1d,),
                                          input_dtype=BF16))
    assert model(torch.rand(4, 3)).dtype is FP32 and seen == [FP32]


def test_layer_norm_double_backward_matches_the_fp32_copy():
    # create_graph=True differentiates an fp32 copy (the old path), so it matches it.
    norm = nn.LayerNorm(4)
    reference = copy.deepcopy(norm)
    convert_model(nn.Sequential(norm), "O2", BF16, patch_ops=False)
    x = torch.rand(3, 4, dtype=BF16)
    grads = []
    for module, xi in ((norm, x.clone()), (reference, x.float())):
        xi.requires_grad_()
        (gx,) = torch.autograd.grad(module(xi).float().pow(2).sum(), xi, create_graph=True)
        gx.float().sum().backward()
        grads.append((xi.grad.float(), module.weight.grad))
    torch.testing.assert_close(grads[0][0], grads[1][0].to(BF16).float())
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_batch_norm_takes_the_low_precision_input():
    assert nn.BatchNorm2d in MIXED_INPUT_NORMS["cuda"]
    torch.manual_seed(4)
    norm = nn.BatchNorm2d(6).cuda()
    reference = copy.deepcopy(norm)
    convert_model(nn.Sequential(norm), "O2", FP16, patch_ops=False, cast_model_outputs=None)
    x = torch.randn(8, 6, 5, 5, device="cuda").half()
    with count_casts() as traffic:
        out = norm(x)
    assert traffic.casts == 0 and out.dtype is FP16
    torch.testing.assert_close(out, reference(x.float()).half())
