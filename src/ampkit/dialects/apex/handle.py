"""apex's handle and ``scale_loss``: :func:`scale_loss` (the training step after
``initialize``), and the pre-1.0 API, ``amp.init()`` and the :class:`AmpHandle` it
returns (an ``"apex-O1"`` region open until ``handle._deactivate()``, with apex's O1
refusals and its own loss scaler).

Example:
    >>> import torch
    >>> from ampkit.dialects.apex.handle import init
    >>> handle = init(device_type="cpu")
    >>> (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
    torch.float16
    >>> handle._deactivate()
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

from ampkit.common.arguments import default_device_type
from ampkit.dialects.apex.functions import disable_casts
from ampkit.dialects.apex.opt_levels import loss_scale_override
from ampkit.dialects.apex.optimizers import OptimWrapper, inner_optimizer, inner_optimizers
from ampkit.dialects.apex.state import amp_state, require_state
from ampkit.engine.function_patching import CastRule, register_function, unregister_function
from ampkit.engine.regions import autocast
from ampkit.policies.presets import APEX_BANNED_FUNCS, APEX_O1, APEX_REFUSED_IN_PLACE
from ampkit.scaling.grad_scaler import GradScaler
from ampkit.scaling.loss_scaling import build_loss_scaler, latest_loss_scaler
from ampkit.scaling.loss_scaling import scale_loss as _scale_loss

__all__ = ["AmpHandle", "NoOpHandle", "init", "scale_loss"]


@contextlib.contextmanager
def scale_loss(loss: torch.Tensor, optimizers: Any, loss_id: int = 0,
               model: nn.Module | None = None,
               delay_unscale: bool = False) -> Iterator[torch.Tensor]:
    """apex's ``amp.scale_loss``: yield ``loss`` times the scale of ``loss_id``; on
    exit unscale the optimizers' gradients, and on overflow make the next ``step()`` of
    each optimizer named here a no-op and lower the scale. An optimizer whose gradients
    put aside from an earlier ``scale_loss`` overflowed skips its step too, and only it.

    ``model`` is accepted and unused, as in apex. ``delay_unscale=True`` keeps the
    gradients scaled for a later ``scale_loss`` (gradient accumulation).

    Raises:
        RuntimeError: :func:`initialize` was not called.

    Example:
        >>> import torch
        >>> import ampkit.apex as amp
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
        >>> before = model.weight.detach().clone()
        >>> with amp.scale_loss(model(torch.rand(1, 2)).sum() * float("inf"), opt) as s:
        ...     s.backward()
        >>> opt.step()                                  # the overflow skips this step
        >>> torch.equal(model.weight, before), amp.state_dict()["loss_scaler0"]["loss_scale"]
        (True, 32768.0)
        >>> amp._amp_state.handle._deactivate()
    """
    state = require_state("scale_loss")
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"model must be None or a torch.nn.Module, got "
                        f"{type(model).__name__}")
    if not state.properties.enabled:
        yield loss
        return
    # apex's loss scalers are process-wide: each amp.initialize replaces them, and
    # every scale_loss uses the latest ones, whatever optimizers it is given (the core
    # keeps each initialize's scalers with that call's optimizers instead).
    with _scale_loss(loss, inner_optimizers(optimizers), loss_id,
                     delay_unscale=delay_unscale, scaler=latest_loss_scaler(loss_id)) as scaled:
        yield scaled


# -- the pre-1.0 API: amp.init() and its handle ---------------------------------------------

_handles_lock = threading.Lock()
_active_handles: list[AmpHandle] = []


def _refusals_for(handles: list[AmpHandle]) -> list[tuple[Any, str, str | None]]:
    """``(owner, name, message)`` of every refusal the active handles call for."""
    wanted: list[tuple[Any, str, str | None]] = []
    if handles:
        for name in APEX_REFUSED_IN_PLACE:
            message = (f"in-place {name} refuses a low-precision tensor under apex's O1 "
                       f"lists: its out-of-place {name[:-1]} runs in float32, this could "
                       f"only compute in the tensor's precision; call {name[:-1]} instead")
            for owner in (torch, torch.Tensor):
                if hasattr(owner, name):
                    wanted.append((owner, name, message))
    # The newest handle decides, as in apex, where each amp.init() patched the banned
    # functions again on top of the earlier handles' patches.
    if handles and not handles[-1]._allow_banned:
        wanted += [(torch.nn.functional, op, message) for op, message in APEX_BANNED_FUNCS]
    return wanted


def _sync_refusals(before: list[AmpHandle], after: list[AmpHandle]) -> None:
    old = {(id(o), n): (o, n) for o, n, _ in _refusals_for(before)}
    new = _refusals_for(after)
    for owner, name, message in new:
        if (id(owner), name) not in old:
            register_function(owner, name, CastRule.REFUSE_LOW, message=message,
                              policy=APEX_O1.name)
    keep = {(id(o), n) for o, n, _ in new}
    for key, (owner, name) in old.items():
        if key not in keep:
            unregister_function(owner, name)


class AmpHandle:
    """The handle ``amp.init()`` returns (and ``amp._amp_state.handle`` after an O1
    ``initialize``): while active, apex's O1 refusals hold in ``"apex-O1"`` regions
    (banned functions unless ``allow_banned``; in-place float32-list ops on
    low-precision tensors). ``init``'s handle also owns the O1 region it opened.

    Example:
        >>> import torch
        >>> import ampkit.apex as amp
        >>> handle = amp.init()                     # O1 casts from here on, this thread
        >>> (torch.ones(2, 2) @ torch.ones(2, 2)).dtype, torch.ones(2).sum().dtype
        (torch.float16, torch.float32)
        >>> handle._deactivate()
        >>> (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
        torch.float32
    """

    def __init__(self, *, allow_banned: bool = False, scaling: bool = True,
                 loss_scale: str | float = "dynamic", region: autocast | None = None,
                 enable_caching: bool = True, verbose: bool = False) -> None:
        self._allow_banned = allow_banned
        self._region = region
        self._enable_caching = enable_caching
        self._verbose = verbose
        # The legacy handle.scale_loss's own scaler (None after wrap_optimizer, as in
        # apex, or for the handle of an O1 initialize, which scales with amp.scale_loss).
        self._default_scaler: GradScaler | None = (
            build_loss_scaler(loss_scale) if scaling else None)
        self._is_active = True
        with _handles_lock:
            before = list(_active_handles)
            _active_handles.append(self)
            _sync_refusals(before, _active_handles)
        if region is not None:
            region.__enter__()

    def is_active(self) -> bool:
        """Whether the handle is active (until :meth:`_deactivate`)."""
        return self._is_active

    def _deactivate(self) -> None:
        """Close the O1 region ``init`` opened (in the thread that opened it) and lift
        this handle's refusals; calling it again does nothing."""
        if not self._is_active:
            return
        self._is_active = False
        if self._region is not None:
            self._region.__exit__(None, None, None)
        with _handles_lock:
            before = list(_active_handles)
            _active_handles.remove(self)
            _sync_refusals(before, _active_handles)
        if amp_state.handle is self:
            amp_state.handle = None

    @contextlib.contextmanager
    def _disable_casts(self) -> Iterator[None]:
        with disable_casts():
            yield

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer,
                       num_loss: int = 1) -> OptimWrapper:
        """The legacy multi-loss API: an optimizer whose ``scale_loss(loss)`` scales
        each of its ``num_loss`` losses with its own dynamic scale (in call order) and
        whose ``step()`` is skipped when any of them overflowed.

        Example:
            >>> import torch
            >>> import ampkit.apex as amp
            >>> handle = amp.init(enabled=False)
            >>> w = torch.nn.Parameter(torch.ones(1))
            >>> opt = handle.wrap_optimizer(torch.optim.SGD([w], lr=0.5))
            >>> with opt.scale_loss(w.sum()) as loss:
            ...     loss.backward()
            >>> opt.step(); w.item()
            0.5
        """
        self._default_scaler = None
        return OptimWrapper(optimizer, self, num_loss)

    @contextlib.contextmanager
    def scale_loss(self, loss: torch.Tensor,
                   optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
        """The legacy ``with handle.scale_loss(loss, optimizer) as scaled``: the loss
        times the handle's own scale; on exit the gradients are unscaled, and an
        overflow skips the optimizer's next step and lowers the scale.

        Raises:
            RuntimeError: after :meth:`wrap_optimizer` (use the wrapper's
                ``scale_loss``), or for the handle of an ``initialize`` (use
                :func:`scale_loss`).
        """
        if not self.is_active():
            yield loss
            return
        if self._default_scaler is None:
            raise RuntimeError("this handle has no loss scaler of its own: after "
                               "handle.wrap_optimizer(), use optimizer.scale_loss(loss); "
                               "after amp.initialize(), use amp.scale_loss(loss, "
                               "optimizer)")
        with _scale_loss(loss, inner_optimizer(optimizer),
                         scaler=self._default_scaler) as scaled:
            yield scaled

    def _clear_cache(self) -> None:
        """Nothing to do: ampkit's weight-cast cache lives with its regions."""

    @property
    def has_cache(self) -> bool:
        """Whether ``init`` was asked to cache weight casts."""
        return self._enable_caching

    @property
    def verbose(self) -> bool:
        """``init``'s ``verbose``."""
        return self._verbose


class NoOpHandle(AmpHandle):
    """``amp.init(enabled=False)``'s handle: nothing casts, nothing scales.

    Example:
        >>> import ampkit.apex as amp
        >>> amp.init(enabled=False).is_active()
        False
    """

    def __init__(self) -> None:
        self._allow_banned = True
        self._region = None
        self._enable_caching = False
        self._verbose = False
        self._default_scaler = None
        self._is_active = False

    @contextlib.contextmanager
    def scale_loss(self, loss: torch.Tensor,
                   optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
        """Yield the loss as it is."""
        yield loss


def init(enabled: bool = True, loss_scale: str | float = "dynamic",
         enable_caching: bool = True, verbose: bool = False, allow_banned: bool = False,
         *, device_type: str | None = None) -> AmpHandle:
    """apex's pre-1.0 ``amp.init()`` (the legacy API, apex's O1): from here on, in this
    thread, ops run by apex's O1 lists (the ``"apex-O1"`` preset, float16) until
    ``handle._deactivate()``.

    Args:
        enabled: ``False`` returns a :class:`NoOpHandle`.
        loss_scale: ``"dynamic"`` or a number: the scale of ``handle.scale_loss``.
        enable_caching: cache the float16 casts of weights within the region.
        verbose: kept for apex's signature (ampkit prints no casts).
        allow_banned: run apex's banned functions (``F.binary_cross_entropy``) in
            float32 instead of refusing a low-precision input.
        device_type: an ampkit extra: the device whose ops are cast; ``None``: CUDA when
            available, else the CPU.

    Example:
        >>> import torch
        >>> import ampkit.apex as amp
        >>> handle = amp.init(device_type="cpu")
        >>> torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype
        torch.float16
        >>> torch.ones(2, dtype=torch.float16).exp_()
        Traceback (most recent call last):
        ...
        NotImplementedError: in-place exp_ refuses a low-precision tensor under ...
        >>> handle._deactivate()
    """
    for value, argument in ((enabled, "enabled"), (enable_caching, "enable_caching"),
                            (verbose, "verbose"), (allow_banned, "allow_banned")):
        if not isinstance(value, bool):
            raise TypeError(f"{argument} must be a bool, got {type(value).__name__}")
    if not enabled:
        handle: AmpHandle = NoOpHandle()
    else:
        device = device_type or default_device_type()
        region = autocast(device, torch.float16, policy=APEX_O1,
                          cache_enabled=enable_caching)
        handle = AmpHandle(allow_banned=allow_banned, loss_scale=loss_scale_override(
            loss_scale), region=region, enable_caching=enable_caching, verbose=verbose)
    amp_state.handle = handle
    return handle
