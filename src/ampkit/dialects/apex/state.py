"""apex's process-wide state: the properties of the last ``initialize``,
``amp._amp_state`` (a view of the core's loss scalers under apex's names, which apex
scripts read and apex's own tests set) and the checkpoint of the loss scalers
(``state_dict``/``load_state_dict``, apex's format).

Example:
    >>> import torch
    >>> import ampkit.apex as amp
    >>> from ampkit.dialects.apex.state import amp_state
    >>> _ = amp.initialize(torch.nn.Linear(2, 2), opt_level="O3", verbosity=0)
    >>> amp_state.opt_properties.opt_level, amp_state is amp._amp_state
    ('O3', True)
"""

from __future__ import annotations

import dataclasses
import numbers
import threading
from collections import OrderedDict
from typing import Any, Protocol

from ampkit.dialects.apex.opt_levels import Properties
from ampkit.scaling.loss_scaling import (
    latest_loss_scaler,
    load_loss_scaling_state_dict,
    loss_scaling_state_dict,
)
from ampkit.scaling.schedule import check_scale_value

__all__ = ["Handle", "amp_state", "load_state_dict", "require_state", "set_properties",
           "state_dict"]


class Handle(Protocol):
    """What ``amp_state.handle`` holds: an :class:`~ampkit.dialects.apex.handle.AmpHandle`
    (named by what it does, so this module need not import the handles' own)."""

    def is_active(self) -> bool: ...

    def _deactivate(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class _State:
    properties: Properties


_lock = threading.Lock()
_state: _State | None = None


def set_properties(properties: Properties) -> None:
    """Record the properties of an ``initialize`` (the ones :func:`require_state` and
    ``amp_state.opt_properties`` give back).

    Example:
        >>> from ampkit.dialects.apex.opt_levels import OPT_LEVELS
        >>> from ampkit.dialects.apex.state import amp_state, set_properties
        >>> set_properties(OPT_LEVELS["O0"]); amp_state.opt_properties.opt_level
        'O0'
    """
    global _state
    with _lock:
        _state = _State(properties)


def require_state(caller: str) -> _State:
    with _lock:
        state = _state
    if state is None:
        raise RuntimeError(f"amp.{caller}() was called before amp.initialize(); call "
                           f"model, optimizer = amp.initialize(model, optimizer, "
                           f"opt_level=...) first")
    return state


class _LossScalerView:
    """apex's ``LossScaler`` of one loss id, over the core's scaler."""

    def __init__(self, loss_id: int) -> None:
        self._loss_id = loss_id

    def loss_scale(self) -> float:
        """The current scale."""
        return latest_loss_scaler(self._loss_id).get_scale()

    @property
    def _loss_scale(self) -> float:
        return self.loss_scale()

    @_loss_scale.setter
    def _loss_scale(self, value: float) -> None:
        value = check_scale_value(value, "_loss_scale")  # before anything changes
        scaler = latest_loss_scaler(self._loss_id)
        if scaler.is_enabled():
            scaler.load_state_dict({**scaler.state_dict(), "scale": float(value)})

    @property
    def dynamic(self) -> bool:
        """Whether the scale is dynamic."""
        scaler = latest_loss_scaler(self._loss_id)
        return scaler.is_enabled() and scaler.schedule.dynamic

    @property
    def _unskipped(self) -> int:
        scaler = latest_loss_scaler(self._loss_id)
        return int(scaler.state_dict()["_growth_tracker"]) if scaler.is_enabled() else 0


class _AmpState:
    """``amp._amp_state``: apex's internal state, which apex scripts read (loss scales
    for logging) and apex's own tests set. A view of the core's state under apex's
    names.

    Example:
        >>> import torch
        >>> import ampkit.apex as amp
        >>> _ = amp.initialize(torch.nn.Linear(2, 2), opt_level="O2", verbosity=0)
        >>> amp._amp_state.opt_properties.opt_level
        'O2'
        >>> amp._amp_state.loss_scalers[0].loss_scale()
        65536.0
    """

    def __init__(self) -> None:
        self.handle: Handle | None = None
        self.allow_incoming_model_not_fp32 = False
        self.verbosity = 1

    @property
    def opt_properties(self) -> Properties:
        """The properties of the last :func:`initialize` (AttributeError before it, as
        in apex, which scripts test with ``hasattr``)."""
        with _lock:
            state = _state
        if state is None:
            raise AttributeError("opt_properties: amp.initialize() has not been called")
        return state.properties

    @property
    def loss_scalers(self) -> list[_LossScalerView]:
        """One view per loss id: ``loss_scale()``, ``_loss_scale`` (settable),
        ``dynamic``."""
        return [_LossScalerView(i) for i in range(len(loss_scaling_state_dict()))]


_amp_state = _AmpState()
#: ``_amp_state`` under a name other modules may import: ``ampkit.apex`` re-exports it
#: as apex's ``amp._amp_state`` (apex's own spelling, underscore included).
amp_state = _amp_state


def state_dict(destination: dict[str, Any] | None = None) -> dict[str, Any]:
    """The loss scalers' state, apex's format: ``{"loss_scaler0": {"loss_scale": ...,
    "unskipped": ...}, ...}`` (into ``destination`` when given).

    Raises:
        RuntimeError: :func:`initialize` was not called.

    Example:
        >>> import torch
        >>> import ampkit.apex as amp
        >>> _ = amp.initialize(torch.nn.Linear(2, 2), opt_level="O1", num_losses=2,
        ...                    verbosity=0)
        >>> dict(amp.state_dict())  # doctest: +NORMALIZE_WHITESPACE
        {'loss_scaler0': {'loss_scale': 65536.0, 'unskipped': 0},
         'loss_scaler1': {'loss_scale': 65536.0, 'unskipped': 0}}
    """
    state = require_state("state_dict")
    out: dict[str, Any] = OrderedDict() if destination is None else destination
    if not state.properties.enabled:
        return out
    for key, core in loss_scaling_state_dict().items():
        out[key] = ({"loss_scale": core["scale"], "unskipped": core["_growth_tracker"]}
                    if core else {"loss_scale": 1.0, "unskipped": 0})
    return out


def load_state_dict(state_dict: dict[str, Any]) -> None:
    """Restore :func:`state_dict`'s output into the loss scalers.

    Raises:
        RuntimeError: unexpected keys (any without ``"loss_scaler"``), or a number of
            loss scalers different from ``num_losses``; :func:`initialize` not called.
        ValueError: an entry without ``loss_scale`` and ``unskipped``.

    Example:
        >>> import torch
        >>> import ampkit.apex as amp
        >>> _ = amp.initialize(torch.nn.Linear(2, 2), opt_level="O1", verbosity=0)
        >>> amp.load_state_dict({"loss_scaler0": {"loss_scale": 128.0, "unskipped": 7}})
        >>> amp.state_dict()["loss_scaler0"]
        {'loss_scale': 128.0, 'unskipped': 7}
    """
    state = require_state("load_state_dict")
    if not isinstance(state_dict, dict):
        raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
    unexpected = [k for k in state_dict if "loss_scaler" not in str(k)]
    if unexpected:
        raise RuntimeError(f"error(s) in loading state_dict: unexpected key(s) "
                           f"{', '.join(repr(k) for k in unexpected)}")
    if not state.properties.enabled:
        return
    current = loss_scaling_state_dict()
    entries = list(state_dict.values())
    if len(entries) != len(current):
        raise RuntimeError(f"state_dict holds {len(entries)} loss scaler(s), but "
                           f"amp.initialize set up {len(current)} (num_losses)")
    for key, entry in zip(current, entries):
        if not isinstance(entry, dict) or not {"loss_scale", "unskipped"} <= set(entry):
            raise ValueError(f"each loss scaler's state must be a dict with 'loss_scale' "
                             f"and 'unskipped', got {entry!r}")
        unskipped = entry["unskipped"]
        if isinstance(unskipped, bool) or not isinstance(unskipped, numbers.Integral) or (
                unskipped < 0):
            raise ValueError(f"'unskipped' must be an int >= 0, got {unskipped!r}")
        if current[key]:  # a scaler that scales (not disabled)
            current[key] = {**current[key], "scale": entry["loss_scale"],
                            "_growth_tracker": int(unskipped)}
    load_loss_scaling_state_dict(current)
