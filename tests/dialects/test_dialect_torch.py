"""ampkit.torch: drop-in torch.autocast / GradScaler, and the seed-003 CPU op table."""

from __future__ import annotations

import glob
import inspect
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampkit
import ampkit.torch as amp
from ampkit.policies.presets import get_policy

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(x)).flatten(2).mean(1)  # (N, 16)
        h = self.norm(h + h.exp() * 0.01)
        return torch.log_softmax(self.head(h) @ torch.ones(5, 5), -1)


# -- drop-in for torch.autocast -------------------------------------------------------------

def test_signature_is_torch_autocast_plus_policy() -> None:
    ours = inspect.signature(amp.autocast.__init__).parameters
    theirs = inspect.signature(torch.autocast.__init__).parameters
    for name, param in theirs.items():
        assert name in ours and ours[name].default == param.default, name
    assert ours["policy"].kind is inspect.Parameter.KEYWORD_ONLY
    assert ours["policy"].default == "torch"


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_values_and_grads_equal_native_autocast(dtype: torch.dtype) -> None:
    net = _Net()
    x = torch.rand(3, 2, 4, 4)
    with torch.autocast("cpu", dtype):
        expected = net(x)
    expected.sum().backward()
    expected_grads = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    with amp.autocast("cpu", dtype):
        got = net(x)
    got.sum().backward()
    assert got.dtype == expected.dtype
    assert torch.equal(got, expected)
    for p, g in zip(net.parameters(), expected_grads):
        assert torch.equal(p.grad, g)


def test_defaults_follow_torch() -> None:
    region = amp.autocast("cpu")
    assert region.fast_dtype == torch.get_autocast_dtype("cpu")
    assert region.device == "cpu"
    assert region.cache_enabled == torch.is_autocast_cache_enabled()
    with amp.autocast("cpu", enabled=False):
        assert not torch.is_autocast_enabled("cpu")
        assert torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype == FP32


def test_unsupported_dtype_warns_and_disables_like_torch() -> None:
    a = torch.ones(2, 2)
    with pytest.warns(UserWarning), torch.autocast("cpu", dtype=torch.float64):
        native = torch.mm(a, a).dtype
    with (pytest.warns(UserWarning, match="float16 and torch.bfloat16"),
          amp.autocast("cpu", dtype=torch.float64)):
        ours = torch.mm(a, a).dtype
    assert ours == native == FP32


def test_bad_device_type_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="device_type must be"):
        amp.autocast("not-a-device")


def test_cpu_autocast_is_the_seeds_torch_cpu_amp_autocast() -> None:
    params = inspect.signature(amp.cpu_autocast.__init__).parameters
    assert [(n, params[n].default) for n in ("enabled", "dtype", "cache_enabled")] == [
        ("enabled", True), ("dtype", BF16), ("cache_enabled", True)]
    with pytest.warns(FutureWarning, match=r"torch.amp.autocast\('cpu', args...\)"):
        region = amp.cpu_autocast()
    with region:
        assert F.linear(torch.ones(2, 3), torch.ones(4, 3)).dtype == BF16
    with pytest.warns(FutureWarning), amp.cpu_autocast(enabled=False):
        assert F.linear(torch.ones(2, 3), torch.ones(4, 3)).dtype == FP32


def test_custom_fwd_works_inside_ampkit_regions() -> None:
    @amp.custom_fwd(device_type="cpu", cast_inputs=FP32)
    def fp32_only(a: torch.Tensor) -> torch.Tensor:
        return a @ a

    with amp.autocast("cpu", BF16, policy="torch-cpu-legacy"):
        assert fp32_only(torch.ones(2, 2, dtype=BF16)).dtype == FP32
    assert amp.is_autocast_available("cpu")


# -- the seed's eligibility rules, under the default and the legacy policy ------------------

@pytest.mark.parametrize("policy", ["torch", "torch-cpu-legacy"])
def test_eligibility_rules_of_the_seed(policy: str) -> None:
    a, b = torch.rand(3, 3), torch.rand(3, 3)
    with amp.autocast("cpu", BF16, policy=policy):
        assert torch.mm(a.double(), b.double()).dtype == torch.float64  # float64: no
        assert torch.mm(a, b).dtype == BF16
        out = torch.empty(3, 3)
        torch.mm(a, b, out=out)  # out=: not autocast
        assert out.dtype == FP32
        c = a.clone()
        c.addmm_(a, b)  # in-place: not autocast
        assert c.dtype == FP32
        assert torch.cumsum(a.to(BF16), 0, dtype=torch.float64).dtype == torch.float64


# -- the seed-003 op table ------------------------------------------------------------------

# The seed's three lists, copied as plain op names (duplicates kept, as in the seed).
SEED_003_BF16 = """conv1d conv2d conv3d bmm mm baddbmm addmm addbmm linear _convolution"""
SEED_003_FP32 = """
conv_transpose1d conv_transpose2d conv_transpose3d batch_norm dropout avg_pool1d avg_pool2d
avg_pool3d gelu upsample_nearest1d _upsample_nearest_exact1d upsample_nearest2d
_upsample_nearest_exact2d upsample_nearest3d _upsample_nearest_exact3d upsample_linear1d
upsample_bilinear2d upsample_trilinear3d binary_cross_entropy
binary_cross_entropy_with_logits instance_norm grid_sampler polar multinomial poisson fmod
prod quantile nanquantile stft cdist cross cumprod cumsum diag diagflat histc logcumsumexp
searchsorted trace tril triu vander view_as_complex cholesky cholesky_inverse
cholesky_solve dot inverse lu_solve matrix_rank orgqr inverse ormqr pinverse vdot im2col
col2im max_pool3d max_unpool2d max_unpool3d adaptive_avg_pool3d reflection_pad1d
reflection_pad2d replication_pad1d replication_pad2d replication_pad3d elu hardshrink
hardsigmoid hardswish log_sigmoid prelu selu celu softplus softshrink group_norm
smooth_l1_loss mse_loss ctc_loss kl_div multilabel_margin_loss fft_fft fft_ifft fft_fft2
fft_ifft2 fft_fftn fft_ifftn fft_rfft fft_irfft fft_rfft2 fft_irfft2 fft_rfftn fft_irfftn
fft_hfft fft_ihfft conv_tbc linalg_matrix_norm linalg_cond linalg_matrix_rank linalg_solve
linalg_cholesky linalg_svdvals linalg_eigvals linalg_eigvalsh linalg_inv
linalg_householder_product linalg_tensorinv linalg_tensorsolve
fake_quantize_per_tensor_affine glu cummax cummin eig geqrf lstsq _lu_with_info lu_unpack
qr solve svd symeig triangular_solve fractional_max_pool2d fractional_max_pool3d
adaptive_max_pool1d adaptive_max_pool2d adaptive_max_pool3d multilabel_margin_loss_forward
linalg_qr linalg_cholesky_ex linalg_svd linalg_eig linalg_eigh linalg_lstsq linalg_inv_ex
"""
SEED_003_PROMOTE = "cat stack index_copy"

# docs/migration.md, "torch-cpu-legacy": seed names with no Python entry point in torch
# 2.13, and what the preset lists instead (None: dropped, already covered).
TRANSLATION = {
    "_upsample_nearest_exact1d": "interpolate", "_upsample_nearest_exact2d": "interpolate",
    "_upsample_nearest_exact3d": "interpolate", "_lu_with_info": "lu",
    "multilabel_margin_loss_forward": None,
}
ADDED_FOR_UPSAMPLE = {"interpolate"}  # F.interpolate is how Python reaches upsample_*


def _seed_lists_from_file() -> list[list[str]] | None:
    paths = glob.glob("/work/shared/seeds/003_*.txt")
    if not paths:
        return None
    with open(paths[0], encoding="utf-8") as f:
        text = f.read()
    lists = []
    for section in re.split(r"\nOps that ", text)[1:]:
        if section.startswith(("can autocast", "promote")):
            body = section.split("Some ops not listed")[0]
            # list items are lines of their own: ``name``,
            lists.append(re.findall(r"^``([A-Za-z_0-9]+)``,?$", body, flags=re.MULTILINE))
    return lists


def test_copied_lists_equal_the_seed_file() -> None:
    lists = _seed_lists_from_file()
    if lists is None:
        pytest.skip("the seed file is outside the repository and not present here")
    assert lists == [SEED_003_BF16.split(), SEED_003_FP32.split(), SEED_003_PROMOTE.split()]


def _translated(names: str) -> set[str]:
    out = set()
    for name in names.split():
        target = TRANSLATION.get(name, name)
        if target is not None:
            out.add(target)
    return out


def test_legacy_preset_is_the_seed_table_after_the_documented_translation() -> None:
    policy = get_policy("torch-cpu-legacy")
    assert policy.lower_precision_ops == _translated(SEED_003_BF16)
    assert policy.fp32_ops == _translated(SEED_003_FP32) | ADDED_FOR_UPSAMPLE
    assert policy.promote_ops == _translated(SEED_003_PROMOTE)
    assert policy.unlisted == "keep"  # "Ops not listed ... run in the type of their inputs"


def test_legacy_preset_behaviour_and_its_differences_from_native() -> None:
    x = torch.rand(2, 4, 8, 8)
    w = torch.rand(4, 4, 3, 3)
    a = torch.rand(3, 3)
    with amp.autocast("cpu", BF16, policy="torch-cpu-legacy"):
        legacy = {
            "linear": F.linear(a, a).dtype, "matmul": (a @ a).dtype,
            "conv_transpose2d": F.conv_transpose2d(x, w).dtype,
            "softmax_bf16": torch.softmax(a.to(BF16), -1).dtype,
            "gelu_bf16": F.gelu(a.to(BF16)).dtype,
            "interpolate_bf16": F.interpolate(x.to(BF16), scale_factor=2).dtype,
            "cat_mixed": torch.cat([a, a.to(BF16)]).dtype,
        }
    with amp.autocast("cpu", BF16):
        native = {"matmul": (a @ a).dtype,
                  "conv_transpose2d": F.conv_transpose2d(x, w).dtype}
    assert legacy == {"linear": BF16, "matmul": FP32, "conv_transpose2d": FP32,
                      "softmax_bf16": BF16, "gelu_bf16": FP32, "interpolate_bf16": FP32,
                      "cat_mixed": FP32}
    # torch 2.13's own CPU list differs: matmul and conv_transpose run in bfloat16.
    assert native == {"matmul": BF16, "conv_transpose2d": BF16}


def test_removed_linalg_names_of_the_seed_still_raise_as_torch_does() -> None:
    # The seed's eig/symeig/lstsq/solve/matrix_rank are stubs in torch 2.13; the preset
    # keeps them listed and they raise exactly as they do without ampkit.
    with pytest.raises(RuntimeError) as native:
        torch.lstsq(torch.rand(2, 2), torch.rand(2, 2))
    with (amp.autocast("cpu", BF16, policy="torch-cpu-legacy"),
          pytest.raises(RuntimeError) as ours):
        torch.lstsq(torch.rand(2, 2), torch.rand(2, 2))
    assert str(ours.value) == str(native.value)


# -- GradScaler, and a short training run ---------------------------------------------------

def test_grad_scaler_is_ampkits_and_matches_torch_with_an_overflow() -> None:
    assert amp.GradScaler is ampkit.GradScaler
    torch.manual_seed(0)
    ref = nn.Linear(6, 3)
    mine = nn.Linear(6, 3)
    mine.load_state_dict(ref.state_dict())
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt_mine = torch.optim.SGD(mine.parameters(), lr=0.1)
    s_ref = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2)
    s_mine = amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2)
    for step in range(6):
        x = torch.rand(4, 6)
        blow_up = float("inf") if step == 2 else 1.0
        for model, opt, scaler in ((ref, opt_ref, s_ref), (mine, opt_mine, s_mine)):
            opt.zero_grad()
            scaler.scale(model(x).pow(2).mean() * blow_up).backward()
            scaler.step(opt)
            scaler.update()
        assert s_mine.get_scale() == s_ref.get_scale()
        for p, q in zip(mine.parameters(), ref.parameters()):
            assert torch.equal(p, q)
    assert s_mine.skipped_steps == 1


def test_training_on_digits_through_ampkit_torch() -> None:
    from helpers_models import digits_split

    x_train, y_train, _, _ = digits_split()
    x_train = x_train.flatten(1)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = amp.GradScaler("cpu", init_scale=2.0 ** 10)
    losses = []
    for step in range(40):
        idx = torch.arange(step * 32, step * 32 + 32) % len(y_train)
        with amp.autocast("cpu", dtype=BF16):
            loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
        if step == 7:
            loss = loss * float("inf")  # an injected overflow
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        if step == 7:
            assert scaler.last_step_skipped and scaler.get_scale() == 2.0 ** 9
            assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
        else:
            losses.append(loss.item())
    assert scaler.skipped_steps == 1
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5
