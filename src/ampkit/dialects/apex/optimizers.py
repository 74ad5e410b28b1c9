"""What ``ampkit.apex`` does with optimizers: it finds the torch optimizer inside an
apex-style wrapper (``.optim``: apex's LARC), lists the parameters an optimizer updates
(``master_params``), and wraps one for the legacy multi-loss API (:class:`OptimWrapper`,
from ``handle.wrap_optimizer``).

Example:
    >>> import torch
    >>> from ampkit.dialects.apex.optimizers import inner_optimizer
    >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    >>> inner_optimizer(opt) is opt
    True
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ampkit.dialects.apex.state import Handle
from ampkit.scaling.loss_scaling import build_loss_scaler
from ampkit.scaling.loss_scaling import scale_loss as _scale_loss

__all__ = ["OptimWrapper", "inner_optimizer", "inner_optimizers", "master_params"]


def inner_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside an apex-style wrapper (``.optim``: apex's LARC), or
    ``optimizer`` itself (checked by the core)."""
    if not isinstance(optimizer, torch.optim.Optimizer) and isinstance(
            getattr(optimizer, "optim", None), torch.optim.Optimizer):
        return optimizer.optim
    return optimizer


def inner_optimizers(optimizers: Any) -> Any:
    if isinstance(optimizers, list | tuple):
        return type(optimizers)(inner_optimizer(o) for o in optimizers)
    return inner_optimizer(optimizers)


def master_params(optimizer: Any) -> Iterator[torch.Tensor]:
    """The parameters the optimizer updates: at O2 these are the fp32 parameters
    themselves (the truth; modules compute with fp16 copies made on use), so apex's
    master parameters and the model's are the same tensors. Clip gradients on these.

    Example:
        >>> import torch
        >>> import ampkit.apex as amp
        >>> w = torch.nn.Parameter(torch.ones(1))
        >>> list(amp.master_params(torch.optim.SGD([w], lr=0.1)))[0] is w
        True
    """
    inner = inner_optimizer(optimizer)
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    for group in inner.param_groups:
        yield from group["params"]


class OptimWrapper:
    """The optimizer :meth:`AmpHandle.wrap_optimizer` returns: ``scale_loss(loss)``
    per loss (each of the ``num_loss`` losses of an iteration, in call order, has its
    own dynamic scale), then ``step()``, skipped when any of them overflowed. Every
    other attribute is the wrapped optimizer's.

    Example:
        >>> import torch
        >>> import ampkit.apex as amp
        >>> handle = amp.init(device_type="cpu")
        >>> w = torch.nn.Parameter(torch.ones(1))
        >>> opt = handle.wrap_optimizer(torch.optim.SGD([w], lr=0.5), num_loss=2)
        >>> with opt.scale_loss(w.sum()) as loss:
        ...     loss.backward()
        >>> with opt.scale_loss(w.sum() * float("inf")) as loss:
        ...     loss.backward()
        >>> opt.step(); w.item()                     # the second loss overflowed
        1.0
        >>> handle._deactivate()
    """

    def __init__(self, optimizer: torch.optim.Optimizer, amp_handle: Handle,
                 num_loss: int) -> None:
        if isinstance(num_loss, bool) or not isinstance(num_loss, int) or num_loss < 1:
            raise ValueError(f"num_loss must be an int >= 1, got {num_loss!r}")
        self._optimizer = optimizer
        self._amp_handle = amp_handle
        self._num_loss = num_loss
        self._loss_idx = 0
        self._loss_scaler = [build_loss_scaler("dynamic") for _ in range(num_loss)]

    @contextlib.contextmanager
    def scale_loss(self, loss: torch.Tensor) -> Iterator[torch.Tensor]:
        """Scale the next loss of this iteration; unscale and check on exit."""
        if not self._amp_handle.is_active():
            yield loss
            return
        if self._loss_idx >= self._num_loss:
            raise RuntimeError(f"scale_loss was called more than num_loss={self._num_loss} "
                               f"times before step(); pass num_loss to wrap_optimizer")
        with _scale_loss(loss, inner_optimizer(self._optimizer), self._loss_idx,
                         scaler=self._loss_scaler[self._loss_idx]) as scaled:
            yield scaled
        self._loss_idx += 1

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Step the optimizer, unless a loss of this iteration overflowed."""
        if not self._amp_handle.is_active():
            return self._optimizer.step(closure)
        self._loss_idx = 0
        if closure is not None:
            raise NotImplementedError("the closure argument is unsupported by the amp "
                                      "optimizer wrapper")
        return self._optimizer.step()

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.__dict__["_optimizer"], attr)

    def __repr__(self) -> str:
        return repr(self._optimizer)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's ``state_dict``."""
        return self._optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The wrapped optimizer's ``load_state_dict``."""
        self._optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's ``zero_grad``."""
        self._optimizer.zero_grad(set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """The wrapped optimizer's ``add_param_group``."""
        self._optimizer.add_param_group(param_group)
