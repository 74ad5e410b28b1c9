"""Paddle's ``decorate``: at O2, the models run in ``dtype`` (except normalization
layers and ``excluded_layers``) while the optimizers keep updating float32 weights; at
O1 (or OD), nothing changes.

Example:
    >>> import torch
    >>> from ampkit.dialects.paddle.model_decoration import decorate
    >>> model = decorate(torch.nn.Linear(2, 2), level="O1")
    >>> model.weight.dtype
    torch.float32
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ampkit import conversion
from ampkit.common.arguments import parse_dtype
from ampkit.conversion import ConversionConfig
from ampkit.dialects.paddle.region import check_bool, parse_low_dtype
from ampkit.torch_internals import BatchNormBase as _BatchNorm

__all__ = ["decorate"]


_SAVE_DTYPES: dict[str, torch.dtype] = {"float16": torch.float16, "bfloat16": torch.bfloat16,
                                        "float32": torch.float32}


# -- decorate ------------------------------------------------------------------------------

def _as_list(value: Any, kind: type, argument: str) -> tuple[list[Any], bool]:
    if isinstance(value, kind):
        return [value], True
    if isinstance(value, list | tuple) and value and all(isinstance(v, kind) for v in value):
        return list(value), False
    raise TypeError(f"{argument} must be a {kind.__module__}.{kind.__qualname__} or a "
                    f"non-empty list of them, got {type(value).__name__}")


def _excluded(excluded_layers: Any) -> tuple[Any, ...]:
    if excluded_layers is None:
        return ()
    items = (excluded_layers if isinstance(excluded_layers, list | tuple)
             else [excluded_layers])
    for item in items:
        if not (isinstance(item, nn.Module)
                or (isinstance(item, type) and issubclass(item, nn.Module))):
            raise TypeError(f"excluded_layers must be a layer, a layer class, or a list of "
                            f"them, got {item!r}")
    return tuple(items)


def decorate(models: nn.Module | list[nn.Module],
             optimizers: torch.optim.Optimizer | list[torch.optim.Optimizer] | None = None,
             level: str = "O1", dtype: str | torch.dtype = "float16",
             master_weight: bool | None = None, save_dtype: str | torch.dtype | None = None,
             master_grad: bool = False,
             excluded_layers: nn.Module | type | list[Any] | None = None) -> Any:
    """Paddle's ``decorate``: at O2, store the models' parameters in ``dtype`` (except
    BatchNorm, LayerNorm for float16, and ``excluded_layers``) and let the optimizers
    update fp32 master weights; at O1 (or OD) change nothing.

    Args:
        models: a module or a list of modules (fp32).
        optimizers: an optimizer, a list of them, or ``None``.
        level: ``'O1'``, ``'OD'`` or ``'O2'``.
        dtype: ``'float16'`` or ``'bfloat16'``.
        master_weight: O2 keeps fp32 master weights unless ``False``.
        save_dtype: ``model.state_dict()`` reports floating values in this dtype
            (``'float16'``, ``'bfloat16'``, ``'float32'``) instead of as stored.
        master_grad: Paddle's fp32 master gradients; ampkit's master weights always
            receive the gradients in fp32, so both values train the same.
        excluded_layers: layers (instances or classes) kept in fp32.

    Returns:
        ``models``, or ``(models, optimizers)`` when optimizers are given, each in the
        shape given (the same objects, changed in place).

    Raises:
        ValueError: a bad ``level``, ``dtype`` or ``save_dtype``; a model that is not
            fp32.
        TypeError: models or optimizers of the wrong type; ``master_weight`` not a bool
            or ``None``; ``master_grad`` not a bool; bad ``excluded_layers``.

    Example:
        >>> import torch
        >>> import ampkit.paddle as amp
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
        >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
        >>> net, opt = amp.decorate(net, opt, level="O2", dtype="bfloat16")
        >>> net[0].weight.dtype, net[1].weight.dtype  # fp32 truth, bf16 copies on use
        (torch.float32, torch.float32)
        >>> {p.dtype for g in opt.param_groups for p in g["params"]}
        {torch.float32}
    """
    if level not in ("O1", "OD", "O2"):
        raise ValueError(f"level should be 'O1', 'OD' or 'O2' (O1: mixed precision, O2: "
                         f"pure low precision), got {level!r}")
    model_list, one_model = _as_list(models, nn.Module, "models")
    opt_list, one_opt = (([], True) if optimizers is None else
                         _as_list(optimizers, torch.optim.Optimizer, "optimizers"))
    low = parse_low_dtype(dtype)
    if master_weight is not None:
        check_bool(master_weight, "master_weight")
    check_bool(master_grad, "master_grad")
    try:
        saved = parse_dtype(save_dtype, "save_dtype", accept=_SAVE_DTYPES.values(),
                            allow_none=True, aliases=False)
    except ValueError:  # Paddle's wording
        raise ValueError(f"save_dtype should be None or one of {list(_SAVE_DTYPES)}, got "
                         f"{save_dtype!r}") from None
    excluded = _excluded(excluded_layers)
    if level == "O2":
        kept: tuple[Any, ...] = (_BatchNorm,) + ((nn.LayerNorm,) if low is torch.float16
                                                 else ()) + excluded
        # master_weight (the default): the fp32 parameters stay the truth and the
        # layers compute with low-precision copies made on use; False: the
        # parameters themselves are stored in low precision (Paddle's pure fp16).
        masters = master_weight is not False
        config = ConversionConfig(param_dtype=None if masters else low,
                                  param_compute_dtype=low if masters else None,
                                  keep_fp32_modules=kept, kept_output_dtype=low,
                                  state_dict_dtype=saved)
        # Check every model before changing any, so a refused call changes nothing.
        plans = [conversion.prepare_conversion(m, config) for m in model_list]
        for model, plan in zip(model_list, plans):
            if plan is not None:
                conversion.apply_conversion(model, config, plan)
    out_models = model_list[0] if one_model else type(models)(model_list)
    if optimizers is None:
        return out_models
    kind: Any = type(optimizers)  # the list or tuple type the optimizers came in
    out_opts = opt_list[0] if one_opt else kind(opt_list)
    return out_models, out_opts
