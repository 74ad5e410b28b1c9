"""MXNet's model conversion: ``convert_hybrid_block`` (and its alias ``convert_model``)
makes a block run by MXNet's lists through :func:`ampkit.convert_model`, its outputs
cast back to float32.

Example:
    >>> import torch
    >>> from ampkit.dialects.mxnet.model_conversion import convert_hybrid_block
    >>> net = convert_hybrid_block(torch.nn.Linear(2, 2), "bfloat16")
    >>> net(torch.ones(1, 2)).dtype
    torch.float32
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn as nn

from ampkit import front_door
from ampkit.conversion import ConversionConfig
from ampkit.dialects.mxnet.lists import build_policy, parse_target_dtype
from ampkit.policies.policy import Policy
from ampkit.policies.registry import MODULE_OPS, OpEntry

__all__ = ["convert_hybrid_block", "convert_model"]


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
        target_dtype_ops: replaces MXNet's default list of ops run in
            ``target_dtype`` (as in :func:`init`).
        fp32_ops: replaces MXNet's default list of ops run in float32 (as in
            :func:`init`).
        conditional_fp32_ops: replaces MXNet's default list of ops run in float32 on a
            condition (as in :func:`init`).
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
    low = parse_target_dtype(target_dtype)
    policy = build_policy(low, target_dtype_ops, fp32_ops, conditional_fp32_ops,
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
