"""apex's ``amp.initialize``: its opt_level (:mod:`~ampkit.dialects.apex.opt_levels`)
and overrides, checked as apex checks them, then carried out by
:func:`ampkit.initialize` with the core's names and meanings, the core's refusals
arriving in apex's words.

Example:
    >>> import torch
    >>> from ampkit.dialects.apex.frontend import initialize
    >>> initialize(torch.nn.Linear(2, 2), opt_level="O3", verbosity=0).weight.dtype
    torch.float16
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

from ampkit.dialects._errors import framework_errors
from ampkit.dialects.apex.handle import AmpHandle
from ampkit.dialects.apex.opt_levels import (
    OPT_LEVELS,
    Properties,
    apply_overrides,
    dtype_override,
)
from ampkit.dialects.apex.optimizers import inner_optimizers
from ampkit.dialects.apex.state import amp_state, set_properties
from ampkit.front_door import initialize as _initialize
from ampkit.policies.presets import APEX_O1
from ampkit.torch_internals import BatchNormBase as _BatchNorm

__all__ = ["initialize"]

# ampkit's names in the core's errors -> apex's.
_APEX_NAMES = {"level": "opt_level", "keep_norms_fp32": "keep_batchnorm_fp32",
               "patch_ops": "patch_torch_functions"}

_BRIEF = {
    "O0": "pure FP32 training",
    "O1": "casts inserted around torch functions and Tensor methods (apex's O1 lists)",
    "O2": "low-precision model, FP32 batchnorm and FP32 master weights, dynamic loss "
          "scaling",
    "O3": "pure low-precision training",
}


def _check_fp32(models: list[nn.Module]) -> None:
    if amp_state.allow_incoming_model_not_fp32:
        return  # apex's switch for its own check; the core still has its say
    for i, model in enumerate(models):
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if tensor.is_floating_point() and tensor.dtype is not torch.float32:
                raise RuntimeError(f"models[{i}]: found {name!r} of dtype {tensor.dtype}, "
                                   f"expected torch.float32; amp.initialize takes the FP32 "
                                   f"model as it is, whatever the opt_level (do not call "
                                   f".half() on it first)")


def _core_overrides(props: Properties, low: torch.dtype) -> dict[str, Any]:
    """apex's properties as the core's level overrides (names and meanings)."""
    level = props.opt_level
    cast = props.cast_model_type
    # cast_model_type=False: the core's "the model as given" (nothing cast, float16
    # parameters taken as they are once apex's own fp32 check let them through).
    if cast is None and amp_state.allow_incoming_model_not_fp32:
        cast = False  # apex's O1 casts no parameter: a non-fp32 model runs as given
    overrides: dict[str, Any] = {"loss_scale": props.loss_scale}
    if cast not in (None, False):
        # apex's model.state_dict() holds float32 wherever it casts the model (O2, O3).
        overrides["state_dict_dtype"] = torch.float32
        # apex casts the model with model.half() (or .to(dtype)): floating buffers too,
        # where the core keeps them. Only where parameters are stored low does it show
        # (O3; O2 with master_weights=False); O2's fp32 truth casts nothing stored.
        overrides["cast_buffers"] = True
    if level == "O1":
        overrides["cast_model_type"] = cast
        overrides["keep_norms_fp32"] = props.keep_batchnorm_fp32
        overrides["master_weights"] = props.master_weights
        if props.cast_model_outputs is not None:
            overrides["cast_model_outputs"] = props.cast_model_outputs
    else:
        # apex keeps BatchNorm only (ampkit's norms default would keep LayerNorm too).
        overrides["cast_model_type"] = cast
        overrides["keep_norms_fp32"] = False
        overrides["keep_fp32_modules"] = [_BatchNorm] if props.keep_batchnorm_fp32 else []
        overrides["master_weights"] = bool(props.master_weights)
        overrides["patch_ops"] = props.patch_torch_functions
        # apex casts outputs only where it casts the model (cast_model_type given).
        if props.cast_model_type is not False:
            overrides["cast_model_outputs"] = props.cast_model_outputs or torch.float32
    if props.patch_torch_functions:
        overrides["policy"] = APEX_O1
    return overrides


def initialize(models: nn.Module | Sequence[nn.Module],
               optimizers: Any = None, enabled: bool = True, opt_level: str = "O1",
               cast_model_type: torch.dtype | bool | None = None,
               patch_torch_functions: bool | None = None,
               keep_batchnorm_fp32: bool | str | None = None,
               master_weights: bool | None = None, loss_scale: float | str | None = None,
               cast_model_outputs: torch.dtype | None = None, num_losses: int = 1,
               verbosity: int = 1, min_loss_scale: float | None = None,
               max_loss_scale: float = 2.0 ** 24, *,
               dtype: torch.dtype | None = None) -> Any:
    """apex's ``amp.initialize``: apply an opt_level to models and optimizers.

    Args:
        models: a model or a list of models (FP32, not yet wrapped in DataParallel/DDP).
        optimizers: an optimizer (or an apex-style wrapper of one, ``.optim``: apex's
            LARC), a list of them, or ``None``.
        enabled: ``False`` returns everything unchanged and makes :func:`scale_loss`
            yield the loss as it is.
        opt_level: ``"O0"``, ``"O1"``, ``"O2"`` or ``"O3"`` (the letter O).
        cast_model_type: and ``patch_torch_functions``, ``keep_batchnorm_fp32``,
            ``master_weights``, ``loss_scale``, ``cast_model_outputs``: override the
            opt_level's properties (``None`` keeps its default); ``cast_model_type``
            may be ``torch.bfloat16``, or ``False`` to leave the model as it is.
        num_losses: how many ``loss_id`` values :func:`scale_loss` takes.
        verbosity: 0 prints nothing; 1 prints the properties chosen.
        min_loss_scale: the lower bound of the dynamic loss scale.
        max_loss_scale: the upper bound of the dynamic loss scale.
        dtype: an ampkit extra: the low-precision dtype (``torch.float16`` by default,
            ``torch.bfloat16``); O1 casts ops to it.

    Returns:
        ``models`` when ``optimizers`` is ``None``, else ``(models, optimizers)``, in the
        shape given.

    Raises:
        RuntimeError: an unknown ``opt_level``, a nonsensical override (the core's
            refusals, in apex's words), a model that is not FP32 or already wrapped.
        ValueError: a bad override value, or ``dtype`` contradicting
            ``cast_model_type``.

    Example:
        >>> import torch
        >>> import ampkit.apex as amp
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
        >>> model = amp.initialize(model, opt_level="O3", keep_batchnorm_fp32=True,
        ...                        verbosity=0)
        >>> model[0].weight.dtype, model[1].weight.dtype, model(torch.rand(3, 2)).dtype
        (torch.float16, torch.float32, torch.float32)
        >>> amp.initialize(torch.nn.Linear(2, 2), opt_level="O1", master_weights=True)
        Traceback (most recent call last):
        ...
        RuntimeError: opt_level O1 keeps fp32 parameters, so there is nothing for ...
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    if isinstance(verbosity, bool) or not isinstance(verbosity, int) or verbosity < 0:
        raise ValueError(f"verbosity must be an int >= 0, got {verbosity!r}")
    if not enabled:
        set_properties(dataclasses.replace(OPT_LEVELS["O0"], enabled=False))
        return models if optimizers is None else (models, optimizers)
    if opt_level not in OPT_LEVELS:
        raise RuntimeError(f"unexpected opt_level {opt_level!r}; options are 'O0', 'O1', "
                           f"'O2', 'O3' (the letter O, not the digit zero)")
    props = apply_overrides(opt_level, {
        "cast_model_type": cast_model_type, "patch_torch_functions": patch_torch_functions,
        "keep_batchnorm_fp32": keep_batchnorm_fp32, "master_weights": master_weights,
        "loss_scale": loss_scale, "cast_model_outputs": cast_model_outputs})
    low = props.cast_model_type if props.cast_model_type in (torch.float16,
                                                              torch.bfloat16) else None
    if dtype is not None:
        dtype = dtype_override(dtype, "dtype")
        if dtype is torch.float32:
            raise ValueError("dtype is the low-precision dtype: torch.float16 or "
                             "torch.bfloat16, got torch.float32")
        if cast_model_type is not None and low is not None and dtype is not low:
            raise ValueError(f"dtype ({dtype}) contradicts cast_model_type ({low}); pass one")
        if low is not None:  # O2/O3 without cast_model_type: the model is cast to dtype
            props = dataclasses.replace(props, cast_model_type=dtype)
            low = dtype
    low = low or dtype or torch.float16

    model_list = [models] if isinstance(models, nn.Module) else models
    if not isinstance(model_list, list | tuple) or not all(
            isinstance(m, nn.Module) for m in model_list):
        raise TypeError(f"models must be a torch.nn.Module or a list of them, got "
                        f"{type(models).__name__}")
    _check_fp32(list(model_list))

    inner = None if optimizers is None else inner_optimizers(optimizers)
    with framework_errors(names=_APEX_NAMES, types={ValueError: RuntimeError}):
        checked: Any = models  # a module, or a list or tuple of them (checked above)
        result = _initialize(checked, inner, level=opt_level, dtype=low,
                             num_losses=num_losses, min_scale=min_loss_scale,
                             max_scale=max_loss_scale, **_core_overrides(props, low))
    set_properties(props)
    amp_state.handle = (AmpHandle(allow_banned=False, scaling=False)
                         if props.patch_torch_functions else None)
    if verbosity > 0:
        print(f"ampkit.apex: selected opt_level {opt_level}: {_BRIEF[opt_level]}, "
              f"low-precision dtype {low}")
        print(props.describe())
    # The core's optimizers are the ones given (changed in place); apex's wrappers
    # (LARC) go back as they came.
    return result if optimizers is None else (result[0], optimizers)
