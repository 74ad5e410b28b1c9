"""MindSpore's network conversion: ``auto_mixed_precision`` (its levels O0-O3),
``custom_mixed_precision`` (your white or black list) and the built-in lists
(``get_white_list``, ``get_black_list``), carried out by :func:`ampkit.convert_model`.

Example:
    >>> import torch
    >>> from ampkit.dialects.mindspore.mixed_precision import auto_mixed_precision
    >>> net = auto_mixed_precision(torch.nn.Linear(2, 2), "O2", torch.bfloat16)
    >>> net(torch.ones(1, 2)).dtype
    torch.float32
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ampkit import front_door
from ampkit.common.arguments import LOW_PRECISION, parse_dtype
from ampkit.conversion import ALL_LOW_PRECISION, ConversionConfig
from ampkit.engine.regions import autocast
from ampkit.policies.policy import Policy
from ampkit.policies.presets import MINDSPORE_AUTO
from ampkit.policies.registry import OpEntry, resolve_ops

__all__ = ["auto_mixed_precision", "custom_mixed_precision", "get_black_list",
           "get_white_list"]


_LEVELS = ("O0", "O1", "O2", "O3", "auto")

# The seed's white list, in its order: cells first, then ops.
_WHITE_LIST: tuple[Any, ...] = (
    nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
    nn.ConvTranspose3d, nn.Linear, nn.LSTMCell, nn.RNNCell, nn.GRUCell,
    F.conv2d, F.conv3d, F.conv_transpose2d, F.conv_transpose3d, torch.matmul, torch.bmm,
    F.prelu, F.relu, torch.outer,
)
_BLACK_LIST: tuple[Any, ...] = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.LayerNorm)

# MindSpore cell names (strings in custom lists) -> torch module classes. Op names
# (``MatMul``, ``Conv2D``, ``ReLU``, ...) go through the registry's alias table.
_CELLS: dict[str, type[nn.Module]] = {
    "Dense": nn.Linear, "Conv1d": nn.Conv1d, "Conv2d": nn.Conv2d, "Conv3d": nn.Conv3d,
    "Conv1dTranspose": nn.ConvTranspose1d, "Conv2dTranspose": nn.ConvTranspose2d,
    "Conv3dTranspose": nn.ConvTranspose3d, "LSTMCell": nn.LSTMCell, "RNNCell": nn.RNNCell,
    "GRUCell": nn.GRUCell, "LSTM": nn.LSTM, "GRU": nn.GRU, "RNN": nn.RNN,
    "BatchNorm1d": nn.BatchNorm1d, "BatchNorm2d": nn.BatchNorm2d,
    "BatchNorm3d": nn.BatchNorm3d, "LayerNorm": nn.LayerNorm, "GroupNorm": nn.GroupNorm,
    "InstanceNorm1d": nn.InstanceNorm1d, "InstanceNorm2d": nn.InstanceNorm2d,
    "InstanceNorm3d": nn.InstanceNorm3d, "Embedding": nn.Embedding,
}


def get_white_list() -> list[Any]:
    """A copy of the built-in white list: torch module classes and op callables, in
    the seed's order.

    Example:
        >>> import torch
        >>> import ampkit.mindspore as amp
        >>> white = amp.get_white_list()
        >>> len(white), torch.nn.Linear in white, torch.matmul in white
        (19, True, True)
    """
    return list(_WHITE_LIST)


def get_black_list() -> list[Any]:
    """A copy of the built-in black list: BatchNorm1d/2d/3d and LayerNorm.

    Example:
        >>> import ampkit.mindspore as amp
        >>> [c.__name__ for c in amp.get_black_list()]
        ['BatchNorm1d', 'BatchNorm2d', 'BatchNorm3d', 'LayerNorm']
    """
    return list(_BLACK_LIST)


def check_network(network: Any, *, functions_too: bool = False) -> nn.Module:
    if not isinstance(network, nn.Module):
        kinds = ("a torch.nn.Module (a Cell in MindSpore) or, at amp_level 'auto', a "
                 "function") if functions_too else "a torch.nn.Module (a Cell in MindSpore)"
        raise TypeError(f"network must be {kinds}, got {type(network).__name__}")
    return network


def _low_dtype(dtype: Any) -> torch.dtype:
    # MindSpore's dtype rule and error are the core's (float16 or bfloat16).
    return parse_dtype(dtype, "dtype", accept=LOW_PRECISION)


def _split(entries: Any, argument: str) -> tuple[tuple[type, ...], frozenset[str]]:
    """A custom list's modules (classes, MindSpore cell names) and ops (everything else:
    torch or MindSpore op names, callables)."""
    if isinstance(entries, str | bytes) or not isinstance(entries, Iterable):
        raise TypeError(f"{argument} must be a list of module classes and ops, got "
                        f"{type(entries).__name__}")
    modules: list[type] = []
    ops: list[OpEntry] = []
    for entry in entries:
        if isinstance(entry, type) and issubclass(entry, nn.Module):
            modules.append(entry)
        elif isinstance(entry, str) and entry in _CELLS:
            modules.append(_CELLS[entry])
        else:
            ops.append(entry)
    return tuple(modules), resolve_ops(ops, framework="mindspore", argument=argument)


def _entries(entries: Any, argument: str) -> list[Any]:
    if entries is None:
        return []
    if isinstance(entries, str | bytes) or not isinstance(entries, Iterable):
        raise TypeError(f"{argument} must be a list of module classes and ops, got "
                        f"{type(entries).__name__}")
    return list(entries)


def _white_list_config(white_list: Any, low: torch.dtype, argument: str) -> ConversionConfig:
    modules, ops = _split(white_list, argument)
    # Everything outside the white list runs in float32: so do the ops that consume the
    # low-precision output of a white-listed op (MindSpore casts that output back).
    policy = Policy(name="mindspore-white-list", lower_precision_ops=ops, unlisted="fp32",
                    description="MindSpore O1: the white list in low precision, all else "
                                "float32.")
    return ConversionConfig(low_precision_modules=modules, white_list_output_dtype=torch.float32,
                            compute_dtype=low, policy=policy, output_dtype=torch.float32,
                            params_as_given=True)


def _black_list_config(black_list: Any, low: torch.dtype, argument: str) -> ConversionConfig:
    modules, ops = _split(black_list, argument)
    policy = (ALL_LOW_PRECISION if not ops else Policy(
        name="mindspore-black-list", fp32_ops=ops, unlisted="lower",
        description="MindSpore O2: all in low precision except the black list."))
    # The network's floating inputs, float64 included, in ``low`` (MindSpore's
    # ``to_float`` of the whole network), not only those an op casts.
    return ConversionConfig(keep_fp32_modules=modules, kept_output_dtype=low,
                            compute_dtype=low, policy=policy, input_dtype=low,
                            output_dtype=torch.float32, params_as_given=True)


def _convert(network: nn.Module, config: ConversionConfig) -> nn.Module:
    # MindSpore converts a network whatever dtype its parameters hold (its own tests
    # build a float16 weight) and leaves each as the user set it: the core's
    # params_as_given; the casts on use make every op see the level's dtypes.
    return front_door.convert_model(network, config)


def _auto_function(function: Callable[..., Any], low: torch.dtype) -> Callable[..., Any]:
    """A plain function run by MindSpore's "auto" lists: each call inside an
    ``ampkit.autocast`` region on torch's default device (where the function's tensors
    are created, as MindSpore's are on its one device)."""
    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        with autocast(torch.get_default_device().type, low, policy=MINDSPORE_AUTO):
            return function(*args, **kwargs)
    return run


def auto_mixed_precision(network: Any, amp_level: str = "O0",
                         dtype: torch.dtype | str = torch.float16) -> Any:
    """MindSpore's ``auto_mixed_precision``: apply a level (see the module docstring)
    to ``network``, in place, and return it.

    ``"auto"`` (MindSpore 2.3 and later) runs ops by MindSpore's built-in lists
    (``ampkit.policies.presets.MINDSPORE_AUTO``): its white list in ``dtype``, its black list
    in float32, its promote list in the widest input type, every other op in its
    inputs' dtype, and the outputs as computed. At ``"auto"`` ``network`` may also be
    a plain function, returned wrapped so that each call runs by those lists on
    torch's default device.

    A network whose parameters are not all float32 (a float16 weight the user set) is
    converted as well; every parameter keeps the dtype it has.

    Args:
        network: an ``nn.Module`` (at ``"auto"`` also a function).
        amp_level: ``"O0"``, ``"O1"``, ``"O2"``, ``"O3"`` or ``"auto"``.
        dtype: ``torch.float16`` or ``torch.bfloat16`` (or ``"float16"`` /
            ``"bfloat16"``).

    Raises:
        TypeError: ``network`` is not an ``nn.Module`` (or, at ``"auto"``, a function).
        ValueError: ``amp_level`` not supported; ``dtype`` neither float16 nor bfloat16.

    Example:
        >>> import torch
        >>> import ampkit.mindspore as amp
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Softmax(-1))
        >>> net = amp.auto_mixed_precision(net, "O1")
        >>> seen = []
        >>> _ = net[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
        >>> net(torch.rand(2, 4)).dtype, seen
        (torch.float32, [torch.float32])
        >>> matmul = amp.auto_mixed_precision(lambda a, b: a @ b, "auto")
        >>> matmul(torch.rand(2, 2), torch.rand(2, 2)).dtype
        torch.float16
    """
    if amp_level not in _LEVELS:
        raise ValueError(f"amp_level must be one of {list(_LEVELS)}, got {amp_level!r}")
    if amp_level == "auto" and isinstance(network, types.FunctionType | types.MethodType
                                          | functools.partial):
        return _auto_function(network, _low_dtype(dtype))
    check_network(network, functions_too=amp_level == "auto")
    low = _low_dtype(dtype)
    if amp_level == "O0":
        return network
    if amp_level == "O1":
        return _convert(network, _white_list_config(_WHITE_LIST, low, "white_list"))
    if amp_level == "O2":
        return _convert(network, _black_list_config(_BLACK_LIST, low, "black_list"))
    if amp_level == "auto":
        return _convert(network, ConversionConfig(compute_dtype=low, policy=MINDSPORE_AUTO,
                                                  params_as_given=True))
    return _convert(network, ConversionConfig(compute_dtype=low, policy=ALL_LOW_PRECISION,
                                              input_dtype=low, output_dtype=torch.float32,
                                              params_as_given=True))


def custom_mixed_precision(network: nn.Module, *, white_list: Sequence[Any] | None = None,
                           black_list: Sequence[Any] | None = None,
                           dtype: torch.dtype | str = torch.float16) -> nn.Module:
    """MindSpore's ``custom_mixed_precision``. Entries: ``nn.Module`` classes,
    MindSpore cell names (``"Dense"``), ops (torch or MindSpore names, callables).

    * ``white_list`` alone: O1 with your white list (those modules and ops compute in
      ``dtype`` and hand float32 on);
    * ``black_list`` alone: O2 with your black list (everything else in ``dtype``);
    * both (MindSpore 2.3 and later; either may be empty): the ops of ``white_list``
      run in ``dtype``, those of ``black_list`` in float32, every other op in its
      inputs' dtype, and the outputs stay as computed (the rule of the ``"auto"``
      level, with your lists).

    Raises:
        TypeError: ``network`` is not an ``nn.Module``; a list that is not a list.
        ValueError: neither list given, or a call that would change nothing (no
            entries in the lists given, other than an empty ``black_list`` alone);
            an entry in both lists; a bad ``dtype``; an unknown op name.

    Example:
        >>> import torch
        >>> import ampkit.mindspore as amp
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        >>> net = amp.custom_mixed_precision(net, black_list=["Dense"])
        >>> seen = []
        >>> _ = net[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
        >>> net(torch.rand(2, 4)).dtype, seen
        (torch.float32, [torch.float16])
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Softmax(-1))
        >>> net = amp.custom_mixed_precision(net, white_list=["MatMul"], black_list=[])
        >>> net(torch.rand(2, 4)).dtype    # linear low; softmax keeps its input's dtype
        torch.float16
    """
    check_network(network)
    if white_list is None and black_list is None:
        raise ValueError("custom_mixed_precision needs white_list, black_list or both")
    white = _entries(white_list, "white_list")
    black = _entries(black_list, "black_list")
    low = _low_dtype(dtype)
    if white_list is not None and black_list is not None:
        if not white and not black:
            raise ValueError("custom_mixed_precision: white_list and black_list are both "
                             "empty, so the call would change nothing")
        policy = Policy(name="mindspore-custom-lists",
                        lower_precision_ops=resolve_ops(white, framework="mindspore",
                                                        argument="white_list"),
                        fp32_ops=resolve_ops(black, framework="mindspore",
                                             argument="black_list"),
                        unlisted="keep",
                        description="MindSpore custom_mixed_precision with both lists.")
        return _convert(network, ConversionConfig(compute_dtype=low, policy=policy,
                                                  params_as_given=True))
    if white_list is not None:
        if not white:
            raise ValueError("custom_mixed_precision: white_list is empty, so the call "
                             "would change nothing")
        return _convert(network, _white_list_config(white, low, "white_list"))
    return _convert(network, _black_list_config(black, low, "black_list"))
