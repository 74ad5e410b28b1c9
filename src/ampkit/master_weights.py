"""fp32 master weights: the optimizer updates fp32 copies of low-precision parameters.

:class:`MasterWeightOptimizer` turns a torch optimizer, in place, into one that keeps
fp32 masters:

* its ``param_groups`` hold the fp32 masters instead of the low-precision model
  parameters (fp32 parameters, such as norms kept in fp32, stay as they are), so LR
  schedulers, ``state_dict()``/``load_state_dict()`` and ``isinstance(opt, Adam)`` keep
  working, and the optimizer state (Adam's moments) is fp32;
* ``step()`` first moves the model's low-precision gradients onto the masters in fp32
  (:func:`sync_master_grads`), runs the optimizer's own step on the masters, then
  refreshes the model parameters from them (rounded to their dtype). A step that is
  never called (an overflow skipped by a loss scaler) leaves the model, the masters and
  the optimizer state exactly as they were;
* ``zero_grad()`` clears the model's gradients too.

Gradients are *moved*: after a sync the masters hold the gradients in fp32 and the
model parameters' ``.grad`` is ``None`` (the low-precision copy is freed at once).
Syncing again before the next backward finds nothing to move, so it is idempotent;
a backward after a sync adds its gradients to the masters' on the next sync, as
gradient accumulation does. Clip with :func:`clip_master_grad_norm_` (or on
:func:`master_params`), not on ``model.parameters()``, once a loss scaler has unscaled.

The masters are the ones :func:`ampkit.conversion.convert_model` made from the original
fp32 values when converting with master weights (so nothing was lost to rounding), or,
for parameters converted without (or changed since without their masters), copies of
their current values. Between steps the model parameters are the masters rounded; to
change weights by hand, change :func:`master_params` (the next step would overwrite a
change made to the model parameters only).

Example:
    >>> import torch
    >>> from ampkit.master_weights import MasterWeightOptimizer, master_params
    >>> model = torch.nn.Linear(2, 1).to(torch.bfloat16)
    >>> opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3))
    >>> isinstance(opt, torch.optim.SGD), [p.dtype for p in master_params(opt)]
    (True, [torch.float32, torch.float32])
    >>> model(torch.ones(1, 2, dtype=torch.bfloat16)).sum().backward()
    >>> opt.step()
    >>> model.weight.grad is None, next(master_params(opt)).grad.dtype
    (True, torch.float32)
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn

from ampkit.conversion import master_copy

__all__ = [
    "MasterWeightOptimizer",
    "clip_master_grad_norm_",
    "master_params",
    "model_params",
    "sync_master_grads",
]

_LOW = (torch.float16, torch.bfloat16)


class _Masters:
    """The model parameters an optimizer manages and their masters, pairwise."""

    __slots__ = ("masters", "models")

    def __init__(self) -> None:
        self.models: list[torch.Tensor] = []
        self.masters: list[nn.Parameter] = []

    def adopt(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The masters standing in for ``params`` (fp32 ones stand for themselves)."""
        out: list[torch.Tensor] = []
        for p in params:
            if p.dtype in _LOW:
                master = master_copy(p, create=True)
                assert master is not None  # created for every low-precision parameter
                if not any(m is p for m in self.models):
                    self.models.append(p)
                    self.masters.append(master)
                out.append(master)
            else:
                out.append(p)
        return out

    def move_grads(self) -> None:
        for model, master in zip(self.models, self.masters):
            grad = model.grad
            if grad is None:
                continue
            if grad.device != master.device:
                raise RuntimeError(f"a model parameter is on {grad.device} but its fp32 master "
                                   f"is on {master.device}: move the model to its device "
                                   f"before ampkit.initialize / MasterWeightOptimizer")
            if master.grad is None:
                master.grad = grad.to(torch.float32)
            else:
                master.grad.add_(grad)
            model.grad = None

    @torch.no_grad()
    def refresh_models(self) -> None:
        by_device: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for model, master in zip(self.models, self.masters):
            dst, src = by_device.setdefault(model.device, ([], []))
            dst.append(model)
            src.append(master)
        for dst, src in by_device.values():
            torch._foreach_copy_(dst, src)  # rounds each fp32 master to its model's dtype


_MANAGED_CLASSES: dict[type, type] = {}


def _managed_class(cls: type) -> type:
    managed = _MANAGED_CLASSES.get(cls)
    if managed is None:
        managed = type(f"MasterWeight{cls.__name__}", (MasterWeightOptimizer, cls),
                       {"__module__": __name__})
        _MANAGED_CLASSES[cls] = managed
    return managed


def _check_step_attribute(optimizer: torch.optim.Optimizer) -> None:
    patched = optimizer.__dict__.get("step")
    if patched is not None and not getattr(patched, "_wrapped_by_lr_sched", False):
        raise RuntimeError("optimizer.step was replaced on this optimizer instance by "
                           "something other than an LR scheduler; make the optimizer use "
                           "master weights before patching its step")


def _rewrap_scheduler_step(optimizer: torch.optim.Optimizer) -> None:
    """An LR scheduler made before this optimizer was managed replaced ``step`` on the
    instance with a wrapper bound to the old class's step; put back one that runs the
    managed step and still tells the scheduler that the optimizer stepped."""
    if "step" not in optimizer.__dict__:
        return
    ref = weakref.ref(optimizer)

    def step(*args: Any, **kwargs: Any) -> Any:
        opt = ref()
        assert opt is not None
        opt._opt_called = True  # what the scheduler's wrapper records
        return type(opt).step(opt, *args, **kwargs)

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = step  # type: ignore[method-assign]


class MasterWeightOptimizer:
    """Make a torch optimizer keep fp32 master weights, in place.

    ``MasterWeightOptimizer(opt)`` returns ``opt`` itself, now also an instance of
    ``MasterWeightOptimizer`` (its class becomes a subclass of both): its
    ``param_groups`` hold the fp32 masters, ``step()`` moves the model's gradients onto
    them, steps, and refreshes the model parameters; ``zero_grad()`` clears both. Any
    ``torch.optim`` optimizer works (foreach and fused variants, several param groups,
    closures). Calling it on an optimizer already managed returns it unchanged.

    Create LR schedulers after it if you can; one created before keeps working.

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``.

    Example:
        >>> import torch
        >>> from ampkit.master_weights import MasterWeightOptimizer
        >>> w = torch.nn.Parameter(torch.ones(1, dtype=torch.float16))
        >>> opt = torch.optim.SGD([w], lr=1e-4)
        >>> MasterWeightOptimizer(opt) is opt, isinstance(opt, torch.optim.SGD)
        (True, True)
        >>> for _ in range(10):
        ...     opt.zero_grad()
        ...     (w * 1.0).sum().backward()
        ...     opt.step()
        >>> w.item(), round(opt.param_groups[0]["params"][0].item(), 6)  # fp16 alone: 1.0
        (0.9990234375, 0.999)
    """

    _ampkit_masters: _Masters

    def __new__(cls, optimizer: torch.optim.Optimizer) -> Any:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        if isinstance(optimizer, MasterWeightOptimizer):
            return optimizer
        _check_step_attribute(optimizer)  # before changing anything
        masters = _Masters()
        for group in optimizer.param_groups:
            group["params"] = masters.adopt(list(group["params"]))
        for model, master in zip(masters.models, masters.masters):
            if model in optimizer.state:  # it already stepped: keep its state, in fp32
                optimizer.state[master] = {
                    k: v.float() if isinstance(v, torch.Tensor) and v.dtype in _LOW else v
                    for k, v in optimizer.state.pop(model).items()}
        object.__setattr__(optimizer, "_ampkit_masters", masters)
        optimizer.__class__ = _managed_class(type(optimizer))
        _rewrap_scheduler_step(optimizer)
        return optimizer

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        # Everything happened in __new__, which returns the optimizer itself.
        pass

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """Move gradients to the masters, step the optimizer, refresh the model.

        ``kwargs`` go to the optimizer's own step (fused optimizers take
        ``grad_scale``/``found_inf`` from a loss scaler).

        Example:
            >>> import torch
            >>> from ampkit.master_weights import MasterWeightOptimizer
            >>> w = torch.nn.Parameter(torch.zeros(1, dtype=torch.bfloat16))
            >>> opt = MasterWeightOptimizer(torch.optim.SGD([w], lr=1.0))
            >>> w.grad = torch.full((1,), -0.5, dtype=torch.bfloat16)
            >>> opt.step()
            >>> w.item()
            0.5
        """
        masters = self._ampkit_masters
        if closure is None:
            masters.move_grads()
            loss = super().step(**kwargs)  # type: ignore[misc]
        else:
            def moved_closure() -> Any:
                with torch.enable_grad():
                    value = closure()
                masters.move_grads()
                return value

            loss = super().step(moved_closure, **kwargs)  # type: ignore[misc]
        masters.refresh_models()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the masters' gradients and the model parameters' gradients.

        Example:
            >>> import torch
            >>> from ampkit.master_weights import MasterWeightOptimizer
            >>> w = torch.nn.Parameter(torch.zeros(1, dtype=torch.bfloat16))
            >>> opt = MasterWeightOptimizer(torch.optim.SGD([w], lr=1.0))
            >>> w.grad = torch.ones(1, dtype=torch.bfloat16)
            >>> opt.zero_grad()
            >>> w.grad is None
            True
        """
        super().zero_grad(set_to_none=set_to_none)  # type: ignore[misc]
        for model in self._ampkit_masters.models:
            if model.grad is None:
                continue
            if set_to_none:
                model.grad = None
            else:
                model.grad.detach_().requires_grad_(False)
                model.grad.zero_()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group of model parameters; low-precision ones get fp32 masters.

        Example:
            >>> import torch
            >>> from ampkit.master_weights import MasterWeightOptimizer
            >>> opt = MasterWeightOptimizer(torch.optim.SGD([torch.nn.Parameter(
            ...     torch.zeros(1))], lr=1.0))
            >>> opt.add_param_group({"params": [torch.nn.Parameter(
            ...     torch.zeros(1, dtype=torch.float16))]})
            >>> opt.param_groups[1]["params"][0].dtype
            torch.float32
        """
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        # Called from Optimizer.__init__ too, before the masters exist: nothing to map.
        masters = self.__dict__.get("_ampkit_masters")
        if masters is not None:
            params = masters.adopt(params)
        super().add_param_group({**param_group, "params": params})  # type: ignore[misc]


def _masters_of(optimizer: Any) -> _Masters | None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    return optimizer.__dict__.get("_ampkit_masters")


def sync_master_grads(optimizer: torch.optim.Optimizer) -> bool:
    """Move the model's low-precision gradients onto the fp32 masters of ``optimizer``.

    Returns ``True`` when ``optimizer`` keeps master weights (see the module docstring
    for the move and why a second call is a no-op), ``False`` (doing nothing) when it
    does not. Loss scalers call it before unscaling.

    Example:
        >>> import torch
        >>> from ampkit.master_weights import MasterWeightOptimizer, sync_master_grads
        >>> w = torch.nn.Parameter(torch.ones(1, dtype=torch.bfloat16))
        >>> opt = MasterWeightOptimizer(torch.optim.SGD([w], lr=0.1))
        >>> w.grad = torch.full((1,), 2.0, dtype=torch.bfloat16)
        >>> sync_master_grads(opt), sync_master_grads(opt)
        (True, True)
        >>> opt.param_groups[0]["params"][0].grad
        tensor([2.])
        >>> sync_master_grads(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1))
        False
    """
    masters = _masters_of(optimizer)
    if masters is None:
        return False
    masters.move_grads()
    return True


def master_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """The parameters ``optimizer`` updates: the fp32 masters (and fp32 parameters)
    when it keeps master weights, else its own parameters.

    Example:
        >>> import torch
        >>> from ampkit.master_weights import master_params
        >>> w = torch.nn.Parameter(torch.ones(1))
        >>> list(master_params(torch.optim.SGD([w], lr=0.1)))[0] is w
        True
    """
    _masters_of(optimizer)  # type check
    for group in optimizer.param_groups:
        yield from group["params"]


def model_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """The model parameters behind ``optimizer``'s parameters: for each master, the
    low-precision parameter it refreshes; other parameters as they are.

    Example:
        >>> import torch
        >>> from ampkit.master_weights import MasterWeightOptimizer, model_params
        >>> w = torch.nn.Parameter(torch.ones(1, dtype=torch.float16))
        >>> opt = MasterWeightOptimizer(torch.optim.SGD([w], lr=0.1))
        >>> next(model_params(opt)) is w
        True
    """
    masters = _masters_of(optimizer)
    model_of = {} if masters is None else {
        id(master): model for model, master in zip(masters.models, masters.masters)}
    for group in optimizer.param_groups:
        for p in group["params"]:
            yield model_of.get(id(p), p)


def clip_master_grad_norm_(optimizer: torch.optim.Optimizer, max_norm: float,
                           norm_type: float = 2.0, *, error_if_nonfinite: bool = False,
                           foreach: bool | None = None) -> torch.Tensor:
    """Clip the gradients ``optimizer`` will apply (the fp32 masters' when it keeps
    master weights, moving the model's gradients there first) to a total norm of
    ``max_norm``; returns the total norm before clipping, like
    ``torch.nn.utils.clip_grad_norm_``.

    Example:
        >>> import torch
        >>> from ampkit.master_weights import MasterWeightOptimizer, clip_master_grad_norm_
        >>> w = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
        >>> opt = MasterWeightOptimizer(torch.optim.SGD([w], lr=1.0))
        >>> w.grad = torch.tensor([3.0, 4.0], dtype=torch.bfloat16)
        >>> clip_master_grad_norm_(opt, 1.0).item()
        5.0
        >>> opt.param_groups[0]["params"][0].grad
        tensor([0.6000, 0.8000])
    """
    sync_master_grads(optimizer)
    return torch.nn.utils.clip_grad_norm_(list(master_params(optimizer)), max_norm,
                                          norm_type, error_if_nonfinite=error_if_nonfinite,
                                          foreach=foreach)
