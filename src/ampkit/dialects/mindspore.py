"""``ampkit.mindspore``: ``mindspore.amp``'s API on PyTorch.

``from mindspore import amp`` becomes ``import ampkit.mindspore as amp``; a ``Cell``
becomes an ``nn.Module``, ``mstype.float16`` becomes ``torch.float16`` (the strings
``"float16"`` / ``"bfloat16"`` work too).

The built-in lists of the seed, in torch terms (:func:`get_white_list`,
:func:`get_black_list`):

* white list: cells ``Conv1d/2d/3d`` → ``nn.Conv1d/2d/3d``, ``Conv1d/2d/3dTranspose`` →
  ``nn.ConvTranspose1d/2d/3d``, ``Dense`` → ``nn.Linear``, ``LSTMCell``, ``RNNCell``,
  ``GRUCell`` → torch's; ops ``Conv2D``, ``Conv3D``, ``Conv2DTranspose``,
  ``Conv3DTranspose`` → ``F.conv2d``, ``F.conv3d``, ``F.conv_transpose2d``,
  ``F.conv_transpose3d``; ``MatMul`` → ``torch.matmul``; ``BatchMatMul`` →
  ``torch.bmm``; ``PReLU`` → ``F.prelu``; ``ReLU`` → ``F.relu``; ``Ger`` → ``torch.outer``;
* black list: ``BatchNorm1d/2d/3d``, ``LayerNorm`` → torch's.

The levels, as the seed defines them (parameters stay float32 at every level, as in
MindSpore: they are cast where they are used):

====  =====================================================================================
O0    unchanged
O1    white-list modules and ops compute in ``dtype`` from inputs and parameters cast on
      the way in; their outputs go back to float32 (white ops: cast by the next op, and
      at the network's output); everything else float32
O2    everything in ``dtype`` except the black-list modules, which compute in float32 and
      hand their outputs back in ``dtype``; the network's output is float32
O3    everything in ``dtype``, norms included; the network's output is float32
====  =====================================================================================

==========================================  ==============================================
MindSpore                                   ampkit core
==========================================  ==============================================
``auto_mixed_precision`` /                  :func:`ampkit.convert_model` with a
``custom_mixed_precision``                  :class:`~ampkit.conversion.ConversionConfig`:
                                            module white list (O1), kept-fp32 modules (O2),
                                            an all-low-precision policy (O2, O3)
``build_train_network``                     the above, then a training step driven by
                                            :class:`ampkit.GradScaler`
``DynamicLossScaler`` / ``StaticLossScaler``  :class:`ampkit.DynamicLossScale` /
                                            :class:`ampkit.StaticLossScale` (floor 1)
``all_finite``                              :func:`ampkit.scaling.all_finite`
==========================================  ==============================================

Example:
    >>> import torch
    >>> import ampkit.mindspore as amp
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    >>> net = amp.auto_mixed_precision(net, "O2", torch.bfloat16)
    >>> net[0].weight.dtype, net(torch.rand(2, 4)).dtype
    (torch.float32, torch.float32)
    >>> amp.auto_mixed_precision(torch.nn.Linear(2, 2), "O4")
    Traceback (most recent call last):
    ...
    ValueError: amp_level must be one of ['O0', 'O1', 'O2', 'O3'], got 'O4'
"""

from __future__ import annotations

import abc
import dataclasses
import inspect
import math
import numbers
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ampkit import front_door
from ampkit.arguments import LOW_PRECISION, parse_dtype, positive_int
from ampkit.conversion import ALL_LOW_PRECISION, ConversionConfig
from ampkit.policy import Policy
from ampkit.registry import OpEntry, resolve_ops
from ampkit.scaling.grad_scaler import GradScaler
from ampkit.scaling.loss_scale import DynamicLossScale, StaticLossScale
from ampkit.scaling.overflow import all_finite as _all_finite
from ampkit.scaling.overflow import unscale_grads_
from ampkit.scaling.schedule import check_scale_value

__all__ = [
    "DynamicLossScaleManager",
    "DynamicLossScaler",
    "FixedLossScaleManager",
    "LossScaleManager",
    "StaticLossScaler",
    "all_finite",
    "auto_mixed_precision",
    "build_train_network",
    "custom_mixed_precision",
    "get_black_list",
    "get_white_list",
]

_LEVELS = ("O0", "O1", "O2", "O3")

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


def _check_network(network: Any) -> nn.Module:
    if not isinstance(network, nn.Module):
        raise TypeError(f"network must be a torch.nn.Module (a Cell in MindSpore), got "
                        f"{type(network).__name__}")
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


def _white_list_config(white_list: Any, low: torch.dtype, argument: str) -> ConversionConfig:
    modules, ops = _split(white_list, argument)
    # Everything outside the white list runs in float32: so do the ops that consume the
    # low-precision output of a white-listed op (MindSpore casts that output back).
    policy = Policy(name="mindspore-white-list", lower_precision_ops=ops, unlisted="fp32",
                    description="MindSpore O1: the white list in low precision, all else "
                                "float32.")
    return ConversionConfig(low_precision_modules=modules, white_list_output_dtype=torch.float32,
                            compute_dtype=low, policy=policy, output_dtype=torch.float32)


def _black_list_config(black_list: Any, low: torch.dtype, argument: str) -> ConversionConfig:
    modules, ops = _split(black_list, argument)
    policy = (ALL_LOW_PRECISION if not ops else Policy(
        name="mindspore-black-list", fp32_ops=ops, unlisted="lower",
        description="MindSpore O2: all in low precision except the black list."))
    # The network's floating inputs, float64 included, in ``low`` (MindSpore's
    # ``to_float`` of the whole network), not only those an op casts.
    return ConversionConfig(keep_fp32_modules=modules, kept_output_dtype=low,
                            compute_dtype=low, policy=policy, input_dtype=low,
                            output_dtype=torch.float32)


def _convert(network: nn.Module, config: ConversionConfig) -> nn.Module:
    return front_door.convert_model(network, config)


def auto_mixed_precision(network: nn.Module, amp_level: str = "O0",
                         dtype: torch.dtype | str = torch.float16) -> nn.Module:
    """MindSpore's ``auto_mixed_precision``: apply a level (see the module docstring)
    to ``network``, in place, and return it.

    Args:
        network: an fp32 ``nn.Module``.
        amp_level: ``"O0"``, ``"O1"``, ``"O2"`` or ``"O3"``.
        dtype: ``torch.float16`` or ``torch.bfloat16`` (or ``"float16"`` /
            ``"bfloat16"``).

    Raises:
        TypeError: ``network`` is not an ``nn.Module``.
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
    """
    _check_network(network)
    if amp_level not in _LEVELS:
        raise ValueError(f"amp_level must be one of {list(_LEVELS)}, got {amp_level!r}")
    low = _low_dtype(dtype)
    if amp_level == "O0":
        return network
    if amp_level == "O1":
        return _convert(network, _white_list_config(_WHITE_LIST, low, "white_list"))
    if amp_level == "O2":
        return _convert(network, _black_list_config(_BLACK_LIST, low, "black_list"))
    return _convert(network, ConversionConfig(compute_dtype=low, policy=ALL_LOW_PRECISION,
                                              input_dtype=low, output_dtype=torch.float32))


def custom_mixed_precision(network: nn.Module, *, white_list: Sequence[Any] | None = None,
                           black_list: Sequence[Any] | None = None,
                           dtype: torch.dtype | str = torch.float16) -> nn.Module:
    """MindSpore's ``custom_mixed_precision``: O1 with your white list, or O2 with
    your black list (exactly one of them). Entries: ``nn.Module`` classes, MindSpore
    cell names (``"Dense"``), ops (torch or MindSpore names, callables).

    Raises:
        TypeError: ``network`` is not an ``nn.Module``.
        ValueError: both lists or neither; a bad ``dtype``; an unknown op name.

    Example:
        >>> import torch
        >>> import ampkit.mindspore as amp
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        >>> net = amp.custom_mixed_precision(net, black_list=["Dense"])
        >>> seen = []
        >>> _ = net[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
        >>> net(torch.rand(2, 4)).dtype, seen
        (torch.float32, [torch.float16])
    """
    _check_network(network)
    if (white_list is None) == (black_list is None):
        raise ValueError("custom_mixed_precision takes exactly one of white_list and "
                         "black_list")
    low = _low_dtype(dtype)
    if white_list is not None:
        return _convert(network, _white_list_config(white_list, low, "white_list"))
    return _convert(network, _black_list_config(black_list, low, "black_list"))


# -- loss scaling -------------------------------------------------------------------------

def _scale_value(value: Any, argument: str) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    # The core's check (finite, > 0), then MindSpore's own floor.
    number = check_scale_value(value, argument)
    if number < 1:
        raise ValueError(f"{argument} must be a finite number >= 1, got {value!r}")
    return number


def _scale_factor(value: Any, argument: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{argument} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or value <= 1:
        raise ValueError(f"{argument} must be a finite number > 1, got {value!r}")
    return float(value)


def _scale_window(value: Any, argument: str) -> int:
    return positive_int(value, argument)


class StaticLossScaler:
    """MindSpore's ``StaticLossScaler``: a constant scale.

    Raises:
        ValueError: ``scale_value`` < 1.

    Example:
        >>> import torch
        >>> import ampkit.mindspore as amp
        >>> scaler = amp.StaticLossScaler(1024)
        >>> scaler.scale(torch.tensor(0.5)), scaler.unscale((torch.tensor(512.0),))
        (tensor(512.), (tensor(0.5000),))
        >>> scaler.adjust(torch.tensor(False))
        False
    """

    def __init__(self, scale_value: float) -> None:
        # Any: a float, which the loss scale's __post_init__ makes a tensor.
        value: Any = _scale_value(scale_value, "scale_value")
        self._state = StaticLossScale(value)

    @property
    def scale_value(self) -> torch.Tensor:
        """The scale, a 0-dim float32 tensor.

        Example:
            >>> import ampkit.mindspore as amp
            >>> amp.StaticLossScaler(8).scale_value
            tensor(8.)
        """
        return self._state.loss_scale

    @scale_value.setter
    def scale_value(self, value: float | torch.Tensor) -> None:
        """Assign the scale (a number or a one-element tensor, ``>= 1``), as MindSpore
        code assigns its ``Parameter``.

        Example:
            >>> import ampkit.mindspore as amp
            >>> scaler = amp.StaticLossScaler(8)
            >>> scaler.scale_value = 16
            >>> scaler.scale_value
            tensor(16.)
        """
        number: Any = _scale_value(value, "scale_value")
        self._state = StaticLossScale(number)

    def scale(self, inputs: Any) -> Any:
        """Every floating tensor in ``inputs`` times the scale.

        Example:
            >>> import torch
            >>> import ampkit.mindspore as amp
            >>> amp.StaticLossScaler(4).scale([torch.tensor(1.0)])
            [tensor(4.)]
        """
        return self._state.scale(inputs)

    def unscale(self, inputs: Any) -> Any:
        """Every floating tensor in ``inputs`` divided by the scale.

        Example:
            >>> import torch
            >>> import ampkit.mindspore as amp
            >>> amp.StaticLossScaler(4).unscale(torch.tensor(2.0))
            tensor(0.5000)
        """
        return self._state.unscale(inputs)

    def adjust(self, grads_finite: bool | torch.Tensor) -> bool:
        """A static scale never moves; returns ``False``.

        Example:
            >>> import ampkit.mindspore as amp
            >>> amp.StaticLossScaler(4).adjust(True)
            False
        """
        self._state.adjust(grads_finite)  # argument check only
        return False


class DynamicLossScaler:
    """MindSpore's ``DynamicLossScaler``: on overflow the scale becomes
    ``max(1, scale / scale_factor)``; after ``scale_window`` finite steps in a row it is
    multiplied by ``scale_factor`` (when the product is finite).

    Raises:
        ValueError: ``scale_value`` < 1, ``scale_factor`` <= 1, ``scale_window`` < 1.

    Example:
        >>> import torch
        >>> import ampkit.mindspore as amp
        >>> scaler = amp.DynamicLossScaler(scale_value=2 ** 10, scale_factor=2,
        ...                                scale_window=50)
        >>> grads = scaler.unscale((torch.tensor([float("inf")]),))
        >>> scaler.adjust(amp.all_finite(grads))
        True
        >>> scaler.scale_value
        tensor(512.)
    """

    def __init__(self, scale_value: float, scale_factor: float, scale_window: int) -> None:
        # Any: a float, which the loss scale's __post_init__ makes a tensor.
        value: Any = _scale_value(scale_value, "scale_value")
        self.scale_factor = _scale_factor(scale_factor, "scale_factor")
        self.scale_window = _scale_window(scale_window, "scale_window")
        self._state = DynamicLossScale(value, growth_interval=self.scale_window,
                                       growth_factor=self.scale_factor,
                                       backoff_factor=1.0 / self.scale_factor, min_scale=1.0)

    @property
    def scale_value(self) -> torch.Tensor:
        """The current scale, a 0-dim float32 tensor.

        Example:
            >>> import ampkit.mindspore as amp
            >>> amp.DynamicLossScaler(16, 2, 10).scale_value
            tensor(16.)
        """
        return self._state.loss_scale

    @scale_value.setter
    def scale_value(self, value: float | torch.Tensor) -> None:
        """Assign the scale (a number or a one-element tensor, ``>= 1``), as MindSpore
        code assigns its ``Parameter``; the counter is kept.

        Example:
            >>> import ampkit.mindspore as amp
            >>> scaler = amp.DynamicLossScaler(16, 2, 10)
            >>> scaler.scale_value = 1024
            >>> scaler.scale_value
            tensor(1024.)
        """
        number = _scale_value(value, "scale_value")
        self._state = dataclasses.replace(
            self._state, loss_scale=torch.tensor(number, device=self._state.loss_scale.device))

    @property
    def counter(self) -> torch.Tensor:
        """Finite steps in a row since the scale last changed.

        Example:
            >>> import ampkit.mindspore as amp
            >>> scaler = amp.DynamicLossScaler(16, 2, 10)
            >>> _ = scaler.adjust(True)
            >>> int(scaler.counter)
            1
        """
        return self._state.growth_tracker

    @counter.setter
    def counter(self, value: int | torch.Tensor) -> None:
        """Assign the count of finite steps (an int or a one-element integer tensor,
        ``>= 0``), as MindSpore code assigns its ``Parameter``; the scale grows when the
        next finite step brings it to ``scale_window``.

        Example:
            >>> import ampkit.mindspore as amp
            >>> scaler = amp.DynamicLossScaler(16, 2, 10)
            >>> scaler.counter = 9
            >>> _ = scaler.adjust(True)
            >>> float(scaler.scale_value), int(scaler.counter)
            (32.0, 0)
        """
        if isinstance(value, torch.Tensor):
            if value.numel() != 1 or value.is_floating_point() or value.dtype is torch.bool:
                raise TypeError(f"counter must be an int or a one-element integer tensor, "
                                f"got {value!r}")
            value = int(value.item())
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"counter must be an int, got {type(value).__name__}")
        if value < 0:
            raise ValueError(f"counter must be >= 0, got {value}")
        # DynamicLossScale makes the int its counter tensor (on the scale's device).
        counter: Any = value
        self._state = dataclasses.replace(self._state, growth_tracker=counter)

    def scale(self, inputs: Any) -> Any:
        """Every floating tensor in ``inputs`` times the scale.

        Example:
            >>> import torch
            >>> import ampkit.mindspore as amp
            >>> amp.DynamicLossScaler(8, 2, 10).scale(torch.tensor(0.25))
            tensor(2.)
        """
        return self._state.scale(inputs)

    def unscale(self, inputs: Any) -> Any:
        """Every floating tensor in ``inputs`` divided by the scale.

        Example:
            >>> import torch
            >>> import ampkit.mindspore as amp
            >>> amp.DynamicLossScaler(8, 2, 10).unscale([torch.tensor(2.0)])
            [tensor(0.2500)]
        """
        return self._state.unscale(inputs)

    def adjust(self, grads_finite: bool | torch.Tensor) -> bool:
        """Update the scale from whether this step's gradients were all finite (a
        bool, or a bool tensor such as :func:`all_finite`'s); returns ``True``.

        Example:
            >>> import ampkit.mindspore as amp
            >>> scaler = amp.DynamicLossScaler(3, 2, 1)
            >>> scaler.adjust(False), float(scaler.scale_value)   # max(1, 3 / 2)
            (True, 1.5)
        """
        self._state = self._state.adjust(grads_finite)
        return True


def all_finite(inputs: Any) -> torch.Tensor:
    """A 0-dim bool tensor: True when every element of every tensor in ``inputs`` (a
    tensor, or lists/tuples/dicts of them) is finite.

    Example:
        >>> import torch
        >>> import ampkit.mindspore as amp
        >>> amp.all_finite((torch.ones(2), torch.tensor([float("nan")])))
        tensor(False)
    """
    return _all_finite(inputs)


class LossScaleManager(abc.ABC):
    """The base of MindSpore's loss-scale managers (for ``build_train_network``).

    Example:
        >>> import ampkit.mindspore as amp
        >>> isinstance(amp.FixedLossScaleManager(), amp.LossScaleManager)
        True
    """

    @abc.abstractmethod
    def get_loss_scale(self) -> float:
        """The starting loss scale.

        Example:
            >>> import ampkit.mindspore as amp
            >>> amp.DynamicLossScaleManager().get_loss_scale()
            16777216.0
        """

    @abc.abstractmethod
    def get_drop_overflow_update(self) -> bool:
        """Whether a step with inf/NaN gradients is skipped.

        Example:
            >>> import ampkit.mindspore as amp
            >>> amp.FixedLossScaleManager(drop_overflow_update=False).get_drop_overflow_update()
            False
        """


class FixedLossScaleManager(LossScaleManager):
    """A constant loss scale; ``drop_overflow_update`` skips steps with inf/NaN
    gradients (``False``: they are applied, as in MindSpore).

    Raises:
        ValueError: ``loss_scale`` < 1.

    Example:
        >>> import ampkit.mindspore as amp
        >>> amp.FixedLossScaleManager(128).get_loss_scale()
        128.0
    """

    def __init__(self, loss_scale: float = 128.0, drop_overflow_update: bool = True) -> None:
        self._loss_scale = _scale_value(loss_scale, "loss_scale")
        if not isinstance(drop_overflow_update, bool):
            raise TypeError(f"drop_overflow_update must be a bool, got "
                            f"{type(drop_overflow_update).__name__}")
        self._drop = drop_overflow_update

    def get_loss_scale(self) -> float:
        """The loss scale.

        Example:
            >>> import ampkit.mindspore as amp
            >>> amp.FixedLossScaleManager().get_loss_scale()
            128.0
        """
        return self._loss_scale

    def get_drop_overflow_update(self) -> bool:
        """Whether overflowing steps are skipped.

        Example:
            >>> import ampkit.mindspore as amp
            >>> amp.FixedLossScaleManager().get_drop_overflow_update()
            True
        """
        return self._drop


class DynamicLossScaleManager(LossScaleManager):
    """A dynamic loss scale: start ``init_loss_scale``, ``max(1, scale / scale_factor)``
    on overflow (the step is skipped), times ``scale_factor`` after ``scale_window``
    clean steps.

    Raises:
        ValueError: ``init_loss_scale`` < 1, ``scale_factor`` <= 1, ``scale_window`` < 1.

    Example:
        >>> import ampkit.mindspore as amp
        >>> manager = amp.DynamicLossScaleManager(init_loss_scale=2 ** 12)
        >>> manager.get_loss_scale(), manager.scale_factor, manager.scale_window
        (4096.0, 2.0, 2000)
    """

    def __init__(self, init_loss_scale: float = 2.0 ** 24, scale_factor: float = 2,
                 scale_window: int = 2000) -> None:
        self._loss_scale = _scale_value(init_loss_scale, "init_loss_scale")
        self.scale_factor = _scale_factor(scale_factor, "scale_factor")
        self.scale_window = _scale_window(scale_window, "scale_window")

    def get_loss_scale(self) -> float:
        """The starting loss scale.

        Example:
            >>> import ampkit.mindspore as amp
            >>> amp.DynamicLossScaleManager(1024).get_loss_scale()
            1024.0
        """
        return self._loss_scale

    def get_drop_overflow_update(self) -> bool:
        """Always ``True``: a dynamic scale skips overflowing steps.

        Example:
            >>> import ampkit.mindspore as amp
            >>> amp.DynamicLossScaleManager().get_drop_overflow_update()
            True
        """
        return True


# -- build_train_network ------------------------------------------------------------------

_TRAIN_LEVELS: dict[str, dict[str, Any]] = {
    "O0": {"keep_batchnorm_fp32": False, "cast_model_type": torch.float32},
    "O1": {"keep_batchnorm_fp32": False, "cast_model_type": torch.float32},
    "O2": {"keep_batchnorm_fp32": True, "cast_model_type": torch.float16},
    "O3": {"keep_batchnorm_fp32": False, "cast_model_type": torch.float16},
}
_TRAIN_KWARGS = ("cast_model_type", "keep_batchnorm_fp32", "loss_scale_manager")
_MODEL_TYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class _WithLossCell(nn.Module):
    """``loss_fn(network(data), label)``, the output and label cast to float32 first
    when the network computes in low precision (MindSpore's loss cell)."""

    def __init__(self, network: nn.Module, loss_fn: nn.Module, cast_to_fp32: bool) -> None:
        super().__init__()
        self.network = network
        self.loss_fn = loss_fn
        self.cast_to_fp32 = cast_to_fp32

    def forward(self, data: Any, label: Any) -> torch.Tensor:
        out = self.network(data)
        if self.cast_to_fp32:
            out = out.float() if out.is_floating_point() else out
            label = label.float() if label.is_floating_point() else label
        return self.loss_fn(out, label)


def _sens_backward(loss: torch.Tensor) -> None:
    """MindSpore's backward from a (scaled) loss: the gradient it starts from ("sens")
    is one at every element of the loss, so a per-sample loss (reduction ``'none'``,
    MindSpore's default) back-propagates the gradient of its sum, a scalar loss that
    of itself."""
    loss.backward(torch.ones_like(loss))


def _needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` must be given a closure (``torch.optim.LBFGS``):
    its ``closure`` parameter has no default."""
    try:
        parameter = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):  # no signature to read: call it as usual
        return False
    return parameter is not None and parameter.default is inspect.Parameter.empty


class _TrainOneStep(nn.Module):
    """One training step per call: forward, (scaled) backward, (skipped) update.

    Returns the loss, or ``(loss, overflow, scale)`` when the loss-scale manager may
    skip steps (MindSpore's ``TrainOneStepWithLossScaleCell``). Any
    ``torch.optim.Optimizer`` steps: one whose ``step`` needs a closure
    (``LBFGS``) gets one that re-runs the forward and backward."""

    def __init__(self, network: nn.Module, optimizer: torch.optim.Optimizer,
                 manager: LossScaleManager | None) -> None:
        super().__init__()
        self.network = network
        self.optimizer = optimizer
        self.manager = manager
        self.scaler: GradScaler | None = None
        if isinstance(manager, DynamicLossScaleManager):
            self.scaler = GradScaler(None, init_scale=manager.get_loss_scale(),
                                     growth_factor=manager.scale_factor,
                                     backoff_factor=1.0 / manager.scale_factor,
                                     growth_interval=manager.scale_window, min_scale=1.0)
        elif isinstance(manager, FixedLossScaleManager) and manager.get_drop_overflow_update():
            self.scaler = GradScaler(None, init_scale=manager.get_loss_scale(), dynamic=False)
        if self.scaler is not None and _needs_closure(optimizer):
            raise ValueError(
                f"optimizer: {type(optimizer).__name__}.step needs a closure, which a loss "
                f"scale that skips overflowing steps cannot give it; pass "
                f"loss_scale_manager=None or FixedLossScaleManager(drop_overflow_update="
                f"False), or an optimizer whose step takes no closure")

    def forward(self, *inputs: Any) -> Any:
        scaler = self.scaler
        if scaler is not None:
            self.optimizer.zero_grad(set_to_none=True)
            loss = self.network(*inputs)
            _sens_backward(scaler.scale(loss))
            scaler.step(self.optimizer)
            overflow = scaler.last_step_skipped
            scale = torch.tensor(scaler.get_scale())
            scaler.update()
            return loss.detach(), torch.tensor(overflow), scale
        fixed = (self.manager.get_loss_scale()
                 if isinstance(self.manager, FixedLossScaleManager) else None)

        losses: list[torch.Tensor] = []

        def closure() -> torch.Tensor:
            self.optimizer.zero_grad(set_to_none=True)
            with torch.enable_grad():
                loss = self.network(*inputs)
                if fixed is None:
                    _sens_backward(loss)
                else:
                    # A fixed scale that never drops a step: scale, unscale, apply
                    # regardless.
                    _sens_backward(loss * fixed)
                    params = [p for g in self.optimizer.param_groups for p in g["params"]]
                    unscale_grads_((p.grad for p in params), torch.tensor(1.0 / fixed),
                                   torch.zeros(()))
            losses.append(loss.detach())
            # LBFGS compares the closure's values: the summed loss, what was derived.
            return loss.detach().sum()

        if _needs_closure(self.optimizer):
            self.optimizer.step(closure)  # type: ignore[arg-type]  # a 0-dim tensor
        else:
            closure()
            self.optimizer.step()
        # The loss at the parameters the step started from (LBFGS evaluates it more
        # than once).
        return losses[0]

def build_train_network(network: nn.Module, optimizer: torch.optim.Optimizer,
                        loss_fn: nn.Module | None = None, level: str = "O0",
                        boost_level: str = "O0", **kwargs: Any) -> nn.Module:
    """MindSpore's ``build_train_network``: a module whose every call runs one training
    step of ``network`` (with ``loss_fn`` when given: called as ``(data, label)``).

    Levels: O0 and O1 keep float32 parameters and no loss scaling (O1 casts the white
    list); O2 computes in float16 with BatchNorm and LayerNorm in float32 and a
    :class:`DynamicLossScaleManager`; O3 computes everything in float16 without loss
    scaling. At O2 and O3 every floating input is cast, float64 included.

    A per-sample loss (reduction ``'none'``, MindSpore's default) back-propagates the
    gradient of its sum, as MindSpore's backward starts from ones. Any
    ``torch.optim.Optimizer`` steps; one whose ``step`` needs a closure (``LBFGS``) is
    given one, except with a loss scale that skips overflowing steps (a ``ValueError``).

    Args:
        network, optimizer, loss_fn: the network (fp32), its optimizer, the loss.
        level: ``"O0"``, ``"O1"``, ``"O2"`` or ``"O3"``.
        boost_level: only ``"O0"`` (MindSpore's boost algorithms are not translated).
        **kwargs: ``cast_model_type`` (``torch.float16``, ``torch.bfloat16``,
            ``torch.float32``), ``keep_batchnorm_fp32`` (bool), ``loss_scale_manager``
            (a :class:`LossScaleManager` or ``None``).

    Returns:
        A module: ``step(*inputs)`` returns the loss, or ``(loss, overflow, scale)``
        when its loss-scale manager skips overflowing steps.

    Raises:
        TypeError: bad network, optimizer, loss function or keyword types.
        ValueError: a bad level, boost_level, keyword name or value.

    Example:
        >>> import torch
        >>> import ampkit.mindspore as amp
        >>> net = torch.nn.Linear(4, 3)
        >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
        >>> step = amp.build_train_network(net, opt, torch.nn.CrossEntropyLoss(), "O2",
        ...                                cast_model_type=torch.bfloat16)
        >>> loss, overflow, scale = step(torch.rand(8, 4), torch.randint(0, 3, (8,)))
        >>> loss.dtype, bool(overflow), float(scale)
        (torch.float32, False, 16777216.0)
        >>> net = torch.nn.Linear(4, 3)
        >>> per_sample = torch.nn.CrossEntropyLoss(reduction="none")
        >>> step = amp.build_train_network(net, torch.optim.LBFGS(net.parameters()),
        ...                                per_sample)
        >>> step(torch.rand(8, 4), torch.randint(0, 3, (8,))).shape
        torch.Size([8])
    """
    _check_network(network)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be None or callable, got {type(loss_fn).__name__}")
    if level not in _TRAIN_LEVELS:
        raise ValueError(f"level must be one of {list(_TRAIN_LEVELS)}, got {level!r}")
    if boost_level != "O0":
        raise ValueError(f"boost_level: only 'O0' is supported (MindSpore's boost "
                         f"algorithms have no ampkit counterpart), got {boost_level!r}")
    unknown = sorted(set(kwargs) - set(_TRAIN_KWARGS))
    if unknown:
        raise ValueError(f"unsupported keyword(s) {unknown}; accepted: {list(_TRAIN_KWARGS)}")
    config = {**_TRAIN_LEVELS[level], "loss_scale_manager":
              DynamicLossScaleManager() if level == "O2" else None, **kwargs}
    model_type = config["cast_model_type"]
    if isinstance(model_type, str):
        model_type = _MODEL_TYPES.get(model_type, model_type)
    if model_type not in _MODEL_TYPES.values():
        raise ValueError(f"cast_model_type must be torch.float16, torch.bfloat16 or "
                         f"torch.float32, got {config['cast_model_type']!r}")
    if not isinstance(config["keep_batchnorm_fp32"], bool):
        raise TypeError(f"keep_batchnorm_fp32 must be a bool, got "
                        f"{type(config['keep_batchnorm_fp32']).__name__}")
    manager = config["loss_scale_manager"]
    if manager is not None and not isinstance(manager, FixedLossScaleManager
                                              | DynamicLossScaleManager):
        raise TypeError(f"loss_scale_manager must be None, a FixedLossScaleManager or a "
                        f"DynamicLossScaleManager, got {type(manager).__name__}")
    low = model_type is not torch.float32
    if level == "O1":
        auto_mixed_precision(network, "O1", torch.float16)
    elif low:
        auto_mixed_precision(network, "O2" if config["keep_batchnorm_fp32"] else "O3",
                             model_type)
    if loss_fn is not None:
        network = _WithLossCell(network, loss_fn, cast_to_fp32=low)
    return _TrainOneStep(network, optimizer, manager)
