"""``ampkit.mxnet``: MXNet's ``contrib.amp`` API on PyTorch.

``from mxnet.contrib import amp`` becomes ``import ampkit.mxnet as amp``; Gluon
``Trainer`` becomes a ``torch.optim.Optimizer`` and ``HybridBlock`` an ``nn.Module``.

==============================================  ==========================================
MXNet                                           ampkit core
==============================================  ==========================================
``amp_cast(data, dtype)``                       :func:`ampkit.amp_cast`
``amp_multicast(*data, num_outputs, ...)``      :func:`ampkit.amp_multicast`
``init(target_dtype, ...)``                     an :class:`ampkit.autocast` region with
                                                the ``"mxnet-float16"`` /
                                                ``"mxnet-bfloat16"`` preset (or the lists
                                                given), kept open
``convert_model`` / ``convert_hybrid_block``    :func:`ampkit.convert_model` with that
                                                policy, outputs cast to float32
``init_trainer`` / ``scale_loss`` / ``unscale``  :class:`ampkit.GradScaler` per optimizer
``LossScaler``                                  :class:`ampkit.GradScaler` with MXNet's
                                                numbers: 2**16 start, 2**24 cap, window
                                                2000, halving on overflow
==============================================  ==========================================

What differs from MXNet, on purpose:

* :func:`init` opens its region in the *calling thread* (ampkit's regions are
  thread-local, like ``torch.autocast``); call it in each thread that runs the model.
  The region caches no weight casts (it never closes, and the weights change at every
  step), so a weight used by several ops is cast at each use.
  A second ``init`` with the same arguments does nothing, as in MXNet; one with other
  arguments is a ``RuntimeError`` (MXNet ignored it silently). :func:`deinit` (an
  ampkit extra) closes the region and allows a new ``init``.
* Op lists take MXNet's names (``"FullyConnected"``, ``"elemwise_add"``), torch's
  (``"linear"``), torch callables or ``nn.Module`` classes; an unknown name is a
  ``ValueError`` that suggests the closest known names.
* Conditional fp32 ops become separate torch ops: ``("Activation", "act_type",
  ["softrelu"])`` is ``softplus``; ``("LeakyReLU", "act_type", ["elu", "selu"])`` are
  ``elu`` and ``selu`` (see :data:`CONDITIONAL_OPS` for every known triple).
* :func:`convert_hybrid_block` returns a converted copy of the module, leaving the
  given one as it was (MXNet returns a new block); ``excluded_sym_names`` are qualified
  module names.
* Errors MXNet raised with ``assert`` are ``ValueError`` (bad value), ``TypeError``
  (bad type) or ``RuntimeError`` (wrong order of calls) here.

Example:
    >>> import torch
    >>> import ampkit.mxnet as amp
    >>> x = torch.ones(2)
    >>> amp.amp_cast(x, "float16").dtype, amp.amp_cast(x, "int32").dtype
    (torch.float16, torch.float32)
    >>> a, b = amp.amp_multicast(x.half(), x, num_outputs=2)
    >>> a.dtype, b.dtype
    (torch.float32, torch.float32)
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import threading
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.nn as nn

from ampkit import casting, front_door
from ampkit.arguments import parse_dtype
from ampkit.autocast_mode import autocast, current_policy
from ampkit.conversion import ConversionConfig
from ampkit.policy import Policy
from ampkit.presets import (
    MXNET_BF16_BF16_FP32_FUNCS,
    MXNET_BF16_FP32_FUNCS,
    MXNET_BF16_FUNCS,
    MXNET_CONDITIONAL_FP32_FUNCS,
    MXNET_FP16_FP32_FUNCS,
    MXNET_FP16_FUNCS,
    MXNET_FP32_FUNCS,
    MXNET_LOSS_OUTPUT_FUNCTIONS,
    MXNET_WIDEST_TYPE_CASTS,
)
from ampkit.registry import MODULE_OPS, OpEntry, resolve_ops
from ampkit.scaling.grad_scaler import GradScaler

__all__ = [
    "CONDITIONAL_OPS",
    "LossScaler",
    "amp_cast",
    "amp_multicast",
    "convert_hybrid_block",
    "convert_model",
    "deinit",
    "init",
    "init_trainer",
    "list_conditional_fp32_ops",
    "list_fp16_ops",
    "list_fp32_ops",
    "list_loss_output_functions",
    "list_lp16_fp32_ops",
    "list_lp16_ops",
    "list_lp16_use_fp32_params",
    "list_widest_type_cast",
    "scale_loss",
    "unscale",
]

# The dtypes of the seed's amp_cast (mx.symbol.amp_cast), plus bfloat16.
_CAST_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16, "float32": torch.float32, "float64": torch.float64,
    "int32": torch.int32, "int64": torch.int64, "int8": torch.int8, "uint8": torch.uint8,
    "bfloat16": torch.bfloat16,
}
_TARGET_DTYPES: dict[str, torch.dtype] = {"float16": torch.float16,
                                          "bfloat16": torch.bfloat16}

#: MXNet's (op, parameter, value) triples, each a separate op in torch.
CONDITIONAL_OPS: dict[tuple[str, str, str], str] = {
    ("Activation", "act_type", "relu"): "relu",
    ("Activation", "act_type", "sigmoid"): "sigmoid",
    ("Activation", "act_type", "tanh"): "tanh",
    ("Activation", "act_type", "softrelu"): "softplus",
    ("Activation", "act_type", "softsign"): "softsign",
    ("LeakyReLU", "act_type", "leaky"): "leaky_relu",
    ("LeakyReLU", "act_type", "elu"): "elu",
    ("LeakyReLU", "act_type", "selu"): "selu",
    ("LeakyReLU", "act_type", "prelu"): "prelu",
    ("LeakyReLU", "act_type", "rrelu"): "rrelu",
    ("LeakyReLU", "act_type", "gelu"): "gelu",
}


# -- casts ---------------------------------------------------------------------------------

def _cast_dtype(dtype: Any) -> torch.dtype:
    try:  # numpy spellings too: np.float16, np.dtype("int8")
        return parse_dtype(dtype, "dtype", accept=_CAST_DTYPES.values(), aliases=False)
    except ValueError:  # MXNet's list of names
        raise ValueError(f"dtype must be one of {list(_CAST_DTYPES)} (or the torch/numpy "
                         f"dtype), got {dtype!r}") from None


def _check_tensor(data: Any, argument: str) -> torch.Tensor:
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"{argument} must be a torch.Tensor, got {type(data).__name__}")
    return data


def amp_cast(data: torch.Tensor, dtype: str | torch.dtype) -> torch.Tensor:
    """MXNet's ``amp_cast``: cast between a low-precision float (float16, bfloat16) and
    float32 only; any other input or target dtype returns ``data`` unchanged.

    Args:
        data: a tensor.
        dtype: ``'float16'``, ``'float32'``, ``'float64'``, ``'int32'``, ``'int64'``,
            ``'int8'``, ``'uint8'`` (the seed's set) or ``'bfloat16'``; torch and numpy
            dtypes of these are accepted too.

    Raises:
        ValueError: any other ``dtype``, listing the accepted ones.
        TypeError: ``data`` is not a tensor.

    Example:
        >>> import torch
        >>> import ampkit.mxnet as amp
        >>> amp.amp_cast(torch.ones(1, dtype=torch.bfloat16), "float32").dtype
        torch.float32
        >>> amp.amp_cast(torch.ones(1, dtype=torch.float64), "float16").dtype
        torch.float64
    """
    target = _cast_dtype(dtype)
    return casting.amp_cast(_check_tensor(data, "data"), target)


def amp_multicast(*data: torch.Tensor, num_outputs: int, cast_narrow: bool = False
                  ) -> torch.Tensor | list[torch.Tensor]:
    """MXNet's ``amp_multicast``: cast the float16/bfloat16/float32 inputs to the widest
    such type present (the narrowest with ``cast_narrow``); others pass through.

    Returns a list of ``num_outputs`` tensors, or the tensor itself when there is one
    (MXNet's single-output ops return an array, not a list).

    Raises:
        ValueError: ``num_outputs`` differs from the number of inputs.
        TypeError: an input is not a tensor, or ``cast_narrow`` is not a bool.

    Example:
        >>> import torch
        >>> import ampkit.mxnet as amp
        >>> a, b = amp.amp_multicast(torch.ones(1), torch.ones(1, dtype=torch.float16),
        ...                          num_outputs=2, cast_narrow=True)
        >>> a.dtype, b.dtype
        (torch.float16, torch.float16)
    """
    if isinstance(num_outputs, bool) or not isinstance(num_outputs, int) or (
            num_outputs != len(data)):
        raise ValueError(f"num_outputs must equal the number of inputs ({len(data)}), "
                         f"got {num_outputs!r}")
    if not isinstance(cast_narrow, bool):
        raise TypeError(f"cast_narrow must be a bool, got {type(cast_narrow).__name__}")
    for i, d in enumerate(data):
        _check_tensor(d, f"data[{i}]")
    out = list(casting.amp_multicast(*data, cast_narrow=cast_narrow))
    return out[0] if len(out) == 1 else out


# -- lists ---------------------------------------------------------------------------------

def _target_dtype(target_dtype: Any) -> torch.dtype:
    try:  # np.float16 too
        return parse_dtype(target_dtype, "target_dtype", accept=_TARGET_DTYPES.values(),
                           aliases=False)
    except ValueError:  # MXNet's wording
        raise ValueError(f"target_dtype must be 'float16' or 'bfloat16' (or torch.float16 "
                         f"/ torch.bfloat16), got {target_dtype!r}") from None


def list_lp16_ops(target_dtype: str | torch.dtype = "float16") -> list[str]:
    """MXNet's default list of ops run in ``target_dtype`` (the names ampkit
    translates to torch ops).

    Example:
        >>> import ampkit.mxnet as amp
        >>> amp.list_lp16_ops("float16")
        ['Convolution', 'Deconvolution', 'FullyConnected', 'RNN']
    """
    low = _target_dtype(target_dtype)
    return list(MXNET_FP16_FUNCS if low is torch.float16 else MXNET_BF16_FUNCS)


def list_fp16_ops(target_dtype: str | torch.dtype = "float16") -> list[str]:
    """MXNet 1.x's name for :func:`list_lp16_ops`.

    Example:
        >>> import ampkit.mxnet as amp
        >>> amp.list_fp16_ops("bfloat16")
        ['Convolution', 'Deconvolution', 'FullyConnected']
    """
    return list_lp16_ops(target_dtype)


def list_fp32_ops(target_dtype: str | torch.dtype = "float16") -> list[str]:
    """MXNet's default list of ops run in float32 (the names ampkit translates).

    Example:
        >>> import ampkit.mxnet as amp
        >>> {"softmax", "LayerNorm", "exp"} <= set(amp.list_fp32_ops())
        True
    """
    low = _target_dtype(target_dtype)
    return list(MXNET_FP32_FUNCS if low is torch.float16 else MXNET_BF16_FP32_FUNCS)


def list_lp16_fp32_ops(target_dtype: str | torch.dtype = "float16") -> list[str]:
    """MXNet's default list of ops that run in ``target_dtype`` or float32 alike: ampkit
    runs them in their inputs' dtype (no cast). The names with a torch counterpart; no
    name is on two of the list functions' lists.

    Example:
        >>> import ampkit.mxnet as amp
        >>> {"reshape", "relu", "BatchNorm"} <= set(amp.list_lp16_fp32_ops("float16"))
        True
        >>> "reshape" in amp.list_lp16_fp32_ops("bfloat16")
        True
    """
    low = _target_dtype(target_dtype)
    return list(MXNET_FP16_FP32_FUNCS if low is torch.float16 else MXNET_BF16_BF16_FP32_FUNCS)


def list_loss_output_functions(target_dtype: str | torch.dtype = "float16") -> list[str]:
    """MXNet's loss output ops (``SoftmaxOutput``, ...), each a torch loss here
    (``cross_entropy``, ``mse_loss``, ``binary_cross_entropy_with_logits``,
    ``l1_loss``). MXNet scaled their gradients by the loss scale; in ampkit
    :func:`scale_loss` scales the loss itself, which is the same product.

    Example:
        >>> import ampkit.mxnet as amp
        >>> amp.list_loss_output_functions("bfloat16")[0]
        'SoftmaxOutput'
    """
    _target_dtype(target_dtype)
    return list(MXNET_LOSS_OUTPUT_FUNCTIONS)


def list_lp16_use_fp32_params(target_dtype: str | torch.dtype = "float16"
                              ) -> dict[str, list[str]] | None:
    """MXNet's ops whose parameters stay float32 with a low-precision input: ``None``
    for float16; for bfloat16, ``BatchNorm``'s (torch's names: ``weight``, ``bias``,
    ``running_mean``, ``running_var``; MXNet's ``gamma``, ``beta``, ``moving_mean``,
    ``moving_var``). :func:`convert_hybrid_block` with ``cast_optional_params`` keeps
    them float32 for both dtypes (batch_norm is on no low-precision list).

    Example:
        >>> import ampkit.mxnet as amp
        >>> amp.list_lp16_use_fp32_params("float16") is None
        True
        >>> amp.list_lp16_use_fp32_params("bfloat16")
        {'BatchNorm': ['weight', 'bias', 'running_mean', 'running_var']}
    """
    low = _target_dtype(target_dtype)
    if low is torch.float16:
        return None
    return {"BatchNorm": ["weight", "bias", "running_mean", "running_var"]}


def list_conditional_fp32_ops(target_dtype: str | torch.dtype = "float16"
                              ) -> list[tuple[str, str, list[str]]]:
    """MXNet's default conditional fp32 ops: ``(op, parameter, values)``.

    Example:
        >>> import ampkit.mxnet as amp
        >>> amp.list_conditional_fp32_ops()
        [('Activation', 'act_type', ['softrelu']), ('LeakyReLU', 'act_type', ['elu', 'selu'])]
    """
    _target_dtype(target_dtype)
    return [(op, param, list(values)) for op, param, values in MXNET_CONDITIONAL_FP32_FUNCS]


def list_widest_type_cast(target_dtype: str | torch.dtype = "float16") -> list[str]:
    """MXNet's ops that run in the widest type of their inputs (amp_multicast).

    Example:
        >>> import ampkit.mxnet as amp
        >>> {"elemwise_add", "Concat", "dot", "where"} <= set(amp.list_widest_type_cast())
        True
    """
    _target_dtype(target_dtype)
    return list(MXNET_WIDEST_TYPE_CASTS)


def _conditional(entries: Any, argument: str) -> frozenset[str]:
    if isinstance(entries, str | bytes) or not isinstance(entries, Iterable):
        raise TypeError(f"{argument} must be a list of (op name, parameter name, list of "
                        f"values) triples, got {type(entries).__name__}")
    ops: set[str] = set()
    for entry in entries:
        if (not isinstance(entry, list | tuple) or len(entry) != 3
                or not all(isinstance(x, str) for x in entry[:2])
                or isinstance(entry[2], str) or not isinstance(entry[2], Iterable)):
            raise TypeError(f"{argument}: each entry must be (op name, parameter name, list "
                            f"of values), got {entry!r}")
        op, param, values = entry
        for value in values:
            torch_op = CONDITIONAL_OPS.get((op, param, value))
            if torch_op is None:
                known = sorted(f"({o!r}, {p!r}, {v!r})" for o, p, v in CONDITIONAL_OPS)
                raise ValueError(f"{argument}: ({op!r}, {param!r}, {value!r}) has no torch "
                                 f"counterpart; known triples: {', '.join(known)}")
            ops.add(torch_op)
    return frozenset(ops)


def _check_mxnet_names(low: torch.dtype, target_ops: Any, fp32_ops: Any,
                       conditional_fp32_ops: Any, target_argument: str) -> None:
    """MXNet's own rules on its op names, which the torch ops they translate to cannot
    show: a conditional op's name (``"Activation"``) on no other list, and an MXNet
    name taken only from the four choosable lists (a widest-type op such as
    ``"elemwise_add"`` cannot be forced to one dtype)."""
    names = {argument: {e for e in entries if isinstance(e, str)}
             for argument, entries in ((target_argument, target_ops), ("fp32_ops", fp32_ops))
             if entries is not None and not isinstance(entries, str | bytes)
             and isinstance(entries, Iterable)}
    conditional = ({e[0] for e in conditional_fp32_ops if isinstance(e, list | tuple) and e
                    and isinstance(e[0], str)}
                   if isinstance(conditional_fp32_ops, list | tuple) else set())
    for argument, given in names.items():
        both = given & conditional
        if both:
            raise ValueError(f"ops {sorted(both)} are in both {argument} and "
                             f"conditional_fp32_ops; an op may be on one list only")
    choosable = (set(list_lp16_ops(low)) | set(list_fp32_ops(low))
                 | set(list_lp16_fp32_ops(low))
                 | {op for op, _, _ in MXNET_CONDITIONAL_FP32_FUNCS})
    for argument, given in names.items():
        widest = sorted((given & set(MXNET_WIDEST_TYPE_CASTS)) - choosable)
        if widest:
            raise ValueError(
                f"{argument}: {widest} run in the widest type of their inputs "
                f"(list_widest_type_cast()) and cannot be put on a list; choose ops from "
                f"list_lp16_ops(), list_fp32_ops(), list_lp16_fp32_ops() or "
                f"list_conditional_fp32_ops()")


def _build_policy(low: torch.dtype, target_ops: Iterable[OpEntry] | None,
                  fp32_ops: Iterable[OpEntry] | None, conditional_fp32_ops: Any,
                  target_argument: str) -> Policy:
    bf16 = low is torch.bfloat16
    _check_mxnet_names(low, target_ops, fp32_ops, conditional_fp32_ops, target_argument)
    lower = resolve_ops(
        (MXNET_BF16_FUNCS if bf16 else MXNET_FP16_FUNCS) if target_ops is None
        else target_ops, framework="mxnet", argument=target_argument)
    fp32 = resolve_ops(
        (MXNET_BF16_FP32_FUNCS if bf16 else MXNET_FP32_FUNCS) if fp32_ops is None
        else fp32_ops, framework="mxnet", argument="fp32_ops")
    conditional = _conditional(
        MXNET_CONDITIONAL_FP32_FUNCS if conditional_fp32_ops is None
        else conditional_fp32_ops, "conditional_fp32_ops")
    for a, a_ops, b, b_ops in ((target_argument, lower, "fp32_ops", fp32),
                               (target_argument, lower, "conditional_fp32_ops", conditional)):
        both = a_ops & b_ops
        if both:
            raise ValueError(f"ops {sorted(both)} are in both {a} and {b}; an op may be on "
                             f"one list only")
    fp32 = fp32 | conditional
    # The listed ops win over the widest-type casts, as in MXNet (its cast to the target
    # type is applied after the multicast).
    widest = resolve_ops(MXNET_WIDEST_TYPE_CASTS, framework="mxnet") - lower - fp32
    return Policy(name="mxnet", dtype=low, lower_precision_ops=lower, fp32_ops=fp32,
                  promote_ops=widest, unlisted="keep",
                  description="MXNet contrib.amp lists (ampkit.mxnet)")


# -- init ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Init:
    policy: Policy
    device_type: str
    scaler: LossScaler


class _ThreadRegion(threading.local):
    def __init__(self) -> None:
        self.region: autocast | None = None


_lock = threading.Lock()
_init: _Init | None = None
_thread = _ThreadRegion()


def _default_device() -> str:
    # MXNet's default context is the CPU until `with mx.gpu():`; torch's counterpart is
    # the default device, so a model on the CPU is cast even when CUDA is present.
    return torch.get_default_device().type


def init(target_dtype: str | torch.dtype = "float16",
         target_precision_ops: Iterable[OpEntry] | None = None,
         conditional_fp32_ops: Sequence[tuple[str, str, Sequence[str]]] | None = None,
         fp32_ops: Iterable[OpEntry] | None = None, *,
         device_type: str | None = None) -> None:
    """Turn AMP on for the calling thread: ops in ``target_precision_ops`` run in
    ``target_dtype``, ops in ``fp32_ops`` (and conditional ones) in float32, the
    widest-type ops in the widest input type, every other op as it is.

    Args:
        target_dtype: ``'float16'`` or ``'bfloat16'`` (or the torch dtype).
        target_precision_ops: replaces MXNet's default low-precision list.
        conditional_fp32_ops: replaces the default ``(op, parameter, values)`` list;
            translated to torch ops by :data:`CONDITIONAL_OPS`.
        fp32_ops: replaces MXNet's default float32 list.
        device_type: an ampkit extra: the device whose ops are cast; ``None`` is
            torch's default device (``torch.get_default_device()``: ``"cpu"`` unless
            ``torch.set_default_device`` changed it, like MXNet's default context),
            also when CUDA is present; pass ``"cuda"`` for a model on the GPU.

    Raises:
        ValueError: a bad dtype, an unknown op name or triple, an op on two lists.
        RuntimeError: ``init`` was already called with other arguments.

    Example:
        >>> import torch
        >>> import ampkit.mxnet as amp
        >>> amp.init("bfloat16", device_type="cpu")
        >>> torch.nn.functional.linear(torch.rand(2, 3), torch.rand(4, 3)).dtype
        torch.bfloat16
        >>> torch.rand(3).exp().dtype, torch.rand(2, 2).matmul(torch.rand(2, 2)).dtype
        (torch.float32, torch.float32)
        >>> amp.deinit()
    """
    low = _target_dtype(target_dtype)
    device = device_type or _default_device()
    policy = _build_policy(low, target_precision_ops, fp32_ops, conditional_fp32_ops,
                           "target_precision_ops")
    global _init
    with _lock:
        if _init is None:
            _init = _Init(policy, device, LossScaler(device=device))
        elif (_init.policy, _init.device_type) != (policy, device):
            raise RuntimeError("amp.init() was already called with other arguments; MXNet "
                               "AMP is initialized once per process (call amp.deinit() "
                               "first to start over)")
        current = _init
    if _thread.region is None:
        # No weight-cast cache: the region never closes, so cached low-precision copies
        # of the weights would outlive the optimizer steps that change the weights.
        region = autocast(current.device_type, current.policy.dtype, policy=current.policy,
                          cache_enabled=False)
        region.__enter__()
        _thread.region = region


def deinit() -> None:
    """An ampkit extra: close the region :func:`init` opened in the calling thread and
    forget the settings, so ``init`` may be called again. A no-op when not initialized.

    Raises:
        RuntimeError: another autocast region opened after ``init`` is still open.

    Example:
        >>> import torch
        >>> import ampkit.mxnet as amp
        >>> amp.init(device_type="cpu")
        >>> amp.deinit()
        >>> torch.nn.functional.linear(torch.rand(2, 3), torch.rand(4, 3)).dtype
        torch.float32
    """
    global _init
    with _lock:
        state = _init
    region = _thread.region
    if region is not None:
        if state is None or current_policy(region.device_type) is not region.policy:
            raise RuntimeError("amp.deinit(): another autocast region is open inside the "
                               "one amp.init() opened; leave it first")
        region.__exit__(None, None, None)
        _thread.region = None
    with _lock:
        _init = None


def _require_init(caller: str) -> _Init:
    with _lock:
        state = _init
    if state is None:
        raise RuntimeError(f"amp.{caller}(): AMP is not initialized; call amp.init() first")
    return state


# -- model conversion --------------------------------------------------------------------

def _low_precision_holders(model: nn.Module, policy: Policy) -> list[str]:
    """Names of the modules whose own parameters feed ops outside the low-precision
    list: with cast_optional_params they keep fp32 parameters (MXNet casts only the
    parameters that low-precision ops consume)."""
    kept = []
    for name, module in model.named_modules():
        if not any(True for _ in module.parameters(recurse=False)):
            continue
        op = next((MODULE_OPS[c] for c in type(module).__mro__ if c in MODULE_OPS), None)
        if op is None or op not in policy.lower_precision_ops:
            kept.append(name)
    return kept


def _convert_v1(block: nn.Module, target_dtype: str | torch.dtype = "float16",
                target_dtype_ops: Iterable[OpEntry] | None = None,
                fp32_ops: Iterable[OpEntry] | None = None,
                conditional_fp32_ops: Sequence[tuple[str, str, Sequence[str]]] | None = None,
                excluded_sym_names: Iterable[str] | None = None,
                ctx: str | torch.device | None = None, cast_optional_params: bool = False,
                *, device: str | torch.device | None = None,
                cast_params_offline: bool | None = None,
                data_example: Any = None) -> nn.Module:
    return _convert_block(block, target_dtype, target_dtype_ops, fp32_ops,
                          conditional_fp32_ops, excluded_sym_names, cast_optional_params,
                          data_example=data_example, device=device, ctx=ctx,
                          cast_params_offline=cast_params_offline)


def _convert_v2(block: nn.Module, data_example: Any, target_dtype: str | torch.dtype,
                target_dtype_ops: Iterable[OpEntry] | None = None,
                fp32_ops: Iterable[OpEntry] | None = None,
                conditional_fp32_ops: Sequence[tuple[str, str, Sequence[str]]] | None = None,
                excluded_sym_names: Iterable[str] | None = None,
                device: str | torch.device | None = None,
                cast_params_offline: bool | None = None, *,
                cast_optional_params: bool | None = None,
                ctx: str | torch.device | None = None) -> nn.Module:
    return _convert_block(block, target_dtype, target_dtype_ops, fp32_ops,
                          conditional_fp32_ops, excluded_sym_names,
                          bool(cast_optional_params), data_example=data_example,
                          device=device, ctx=ctx, cast_params_offline=cast_params_offline)


def convert_hybrid_block(block: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
    """Make ``block`` run in mixed precision by MXNet's lists (or the lists given):
    its forward runs the ops by the lists, excluded modules in float32, and its
    floating outputs come back as float32. Returns a converted copy and leaves
    ``block`` as it was, as MXNet returns a new block. Also MXNet's ``convert_model``
    (the same function: a torch model is its symbol and its parameters at once).

    Both MXNet signatures are accepted: 1.x's ``(block, target_dtype='float16',
    target_dtype_ops, fp32_ops, conditional_fp32_ops, excluded_sym_names, ctx,
    cast_optional_params)`` and 2.0's ``(block, data_example, target_dtype,
    target_dtype_ops, fp32_ops, conditional_fp32_ops, excluded_sym_names, device,
    cast_params_offline)``: a tensor (or list/tuple) second is 2.0's form.

    Args:
        block: an fp32 ``nn.Module``.
        target_dtype: ``'float16'`` or ``'bfloat16'``.
        target_dtype_ops, fp32_ops, conditional_fp32_ops: replace MXNet's default
            lists (as in :func:`init`).
        excluded_sym_names: qualified module names (as in ``named_modules()``) that run
            in float32.
        cast_optional_params: store in ``target_dtype`` the parameters of the modules
            whose op is on the low-precision list (Linear, Conv, RNN with the default
            lists); others stay fp32. ``cast_params_offline`` is MXNet 2.0's name.
        data_example: MXNet 2.0 traces the block with it; a torch module needs no
            trace, so it is only checked to be a tensor (or a list/tuple of tensors).
        device: where the block's parameters go (``block.to(device)``); ``None``:
            where they are. ``ctx`` is MXNet 1.x's name.

    Raises:
        ValueError: a bad dtype, an unknown op or module name, an op on two lists;
            ``cast_optional_params`` and ``cast_params_offline`` (or ``device`` and
            ``ctx``) both given and different.
        TypeError: ``block`` is not an ``nn.Module``; a wrong list type; a
            ``data_example`` that is not tensors.

    Example:
        >>> import torch
        >>> import ampkit.mxnet as amp
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Softmax(-1))
        >>> net = amp.convert_hybrid_block(net, "bfloat16")
        >>> net[0].weight.dtype, net(torch.rand(2, 3)).dtype
        (torch.float32, torch.float32)
        >>> amp.convert_model(torch.nn.Linear(3, 4), cast_optional_params=True).weight.dtype
        torch.float16
        >>> x = torch.rand(2, 3)                                  # MXNet 2.0's form
        >>> amp.convert_hybrid_block(torch.nn.Linear(3, 4), x, "bfloat16",
        ...                          cast_params_offline=True).weight.dtype
        torch.bfloat16
    """
    second = args[0] if args else kwargs.get("data_example")
    v2 = isinstance(second, torch.Tensor | list | tuple)
    form = _convert_v2 if v2 else _convert_v1
    try:
        bound = inspect.signature(form).bind(block, *args, **kwargs)
    except TypeError as error:
        which = ("MXNet 2.0's (block, data_example, target_dtype, ...)" if v2 else
                 "MXNet 1.x's (block, target_dtype='float16', ...)")
        raise TypeError(f"convert_hybrid_block: {error}; read as {which} form") from None
    return form(*bound.args, **bound.kwargs)


def _convert_block(block: nn.Module, target_dtype: Any, target_dtype_ops: Any,
                   fp32_ops: Any, conditional_fp32_ops: Any, excluded_sym_names: Any,
                   cast_optional_params: Any, *, data_example: Any, device: Any, ctx: Any,
                   cast_params_offline: bool | None) -> nn.Module:
    if data_example is not None and not all(
            isinstance(d, torch.Tensor) for d in (
                data_example if isinstance(data_example, list | tuple) else [data_example])):
        raise TypeError(f"data_example must be a tensor or a list/tuple of tensors, got "
                        f"{type(data_example).__name__}")
    if cast_params_offline is not None:
        if cast_optional_params and not cast_params_offline:
            raise ValueError("cast_optional_params=True and cast_params_offline=False "
                             "disagree; give one of them")
        cast_optional_params = cast_params_offline
    if device is not None and ctx is not None and torch.device(device) != torch.device(ctx):
        raise ValueError(f"device={device!r} and ctx={ctx!r} disagree; give one of them")
    place = device if device is not None else ctx
    if not isinstance(block, nn.Module):
        raise TypeError(f"block must be a torch.nn.Module, got {type(block).__name__}")
    if not isinstance(cast_optional_params, bool):
        raise TypeError(f"cast_optional_params must be a bool, got "
                        f"{type(cast_optional_params).__name__}")
    low = _target_dtype(target_dtype)
    policy = _build_policy(low, target_dtype_ops, fp32_ops, conditional_fp32_ops,
                           "target_dtype_ops")
    if excluded_sym_names is None:
        excluded: tuple[str, ...] = ()
    elif isinstance(excluded_sym_names, str) or not all(
            isinstance(n, str) for n in excluded_sym_names):
        raise TypeError("excluded_sym_names must be a list of qualified module names")
    else:
        excluded = tuple(excluded_sym_names)
    keep = excluded + (tuple(_low_precision_holders(block, policy))
                       if cast_optional_params else ())
    # A parameter shared with an fp32 module stays fp32: MXNet casts a parameter
    # offline only when every op that reads it is low precision, and casts it on use
    # for the low-precision ones otherwise.
    config = ConversionConfig(
        param_dtype=low if cast_optional_params else None, keep_fp32_modules=keep,
        compute_dtype=low, policy=policy, output_dtype=torch.float32,
        cast_shared_on_use=cast_optional_params)
    # MXNet returns a new block and leaves the given one as it was (its tests convert
    # one block twice, with other lists, and compare with the fp32 original).
    converted = copy.deepcopy(block)
    if place is not None:
        converted.to(place)
    return front_door.convert_model(converted, config)


# MXNet's convert_model takes a symbol and its parameters; a torch model is both, so
# the two names are one function (test_dialect_mxnet checks both).
convert_model = convert_hybrid_block


# -- loss scaling --------------------------------------------------------------------------

class LossScaler(GradScaler):
    """MXNet's dynamic loss scaler: starts at 2**16, halves on overflow (the step is
    skipped), doubles after 2000 clean steps, never above 2**24. A
    :class:`ampkit.GradScaler` with those settings, plus MXNet's ``loss_scale``.

    Example:
        >>> import ampkit.mxnet as amp
        >>> scaler = amp.LossScaler(device="cpu")
        >>> scaler.loss_scale, scaler.schedule.max_scale, scaler.get_growth_interval()
        (65536.0, 16777216.0, 2000)
    """

    def __init__(self, *, device: str | torch.device | None = None) -> None:
        super().__init__(device, init_scale=2.0 ** 16, growth_interval=2000,
                         max_scale=2.0 ** 24)

    @property
    def loss_scale(self) -> float:
        """The current loss scale.

        Example:
            >>> import ampkit.mxnet as amp
            >>> amp.LossScaler(device="cpu").loss_scale
            65536.0
        """
        return self.get_scale()


_scalers: weakref.WeakKeyDictionary[torch.optim.Optimizer, LossScaler] = (
    weakref.WeakKeyDictionary())


def _check_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer_or_trainer must be a torch.optim.Optimizer (Gluon's "
                        f"Trainer in MXNet), got {type(optimizer).__name__}")
    return optimizer


def _scaler_of(optimizer: torch.optim.Optimizer) -> LossScaler:
    scaler = _scalers.get(_check_optimizer(optimizer))
    if scaler is None:
        raise RuntimeError("this optimizer has no loss scaler; did you forget to call "
                           "amp.init_trainer(optimizer)?")
    return scaler


def init_trainer(optimizer_or_trainer: torch.optim.Optimizer) -> None:
    """Give the optimizer a dynamic loss scaler: its ``step()`` then unscales the
    gradients, skips the update when any is inf/NaN, and adjusts the scale.

    The first optimizer gets the scaler :func:`init` made, later ones a new one each
    (as in MXNet). The scaler is ``optimizer._amp_loss_scaler``.

    Raises:
        RuntimeError: :func:`init` was not called, or the optimizer already has one.
        TypeError: not a ``torch.optim.Optimizer``.

    Example:
        >>> import torch
        >>> import ampkit.mxnet as amp
        >>> amp.init(device_type="cpu")
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> opt = torch.optim.SGD([w], lr=1.0)
        >>> amp.init_trainer(opt)
        >>> with amp.scale_loss((w * float("inf")).sum(), opt) as scaled:
        ...     scaled.backward()
        >>> opt.step()                                   # overflow: skipped
        >>> w.tolist(), opt._amp_loss_scaler.loss_scale
        ([1.0, 1.0], 32768.0)
        >>> amp.deinit()
    """
    state = _require_init("init_trainer")
    optimizer = _check_optimizer(optimizer_or_trainer)
    if optimizer in _scalers:
        raise RuntimeError("amp.init_trainer() was already called for this optimizer")
    with _lock:
        handed_out = any(s is state.scaler for s in _scalers.values())
    scaler = LossScaler(device=state.device_type) if handed_out else state.scaler
    _scalers[optimizer] = scaler
    optimizer._amp_loss_scaler = scaler  # type: ignore[attr-defined]
    plain_step = optimizer.step
    stepping = threading.local()

    def step(*args: Any, **kwargs: Any) -> Any:
        # A Trainer's step under MXNet AMP: unscale, skip on overflow, update the scale.
        # The scaler calls optimizer.step() itself when nothing overflowed: that inner
        # call is the plain step.
        if getattr(stepping, "active", False):
            return plain_step(*args, **kwargs)
        stepping.active = True
        try:
            result = scaler.step(optimizer, *args, **kwargs)
        finally:
            stepping.active = False
        scaler.update()
        return result

    step.__wrapped__ = plain_step  # type: ignore[attr-defined]
    optimizer.step = step  # type: ignore[method-assign]


@contextlib.contextmanager
def scale_loss(loss: torch.Tensor | Sequence[torch.Tensor],
               optimizer_or_trainer: torch.optim.Optimizer
               ) -> Iterator[torch.Tensor | list[torch.Tensor]]:
    """Yield the loss (or a list of losses) times the optimizer's loss scale; call
    ``backward`` on it. The gradients stay scaled until ``optimizer.step()`` (or
    :func:`unscale`) divides them.

    Raises:
        RuntimeError: :func:`init_trainer` was not called for this optimizer.

    Example:
        >>> import torch
        >>> import ampkit.mxnet as amp
        >>> amp.init(device_type="cpu")
        >>> w = torch.nn.Parameter(torch.ones(1))
        >>> opt = torch.optim.SGD([w], lr=0.5)
        >>> amp.init_trainer(opt)
        >>> with amp.scale_loss(w.sum(), opt) as scaled:
        ...     scaled.backward()
        >>> w.grad.item()
        65536.0
        >>> opt.step()
        >>> w.item()
        0.5
        >>> amp.deinit()
    """
    scaler = _scaler_of(optimizer_or_trainer)
    if isinstance(loss, list | tuple):
        items: list[torch.Tensor] = list(loss)
        yield [scaler.scale(item) for item in items]
    else:
        one: torch.Tensor = loss  # type: ignore[assignment]  # not a list or tuple: a tensor
        yield scaler.scale(one)


def unscale(optimizer_or_trainer: torch.optim.Optimizer) -> None:
    """Divide the optimizer's gradients by the loss scale now (to clip or inspect
    them); its next ``step()`` does not divide again and still skips on inf/NaN.

    Raises:
        RuntimeError: no loss scaler (see :func:`init_trainer`), or the gradients were
            already unscaled in this iteration.

    Example:
        >>> import torch
        >>> import ampkit.mxnet as amp
        >>> amp.init(device_type="cpu")
        >>> w = torch.nn.Parameter(torch.ones(1))
        >>> opt = torch.optim.SGD([w], lr=0.5)
        >>> amp.init_trainer(opt)
        >>> with amp.scale_loss(3 * w.sum(), opt) as scaled:
        ...     scaled.backward()
        >>> amp.unscale(opt)
        >>> w.grad.item()
        3.0
        >>> amp.deinit()
    """
    _scaler_of(optimizer_or_trainer).unscale_(optimizer_or_trainer)
