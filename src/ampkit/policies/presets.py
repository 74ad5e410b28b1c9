"""Named policies: ``"torch"`` (the default) and curated alternatives.

* ``"torch"``: exactly native ``torch.autocast`` for the running device and torch
  version; nothing is intercepted, so it costs nothing extra.
* ``"conservative"``: only matrix products and convolutions run in low precision;
  numerically sensitive ops are pinned to float32; ops taking several tensors promote
  to the widest; every other op runs in its inputs' dtype. Its lists are written out in
  ``docs/policies.md``.

Dialects add their frameworks' presets here (a preset is data, not behaviour).

Example:
    >>> from ampkit.policies.presets import get_policy, available_policies
    >>> "torch" in available_policies() and get_policy("torch").is_native
    True
    >>> get_policy("conservative").rule_for("softmax")
    'fp32'
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable, Mapping
from types import MappingProxyType

import torch

from ampkit.policies.policy import Policy
from ampkit.policies.registry import resolve_ops

__all__ = ["CONSERVATIVE", "TORCH", "add_in_use_check", "available_policies", "get_policy",
           "register_policy", "unregister_policy"]

TORCH = Policy(
    name="torch",
    description="Native torch.autocast for the running device and torch version.",
)

CONSERVATIVE = Policy(
    name="conservative",
    lower_precision_ops=frozenset({
        "linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "addbmm", "einsum",
        "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
        "conv_transpose3d", "scaled_dot_product_attention",
    }),
    fp32_ops=frozenset({
        # exponentials, logs and powers overflow or lose range in 16 bits
        "exp", "expm1", "log", "log1p", "log2", "log10", "pow", "rsqrt", "reciprocal",
        "sinh", "cosh", "tan", "erfinv",
        # normalisations, softmax and reductions accumulate over many values
        "softmax", "log_softmax", "softmin", "logsumexp", "layer_norm", "group_norm",
        "batch_norm", "instance_norm", "rms_norm", "normalize", "sum", "mean", "prod",
        "std", "var", "norm", "cumsum", "cumprod", "dist", "cdist",
        # losses
        "cross_entropy", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
        "binary_cross_entropy", "binary_cross_entropy_with_logits", "kl_div",
        "poisson_nll_loss", "cosine_embedding_loss", "margin_ranking_loss",
        "soft_margin_loss", "multilabel_soft_margin_loss",
    }),
    promote_ops=frozenset({
        "add", "sub", "mul", "div", "cat", "stack", "where", "addcmul", "addcdiv",
        "maximum", "minimum", "atan2", "lerp", "index_copy", "dot", "vdot",
    }),
    unlisted="keep",
    description="Matmuls and convolutions in low precision, sensitive ops in float32, "
                "multi-input ops promoted, all else in the inputs' dtype.",
)

_PRESETS: dict[str, Policy] = {p.name: p for p in (TORCH, CONSERVATIVE)}


def register_policy(policy: Policy, *, overwrite: bool = False) -> Policy:
    """Make ``policy`` available by its name to :func:`get_policy` and ``autocast``.

    Example:
        >>> from ampkit.policies.policy import Policy
        >>> from ampkit.policies.presets import register_policy, get_policy
        >>> _ = register_policy(Policy("doc-example", fp32_ops={"exp"}), overwrite=True)
        >>> get_policy("doc-example").fp32_ops
        frozenset({'exp'})
        >>> unregister_policy("doc-example")  # (keeps other examples' listings as shipped)
    """
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be an ampkit Policy, got {type(policy).__name__}")
    if policy.name in _PRESETS and not overwrite and _PRESETS[policy.name] != policy:
        raise ValueError(f"a different policy named {policy.name!r} is already registered; "
                         f"pass overwrite=True to replace it")
    _PRESETS[policy.name] = policy
    return policy


# Checks that ``unregister_policy`` asks whether a policy is in use: each returns a
# description of the users, or ``None``. The autocast engine adds its live regions'.
_IN_USE: list[Callable[[Policy], str | None]] = []


def add_in_use_check(check: Callable[[Policy], str | None]) -> None:
    """Make :func:`unregister_policy` ask ``check(policy)`` whether the policy is in
    use; a string (who uses it) refuses the removal with it. The autocast engine adds
    the check of its live regions; a layer above the presets may add its own.

    Example:
        >>> from ampkit.policies.policy import Policy
        >>> from ampkit.policies.presets import add_in_use_check, register_policy, unregister_policy
        >>> users = {"pinned-example": "a test"}
        >>> add_in_use_check(lambda policy, users=users: users.get(policy.name))
        >>> _ = register_policy(Policy("pinned-example", fp32_ops={"exp"}))
        >>> unregister_policy("pinned-example")
        Traceback (most recent call last):
        ...
        RuntimeError: unregister_policy('pinned-example'): the policy is in use by a test; ...
        >>> users.clear()                     # no longer in use: it can go
        >>> unregister_policy("pinned-example")
    """
    _IN_USE.append(check)


def unregister_policy(name: str) -> None:
    """Remove the policy registered as ``name`` (the presets ampkit ships stay).

    Raises:
        KeyError: nothing is registered as ``name``.
        ValueError: ``name`` is one of the presets ampkit ships.
        RuntimeError: a live ``ampkit.autocast`` region (in any thread) was given the
            policy; nothing is removed (exit the region first).

    Example:
        >>> from ampkit.policies.policy import Policy
        >>> from ampkit.policies.presets import (
        ...     available_policies, register_policy, unregister_policy)
        >>> _ = register_policy(Policy("short-lived", fp32_ops={"exp"}))
        >>> unregister_policy("short-lived")
        >>> "short-lived" in available_policies()
        False
    """
    if name in _SHIPPED:
        raise ValueError(f"{name!r} is one of the presets ampkit ships "
                         f"{sorted(_SHIPPED)}; only policies registered later can be removed")
    if name not in _PRESETS:
        raise KeyError(f"no policy is registered as {name!r}; registered: "
                       f"{sorted(set(_PRESETS) - _SHIPPED)}")
    for in_use in _IN_USE:
        users = in_use(_PRESETS[name])
        if users is not None:
            raise RuntimeError(f"unregister_policy({name!r}): the policy is in use by "
                               f"{users}; exit those regions first, then unregister it")
    del _PRESETS[name]


def available_policies() -> Mapping[str, Policy]:
    """All named policies, read-only.

    Example:
        >>> from ampkit.policies.presets import available_policies
        >>> {"conservative", "torch"} <= set(available_policies())
        True
    """
    return MappingProxyType(_PRESETS)


def get_policy(policy: str | os.PathLike[str] | Policy) -> Policy:
    """A policy by name, by the path of a policy JSON file (as ``ampkit tune`` and
    :meth:`Policy.save` write it), or the policy itself; unknown names list the known
    ones. A name that is a registered preset is the preset, even if a file of that
    name exists; a file is read again only when it changes.

    Example:
        >>> import os, tempfile
        >>> from ampkit.policies.policy import Policy
        >>> from ampkit.policies.presets import get_policy
        >>> get_policy("torch").name
        'torch'
        >>> path = os.path.join(tempfile.mkdtemp(), "tuned-policy.json")
        >>> Policy("tuned", fp32_ops={"exp"}).save(path)
        >>> get_policy(path).fp32_ops
        frozenset({'exp'})
    """
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, os.PathLike):
        return _policy_file(os.fspath(policy))
    if not isinstance(policy, str):
        raise TypeError(f"policy must be a preset name, the path of a policy file or a "
                        f"Policy, got {type(policy).__name__}")
    if policy in _PRESETS:
        return _PRESETS[policy]
    if policy.endswith(".json") or os.sep in policy or os.path.isfile(policy):
        return _policy_file(policy)
    close = difflib.get_close_matches(policy, list(_PRESETS), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(f"policy: unknown preset {policy!r}{hint}; accepted values: "
                     f"{sorted(_PRESETS)} or the path of a policy JSON file")


# (absolute path, mtime, size) -> the policy read from it: autocast regions are entered
# every step, and re-reading the file each time would cost a file read per step.
_FILE_CACHE: dict[tuple[str, float, int], Policy] = {}


def _policy_file(path: str) -> Policy:
    try:
        stat = os.stat(path)
    except OSError:
        raise ValueError(f"policy: {path!r} is neither a preset {sorted(_PRESETS)} nor an "
                         f"existing policy file") from None
    key = (os.path.abspath(path), stat.st_mtime, stat.st_size)
    found = _FILE_CACHE.get(key)
    if found is None:
        try:
            found = Policy.load(path)
        except (ValueError, TypeError) as error:
            raise ValueError(f"policy: {path!r} is not a policy file: {error}") from None
        _FILE_CACHE[key] = found
    return found


# -- the dialects' presets (data: each framework's default lists, in torch terms) -------
#
# Lists of other frameworks' op names are resolved through the registry's alias tables
# (``ampkit.policies.registry.FRAMEWORK_ALIASES``). Names with no torch counterpart are left out
# and listed in docs/migration.md.

# The torch.cpu.amp CPU lists of an older torch release (seed 003), translated to torch
# 2.13 entry points: ``_upsample_nearest_exact{1,2,3}d`` (reached only through
# ``F.interpolate``) became ``interpolate``, which is also added for the other
# ``upsample_*`` ops; ``_lu_with_info`` became ``lu``; ``multilabel_margin_loss_forward``
# is ``multilabel_margin_loss`` (already listed); ``inverse``, listed twice, is kept
# once. ``eig``, ``symeig``, ``lstsq``, ``solve`` and ``matrix_rank`` stay: torch 2.13
# keeps them as stubs that raise "removed".
TORCH_CPU_LEGACY_LOWER: tuple[str, ...] = (
    "conv1d", "conv2d", "conv3d", "bmm", "mm", "baddbmm", "addmm", "addbmm", "linear",
    "_convolution",
)
TORCH_CPU_LEGACY_FP32: tuple[str, ...] = (
    "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "batch_norm", "dropout",
    "avg_pool1d", "avg_pool2d", "avg_pool3d", "gelu", "upsample_nearest1d",
    "upsample_nearest2d", "upsample_nearest3d", "upsample_linear1d", "upsample_bilinear2d",
    "upsample_trilinear3d", "interpolate", "binary_cross_entropy",
    "binary_cross_entropy_with_logits", "instance_norm", "grid_sampler", "polar",
    "multinomial", "poisson", "fmod", "prod", "quantile", "nanquantile", "stft", "cdist",
    "cross", "cumprod", "cumsum", "diag", "diagflat", "histc", "logcumsumexp",
    "searchsorted", "trace", "tril", "triu", "vander", "view_as_complex", "cholesky",
    "cholesky_inverse", "cholesky_solve", "dot", "inverse", "lu_solve", "matrix_rank",
    "orgqr", "ormqr", "pinverse", "vdot", "im2col", "col2im", "max_pool3d", "max_unpool2d",
    "max_unpool3d", "adaptive_avg_pool3d", "reflection_pad1d", "reflection_pad2d",
    "replication_pad1d", "replication_pad2d", "replication_pad3d", "elu", "hardshrink",
    "hardsigmoid", "hardswish", "log_sigmoid", "prelu", "selu", "celu", "softplus",
    "softshrink", "group_norm", "smooth_l1_loss", "mse_loss", "ctc_loss", "kl_div",
    "multilabel_margin_loss", "fft_fft", "fft_ifft", "fft_fft2", "fft_ifft2", "fft_fftn",
    "fft_ifftn", "fft_rfft", "fft_irfft", "fft_rfft2", "fft_irfft2", "fft_rfftn",
    "fft_irfftn", "fft_hfft", "fft_ihfft", "conv_tbc", "linalg_matrix_norm", "linalg_cond",
    "linalg_matrix_rank", "linalg_solve", "linalg_cholesky", "linalg_svdvals",
    "linalg_eigvals", "linalg_eigvalsh", "linalg_inv", "linalg_householder_product",
    "linalg_tensorinv", "linalg_tensorsolve", "fake_quantize_per_tensor_affine", "glu",
    "cummax", "cummin", "eig", "geqrf", "lstsq", "lu", "lu_unpack", "qr", "solve", "svd",
    "symeig", "triangular_solve", "fractional_max_pool2d", "fractional_max_pool3d",
    "adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d", "linalg_qr",
    "linalg_cholesky_ex", "linalg_svd", "linalg_eig", "linalg_eigh", "linalg_lstsq",
    "linalg_inv_ex",
)
TORCH_CPU_LEGACY_PROMOTE: tuple[str, ...] = ("cat", "stack", "index_copy")

TORCH_CPU_LEGACY = Policy(
    name="torch-cpu-legacy",
    lower_precision_ops=frozenset(TORCH_CPU_LEGACY_LOWER),
    fp32_ops=frozenset(TORCH_CPU_LEGACY_FP32),
    promote_ops=frozenset(TORCH_CPU_LEGACY_PROMOTE),
    unlisted="keep",
    description="The older torch.cpu.amp CPU op lists (seed 003): bfloat16 for "
                "convolutions and matmuls except matmul itself, float32 for a long list "
                "(conv_transpose included), every other op in its inputs' dtype.",
)

# PaddlePaddle's default lists (python/paddle/amp/amp_lists.py; the same for float16
# and bfloat16). Left out, no torch op: fused_rotary_position_embedding,
# fused_feedforward, fake_quantize_dequantize_abs_max,
# fake_quantize_dequantize_moving_average_abs_max (white); hsigmoid_loss,
# margin_cross_entropy (black).
PADDLE_WHITE_LIST: tuple[str, ...] = (
    "conv2d", "einsum", "matmul", "matmul_v2", "max_pool2d_with_index", "mul",
    "fused_gemm_epilogue", "flash_attn", "fused_attention",
)
PADDLE_BLACK_LIST: tuple[str, ...] = (
    "tan", "acos", "asin", "sinh", "cosh", "atanh", "tanh_shrink", "erfinv", "exp",
    "expm1", "log", "log10", "log2", "reciprocal", "rsqrt", "pow", "square", "reduce_sum",
    "mean", "reduce_mean", "reduce_prod", "cumprod", "cumsum", "dist", "pnorm",
    "frobenius_norm", "renorm", "group_norm", "layer_norm", "softmax", "softmin",
    "softplus", "log_softmax", "softmax_with_cross_entropy",
    "sigmoid_cross_entropy_with_logits", "c_softmax_with_cross_entropy", "cross_entropy",
    "cross_entropy2", "nll_loss", "huber_loss", "triplet_margin_loss", "log_loss",
)
#: float32 at O1 and O2 alike (their low-precision backward is slow, says Paddle).
PADDLE_EXTRA_BLACK_LIST: tuple[str, ...] = (
    "linear_interp_v2", "nearest_interp_v2", "bilinear_interp_v2", "bicubic_interp_v2",
    "trilinear_interp_v2", "lookup_table", "lookup_table_v2", "scatter",
)

_PADDLE_WHITE = resolve_ops(PADDLE_WHITE_LIST, framework="paddle")
_PADDLE_BLACK = resolve_ops(PADDLE_BLACK_LIST, framework="paddle")
_PADDLE_EXTRA_BLACK = resolve_ops(PADDLE_EXTRA_BLACK_LIST, framework="paddle")

PADDLE_O1 = Policy(
    name="paddle-O1", lower_precision_ops=_PADDLE_WHITE,
    fp32_ops=_PADDLE_BLACK | _PADDLE_EXTRA_BLACK, unlisted="promote",
    description="Paddle O1: white list low precision, black list float32, every other "
                "op float32 if any input is float32, else low precision.")
PADDLE_OD = Policy(
    name="paddle-OD", lower_precision_ops=_PADDLE_WHITE, unlisted="fp32",
    description="Paddle OD: only the white list in low precision, everything else "
                "float32.")
PADDLE_O2 = Policy(
    name="paddle-O2", lower_precision_ops=_PADDLE_WHITE, fp32_ops=_PADDLE_EXTRA_BLACK,
    unlisted="promote",
    description="Paddle O2 with use_promote: white list low precision, the extra black "
                "list float32, every other op float32 if any input is float32, else low "
                "precision (decorate() makes the parameters low precision).")
PADDLE_O2_NO_PROMOTE = Policy(
    name="paddle-O2-no-promote", lower_precision_ops=_PADDLE_WHITE,
    fp32_ops=_PADDLE_EXTRA_BLACK, unlisted="lower",
    description="Paddle O2 with use_promote=False: everything low precision except the "
                "extra black list.")

# MXNet's contrib.amp lists (python/mxnet/contrib/amp/lists/symbol_fp16.py), the names
# with a torch counterpart. Left out, no torch op: the _sparse_*, _contrib_*, _linalg_*
# (internal spellings), _*Scalar and _random_* variants, Convolution_v1,
# IdentityAttachKLSparseReg, rcbrt, _square_sum, khatri_rao, linalg_gelqf,
# linalg_maketrian, linalg_extracttrian, linalg_extractdiag (a view), _NDArray, _Native,
# Custom, MakeLoss, make_loss, Correlation, random_pdf_*; and linalg_gemm2, linalg_syrk,
# linalg_trmm, whose torch counterpart (matmul) is MXNet's widest-type ``dot``.
MXNET_FP16_FUNCS: tuple[str, ...] = ("Convolution", "Deconvolution", "FullyConnected", "RNN")
MXNET_FP32_FUNCS: tuple[str, ...] = (
    "arccos", "arcsin", "cosh", "erfinv", "sinh", "tan", "arctanh", "exp", "expm1", "log",
    "log10", "log2", "log1p", "broadcast_power", "square", "reciprocal", "rsqrt", "_Power",
    "_power", "linalg_sumlogdiag", "_Hypot", "_hypot", "broadcast_hypot", "sum",
    "sum_axis", "nansum", "prod", "mean", "norm", "softmin", "moments", "gamma", "gammaln",
    "linalg_gemm", "linalg_potrf", "linalg_potri", "linalg_syevd", "linalg_trsm",
    "linalg_makediag", "linalg_inverse", "linalg_det", "linalg_slogdet", "argsort", "topk",
    "softmax", "Softmax", "log_softmax", "InstanceNorm", "LayerNorm", "GroupNorm",
    "L2Normalization", "LRN", "SoftmaxActivation", "softmax_cross_entropy", "smooth_l1",
    "CTCLoss", "ctc_loss",
)
#: Ops that run in float32 only for some values of one parameter, as (op, parameter,
#: values) triples; torch has one op per value.
MXNET_CONDITIONAL_FP32_FUNCS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("Activation", "act_type", ("softrelu",)),
    ("LeakyReLU", "act_type", ("elu", "selu")),
)
#: The torch ops of MXNET_CONDITIONAL_FP32_FUNCS: softrelu is softplus; elu, selu.
MXNET_CONDITIONAL_FP32_OPS: tuple[str, ...] = ("softplus", "elu", "selu")
MXNET_WIDEST_TYPE_CASTS: tuple[str, ...] = (
    "_Plus", "_plus", "_Minus", "_sub", "_Mul", "_Div", "_div", "_Mod", "_Not_Equal",
    "_Equal", "_equal", "_Greater", "_greater", "_Greater_Equal", "_greater_equal",
    "_Lesser", "_Lesser_Equal", "_lesser", "_lesser_equal", "_Logical_And", "_Logical_Or",
    "_Logical_Xor", "_logical_and", "_logical_or", "_logical_xor", "_maximum", "_minimum",
    "_minus", "_mod", "_mul", "_not_equal", "Concat", "concat", "ElementWiseSum", "add_n",
    "batch_dot", "broadcast_add", "broadcast_plus", "broadcast_div", "broadcast_equal",
    "broadcast_greater", "broadcast_greater_equal", "broadcast_lesser",
    "broadcast_lesser_equal", "broadcast_logical_and", "broadcast_logical_or",
    "broadcast_logical_xor", "broadcast_maximum", "broadcast_minimum", "broadcast_minus",
    "broadcast_mod", "broadcast_mul", "broadcast_not_equal", "broadcast_sub", "dot",
    "elemwise_add", "elemwise_div", "elemwise_mul", "elemwise_sub", "stack", "_Maximum",
    "_Minimum", "where",
)
# symbol_bf16.py: Convolution, Deconvolution and FullyConnected in bfloat16; RNN (and
# Dropout, Embedding, UpSampling) move to float32. Its float32 list also pins
# data-movement and rounding ops (reshape, flatten, floor, ...) for want of bfloat16
# kernels in MXNet's CPU backend; torch has them, so they stay in the inputs' dtype.
# Deconvolution is in bfloat16 as in MXNet 2.0's symbol_bf16.py (1.9 kept it float32,
# having no bfloat16 kernel for it then; torch's CPU autocast lists it too).
MXNET_BF16_FUNCS: tuple[str, ...] = ("Convolution", "Deconvolution", "FullyConnected")
MXNET_BF16_FP32_FUNCS: tuple[str, ...] = (
    *MXNET_FP32_FUNCS, "RNN", "Dropout", "Embedding", "UpSampling")
#: MXNet's ops that run in float16 or float32 alike (symbol_fp16.py's FP16_FP32_FUNCS),
#: the names with a torch counterpart: ampkit runs them in their inputs' dtype.
MXNET_FP16_FP32_FUNCS: tuple[str, ...] = (
    "BatchNorm", "Dropout", "Embedding", "UpSampling", "abs", "arccosh", "arcsinh",
    "arctan", "argmax", "argmin", "broadcast_to", "ceil", "clip", "cos", "degrees", "diag",
    "erf", "fix", "flatten", "flip", "floor", "logical_not", "max", "min", "negative",
    "normal", "one_hot", "ones_like", "pad", "radians", "relu", "repeat", "reshape",
    "round", "sigmoid", "sign", "sin", "softsign", "sort", "split", "sqrt", "squeeze",
    "swapaxes", "take", "tanh", "tile", "transpose", "trunc", "unravel_index", "zeros_like",
)
#: The bfloat16 counterpart (symbol_bf16.py's BF16_FP32_FUNCS with a torch counterpart),
#: plus the data-movement and rounding ops that symbol_bf16.py pins to float32 and
#: ampkit leaves in their inputs' dtype (see MXNET_BF16_FP32_FUNCS).
MXNET_BF16_BF16_FP32_FUNCS: tuple[str, ...] = (
    "abs", "BatchNorm", "clip", "relu", "sqrt", "tanh", "arccosh", "arcsinh", "arctan",
    "argmax", "argmin", "broadcast_to", "ceil", "cos", "degrees", "diag", "erf", "fix",
    "flatten", "flip", "floor", "logical_not", "max", "min", "negative", "normal",
    "one_hot", "ones_like", "pad", "radians", "repeat", "reshape", "round", "sigmoid",
    "sign", "sin", "softsign", "sort", "split", "squeeze", "swapaxes", "take", "tile",
    "transpose", "trunc", "unravel_index", "zeros_like",
)
#: MXNet's loss output ops (LOSS_OUTPUT_FUNCTIONS, both dtypes), whose gradient MXNet's
#: init scaled; each has a torch loss counterpart (see the registry's MXNet aliases).
MXNET_LOSS_OUTPUT_FUNCTIONS: tuple[str, ...] = (
    "SoftmaxOutput", "LinearRegressionOutput", "LogisticRegressionOutput",
    "MAERegressionOutput",
)

def _mxnet_policy(dtype: torch.dtype, low: tuple[str, ...], fp32: tuple[str, ...],
                  what: str) -> Policy:
    """One of MXNet's contrib.amp list pairs as a policy (its conditional fp32 ops and
    widest-type casts are the same for both dtypes)."""
    name = str(dtype).removeprefix("torch.")
    return Policy(
        name=f"mxnet-{name}", dtype=dtype,
        lower_precision_ops=resolve_ops(low, framework="mxnet"),
        fp32_ops=resolve_ops(fp32, framework="mxnet") | frozenset(MXNET_CONDITIONAL_FP32_OPS),
        promote_ops=resolve_ops(MXNET_WIDEST_TYPE_CASTS, framework="mxnet"),
        unlisted="keep",
        description=f"MXNet contrib.amp {name} lists: {what}, multi-input ops widest "
                    f"type, all else untouched.")


MXNET_FLOAT16 = _mxnet_policy(
    torch.float16, MXNET_FP16_FUNCS, MXNET_FP32_FUNCS,
    "convolutions, dense and RNN layers in float16, sensitive ops float32")
MXNET_BFLOAT16 = _mxnet_policy(
    torch.bfloat16, MXNET_BF16_FUNCS, MXNET_BF16_FP32_FUNCS,
    "convolutions, deconvolutions and dense layers in bfloat16, RNNs and sensitive ops "
    "float32")

# NVIDIA apex's own O1 lists (apex/amp/lists/{functional,torch,tensor}_overrides.py and
# rnn_compat.py at apex commit e13873de, the last before amp was removed). apex applied
# them to CUDA tensors; as a policy they hold on every device. The batched matmuls
# (bmm, baddbmm, addbmm) are on the float16 list as on every CUDA >= 9.1 build (apex
# left them unlisted without CUDA). Tensor dunders map to their ops (``__matmul__`` is
# matmul, ``__pow__`` pow, ``__add__`` add, ...); ``cpu`` stays: apex casts a tensor to
# float32 before moving it to the CPU.
APEX_FP16_FUNCS: tuple[str, ...] = (
    # torch.nn.functional, torch and Tensor
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "conv_tbc", "linear", "prelu", "addmm", "addmv", "addr", "matmul",
    "mm", "mv", "addbmm", "baddbmm", "bmm",
    # RNNs and RNN cells (cast whole, weights and hidden state included)
    "rnn_relu", "rnn_tanh", "gru", "lstm", "rnn_relu_cell", "rnn_tanh_cell", "gru_cell",
    "lstm_cell",
)
APEX_FP32_FUNCS: tuple[str, ...] = (
    # torch.nn.functional
    "interpolate", "grid_sample", "softplus", "softmin", "log_softmax", "softmax", "gelu",
    "layer_norm", "group_norm", "local_response_norm", "normalize", "cosine_similarity",
    "poisson_nll_loss", "cosine_embedding_loss", "cross_entropy", "hinge_embedding_loss",
    "kl_div", "l1_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss",
    "multilabel_soft_margin_loss", "multi_margin_loss", "nll_loss",
    "binary_cross_entropy_with_logits", "smooth_l1_loss", "soft_margin_loss",
    "triplet_margin_loss", "ctc_loss",
    # torch and Tensor
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "reciprocal",
    "rsqrt", "sinh", "tan", "pow", "cumprod", "cumsum", "dist", "norm", "prod", "std",
    "sum", "var", "renorm", "cpu",
)
#: Promoted to the widest floating type (apex's CASTS and SEQUENCE_CASTS).
APEX_CASTS: tuple[str, ...] = (
    "addcdiv", "addcmul", "atan2", "cross", "bilinear", "dot", "add", "div", "mul", "sub",
    "eq", "equal", "ge", "gt", "le", "lt", "ne", "cat", "stack",
)
#: Ops refused a low-precision input unless ``allow_banned`` (then they run in float32,
#: the rule on APEX_O1's list), each paired with the message apex gives.
APEX_BANNED_FUNCS: tuple[tuple[str, str], ...] = (
    ("binary_cross_entropy",
     "F.binary_cross_entropy and torch.nn.BCELoss are unsafe in float16: apex refuses "
     "them a low-precision input. Use torch.nn.BCEWithLogitsLoss (sigmoid and BCELoss in "
     "one op, which runs in float32), or run the sigmoid in float32 "
     "(amp.register_float_function(torch, 'sigmoid')); amp.init(allow_banned=True) runs "
     "the loss in float32 instead."),
)
#: In-place versions of the float32-list ops, which apex refuses a low-precision tensor
#: (they could only compute in that precision): ``torch.exp_``, ``Tensor.exp_``, ...
APEX_REFUSED_IN_PLACE: tuple[str, ...] = tuple(
    f"{name}_" for name in APEX_FP32_FUNCS
    if hasattr(torch.Tensor, f"{name}_") or hasattr(torch, f"{name}_"))

APEX_O1 = Policy(
    name="apex-O1", dtype=torch.float16,
    lower_precision_ops=frozenset(APEX_FP16_FUNCS),
    fp32_ops=frozenset(APEX_FP32_FUNCS) | {op for op, _ in APEX_BANNED_FUNCS},
    promote_ops=frozenset(APEX_CASTS), unlisted="keep",
    description="NVIDIA apex's own O1 lists, on every device: matmuls, convolutions and "
                "RNNs in float16; pointwise transcendentals, reductions, softmax, norms and "
                "losses in float32; multi-input ops promoted to the widest type; all else "
                "in its inputs' dtype.")

# MindSpore's amp_level="auto" lists (mindspore.amp.auto_mixed_precision, 2.3 and
# later), in torch's op names. White: Conv2D/Conv2DExt/Convolution, Conv3D/Conv3DExt,
# Conv2DTranspose/ConvTranspose2D, Conv3DTranspose, MatMul/MatMulExt,
# BatchMatMul/BatchMatMulExt, PReLU, Einsum, Dense, Addmm, Addbmm, Addmv, Baddbmm, Mv.
# Black: the transcendentals, Softplus, the norms, the losses, Pdist, Cdist, Renorm,
# the reductions, Softmax and LogSoftmax, CumProd and CumSum, Norm. Promote: Addcdiv,
# Addcmul, Cross, Dot, GridSampler2D/3D, IndexPut; BiasAdd, also on it, has no torch op
# of its own (torch's add promotes by itself). BatchNorm, on MindSpore's black list, casts
# only its parameters: it computes in float32 and returns its input's dtype (MindSpore's
# auto tests compare with a network that rounds BatchNorm's output to float16), which is
# what batch_norm does in its inputs' dtype with float32 parameters: it is left unlisted.
MINDSPORE_AUTO_WHITE_LIST: tuple[str, ...] = (
    "conv1d", "conv2d", "conv3d", "conv_transpose2d", "conv_transpose3d", "matmul", "mm",
    "bmm", "prelu", "einsum", "linear", "addmm", "addbmm", "addmv", "baddbmm", "mv",
)
MINDSPORE_AUTO_BLACK_LIST: tuple[str, ...] = (
    "pow", "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log1p",
    "log2", "reciprocal", "rsqrt", "sinh", "tan", "softplus", "layer_norm", "group_norm",
    "kl_div", "smooth_l1_loss", "multilabel_margin_loss", "soft_margin_loss",
    "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits",
    "pdist", "cdist", "renorm", "prod", "softmax", "log_softmax", "cumprod", "cumsum",
    "sum", "norm", "l1_loss", "mse_loss", "nll_loss",
)
MINDSPORE_AUTO_PROMOTE_LIST: tuple[str, ...] = (
    "addcdiv", "addcmul", "cross", "linalg_cross", "dot", "grid_sample", "index_put",
)

MINDSPORE_AUTO = Policy(
    name="mindspore-auto", lower_precision_ops=resolve_ops(MINDSPORE_AUTO_WHITE_LIST),
    fp32_ops=resolve_ops(MINDSPORE_AUTO_BLACK_LIST),
    promote_ops=resolve_ops(MINDSPORE_AUTO_PROMOTE_LIST), unlisted="keep",
    description="MindSpore amp_level='auto': its white list in low precision, its black "
                "list in float32, its promote list in the widest input type, every other "
                "op in its inputs' dtype.")

for _preset in (TORCH_CPU_LEGACY, PADDLE_O1, PADDLE_OD, PADDLE_O2, PADDLE_O2_NO_PROMOTE,
                MXNET_FLOAT16, MXNET_BFLOAT16, APEX_O1,
                MINDSPORE_AUTO):
    _PRESETS[_preset.name] = _preset
del _preset

__all__ += [
    "APEX_BANNED_FUNCS", "APEX_CASTS", "APEX_FP16_FUNCS", "APEX_FP32_FUNCS", "APEX_O1",
    "APEX_REFUSED_IN_PLACE", "MXNET_BF16_FP32_FUNCS", "MXNET_BF16_FUNCS", "MXNET_BFLOAT16",
    "MXNET_BF16_BF16_FP32_FUNCS", "MXNET_CONDITIONAL_FP32_FUNCS",
    "MXNET_CONDITIONAL_FP32_OPS", "MXNET_FLOAT16", "MXNET_FP16_FP32_FUNCS", "MXNET_FP16_FUNCS",
    "MINDSPORE_AUTO", "MINDSPORE_AUTO_BLACK_LIST", "MINDSPORE_AUTO_PROMOTE_LIST",
    "MINDSPORE_AUTO_WHITE_LIST", "MXNET_LOSS_OUTPUT_FUNCTIONS", "MXNET_FP32_FUNCS",
    "MXNET_WIDEST_TYPE_CASTS",
    "PADDLE_BLACK_LIST",
    "PADDLE_EXTRA_BLACK_LIST", "PADDLE_O1", "PADDLE_O2", "PADDLE_O2_NO_PROMOTE",
    "PADDLE_OD", "PADDLE_WHITE_LIST", "TORCH_CPU_LEGACY", "TORCH_CPU_LEGACY_FP32",
    "TORCH_CPU_LEGACY_LOWER", "TORCH_CPU_LEGACY_PROMOTE",
]

#: The presets ampkit ships: unregister_policy leaves them alone.
_SHIPPED: frozenset[str] = frozenset(_PRESETS)
