"""MXNet's loss scaling on a trainer (a torch optimizer here): ``init_trainer`` gives
the optimizer its :class:`~ampkit.dialects.mxnet.loss_scaler.LossScaler` and a
``step()`` that unscales, skips on overflow and updates the scale; ``scale_loss`` and
``unscale`` use that scaler.

Example:
    >>> import torch
    >>> from ampkit.dialects.mxnet.region import deinit, init
    >>> from ampkit.dialects.mxnet.trainer import init_trainer, scale_loss
    >>> init(device_type="cpu")
    >>> w = torch.nn.Parameter(torch.ones(2))
    >>> opt = torch.optim.SGD([w], lr=1.0)
    >>> init_trainer(opt)
    >>> with scale_loss(w.sum(), opt) as scaled:
    ...     scaled.backward()
    >>> opt.step()
    >>> w.tolist()
    [0.0, 0.0]
    >>> deinit()
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ampkit.dialects.mxnet.loss_scaler import LossScaler
from ampkit.dialects.mxnet.region import init_lock, require_init

__all__ = ["init_trainer", "scale_loss", "unscale"]


_scalers: weakref.WeakKeyDictionary[torch.optim.Optimizer, LossScaler] = (
    weakref.WeakKeyDictionary())


def _check_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer_or_trainer must be a torch.optim.Optimizer (Gluon's "
                        f"Trainer in MXNet), got {type(optimizer).__name__}")
    return optimizer


def _scaler_of(optimizer: torch.optim.Optimizer) -> LossScaler:
    scaler = _scalers.get(_check_optimizer(optimizer))
    if scaler is None:
        raise RuntimeError("this optimizer has no loss scaler; did you forget to call "
                           "amp.init_trainer(optimizer)?")
    return scaler


def init_trainer(optimizer_or_trainer: torch.optim.Optimizer) -> None:
    """Give the optimizer a dynamic loss scaler: its ``step()`` then unscales the
    gradients, skips the update when any is inf/NaN, and adjusts the scale.

    The first optimizer gets the scaler :func:`init` made, later ones a new one each
    (as in MXNet). The scaler is ``optimizer._amp_loss_scaler``.

    Raises:
        RuntimeError: :func:`init` was not called, or the optimizer already has one.
        TypeError: not a ``torch.optim.Optimizer``.

    Example:
        >>> import torch
        >>> import ampkit.mxnet as amp
        >>> amp.init(device_type="cpu")
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> opt = torch.optim.SGD([w], lr=1.0)
        >>> amp.init_trainer(opt)
        >>> with amp.scale_loss((w * float("inf")).sum(), opt) as scaled:
        ...     scaled.backward()
        >>> opt.step()                                   # overflow: skipped
        >>> w.tolist(), opt._amp_loss_scaler.loss_scale
        ([1.0, 1.0], 32768.0)
        >>> amp.deinit()
    """
    state = require_init("init_trainer")
    optimizer = _check_optimizer(optimizer_or_trainer)
    if optimizer in _scalers:
        raise RuntimeError("amp.init_trainer() was already called for this optimizer")
    with init_lock:
        handed_out = any(s is state.scaler for s in _scalers.values())
    scaler = LossScaler(device=state.device_type) if handed_out else state.scaler
    _scalers[optimizer] = scaler
    optimizer._amp_loss_scaler = scaler  # type: ignore[attr-defined]
    plain_step = optimizer.step
    stepping = threading.local()

    def step(*args: Any, **kwargs: Any) -> Any:
        # A Trainer's step under MXNet AMP: unscale, skip on overflow, update the scale.
        # The scaler calls optimizer.step() itself when nothing overflowed: that inner
        # call is the plain step.
        if getattr(stepping, "active", False):
            return plain_step(*args, **kwargs)
        stepping.active = True
        try:
            result = scaler.step(optimizer, *args, **kwargs)
        finally:
            stepping.active = False
        scaler.update()
        return result

    step.__wrapped__ = plain_step  # type: ignore[attr-defined]
    optimizer.step = step  # type: ignore[method-assign]


@contextlib.contextmanager
def scale_loss(loss: torch.Tensor | Sequence[torch.Tensor],
               optimizer_or_trainer: torch.optim.Optimizer
               ) -> Iterator[torch.Tensor | list[torch.Tensor]]:
    """Yield the loss (or a list of losses) times the optimizer's loss scale; call
    ``backward`` on it. The gradients stay scaled until ``optimizer.step()`` (or
    :func:`unscale`) divides them.

    Raises:
        RuntimeError: :func:`init_trainer` was not called for this optimizer.

    Example:
        >>> import torch
        >>> import ampkit.mxnet as amp
        >>> amp.init(device_type="cpu")
        >>> w = torch.nn.Parameter(torch.ones(1))
        >>> opt = torch.optim.SGD([w], lr=0.5)
        >>> amp.init_trainer(opt)
        >>> with amp.scale_loss(w.sum(), opt) as scaled:
        ...     scaled.backward()
        >>> w.grad.item()
        65536.0
        >>> opt.step()
        >>> w.item()
        0.5
        >>> amp.deinit()
    """
    scaler = _scaler_of(optimizer_or_trainer)
    if isinstance(loss, list | tuple):
        items: list[torch.Tensor] = list(loss)
        yield [scaler.scale(item) for item in items]
    else:
        one: torch.Tensor = loss  # type: ignore[assignment]  # not a list or tuple: a tensor
        yield scaler.scale(one)


def unscale(optimizer_or_trainer: torch.optim.Optimizer) -> None:
    """Divide the optimizer's gradients by the loss scale now (to clip or inspect
    them); its next ``step()`` does not divide again and still skips on inf/NaN.

    Raises:
        RuntimeError: no loss scaler (see :func:`init_trainer`), or the gradients were
            already unscaled in this iteration.

    Example:
        >>> import torch
        >>> import ampkit.mxnet as amp
        >>> amp.init(device_type="cpu")
        >>> w = torch.nn.Parameter(torch.ones(1))
        >>> opt = torch.optim.SGD([w], lr=0.5)
        >>> amp.init_trainer(opt)
        >>> with amp.scale_loss(3 * w.sum(), opt) as scaled:
        ...     scaled.backward()
        >>> amp.unscale(opt)
        >>> w.grad.item()
        3.0
        >>> amp.deinit()
    """
    _scaler_of(optimizer_or_trainer).unscale_(optimizer_or_trainer)
