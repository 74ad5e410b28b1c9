"""What a :class:`~ampkit.scaling.grad_scaler.GradScaler` keeps between calls, and how
it is read and saved: the scale and its counters (host numbers until the first
``scale()``, then tensors on the loss's device), each optimizer's place in the current
iteration, the reporting properties, the torch-compatible knobs, ``state_dict`` and
pickling. The iteration itself (scale, unscale, step, update) is ``GradScaler``'s, in
:mod:`ampkit.scaling.grad_scaler`; this base class never changes the scale.

Example:
    >>> from ampkit.scaling.grad_scaler import GradScaler
    >>> from ampkit.scaling.scaler_state import ScalerState
    >>> scaler = GradScaler("cpu", init_scale=8.0)
    >>> isinstance(scaler, ScalerState), scaler.get_scale(), scaler.steps
    (True, 8.0, 0)
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import torch

from ampkit.scaling.schedule import ScaleSchedule, check_scale_value

__all__ = ["OptState", "OptimizerRecord", "ScalerState"]


class OptState(enum.Enum):
    """Where one optimizer is in the current iteration."""

    READY = 0  # gradients still scaled
    UNSCALED = 1  # unscale_() ran: gradients unscaled, found_inf recorded
    STEPPED = 2  # step() ran (or was skipped); wait for update()


@dataclasses.dataclass
class OptimizerRecord:
    """One optimizer's place in the current iteration: its stage, and whether its
    gradients overflowed (``found_inf``, nonzero on overflow on any rank, on the scale's
    device; ``None`` until checked)."""

    stage: OptState = OptState.READY
    found_inf: torch.Tensor | None = None


# state_dict keys: torch's five, then ampkit's (optional on load, so torch checkpoints load)
_TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
_EXTRA_KEYS = ("hysteresis", "min_scale", "max_scale", "dynamic", "_overflow_tracker",
               "skipped_steps", "steps", "last_overflow_step")


class ScalerState:
    """The state a :class:`~ampkit.scaling.grad_scaler.GradScaler` keeps, its readings
    and its checkpoints (the base class of ``GradScaler``, which sets every attribute
    below in its constructor; not meant to be built on its own).

    Example:
        >>> from ampkit.scaling.grad_scaler import GradScaler
        >>> scaler = GradScaler("cpu", init_scale=4.0)
        >>> scaler.metrics(), scaler.last_step_skipped
        ({'loss_scale': 4.0, 'skipped_steps': 0.0}, False)
    """

    _device: str
    _schedule: ScaleSchedule
    _init_scale: float
    _enabled: bool
    _process_group: Any
    log_skipped_steps: bool
    _scale_bfloat16: bool
    _steps: int
    _init_growth_tracker: int
    _init_overflow_tracker: int
    _init_skipped: int
    _init_last_overflow: int
    _scale: torch.Tensor | None
    _growth_tracker: torch.Tensor | None
    _overflow_tracker: torch.Tensor | None
    _skipped: torch.Tensor | None
    _last_overflow: torch.Tensor | None
    _last_found_inf: torch.Tensor | None
    _records: dict[int, OptimizerRecord]

    # -- state -----------------------------------------------------------------------

    def _lazy_init(self, device: torch.device) -> None:
        self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=device)
        self._growth_tracker = torch.full((), self._init_growth_tracker, dtype=torch.int32,
                                          device=device)
        self._overflow_tracker = torch.full((), self._init_overflow_tracker,
                                            dtype=torch.int32, device=device)
        self._skipped = torch.full((), self._init_skipped, dtype=torch.int64, device=device)
        self._last_overflow = torch.full((), self._init_last_overflow, dtype=torch.int64,
                                         device=device)

    def _require_scale(self, method: str) -> torch.Tensor:
        if self._scale is None:
            raise RuntimeError(f"GradScaler.{method}() was called before any loss was "
                               f"scaled; call scaler.scale(loss).backward() first in each "
                               f"iteration")
        return self._scale

    def _record(self, optimizer: torch.optim.Optimizer) -> OptimizerRecord:
        return self._records.setdefault(id(optimizer), OptimizerRecord())

    @property
    def schedule(self) -> ScaleSchedule:
        """The immutable rule the scale follows (factors, interval, bounds, ...)."""
        return self._schedule

    @property
    def process_group(self) -> Any:
        """The process group whose ranks agree on an overflow (``None``: the default
        group when torch.distributed is initialised, else this process alone).

        Example:
            >>> from ampkit.scaling.grad_scaler import GradScaler
            >>> GradScaler("cpu").process_group is None
            True
        """
        return self._process_group

    def found_inf(self) -> torch.Tensor | None:
        """The overflow of the gradients unscaled since the last :meth:`update`, still
        on the device (nonzero: an inf/NaN was found on some rank; no host sync), or
        ``None`` when no optimizer was unscaled yet.

        Example:
            >>> import torch
            >>> from ampkit.scaling.grad_scaler import GradScaler
            >>> w = torch.nn.Parameter(torch.ones(1))
            >>> opt = torch.optim.SGD([w], lr=0.1)
            >>> scaler = GradScaler("cpu")
            >>> scaler.found_inf() is None
            True
            >>> scaler.scale(w.sum() * float("inf")).backward()
            >>> scaler.unscale_(opt)
            >>> bool(scaler.found_inf())
            True
        """
        found = [r.found_inf for r in self._records.values() if r.found_inf is not None]
        if not found:
            return None
        assert self._scale is not None
        combined = found[0].to(self._scale.device, non_blocking=True)
        for other in found[1:]:
            combined = combined + other.to(self._scale.device, non_blocking=True)
        return combined

    def get_scale(self) -> float:
        """The current scale as a Python float (a host sync); 1.0 when disabled.

        Example:
            >>> from ampkit.scaling.grad_scaler import GradScaler
            >>> GradScaler("cpu").get_scale(), GradScaler("cpu", enabled=False).get_scale()
            (65536.0, 1.0)
        """
        if not self._enabled:
            return 1.0
        return self._init_scale if self._scale is None else float(self._scale.item())

    def _get_scale_async(self) -> torch.Tensor | None:
        # torch's name, used by some training libraries to read the scale without a sync.
        return self._scale

    def get_growth_factor(self) -> float:
        """The growth factor.

        Example:
            >>> from ampkit.scaling.grad_scaler import GradScaler
            >>> GradScaler("cpu").get_growth_factor()
            2.0
        """
        return self._schedule.growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Replace the growth factor (> 1).

        Example:
            >>> from ampkit.scaling.grad_scaler import GradScaler
            >>> scaler = GradScaler("cpu")
            >>> scaler.set_growth_factor(4.0)
            >>> scaler.get_growth_factor()
            4.0
        """
        self._schedule = dataclasses.replace(self._schedule, growth_factor=new_factor)

    def get_backoff_factor(self) -> float:
        """The backoff factor.

        Example:
            >>> from ampkit.scaling.grad_scaler import GradScaler
            >>> GradScaler("cpu").get_backoff_factor()
            0.5
        """
        return self._schedule.backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Replace the backoff factor (in (0, 1)).

        Example:
            >>> from ampkit.scaling.grad_scaler import GradScaler
            >>> scaler = GradScaler("cpu")
            >>> scaler.set_backoff_factor(0.25)
            >>> scaler.get_backoff_factor()
            0.25
        """
        self._schedule = dataclasses.replace(self._schedule, backoff_factor=new_factor)

    def get_growth_interval(self) -> int:
        """The growth interval.

        Example:
            >>> from ampkit.scaling.grad_scaler import GradScaler
            >>> GradScaler("cpu").get_growth_interval()
            2000
        """
        return self._schedule.growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Replace the growth interval (int >= 1).

        Example:
            >>> from ampkit.scaling.grad_scaler import GradScaler
            >>> scaler = GradScaler("cpu")
            >>> scaler.set_growth_interval(100)
            >>> scaler.get_growth_interval()
            100
        """
        self._schedule = dataclasses.replace(self._schedule, growth_interval=new_interval)

    def _get_growth_tracker(self) -> int:
        if not self._enabled:
            return 0
        if self._growth_tracker is None:
            return self._init_growth_tracker
        return int(self._growth_tracker.item())

    def _get_overflow_tracker(self) -> int:
        if not self._enabled:
            return 0
        if self._overflow_tracker is None:
            return self._init_overflow_tracker
        return int(self._overflow_tracker.item())

    def is_enabled(self) -> bool:
        """Whether the scaler scales (``False``: every method is a pass-through).

        Example:
            >>> from ampkit.scaling.grad_scaler import GradScaler
            >>> GradScaler("cpu", enabled=False).is_enabled()
            False
        """
        return self._enabled

    # -- reporting -------------------------------------------------------------------

    @property
    def skipped_steps(self) -> int:
        """Iterations skipped so far because of inf/NaN gradients (the current one
        counts as soon as it has been checked). Reading it is a host sync.

        Example:
            >>> from ampkit.scaling.grad_scaler import GradScaler
            >>> GradScaler("cpu").skipped_steps
            0
        """
        if not self._enabled:
            return 0
        committed = self._init_skipped if self._skipped is None else int(self._skipped.item())
        current = self.found_inf()
        return committed + (1 if current is not None and current.item() != 0 else 0)

    @property
    def steps(self) -> int:
        """Iterations ended by ``update()`` so far (the index the next one gets).

        Example:
            >>> from ampkit.scaling.grad_scaler import GradScaler
            >>> GradScaler("cpu").steps
            0
        """
        return self._steps

    @property
    def last_overflow_step(self) -> int | None:
        """The index (counted by ``update()``, from 0) of the last iteration whose
        gradients overflowed, or ``None``. Reading it is a host sync.

        Example:
            >>> import torch
            >>> from ampkit.scaling.grad_scaler import GradScaler
            >>> w = torch.nn.Parameter(torch.ones(1))
            >>> opt = torch.optim.SGD([w], lr=0.1)
            >>> scaler = GradScaler("cpu")
            >>> for x in (1.0, float("inf"), 1.0):
            ...     scaler.scale((w * x).sum()).backward()
            ...     scaler.step(opt)
            ...     scaler.update()
            ...     opt.zero_grad()
            >>> scaler.last_overflow_step, scaler.skipped_steps, scaler.steps
            (1, 1, 3)
        """
        if not self._enabled:
            return None
        index = (self._init_last_overflow if self._last_overflow is None
                 else int(self._last_overflow.item()))
        return None if index < 0 else index

    def metrics(self) -> dict[str, torch.Tensor | float]:
        """``{"loss_scale": ..., "skipped_steps": ...}`` for a training log, as tensors
        on the scale's device (no host sync: the logger reads them when it writes);
        plain numbers before the first ``scale()``. The integrations log them as
        ``amp/loss_scale`` and ``amp/skipped_steps``.

        Example:
            >>> from ampkit.scaling.grad_scaler import GradScaler
            >>> GradScaler("cpu", init_scale=4.0).metrics()
            {'loss_scale': 4.0, 'skipped_steps': 0.0}
        """
        if not self._enabled:
            return {"loss_scale": 1.0, "skipped_steps": 0.0}
        if self._scale is None or self._skipped is None:
            return {"loss_scale": self._init_scale, "skipped_steps": float(self._init_skipped)}
        return {"loss_scale": self._scale.detach().clone(),
                "skipped_steps": self._skipped.to(torch.float32)}

    @property
    def last_step_skipped(self) -> bool:
        """Whether the latest checked iteration overflowed, so its optimizer steps were
        skipped: the current iteration once ``step``/``unscale_`` has run, else the one
        before the last ``update()``. Reading it is a host sync.

        Example:
            >>> from ampkit.scaling.grad_scaler import GradScaler
            >>> GradScaler("cpu").last_step_skipped
            False
        """
        if not self._enabled:
            return False
        current = self.found_inf()
        if current is None:
            current = self._last_found_inf
        return current is not None and bool(current.item() != 0)

    # -- checkpoints -----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state: torch's five keys (``scale``, ``growth_factor``,
        ``backoff_factor``, ``growth_interval``, ``_growth_tracker``) plus
        ``hysteresis``, ``min_scale``, ``max_scale``, ``dynamic``, ``_overflow_tracker``
        and ``skipped_steps``. Empty when disabled. Take it after ``update()``.

        Example:
            >>> from ampkit.scaling.grad_scaler import GradScaler
            >>> sorted(GradScaler("cpu").state_dict())[:4]
            ['_growth_tracker', '_overflow_tracker', 'backoff_factor', 'dynamic']
        """
        if not self._enabled:
            return {}
        rule = self._schedule
        return {
            "scale": self.get_scale(),
            "growth_factor": rule.growth_factor,
            "backoff_factor": rule.backoff_factor,
            "growth_interval": rule.growth_interval,
            "_growth_tracker": self._get_growth_tracker(),
            "hysteresis": rule.hysteresis,
            "min_scale": rule.min_scale,
            "max_scale": rule.max_scale,
            "dynamic": rule.dynamic,
            "_overflow_tracker": self._get_overflow_tracker(),
            "skipped_steps": (self._init_skipped if self._skipped is None
                              else int(self._skipped.item())),
            "steps": self._steps,
            "last_overflow_step": self.last_overflow_step,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a state from :meth:`state_dict` (ampkit's or torch's own; keys
        ampkit adds keep this scaler's values when absent). A no-op when disabled.

        Raises:
            RuntimeError: the dict is empty (saved from a disabled scaler).
            ValueError: keys are missing or unknown (named), or a value is invalid.

        Example:
            >>> import torch
            >>> from ampkit.scaling.grad_scaler import GradScaler
            >>> scaler = GradScaler("cpu")
            >>> scaler.load_state_dict(torch.amp.GradScaler("cpu", init_scale=8.0).state_dict())
            >>> scaler.get_scale()
            8.0
        """
        if not self._enabled:
            return
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
        if len(state_dict) == 0:
            raise RuntimeError("the state dict is empty, probably saved from a disabled "
                               "GradScaler; there is no scale to restore")
        missing = [k for k in _TORCH_KEYS if k not in state_dict]
        unknown = sorted(k for k in state_dict if k not in _TORCH_KEYS + _EXTRA_KEYS)
        if missing or unknown:
            raise ValueError(f"GradScaler.load_state_dict: missing keys {missing}, unknown "
                             f"keys {unknown}; expected {list(_TORCH_KEYS)} and optionally "
                             f"{list(_EXTRA_KEYS)}")
        rule = self._schedule
        schedule = ScaleSchedule(
            growth_factor=state_dict["growth_factor"],
            backoff_factor=state_dict["backoff_factor"],
            growth_interval=state_dict["growth_interval"],
            hysteresis=state_dict.get("hysteresis", rule.hysteresis),
            min_scale=state_dict.get("min_scale", rule.min_scale),
            max_scale=state_dict.get("max_scale", rule.max_scale),
            dynamic=state_dict.get("dynamic", rule.dynamic))
        scale = check_scale_value(state_dict["scale"], "state_dict['scale']")
        counters = {key: state_dict.get(key, 0) for key in
                    ("_growth_tracker", "_overflow_tracker", "skipped_steps")}
        counters["steps"] = state_dict.get("steps", self._steps)
        for key, value in counters.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"state_dict[{key!r}] must be an int >= 0, got {value!r}")
        last_overflow = state_dict.get("last_overflow_step")
        if last_overflow is not None and (isinstance(last_overflow, bool) or not isinstance(
                last_overflow, int) or last_overflow < 0):
            raise ValueError(f"state_dict['last_overflow_step'] must be None or an int >= 0, "
                             f"got {last_overflow!r}")
        self._schedule = schedule
        self._init_scale = scale
        self._init_growth_tracker = counters["_growth_tracker"]
        self._init_overflow_tracker = counters["_overflow_tracker"]
        self._init_skipped = counters["skipped_steps"]
        self._steps = counters["steps"]
        self._init_last_overflow = -1 if last_overflow is None else last_overflow
        if self._scale is not None:
            assert self._growth_tracker is not None and self._overflow_tracker is not None
            assert self._skipped is not None
            self._scale.fill_(scale)
            self._growth_tracker.fill_(self._init_growth_tracker)
            self._overflow_tracker.fill_(self._init_overflow_tracker)
            self._skipped.fill_(self._init_skipped)
            assert self._last_overflow is not None
            self._last_overflow.fill_(self._init_last_overflow)
        self._last_found_inf = None

    def __getstate__(self) -> dict[str, Any]:
        if self._records:
            raise RuntimeError("a GradScaler can only be pickled between iterations (before "
                               "scale() or after update()), not in the middle of one")
        if self._process_group is not None:
            raise RuntimeError("a GradScaler with an explicit process_group cannot be "
                               "pickled (process groups cannot); pickle one built with "
                               "process_group=None")
        state = self.__dict__.copy()
        if self._enabled:
            # Tensors go back to plain numbers; they are rebuilt lazily on the next scale().
            saved = self.state_dict()
            state["_init_scale"] = saved["scale"]
            state["_init_growth_tracker"] = saved["_growth_tracker"]
            state["_init_overflow_tracker"] = saved["_overflow_tracker"]
            state["_init_skipped"] = saved["skipped_steps"]
            last = saved["last_overflow_step"]
            state["_init_last_overflow"] = -1 if last is None else last
        for name in ("_scale", "_growth_tracker", "_overflow_tracker", "_skipped",
                     "_last_overflow", "_last_found_inf"):
            state[name] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
