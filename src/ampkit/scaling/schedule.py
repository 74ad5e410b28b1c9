"""The loss-scale schedule: how the scale moves after each step, as one immutable rule.

A :class:`ScaleSchedule` holds the knobs every seed system exposes under its own names:

=================  ===================  ======================  ==========================
ampkit             torch / Paddle       apex / DeepSpeed        MindSpore / MXNet / jmp
=================  ===================  ======================  ==========================
growth_factor      growth_factor /      (2.0)                   scale_factor / factor
                   incr_ratio
backoff_factor     backoff_factor /     (0.5)                   1 / scale_factor
                   decr_ratio
growth_interval    growth_interval /    window 2000             scale_window / period
                   incr_every_n_steps
hysteresis         ``decr_every_n_``    hysteresis (DeepSpeed)  (1)
                   ``nan_or_inf``
min_scale          (none; Paddle 1.0)   min_loss_scale          1.0 (MindSpore)
max_scale          (none)               max_loss_scale 2**24    2**24 (MXNet)
dynamic            ``use_dynamic_``     loss_scale="dynamic"    Dynamic/StaticLossScaler
                   ``loss_scaling``
=================  ===================  ======================  ==========================

The rule, applied by :func:`update_scale_` once per iteration:

* overflow (inf/NaN found): the step was skipped, the growth count restarts; after
  ``hysteresis`` consecutive overflows the scale is multiplied by ``backoff_factor``
  (never below ``min_scale``);
* no overflow: after ``growth_interval`` consecutive clean steps the scale is
  multiplied by ``growth_factor`` (never above ``max_scale``; a product that is not a
  finite float32 is dropped), and the count restarts;
* static (``dynamic=False``): the scale never moves.

With the defaults (``hysteresis=1``, no bounds) this is exactly
``torch.amp.GradScaler``'s rule, and :func:`update_scale_` runs torch's own kernel for
it. Products are taken in float64 and rounded to float32, as torch's kernel does, so
trajectories agree bit for bit.

Example:
    >>> import torch
    >>> from ampkit.scaling.schedule import ScaleSchedule, update_scale_
    >>> rule = ScaleSchedule(growth_interval=2, hysteresis=2, min_scale=1.0)
    >>> scale = torch.tensor(4.0)
    >>> growth, overflows = torch.tensor(0, dtype=torch.int32), torch.tensor(0, dtype=torch.int32)
    >>> for found_inf in (1.0, 1.0, 0.0, 0.0):
    ...     update_scale_(scale, growth, overflows, torch.tensor(found_inf), rule)
    ...     print(scale.item(), growth.item(), overflows.item())
    4.0 0 1
    2.0 0 0
    2.0 1 0
    4.0 0 0
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

import torch

from ampkit import torch_internals
from ampkit.common.arguments import positive_int, positive_number

__all__ = ["ScaleSchedule", "check_scale_value", "update_scale_"]


#: A scale value's check (a positive finite number), kept under its old name.
check_scale_value = positive_number


@dataclasses.dataclass(frozen=True)
class ScaleSchedule:
    """How a loss scale grows and backs off; immutable and validated on creation.

    Args:
        growth_factor: multiplier applied after ``growth_interval`` clean steps; > 1.
        backoff_factor: multiplier applied on overflow; in (0, 1).
        growth_interval: consecutive clean steps before the scale grows; int >= 1.
        hysteresis: consecutive overflows before the scale backs off (Paddle's
            ``decr_every_n_nan_or_inf``, DeepSpeed's ``hysteresis``); int >= 1. Every
            overflow still skips its step.
        min_scale: floor for backing off (apex ``min_loss_scale``; 1.0 for MindSpore);
            ``None`` for no floor.
        max_scale: ceiling for growing (apex ``max_loss_scale``, MXNet 2**24); ``None``
            for no ceiling.
        dynamic: ``False`` keeps the scale constant (static loss scaling).

    Bad values raise ``ValueError`` naming the argument (``TypeError`` for a wrong type).

    Example:
        >>> from ampkit.scaling.schedule import ScaleSchedule
        >>> ScaleSchedule(max_scale=2.0 ** 24).uses_native_rule
        False
        >>> ScaleSchedule(backoff_factor=1.5)
        Traceback (most recent call last):
        ...
        ValueError: backoff_factor must be in (0, 1), got 1.5
    """

    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    min_scale: float | None = None
    max_scale: float | None = None
    dynamic: bool = True

    def __post_init__(self) -> None:
        growth = check_scale_value(self.growth_factor, "growth_factor")
        if growth <= 1.0:
            raise ValueError(f"growth_factor must be > 1, got {self.growth_factor!r}")
        if isinstance(self.backoff_factor, bool) or not isinstance(self.backoff_factor,
                                                                   numbers.Real):
            raise TypeError(f"backoff_factor must be a number in (0, 1), got "
                            f"{type(self.backoff_factor).__name__} {self.backoff_factor!r}")
        backoff = float(self.backoff_factor)
        if not 0.0 < backoff < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {self.backoff_factor!r}")
        fields: dict[str, Any] = {
            "growth_factor": growth,
            "backoff_factor": backoff,
            "growth_interval": positive_int(self.growth_interval, "growth_interval"),
            "hysteresis": positive_int(self.hysteresis, "hysteresis"),
            "min_scale": (None if self.min_scale is None
                          else check_scale_value(self.min_scale, "min_scale")),
            "max_scale": (None if self.max_scale is None
                          else check_scale_value(self.max_scale, "max_scale")),
        }
        if not isinstance(self.dynamic, bool):
            raise TypeError(f"dynamic must be a bool, got {type(self.dynamic).__name__}")
        low, high = fields["min_scale"], fields["max_scale"]
        if low is not None and high is not None and low > high:
            raise ValueError(f"min_scale ({low}) must be <= max_scale ({high})")
        for name, value in fields.items():  # store the normalised values
            object.__setattr__(self, name, value)

    @property
    def uses_native_rule(self) -> bool:
        """True when the rule is exactly torch's (so torch's fused kernel applies it)."""
        return (self.dynamic and self.hysteresis == 1 and self.min_scale is None
                and self.max_scale is None)

    def check_init_scale(self, init_scale: Any, argument: str = "init_scale") -> float:
        """Validate a starting scale: positive, finite and within ``[min_scale,
        max_scale]`` when those are set (static schedules ignore the bounds).

        Example:
            >>> from ampkit.scaling.schedule import ScaleSchedule
            >>> ScaleSchedule(max_scale=8.0).check_init_scale(16.0)
            Traceback (most recent call last):
            ...
            ValueError: init_scale (16.0) must be <= max_scale (8.0)
        """
        value = check_scale_value(init_scale, argument)
        if self.dynamic:
            if self.min_scale is not None and value < self.min_scale:
                raise ValueError(f"{argument} ({value}) must be >= min_scale "
                                 f"({self.min_scale})")
            if self.max_scale is not None and value > self.max_scale:
                raise ValueError(f"{argument} ({value}) must be <= max_scale "
                                 f"({self.max_scale})")
        return value


def _scaled(scale: torch.Tensor, factor: float) -> torch.Tensor:
    # float64 product rounded once to float32: what torch's update kernel does.
    return (scale.double() * factor).float()


def update_scale_(scale: torch.Tensor, growth_tracker: torch.Tensor,
                  overflow_tracker: torch.Tensor, found_inf: torch.Tensor,
                  schedule: ScaleSchedule) -> None:
    """Advance a loss scale by one iteration, in place and without a host sync.

    ``scale`` is a 0-dim float32 tensor; ``growth_tracker`` (clean steps in a row) and
    ``overflow_tracker`` (overflows in a row, for hysteresis) are 0-dim int32 tensors on
    the same device; ``found_inf`` is nonzero when the iteration overflowed.

    Example:
        >>> import torch
        >>> from ampkit.scaling.schedule import ScaleSchedule, update_scale_
        >>> scale = torch.tensor(2.0 ** 24)
        >>> zero = torch.tensor(0, dtype=torch.int32)
        >>> update_scale_(scale, zero, zero.clone(), torch.tensor(1.0), ScaleSchedule())
        >>> scale.item()
        8388608.0
    """
    if not schedule.dynamic:
        return
    if schedule.uses_native_rule:
        torch_internals.amp_update_scale_(scale, growth_tracker, found_inf, schedule.growth_factor,
                                 schedule.backoff_factor, schedule.growth_interval)
    else:
        _update_by_ops(scale, growth_tracker, overflow_tracker, found_inf, schedule)


def _update_by_ops(scale: torch.Tensor, growth_tracker: torch.Tensor,
                   overflow_tracker: torch.Tensor, found_inf: torch.Tensor,
                   schedule: ScaleSchedule) -> None:
    """The full rule in tensor ops (torch's kernel knows no hysteresis or bounds)."""
    found = found_inf != 0  # NaN counts as found, like torch's kernel
    overflows = torch.where(found, overflow_tracker + 1, 0)
    back_off = found & (overflows >= schedule.hysteresis)
    successes = torch.where(found, 0, growth_tracker + 1)
    # torch grows when the count *equals* the interval; kept identical on purpose.
    grow = successes == schedule.growth_interval

    backed = _scaled(scale, schedule.backoff_factor)
    if schedule.min_scale is not None:  # the floor never raises a scale already below it
        backed = torch.maximum(backed, torch.clamp(scale, max=schedule.min_scale))
    grown = _scaled(scale, schedule.growth_factor)
    if schedule.max_scale is not None:  # the ceiling never lowers a scale already above it
        grown = torch.minimum(grown, torch.clamp(scale, min=schedule.max_scale))
    grow_applies = grow & torch.isfinite(grown)

    new_scale = torch.where(back_off, backed, torch.where(grow_applies, grown, scale))
    scale.copy_(new_scale)
    growth_tracker.copy_(torch.where(grow, 0, successes))
    overflow_tracker.copy_(torch.where(back_off, 0, overflows))
