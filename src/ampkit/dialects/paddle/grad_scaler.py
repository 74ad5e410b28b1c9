"""Paddle's ``GradScaler`` (``AmpScaler``'s behaviour): Paddle's names, defaults and
``state_dict`` over the core :class:`ampkit.GradScaler`, with ``minimize`` and
``step``/``update`` as Paddle spells them.

Example:
    >>> from ampkit.dialects.paddle.grad_scaler import GradScaler
    >>> GradScaler(init_loss_scaling=1024).get_init_loss_scaling()
    1024.0
"""

from __future__ import annotations

import numbers
import warnings
from typing import Any

import torch

from ampkit.dialects._errors import framework_errors
from ampkit.dialects.paddle.region import check_bool, last_amp_dtype
from ampkit.scaling.grad_scaler import GradScaler as _CoreGradScaler
from ampkit.scaling.schedule import check_scale_value

__all__ = ["GradScaler"]


# -- GradScaler ----------------------------------------------------------------------------

# Paddle's names for the core scaler's settings and state (its state_dict keys, in
# Paddle's order): the one table the constructor's errors, state_dict and
# load_state_dict translate by.
_SETTINGS = {"incr_ratio": "growth_factor", "decr_ratio": "backoff_factor",
             "incr_every_n_steps": "growth_interval",
             "decr_every_n_nan_or_inf": "hysteresis"}
_STATE = {"scale": "scale", **_SETTINGS, "incr_count": "_growth_tracker",
          "decr_count": "_overflow_tracker", "use_dynamic_loss_scaling": "dynamic"}

# ampkit's argument names in the core's errors -> Paddle's.
_RENAMES = {"init_scale": "init_loss_scaling", **{core: paddle for paddle, core in
                                                   _SETTINGS.items()}}


def _as_float(value: Any, argument: str) -> float:
    if isinstance(value, torch.Tensor):
        value = value.detach().reshape(-1)[0].item()
    elif hasattr(value, "item"):  # numpy arrays and scalars, as Paddle saves them
        value = value.item() if getattr(value, "size", 1) == 1 else value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{argument} must be a number, got {type(value).__name__}")
    return float(value)



# Paddle's positional order, its defaults, and torch's spellings of the same settings.
_PADDLE_ORDER: dict[str, Any] = {
    "enable": True, "init_loss_scaling": 2.0**16, "incr_ratio": 2.0, "decr_ratio": 0.5,
    "incr_every_n_steps": 2000, "decr_every_n_nan_or_inf": 1,
    "use_dynamic_loss_scaling": True}
_TORCH_NAMES = {"enabled": "enable", "init_scale": "init_loss_scaling",
                "growth_factor": "incr_ratio", "backoff_factor": "decr_ratio",
                "growth_interval": "incr_every_n_steps"}
# torch.amp.GradScaler's positional order after ``device``.
_TORCH_ORDER = ("init_scale", "growth_factor", "backoff_factor", "growth_interval", "enabled")


def _paddle_settings(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The constructor's arguments, in any of the forms Paddle accepts, as Paddle's
    settings: Paddle's positional order and names; torch's names as keywords; torch's
    positional order, told apart by its first argument (a device name, or a number
    where Paddle's ``enable`` is a bool); ``device`` taken and ignored, as in Paddle."""
    given = dict(kwargs)
    if args and (isinstance(args[0], str) or (isinstance(args[0], numbers.Real)
                                               and not isinstance(args[0], bool))):
        if isinstance(args[0], str):
            given.setdefault("device", args[0])  # a second device is caught below
            if given["device"] is not args[0]:
                raise TypeError("GradScaler got multiple values for argument 'device'")
            args = args[1:]
        order: tuple[str, ...] = _TORCH_ORDER
    else:
        order = tuple(_PADDLE_ORDER)
    if len(args) > len(order):
        raise TypeError(f"GradScaler takes at most {len(order)} positional arguments in "
                        f"this form ({', '.join(order)}), got {len(args)}")
    for name, value in zip(order, args, strict=False):
        if name in given:
            raise TypeError(f"GradScaler got multiple values for argument {name!r}")
        given[name] = value
    given.pop("device", None)  # torch's device: Paddle ignores it (one global place)
    unknown = sorted(set(given) - set(_PADDLE_ORDER) - set(_TORCH_NAMES))
    if unknown:
        raise TypeError(f"GradScaler got unexpected keyword argument(s) {unknown}; "
                        f"accepted: {[*_PADDLE_ORDER, *_TORCH_NAMES, 'device']}")
    settings = dict(_PADDLE_ORDER)
    for name, value in given.items():
        paddle = _TORCH_NAMES.get(name, name)
        torch_name = next((t for t, p in _TORCH_NAMES.items() if p == paddle), None)
        if (torch_name is not None and torch_name in given and paddle in given
                and given[paddle] != given[torch_name]):
            raise ValueError(f"{paddle}={given[paddle]!r} and {torch_name}="
                             f"{given[torch_name]!r} name the same setting with different "
                             f"values; pass one of them")
        settings[paddle] = value
    return settings


class GradScaler:
    """Paddle's ``GradScaler``: scales the loss, unscales and checks the gradients,
    skips the step on inf/NaN and adjusts the scale.

    Args:
        enable: ``False`` makes every method a pass-through.
        init_loss_scaling: the starting scale.
        incr_ratio: the factor the scale grows by; > 1.
        decr_ratio: the factor it shrinks by; in (0, 1).
        incr_every_n_steps: clean steps in a row before it grows.
        decr_every_n_nan_or_inf: overflows in a row before it shrinks (each one skips
            its step).
        use_dynamic_loss_scaling: ``False`` keeps ``init_loss_scaling`` (overflowing
            steps are still skipped).

    The scale never goes below 1, as in Paddle.

    torch's spellings work too, as in Paddle 3: the keywords ``enabled``,
    ``init_scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``, torch's
    positional order (``GradScaler(1024.0)``, ``GradScaler("cuda", 1024.0)``) and a
    ``device`` that is ignored; a Paddle name and a torch name for one setting with
    different values are a ``ValueError``. ``is_enabled``, ``get_scale`` and the
    ``get_``/``set_growth_factor``, ``backoff_factor``, ``growth_interval`` methods are
    the Paddle ones under torch's names.

    Raises:
        ValueError, TypeError: a bad value, named with Paddle's argument names; a
            Paddle and a torch name for one setting that disagree (``ValueError``).

    Example:
        >>> import torch
        >>> import ampkit.paddle as amp
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> scaler = amp.GradScaler(init_loss_scaling=1024)
        >>> with amp.auto_cast():
        ...     loss = model(torch.rand(4, 2)).float().mean()
        >>> scaled = scaler.scale(loss)
        >>> scaled.backward()
        >>> _ = scaler.minimize(opt, scaled)
        >>> opt.zero_grad()
        >>> scaler.state_dict()["scale"]
        1024.0
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        settings = _paddle_settings(args, kwargs)
        enable = check_bool(settings["enable"], "enable")
        check_bool(settings["use_dynamic_loss_scaling"], "use_dynamic_loss_scaling")
        with framework_errors(names=_RENAMES):
            self._scaler = _CoreGradScaler(
                None, init_scale=settings["init_loss_scaling"],
                growth_factor=settings["incr_ratio"], backoff_factor=settings["decr_ratio"],
                growth_interval=settings["incr_every_n_steps"], enabled=enable,
                hysteresis=settings["decr_every_n_nan_or_inf"], min_scale=1.0,
                dynamic=settings["use_dynamic_loss_scaling"])
        # Paddle's disabled scaler reports an initial scale of 1.
        self._init_loss_scaling = float(settings["init_loss_scaling"]) if enable else 1.0

    # -- the training step ---------------------------------------------------------------

    def scale(self, var: torch.Tensor) -> torch.Tensor:
        """The loss times the current scale (``var`` itself when disabled).

        Example:
            >>> import torch
            >>> import ampkit.paddle as amp
            >>> amp.GradScaler(init_loss_scaling=8.0).scale(torch.tensor(2.0))
            tensor(16.)
        """
        if not isinstance(var, torch.Tensor):
            raise TypeError(f"var must be a torch.Tensor, got {type(var).__name__}")
        dtype = last_amp_dtype()
        if self._scaler.is_enabled() and self._scaler.schedule.dynamic and (
                dtype != "float16"):
            # Paddle's rule: dynamic loss scaling is for float16 only; after a bfloat16
            # auto_cast the scaler turns itself off for good (a pass-through).
            warnings.warn(f"GradScaler: dynamic loss scaling is not used with {dtype} "
                          f"(the last auto_cast's dtype), so the scaler disables itself, "
                          f"as Paddle's does", UserWarning, stacklevel=2)
            self._scaler = _CoreGradScaler(None, enabled=False, dynamic=False)
        return self._scaler.scale(var)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale and check them for inf/NaN.

        Raises:
            RuntimeError: called twice for one optimizer before ``update()``, or after
                ``step()``.

        Example:
            >>> import torch
            >>> import ampkit.paddle as amp
            >>> w = torch.nn.Parameter(torch.ones(1))
            >>> opt = torch.optim.SGD([w], lr=0.1)
            >>> scaler = amp.GradScaler(init_loss_scaling=4.0)
            >>> scaler.scale(w.sum()).backward()
            >>> scaler.unscale_(opt)
            >>> w.grad.item()
            1.0
        """
        self._scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale (unless done) and run ``optimizer.step()`` unless a gradient is
        inf/NaN. Call :meth:`update` after it.

        Raises:
            RuntimeError: called twice for one optimizer before ``update()``.

        Example:
            >>> import torch
            >>> import ampkit.paddle as amp
            >>> w = torch.nn.Parameter(torch.ones(1))
            >>> opt = torch.optim.SGD([w], lr=0.5)
            >>> scaler = amp.GradScaler()
            >>> scaler.scale(w.sum()).backward()
            >>> scaler.step(opt)
            >>> scaler.update()
            >>> w.item()
            0.5
        """
        self._scaler.step(optimizer)

    def update(self) -> None:
        """Adjust the scale after the step(s) of this iteration.

        Example:
            >>> import torch
            >>> import ampkit.paddle as amp
            >>> w = torch.nn.Parameter(torch.ones(1))
            >>> opt = torch.optim.SGD([w], lr=0.5)
            >>> scaler = amp.GradScaler(init_loss_scaling=8.0)
            >>> scaler.scale(w.sum() * float("inf")).backward()
            >>> scaler.step(opt)
            >>> scaler.update()
            >>> w.item(), scaler.state_dict()["scale"]
            (1.0, 4.0)
        """
        self._scaler.update()

    def minimize(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any
                 ) -> tuple[list[Any], list[tuple[torch.Tensor, torch.Tensor]]] | tuple[
                     None, None]:
        """:meth:`step` then :meth:`update`, returning what Paddle's ``minimize``
        returns in dynamic graph mode: ``(optimize_ops, params_grads)``, that is ``[]``
        and the ``(parameter, gradient)`` pairs the step applied (unscaled), or
        ``(None, None)`` when an overflow skipped the step. Paddle passes the remaining
        arguments (the scaled loss) to ``optimizer.minimize``, which in dynamic graph
        mode only applies the gradients already computed; torch's ``step()`` does the
        same, so they are not used.

        Example:
            >>> import torch
            >>> import ampkit.paddle as amp
            >>> w = torch.nn.Parameter(torch.ones(1))
            >>> opt = torch.optim.SGD([w], lr=0.5)
            >>> scaler = amp.GradScaler()
            >>> scaled = scaler.scale(w.sum())
            >>> scaled.backward()
            >>> ops, params_grads = scaler.minimize(opt, scaled)
            >>> ops, params_grads[0][0] is w, params_grads[0][1].item(), w.item()
            ([], True, 1.0, 0.5)
        """
        self._scaler.step(optimizer)
        self._scaler.update()
        if self._scaler.last_step_skipped:
            return None, None
        return [], [(p, p.grad) for group in optimizer.param_groups for p in group["params"]
                    if p.grad is not None]

    # -- settings ------------------------------------------------------------------------

    def is_enable(self) -> bool:
        """Whether the scaler is enabled.

        Example:
            >>> import ampkit.paddle as amp
            >>> amp.GradScaler(enable=False).is_enable()
            False
        """
        return self._scaler.is_enabled()

    def is_use_dynamic_loss_scaling(self) -> bool:
        """Whether the scale is dynamic.

        Example:
            >>> import ampkit.paddle as amp
            >>> amp.GradScaler(use_dynamic_loss_scaling=False).is_use_dynamic_loss_scaling()
            False
        """
        return self._scaler.schedule.dynamic

    def get_init_loss_scaling(self) -> float:
        """The initial scale (as constructed or last set).

        Example:
            >>> import ampkit.paddle as amp
            >>> amp.GradScaler().get_init_loss_scaling()
            65536.0
        """
        return self._init_loss_scaling

    def set_init_loss_scaling(self, new_init_loss_scaling: float) -> None:
        """Set the initial scale; the current scale becomes it too (as in Paddle).

        Example:
            >>> import ampkit.paddle as amp
            >>> scaler = amp.GradScaler()
            >>> scaler.set_init_loss_scaling(128)
            >>> scaler.get_init_loss_scaling(), scaler.state_dict()["scale"]
            (128.0, 128.0)
        """
        value = check_scale_value(_as_float(new_init_loss_scaling, "new_init_loss_scaling"),
                                  "new_init_loss_scaling")
        self._replace(scale=value)
        self._init_loss_scaling = value

    def get_incr_ratio(self) -> float:
        """The growth factor.

        Example:
            >>> import ampkit.paddle as amp
            >>> amp.GradScaler().get_incr_ratio()
            2.0
        """
        return self._scaler.get_growth_factor()

    def set_incr_ratio(self, new_incr_ratio: float) -> None:
        """Set the growth factor (> 1).

        Example:
            >>> import ampkit.paddle as amp
            >>> scaler = amp.GradScaler()
            >>> scaler.set_incr_ratio(3.0)
            >>> scaler.get_incr_ratio()
            3.0
        """
        self._replace(growth_factor=new_incr_ratio)

    def get_decr_ratio(self) -> float:
        """The backoff factor.

        Example:
            >>> import ampkit.paddle as amp
            >>> amp.GradScaler().get_decr_ratio()
            0.5
        """
        return self._scaler.get_backoff_factor()

    def set_decr_ratio(self, new_decr_ratio: float) -> None:
        """Set the backoff factor (in (0, 1)).

        Example:
            >>> import ampkit.paddle as amp
            >>> scaler = amp.GradScaler()
            >>> scaler.set_decr_ratio(0.25)
            >>> scaler.get_decr_ratio()
            0.25
        """
        self._replace(backoff_factor=new_decr_ratio)

    def get_incr_every_n_steps(self) -> int:
        """Clean steps in a row before the scale grows.

        Example:
            >>> import ampkit.paddle as amp
            >>> amp.GradScaler().get_incr_every_n_steps()
            2000
        """
        return self._scaler.get_growth_interval()

    def set_incr_every_n_steps(self, new_incr_every_n_steps: int) -> None:
        """Set the clean steps in a row before the scale grows.

        Example:
            >>> import ampkit.paddle as amp
            >>> scaler = amp.GradScaler()
            >>> scaler.set_incr_every_n_steps(100)
            >>> scaler.get_incr_every_n_steps()
            100
        """
        self._replace(growth_interval=new_incr_every_n_steps)

    def get_decr_every_n_nan_or_inf(self) -> int:
        """Overflows in a row before the scale shrinks.

        Example:
            >>> import ampkit.paddle as amp
            >>> amp.GradScaler(decr_every_n_nan_or_inf=2).get_decr_every_n_nan_or_inf()
            2
        """
        return self._scaler.schedule.hysteresis

    def set_decr_every_n_nan_or_inf(self, new_decr_every_n_nan_or_inf: int) -> None:
        """Set the overflows in a row before the scale shrinks.

        Example:
            >>> import ampkit.paddle as amp
            >>> scaler = amp.GradScaler()
            >>> scaler.set_decr_every_n_nan_or_inf(3)
            >>> scaler.get_decr_every_n_nan_or_inf()
            3
        """
        self._replace(hysteresis=new_decr_every_n_nan_or_inf)

    # -- torch's names for the same settings (Paddle 3) ----------------------------------

    def is_enabled(self) -> bool:
        """:meth:`is_enable` under torch's name.

        Example:
            >>> import ampkit.paddle as amp
            >>> amp.GradScaler(enabled=False).is_enabled()
            False
        """
        return self.is_enable()

    def get_scale(self) -> float:
        """The current scale; ``0.0`` for a disabled scaler, as Paddle reports it.

        Example:
            >>> import ampkit.paddle as amp
            >>> amp.GradScaler(init_scale=2048.0).get_scale(), amp.GradScaler(False).get_scale()
            (2048.0, 0.0)
        """
        if not self._scaler.is_enabled():
            return 0.0
        return float(self._scaler.get_scale())

    def get_growth_factor(self) -> float:
        """:meth:`get_incr_ratio` under torch's name.

        Example:
            >>> import ampkit.paddle as amp
            >>> amp.GradScaler(growth_factor=3.0).get_growth_factor()
            3.0
        """
        return self.get_incr_ratio()

    def set_growth_factor(self, new_factor: float) -> None:
        """:meth:`set_incr_ratio` under torch's name.

        Example:
            >>> import ampkit.paddle as amp
            >>> scaler = amp.GradScaler()
            >>> scaler.set_growth_factor(4.0)
            >>> scaler.get_incr_ratio()
            4.0
        """
        self.set_incr_ratio(new_factor)

    def get_backoff_factor(self) -> float:
        """:meth:`get_decr_ratio` under torch's name.

        Example:
            >>> import ampkit.paddle as amp
            >>> amp.GradScaler(backoff_factor=0.25).get_backoff_factor()
            0.25
        """
        return self.get_decr_ratio()

    def set_backoff_factor(self, new_factor: float) -> None:
        """:meth:`set_decr_ratio` under torch's name.

        Example:
            >>> import ampkit.paddle as amp
            >>> scaler = amp.GradScaler()
            >>> scaler.set_backoff_factor(0.1)
            >>> scaler.get_decr_ratio()
            0.1
        """
        self.set_decr_ratio(new_factor)

    def get_growth_interval(self) -> int:
        """:meth:`get_incr_every_n_steps` under torch's name.

        Example:
            >>> import ampkit.paddle as amp
            >>> amp.GradScaler(growth_interval=500).get_growth_interval()
            500
        """
        return self.get_incr_every_n_steps()

    def set_growth_interval(self, new_interval: int) -> None:
        """:meth:`set_incr_every_n_steps` under torch's name.

        Example:
            >>> import ampkit.paddle as amp
            >>> scaler = amp.GradScaler()
            >>> scaler.set_growth_interval(100)
            >>> scaler.get_incr_every_n_steps()
            100
        """
        self.set_incr_every_n_steps(new_interval)

    def _replace(self, **changes: Any) -> None:
        if not self._scaler.is_enabled():
            return  # a disabled scaler has no state to change, as in Paddle
        state = {**self._scaler.state_dict(), **changes}
        with framework_errors(names=_RENAMES):
            self._scaler.load_state_dict(state)

    # -- checkpoints -----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Paddle's keys: ``scale``, ``incr_ratio``, ``decr_ratio``,
        ``incr_every_n_steps``, ``decr_every_n_nan_or_inf``, ``incr_count``,
        ``decr_count``, ``use_dynamic_loss_scaling``; empty when disabled.

        Example:
            >>> import ampkit.paddle as amp
            >>> sorted(amp.GradScaler().state_dict())[:3]
            ['decr_count', 'decr_every_n_nan_or_inf', 'decr_ratio']
        """
        core = self._scaler.state_dict()
        if not core:
            return {}
        return {paddle: core[name] for paddle, name in _STATE.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (a no-op when disabled).

        Raises:
            RuntimeError: the dict is empty (saved from a disabled scaler).
            ValueError: keys missing or unknown (named), or a bad value.

        Example:
            >>> import ampkit.paddle as amp
            >>> scaler = amp.GradScaler()
            >>> scaler.load_state_dict({**scaler.state_dict(), "scale": 512.0})
            >>> scaler.state_dict()["scale"]
            512.0
        """
        if not self._scaler.is_enabled():
            return
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
        if not state_dict:
            raise RuntimeError("the input state dict is empty, probably saved from a "
                               "disabled GradScaler; there is no scale to restore")
        missing = [k for k in _STATE if k not in state_dict]
        unknown = sorted(str(k) for k in state_dict if k not in _STATE)
        if missing or unknown:
            raise ValueError(f"GradScaler.load_state_dict: missing keys {missing}, unknown "
                             f"keys {unknown}; expected {list(_STATE)}")
        scale = check_scale_value(_as_float(state_dict["scale"], "state_dict['scale']"),
                                  "state_dict['scale']")
        self._init_loss_scaling = scale  # Paddle: the loaded scale is the initial one
        loaded = {name: state_dict[paddle] for paddle, name in _STATE.items()}
        self._replace(**{**loaded, "scale": scale})

    def __repr__(self) -> str:
        return f"ampkit.paddle.{self._scaler!r}"
