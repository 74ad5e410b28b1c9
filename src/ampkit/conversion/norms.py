"""The norms a conversion keeps in fp32, and the kernels that let a kept norm take its
low-precision activation as it is: :data:`NORM_MODULES` (what ``keep_norms_fp32``
keeps), :data:`MIXED_INPUT_NORMS` (torch kernels that compute in fp32 inside from a
low-precision input), LayerNorm on CPU through a function of its own, and the
saved-tensor hooks that keep the low-precision original, not its fp32 upcast, for the
backward of a kept norm whose input is cast.

Example:
    >>> import torch
    >>> from ampkit.conversion import MIXED_INPUT_NORMS, NORM_MODULES
    >>> torch.nn.LayerNorm in NORM_MODULES, torch.nn.BatchNorm2d in MIXED_INPUT_NORMS["cpu"]
    (True, True)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ampkit import torch_internals
from ampkit.common.arguments import LOW_PRECISION
from ampkit.common.containers import iter_tensors
from ampkit.conversion.classes import original_class

__all__ = ["LOW_INPUT_LAYER_NORM", "LOW_INPUT_LAYER_NORM_DEVICES", "MIXED_INPUT_NORMS",
           "NORM_MODULES", "SaveLowCopies", "low_contiguous", "saved_tensor_hooks_free",
           "takes_low_input", "updates_float_buffers"]

_LOW = LOW_PRECISION


def _norm_modules() -> tuple[type[nn.Module], ...]:
    norms: list[type[nn.Module]] = [torch_internals.BatchNormBase, nn.LayerNorm,
                                    nn.GroupNorm, torch_internals.InstanceNormBase]
    if hasattr(nn, "RMSNorm"):  # torch >= 2.4
        norms.append(nn.RMSNorm)
    return tuple(norms)


#: The modules ``keep_norms_fp32`` keeps in fp32: every BatchNorm (incl. SyncBatchNorm),
#: LayerNorm, GroupNorm, InstanceNorm and RMSNorm.
NORM_MODULES: tuple[type[nn.Module], ...] = _norm_modules()


class _LowCopy:
    """What autograd keeps instead of an fp32 upcast of a low-precision input: the input
    itself (half the bytes). Upcasting is exact, so unpacking gives the same bits."""

    __slots__ = ("low", "version")

    def __init__(self, low: torch.Tensor) -> None:
        self.low = low
        self.version = torch_internals.tensor_version(low)


class SaveLowCopies:
    """saved_tensors_hooks that store the low-precision original of each fp32 upcast a
    kept-fp32 module saves for backward (norms save their input), instead of the upcast.

    ``upcasts``: id(upcast) -> (upcast, original, upcast's version when made). Autograd
    keeps the hook functions with every tensor saved meanwhile, so the table is emptied
    on exit: otherwise it would keep the fp32 upcasts alive as long as the graph."""

    __slots__ = ("hooks", "upcasts")

    def __init__(self, upcasts: dict[int, tuple[torch.Tensor, torch.Tensor, int]]) -> None:
        self.upcasts = upcasts
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack_low_copy)

    def _pack(self, tensor: torch.Tensor) -> Any:
        entry = self.upcasts.get(id(tensor))
        # Only the untouched upcast itself: a view or an in-place-modified copy differs.
        if entry is not None and entry[0] is tensor and \
                torch_internals.tensor_version(tensor) == entry[2]:
            return _LowCopy(entry[1])
        return tensor

    def __enter__(self) -> None:
        self.hooks.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.hooks.__exit__(*exc)
        self.upcasts.clear()


def _unpack_low_copy(packed: Any) -> torch.Tensor:
    if not isinstance(packed, _LowCopy):
        unchanged: torch.Tensor = packed
        return unchanged
    if torch_internals.tensor_version(packed.low) != packed.version:
        raise RuntimeError("one of the variables needed for gradient computation has been "
                           "modified by an inplace operation: the low-precision input of a "
                           "kept-fp32 module (ampkit saved it in place of its fp32 copy)")
    return packed.low.to(torch.float32)


def saved_tensor_hooks_free() -> bool:
    """True when no other saved-tensor hooks are active (activation checkpointing and
    offloading use them; ours must not shadow theirs)."""
    return torch_internals.saved_tensors_hooks_free()


def _mixed_input_norms() -> dict[str, tuple[type[nn.Module], ...]]:
    """Per device type, the norm classes whose torch kernels take a low-precision input
    with fp32 weight, bias and running statistics, compute in fp32 inside and return the
    input's dtype, with gradients as exact as the fp32 computation's. Exact classes only:
    a subclass may override ``forward`` with ops that would then run in low precision.

    Checked against float64 on torch 2.13 CPU (output, input gradient, weight and bias
    gradients, running statistics; bfloat16 and float16): BatchNorm, GroupNorm and
    InstanceNorm match the cast-to-fp32 path to fp32 rounding. Left out on purpose:

    * LayerNorm: the CPU kernel takes mixed input, but its backward accumulates the
      weight and bias gradients in the input's dtype (1-2% relative error in bfloat16),
      so on CPU it runs through :class:`_LowInputLayerNorm` instead (see
      :data:`LOW_INPUT_LAYER_NORM_DEVICES`); CUDA refuses mixed input (torch 2.11:
      "expected scalar type BFloat16 but found Float").
    * RMSNorm: with mixed dtypes ``F.rms_norm`` falls back to a composite that upcasts
      the input itself and rounds twice, so nothing is saved.
    * SyncBatchNorm, and on CUDA GroupNorm (refuses mixed input, torch 2.11) and
      InstanceNorm (not checked on a GPU).

    CUDA BatchNorm (native and cuDNN kernels) takes mixed input: measured on an H100
    with torch 2.11, and the way apex's O2 has always run it.

    Even for these classes the input is still cast (see :func:`takes_low_input` and
    :func:`low_contiguous`) when the norm has no weight or bias (``affine=False``: torch
    then runs its all-low-precision kernel, several ulps off), when the input is not
    contiguous (channels-last and strided inputs take CPU kernels whose mixed backward
    sums the bias gradient in low precision) and when it is in the other low dtype
    (it would be rounded twice)."""
    from torch.nn.modules import batchnorm, instancenorm

    batch = (batchnorm.BatchNorm1d, batchnorm.BatchNorm2d, batchnorm.BatchNorm3d)
    instance = (instancenorm.InstanceNorm1d, instancenorm.InstanceNorm2d,
                instancenorm.InstanceNorm3d)
    return {"cpu": (*batch, nn.GroupNorm, *instance), "cuda": batch}


#: Per device type, the kept-fp32 norm classes that take the low-precision activation
#: as it is (see :func:`_mixed_input_norms`): no fp32 copy of their input is made.
MIXED_INPUT_NORMS: dict[str, tuple[type[nn.Module], ...]] = _mixed_input_norms()


#: Device types on which a kept-fp32 ``nn.LayerNorm`` takes the low-precision
#: activation as it is, through :class:`_LowInputLayerNorm`.
LOW_INPUT_LAYER_NORM_DEVICES: tuple[str, ...] = ("cpu",)


class _LowInputLayerNorm(torch.autograd.Function):
    """``F.layer_norm`` of a low-precision input with fp32 weight and bias, fp32
    statistics and fp32 arithmetic, without an fp32 copy of the input in the forward.

    Forward and input gradient: torch's mixed-dtype kernels (bit-equal, on torch 2.13
    CPU, to normalising an fp32 copy and rounding). Weight and bias gradients: torch's
    fp32 kernel on fp32 copies of the input and the incoming gradient, made only in the
    backward and only when those gradients are needed, because the mixed kernel sums
    them in the input's dtype. A backward with ``create_graph=True`` (double backward,
    gradient penalties) differentiates ``F.layer_norm`` of an fp32 copy instead, so it
    can be differentiated again."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, normalized_shape: Any, weight: Any, bias: Any,
                eps: float) -> torch.Tensor:
        out, mean, rstd = torch.native_layer_norm(x, normalized_shape, weight, bias, eps)
        ctx.save_for_backward(x, mean, rstd, weight, bias)
        ctx.normalized_shape = normalized_shape
        ctx.eps = eps
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, mean, rstd, weight, bias = ctx.saved_tensors
        needs_x, _, needs_w, needs_b, _ = ctx.needs_input_grad
        if torch.is_grad_enabled():  # create_graph=True: a backward autograd can follow
            x32 = x.float()
            wanted = [(i, t) for i, t in ((0, x32), (2, weight), (3, bias))
                      if ctx.needs_input_grad[i]]
            out = F.layer_norm(x32, ctx.normalized_shape, weight, bias, ctx.eps)
            grads = torch.autograd.grad(out, [t for _, t in wanted], grad.float(),
                                        create_graph=True)
            result: list[Any] = [None] * 5
            for (i, _), g in zip(wanted, grads):
                result[i] = g
            if result[0] is not None:
                result[0] = result[0].to(x.dtype)
            return tuple(result)
        backward = torch.ops.aten.native_layer_norm_backward
        shape = ctx.normalized_shape
        grad_x = grad_w = grad_b = None
        if needs_x:
            grad_x = backward(grad, x, shape, mean, rstd, weight, bias,
                              [True, False, False])[0]
        if needs_w or needs_b:
            _, grad_w, grad_b = backward(grad.float(), x.float(), shape, mean, rstd, weight,
                                         bias, [False, needs_w, needs_b])
        return grad_x, None, grad_w, grad_b, None


def _is_fp32(t: Any) -> bool:
    return t is None or (isinstance(t, torch.Tensor) and t.dtype is torch.float32)


class _LayerNormFromLowInput(torch.overrides.TorchFunctionMode):
    """Entered around a kept ``nn.LayerNorm``'s forward: its ``F.layer_norm`` call
    goes to :class:`_LowInputLayerNorm`."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.layer_norm:
            bound = dict(zip(("input", "normalized_shape", "weight", "bias", "eps"), args))
            bound.update(kwargs)
            x, weight, bias = bound["input"], bound.get("weight"), bound.get("bias")
            if x.dtype in _LOW and _is_fp32(weight) and _is_fp32(bias):
                return _LowInputLayerNorm.apply(  # type: ignore[no-untyped-call]
                    x, tuple(bound["normalized_shape"]), weight, bias, bound.get("eps", 1e-5))
        return func(*args, **kwargs)


LOW_INPUT_LAYER_NORM = _LayerNormFromLowInput()


def takes_low_input(module: nn.Module, device_type: str,
                     module_type: type | None = None) -> bool:
    # ``module_type``: the class the module had when converted; FSDP2 swaps in a
    # subclass of its own (FSDPBatchNorm1d), which must still count as the norm it is.
    # Only with an fp32 weight or bias: without one (affine=False, the InstanceNorm
    # default) torch runs its all-low-precision kernels (running statistics alone do not
    # always switch InstanceNorm to the mixed one), several ulps off in output and
    # input gradient.
    cls = module_type or original_class(type(module))
    return (cls in MIXED_INPUT_NORMS.get(device_type, ()) or (
        cls is nn.LayerNorm and device_type in LOW_INPUT_LAYER_NORM_DEVICES)) and any(
        p is not None and p.dtype is torch.float32
        for p in torch_internals.module_parameters(module).values())



def low_contiguous(args: Any, dtype: torch.dtype) -> bool:
    """Every floating input is contiguous and already in ``dtype``, the kept output
    dtype. Another low dtype would be rounded twice (in the kernel, then by the output
    cast). Channels-last and strided inputs take other CPU kernels, whose mixed-dtype
    backward sums in low precision (BatchNorm's bias gradient 1e-3 off in bfloat16);
    on CUDA too, where no other layout has been checked."""
    return all(t.dtype is dtype and t.is_contiguous()
               for t in iter_tensors(args) if t.is_floating_point())



def updates_float_buffers(module: nn.Module) -> bool:
    """A norm that updates fp32 running statistics in place (BatchNorm, InstanceNorm
    with ``track_running_stats``). Cast on use, its parameters would be low precision
    next to fp32 statistics, which torch's kernels refuse; its statistics cannot be
    copies either, or their updates would be lost. So at O2 it computes with its fp32
    parameters even when norms are not kept (``keep_norms_fp32=False``), taking the
    low-precision activation as it is."""
    return isinstance(module, torch_internals.NormBase) and any(
        b is not None and b.is_floating_point()
        for b in torch_internals.module_buffers(module).values())

