"""MindSpore's loss scalers for a hand-written training step: ``StaticLossScaler``,
``DynamicLossScaler`` (MindSpore's own update rule and numbers) and ``all_finite``,
the overflow check they are used with; the checks of their arguments are shared with
the loss-scale managers.

Example:
    >>> import torch
    >>> from ampkit.dialects.mindspore.loss_scalers import DynamicLossScaler, all_finite
    >>> scaler = DynamicLossScaler(8, 2, 10)
    >>> bool(all_finite([torch.ones(2)])), float(scaler.scale(torch.tensor(1.0)))
    (True, 8.0)
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import torch

from ampkit.common.arguments import positive_int
from ampkit.scaling.loss_scale import DynamicLossScale, StaticLossScale
from ampkit.scaling.overflow import all_finite as _all_finite
from ampkit.scaling.schedule import check_scale_value

__all__ = ["DynamicLossScaler", "StaticLossScaler", "all_finite"]


# -- loss scaling -------------------------------------------------------------------------

def check_loss_scale(value: Any, argument: str) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    # The core's check (finite, > 0), then MindSpore's own floor.
    number = check_scale_value(value, argument)
    if number < 1:
        raise ValueError(f"{argument} must be a finite number >= 1, got {value!r}")
    return number


def check_scale_factor(value: Any, argument: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{argument} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or value <= 1:
        raise ValueError(f"{argument} must be a finite number > 1, got {value!r}")
    return float(value)


def check_scale_window(value: Any, argument: str) -> int:
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
        value: Any = check_loss_scale(scale_value, "scale_value")
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
        number: Any = check_loss_scale(value, "scale_value")
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
        value: Any = check_loss_scale(scale_value, "scale_value")
        self.scale_factor = check_scale_factor(scale_factor, "scale_factor")
        self.scale_window = check_scale_window(scale_window, "scale_window")
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
        number = check_loss_scale(value, "scale_value")
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
