"""Pure loss-scale values, jmp style: immutable objects that scale, unscale and adjust.

Where :class:`~ampkit.scaling.grad_scaler.GradScaler` drives an optimizer, these are the
bare state for code that manages its own step (MindSpore's ``DynamicLossScaler`` /
``StaticLossScaler``, MXNet's loss scaler, jmp's ``DynamicLossScale``). Nothing is
mutated: :meth:`DynamicLossScale.adjust` returns a new object, and ``scale``/``unscale``
return new tensors. The scale and counters are 0-dim tensors, so a training step
written with them needs no host sync except where *you* decide to skip.

Both follow the same rule as ``GradScaler`` (:mod:`ampkit.scaling.schedule`); the seed
systems are settings of it:

* torch / Paddle: the defaults (Paddle: ``min_scale=1.0`` and ``hysteresis`` = its
  ``decr_every_n_nan_or_inf``);
* MindSpore ``DynamicLossScaler(scale_value, scale_factor, scale_window)``:
  ``growth_factor=f, backoff_factor=1/f, growth_interval=w, min_scale=1.0``
  (overflow: ``scale = max(1, scale / f)``);
* MXNet: ``DynamicLossScale(2.0 ** 16, max_scale=2.0 ** 24)`` (window 2000, halving);
* apex: ``min_scale=min_loss_scale, max_scale=max_loss_scale``.

Example:
    >>> import torch
    >>> from ampkit.scaling.loss_scale import DynamicLossScale
    >>> from ampkit.scaling.overflow import all_finite
    >>> w = torch.nn.Parameter(torch.ones(2))
    >>> loss_scale = DynamicLossScale(2.0 ** 15, growth_interval=1000, min_scale=1.0)
    >>> loss_scale.scale((3 * w).sum()).backward()
    >>> (grad,) = loss_scale.unscale([w.grad])
    >>> finite = all_finite(grad)
    >>> loss_scale = loss_scale.adjust(finite)
    >>> grad.tolist(), bool(finite), float(loss_scale.loss_scale)
    ([3.0, 3.0], True, 32768.0)
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, TypeVar

import torch

from ampkit.engine.casting import map_floating
from ampkit.scaling.schedule import ScaleSchedule, check_scale_value, update_scale_

__all__ = ["DynamicLossScale", "StaticLossScale"]

T = TypeVar("T")
S = TypeVar("S")


def _as_scale_tensor(value: Any, argument: str, schedule: ScaleSchedule | None
                     ) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or not value.is_floating_point():
            raise ValueError(f"{argument} must be a positive finite number or a "
                             f"one-element floating tensor, got {value!r}")
        # The value is checked as a number's is: one host sync, here where a scale
        # enters. adjust() and to() build their results without coming back here.
        number = float(value.detach().reshape(()).item())
        if schedule is None:
            check_scale_value(number, argument)
        else:
            schedule.check_init_scale(number, argument)
        return value.detach().to(torch.float32).reshape(())
    number = (check_scale_value(value, argument) if schedule is None
              else schedule.check_init_scale(value, argument))
    return torch.tensor(number, dtype=torch.float32)


def _evolve(state: S, **tensors: torch.Tensor) -> S:
    """``state`` with some of its tensors replaced by ones this module computed from
    checked values: no check again (checking a tensor's value is a host sync, and
    adjust() runs every step)."""
    new = copy.copy(state)
    for name, value in tensors.items():
        object.__setattr__(new, name, value)
    return new


def _as_counter(value: Any, argument: str, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_floating_point() or value.dtype is torch.bool:
            raise ValueError(f"{argument} must be an int >= 0 or a one-element integer "
                             f"tensor, got {value!r}")
        return value.detach().to(device=device, dtype=torch.int32).reshape(())
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{argument} must be an int >= 0, got {value!r}")
    return torch.tensor(value, dtype=torch.int32, device=device)


def _map_floats(tree: T, multiplier: torch.Tensor) -> T:
    # Plain type promotion, as torch's GradScaler.scale: a float16 tensor stays float16,
    # a 0-dim float16 loss becomes float32.
    return map_floating(tree, lambda x: x * multiplier.to(x.device, non_blocking=True))


def _inverse(loss_scale: torch.Tensor) -> torch.Tensor:
    # float64 reciprocal rounded to float32, as GradScaler (and torch's) unscale_ does.
    return loss_scale.double().reciprocal().float()


def _found_inf(grads_finite: bool | torch.Tensor, device: torch.device) -> torch.Tensor:
    if isinstance(grads_finite, torch.Tensor):
        if grads_finite.numel() != 1:
            raise ValueError(f"grads_finite must be a bool or a one-element tensor, got "
                             f"shape {tuple(grads_finite.shape)}")
        return (grads_finite.reshape(()) == 0).to(device=device, dtype=torch.float32)
    if not isinstance(grads_finite, bool):
        raise TypeError(f"grads_finite must be a bool or a one-element tensor, got "
                        f"{type(grads_finite).__name__}")
    return torch.tensor(0.0 if grads_finite else 1.0, device=device)


@dataclasses.dataclass(frozen=True, eq=False)
class StaticLossScale:
    """A constant loss scale (MindSpore ``StaticLossScaler``, apex ``loss_scale=128.0``).

    Args:
        loss_scale: the scale; a positive finite number (or a one-element floating
            tensor holding one: its value is checked, one host sync).

    Raises:
        ValueError: ``loss_scale`` is not finite and > 0.

    Example:
        >>> import torch
        >>> from ampkit.scaling.loss_scale import StaticLossScale
        >>> ls = StaticLossScale(128.0)
        >>> ls.scale(torch.tensor(2.0)).item(), ls.unscale(torch.tensor(256.0)).item()
        (256.0, 2.0)
        >>> ls.adjust(False) is ls
        True
    """

    loss_scale: torch.Tensor

    def __post_init__(self) -> None:
        object.__setattr__(self, "loss_scale",
                           _as_scale_tensor(self.loss_scale, "loss_scale", None))

    def scale(self, tree: T) -> T:
        """Every floating tensor in ``tree`` (nested lists/tuples/dicts) times the scale.

        Example:
            >>> import torch
            >>> from ampkit.scaling.loss_scale import StaticLossScale
            >>> StaticLossScale(4.0).scale({"loss": torch.tensor(1.5)})
            {'loss': tensor(6.)}
        """
        return _map_floats(tree, self.loss_scale)

    def unscale(self, tree: T) -> T:
        """Every floating tensor in ``tree`` divided by the scale (new tensors).

        Example:
            >>> import torch
            >>> from ampkit.scaling.loss_scale import StaticLossScale
            >>> StaticLossScale(4.0).unscale([torch.tensor(6.0)])
            [tensor(1.5000)]
        """
        return _map_floats(tree, _inverse(self.loss_scale))

    def adjust(self, grads_finite: bool | torch.Tensor) -> StaticLossScale:
        """The scale for the next step: this one (a static scale never moves).

        Example:
            >>> from ampkit.scaling.loss_scale import StaticLossScale
            >>> float(StaticLossScale(8.0).adjust(True).loss_scale)
            8.0
        """
        _found_inf(grads_finite, self.loss_scale.device)  # same argument check as dynamic
        return self

    def to(self, device: torch.device | str) -> StaticLossScale:
        """The same scale with its tensor on ``device``.

        Example:
            >>> from ampkit.scaling.loss_scale import StaticLossScale
            >>> StaticLossScale(2.0).to("cpu").loss_scale.device.type
            'cpu'
        """
        return _evolve(self, loss_scale=self.loss_scale.to(device))


_RULE = ScaleSchedule()  # the default rule


@dataclasses.dataclass(frozen=True, eq=False)
class DynamicLossScale:
    """A loss scale that backs off on overflow and grows after clean steps; immutable.

    Args:
        loss_scale: the current scale; a positive finite number within the bounds (or
            a one-element floating tensor holding one: its value is checked, one host
            sync; :meth:`adjust` and :meth:`to` do not check again).
        growth_interval: clean steps in a row before growing (MindSpore
            ``scale_window``, jmp ``period``); int >= 1.
        growth_factor: multiplier when growing; > 1.
        backoff_factor: multiplier on overflow; in (0, 1).
        hysteresis: overflows in a row before backing off; int >= 1.
        min_scale: floor, or ``None`` (MindSpore: 1.0).
        max_scale: ceiling, or ``None`` (MXNet, apex: 2**24).
        growth_tracker: clean steps counted so far (int or 0-dim int tensor).
        overflow_tracker: overflows in a row counted so far (int or 0-dim int tensor).

    Example:
        >>> import torch
        >>> from ampkit.scaling.loss_scale import DynamicLossScale
        >>> ls = DynamicLossScale(2.0, growth_factor=3.0, backoff_factor=1 / 3,
        ...                       growth_interval=1, min_scale=1.0)   # MindSpore, factor 3
        >>> ls = ls.adjust(torch.tensor(True))
        >>> float(ls.loss_scale)
        6.0
        >>> float(ls.adjust(False).adjust(False).loss_scale)  # max(1, 6 / 3 / 3)
        1.0
    """

    loss_scale: torch.Tensor
    _: dataclasses.KW_ONLY
    # The rule's settings, flat as jmp has them; their defaults are the schedule's own.
    growth_interval: int = _RULE.growth_interval
    growth_factor: float = _RULE.growth_factor
    backoff_factor: float = _RULE.backoff_factor
    hysteresis: int = _RULE.hysteresis
    min_scale: float | None = _RULE.min_scale
    max_scale: float | None = _RULE.max_scale
    growth_tracker: torch.Tensor = 0  # type: ignore[assignment]
    overflow_tracker: torch.Tensor = 0  # type: ignore[assignment]

    def __post_init__(self) -> None:
        schedule = ScaleSchedule(
            growth_factor=self.growth_factor, backoff_factor=self.backoff_factor,
            growth_interval=self.growth_interval, hysteresis=self.hysteresis,
            min_scale=self.min_scale, max_scale=self.max_scale)
        scale = _as_scale_tensor(self.loss_scale, "loss_scale", schedule)
        values: dict[str, Any] = {
            name: getattr(schedule, name) for name in
            ("growth_interval", "growth_factor", "backoff_factor", "hysteresis",
             "min_scale", "max_scale")}
        values["loss_scale"] = scale
        values["growth_tracker"] = _as_counter(self.growth_tracker, "growth_tracker",
                                               scale.device)
        values["overflow_tracker"] = _as_counter(self.overflow_tracker, "overflow_tracker",
                                                 scale.device)
        for name, value in values.items():
            object.__setattr__(self, name, value)

    @property
    def schedule(self) -> ScaleSchedule:
        """The rule this scale follows.

        Example:
            >>> from ampkit.scaling.loss_scale import DynamicLossScale
            >>> DynamicLossScale(8.0).schedule.uses_native_rule
            True
        """
        return ScaleSchedule(
            growth_factor=self.growth_factor, backoff_factor=self.backoff_factor,
            growth_interval=self.growth_interval, hysteresis=self.hysteresis,
            min_scale=self.min_scale, max_scale=self.max_scale)

    def scale(self, tree: T) -> T:
        """Every floating tensor in ``tree`` (nested lists/tuples/dicts) times the scale.

        Example:
            >>> import torch
            >>> from ampkit.scaling.loss_scale import DynamicLossScale
            >>> DynamicLossScale(1024.0).scale(torch.tensor([0.5], dtype=torch.float16))
            tensor([512.], dtype=torch.float16)
        """
        return _map_floats(tree, self.loss_scale)

    def unscale(self, tree: T) -> T:
        """Every floating tensor in ``tree`` divided by the scale (new tensors).

        Example:
            >>> import torch
            >>> from ampkit.scaling.loss_scale import DynamicLossScale
            >>> DynamicLossScale(1024.0).unscale((torch.tensor(512.0),))
            (tensor(0.5000),)
        """
        return _map_floats(tree, _inverse(self.loss_scale))

    def adjust(self, grads_finite: bool | torch.Tensor) -> DynamicLossScale:
        """The scale for the next step, given whether this step's gradients were all
        finite (a bool, or a bool tensor such as :func:`~ampkit.scaling.overflow.
        all_finite`'s: then no host sync).

        Example:
            >>> from ampkit.scaling.loss_scale import DynamicLossScale
            >>> ls = DynamicLossScale(2.0 ** 24, growth_interval=1, max_scale=2.0 ** 24)
            >>> float(ls.adjust(True).loss_scale), float(ls.adjust(False).loss_scale)
            (16777216.0, 8388608.0)
        """
        scale = self.loss_scale.clone()
        growth = self.growth_tracker.clone()
        overflows = self.overflow_tracker.clone()
        update_scale_(scale, growth, overflows, _found_inf(grads_finite, scale.device),
                      self.schedule)
        return _evolve(self, loss_scale=scale, growth_tracker=growth,
                       overflow_tracker=overflows)

    def to(self, device: torch.device | str) -> DynamicLossScale:
        """The same state with its tensors on ``device``.

        Example:
            >>> from ampkit.scaling.loss_scale import DynamicLossScale
            >>> DynamicLossScale(2.0).to("cpu").growth_tracker.device.type
            'cpu'
        """
        return _evolve(self, loss_scale=self.loss_scale.to(device),
                       growth_tracker=self.growth_tracker.to(device),
                       overflow_tracker=self.overflow_tracker.to(device))
