"""The optimizer step inside backward: each parameter is stepped as soon as its
gradient is accumulated, and its gradient freed, so the gradients never all exist at
once (``initialize(..., step_in_backward=True)``, or :func:`enable_step_in_backward`).

PyTorch's optimizer-in-backward pattern (``Tensor.register_post_accumulate_grad_hook``)
with one optimizer instead of one per parameter: the hook narrows the optimizer's
parameter groups to the parameter whose gradient is ready and runs the optimizer's own
step on it, so its hyper-parameters, ``state``, ``state_dict`` and LR schedulers stay
the optimizer's. A pure low-precision optimizer (:mod:`ampkit.pure`) draws the same
random bits for a parameter as its ordinary step would, so the trajectory is bit for
bit the ordinary one's wherever the update does not depend on other parameters (every
element-wise ``torch.optim`` optimizer: SGD, Adam/AdamW, NAdam, RAdam, Adagrad, ...).

What it gives up (each refused loudly):

* ``optimizer.step()``: the steps already ran inside ``backward()``; a call raises. So
  does ``scaler.step(optimizer)``.
* gradient accumulation over several backward passes: every ``backward()`` steps;
* a closure, and optimizers whose step needs one (``LBFGS``): they re-evaluate the loss
  over all parameters;
* loss scaling (float16): an overflow is known only once every gradient exists, and by
  then the parameters have stepped;
* a global gradient norm (``clip_grad_norm_`` over the model): it needs every gradient
  at once. After ``backward()`` the gradients are gone, so such a call sees none.
  Per-parameter clipping works: :func:`clip_each_gradient`;
* more than one process (DDP, FSDP2): each parameter would step on its local gradient
  before the ranks' gradients are reduced.

The optimizer's step hooks (``register_step_pre_hook``/``post_hook``) run once per
parameter stepped. LR schedulers work as usual, stepped after ``backward()`` (one
parameter group per parameter and ``LambdaLR`` with a lambda per group gives each
parameter its own schedule); the new learning rate applies from the next
``backward()``.

Example:
    >>> import torch
    >>> from ampkit.step_in_backward import enable_step_in_backward
    >>> net = torch.nn.Linear(3, 1)
    >>> opt = enable_step_in_backward(torch.optim.SGD(net.parameters(), lr=0.1))
    >>> before = net.weight.detach().clone()
    >>> net(torch.ones(2, 3)).sum().backward()  # steps every parameter
    >>> net.weight.grad is None, bool((net.weight != before).all())
    (True, True)
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch

__all__ = ["check_step_in_backward", "clip_each_gradient", "enable_step_in_backward",
           "steps_in_backward"]

_KEY = "_ampkit_in_backward"
_REFUSED_STEP = (
    "this optimizer steps inside backward (step_in_backward=True): every parameter "
    "was stepped as its gradient was accumulated and the gradient freed, so "
    "optimizer.step() has nothing to do. Remove the call (and scaler.step(optimizer)); "
    "gradient accumulation over several backward passes and closures cannot work in "
    "this mode: use step_in_backward=False for them")


def _distributed_reason(params: list[torch.Tensor]) -> str | None:
    """Why stepping in backward cannot work here, or ``None``."""
    from ampkit.pure.rounding import is_dtensor

    if any(is_dtensor(p) for p in params):
        return ("its parameters are sharded DTensors (FSDP2): each would step on its "
                "unsharded gradient before the reduce-scatter")
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return (f"a process group of {dist.get_world_size()} ranks is initialized: under "
                f"DistributedDataParallel each parameter would step on its local "
                f"gradient before the ranks' gradients are averaged")
    return None


def check_step_in_backward(optimizer: Any, *, loss_scale: Any = None,
                           argument: str = "optimizer") -> None:
    """Raise the error :func:`enable_step_in_backward` would raise, changing nothing
    (``initialize`` checks before converting anything; ``loss_scale``: the run's
    loss scaling, ``None`` when off). ``optimizer=None`` checks the settings alone.

    Raises:
        TypeError: ``optimizer`` is not an optimizer.
        ValueError: loss scaling is on, or the optimizer's step needs a closure.
        RuntimeError: more than one process, or sharded (DTensor) parameters.

    Example:
        >>> import torch
        >>> from ampkit.step_in_backward import check_step_in_backward
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> check_step_in_backward(torch.optim.LBFGS([w]))
        Traceback (most recent call last):
        ...
        ValueError: step_in_backward: LBFGS's step needs a closure, which re-evaluates ...
    """
    if loss_scale is not None:
        raise ValueError(f"step_in_backward: loss_scale={loss_scale!r} cannot work with "
                         f"it: an overflow is known only once every gradient exists, and "
                         f"by then each parameter has stepped. Use bfloat16 without loss "
                         f"scaling, or step_in_backward=False")
    if optimizer is None:
        return
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{argument} must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    from ampkit.pure.optimizer import needs_closure, optimizer_class_name

    if needs_closure(optimizer):
        raise ValueError(f"step_in_backward: {optimizer_class_name(optimizer)}'s step "
                         f"needs a closure, which re-evaluates the loss over all "
                         f"parameters; use step_in_backward=False")
    reason = _distributed_reason([p for g in optimizer.param_groups for p in g["params"]])
    if reason is not None:
        raise RuntimeError(f"step_in_backward cannot work here: {reason}. Use "
                           f"step_in_backward=False")


class _InBackward:
    """What an optimizer stepping in backward keeps: the hooks' handles, the
    per-parameter clipping, and the pure optimizer's rounding keys (the whole
    optimizer's, cached while its groups keep their parameters)."""

    __slots__ = ("__weakref__", "clip", "handles", "indices", "layout", "opt")

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.opt = weakref.ref(optimizer)
        self.handles: list[Any] = []
        self.clip: tuple[float | None, float | None, float] = (None, None, 2.0)
        self.layout: tuple[tuple[int, ...], ...] = ()
        self.indices: dict[int, tuple[int, int]] = {}

    def step_one(self, p: torch.Tensor) -> None:
        opt = self.opt()
        if opt is None or p.grad is None:
            return
        reason = _distributed_reason([p])
        if reason is not None:
            raise RuntimeError(f"step_in_backward cannot work here: {reason}. Use "
                               f"step_in_backward=False")
        max_norm, max_value, norm_type = self.clip
        if max_value is not None:
            torch.nn.utils.clip_grad_value_([p], max_value)
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_([p], max_norm, norm_type)
        groups = opt.param_groups
        lists = [g["params"] for g in groups]
        layout = tuple(tuple(map(id, ps)) for ps in lists)
        if layout != self.layout:  # groups added or changed since the last hook
            from ampkit.pure.optimizer import rounding_keys

            self.layout, self.indices = layout, rounding_keys(opt)
        saved = [list(ps) for ps in lists]
        mine = next(i for i, ids in enumerate(layout) if id(p) in ids)
        opt.__dict__["_ampkit_indices"] = self.indices
        try:
            for i, ps in enumerate(lists):
                ps[:] = [p] if i == mine else []
            type(opt).step(opt)  # the class's step: the instance's refuses
        finally:
            for ps, original in zip(lists, saved):
                ps[:] = original
            del opt.__dict__["_ampkit_indices"]
        opt._opt_called = True  # type: ignore[attr-defined]  # LR schedulers' flag
        p.grad = None


def steps_in_backward(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` steps inside backward.

    Example:
        >>> import torch
        >>> from ampkit.step_in_backward import enable_step_in_backward, steps_in_backward
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
        >>> steps_in_backward(opt), steps_in_backward(enable_step_in_backward(opt))
        (False, True)
    """
    return isinstance(optimizer.__dict__.get(_KEY), _InBackward)


def enable_step_in_backward(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Make ``optimizer`` step each of its parameters inside backward, as soon as the
    parameter's gradient is accumulated, and free the gradient (see the module
    docstring). Returns ``optimizer`` itself; from now on its ``step()`` raises. Make a
    pure optimizer pure first (``initialize`` does both, in order).

    Raises:
        TypeError, ValueError, RuntimeError: as :func:`check_step_in_backward`.

    Example:
        >>> import torch
        >>> from ampkit.step_in_backward import enable_step_in_backward
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> opt = enable_step_in_backward(torch.optim.SGD([w], lr=0.5))
        >>> (w * w).sum().backward()
        >>> w.tolist(), w.grad
        ([0.0, 0.0], None)
        >>> opt.step()
        Traceback (most recent call last):
        ...
        RuntimeError: this optimizer steps inside backward (step_in_backward=True): ...
    """
    check_step_in_backward(optimizer)
    if steps_in_backward(optimizer):
        return optimizer
    state = _InBackward(optimizer)
    ref = weakref.ref(state)

    def hook(p: torch.Tensor) -> None:
        live = ref()
        if live is not None:
            live.step_one(p)

    for group in optimizer.param_groups:
        for p in group["params"]:
            state.handles.append(p.register_post_accumulate_grad_hook(hook))

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(_REFUSED_STEP)

    # An LR scheduler wraps optimizer.step to see it called: mark this one as such, so
    # that a scheduler neither warns about it nor wraps it (the hooks set the flag).
    refuse._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.__dict__[_KEY] = state
    optimizer.step = refuse  # type: ignore[method-assign]
    # A loss scaler then hands the step its found_inf instead of asserting that it saw
    # no gradients: the call reaches this step, which refuses in words.
    optimizer._step_supports_amp_scaling = True  # type: ignore[attr-defined]
    return optimizer


def clip_each_gradient(optimizer: torch.optim.Optimizer, *, max_norm: float | None = None,
                       max_value: float | None = None, norm_type: float = 2.0) -> None:
    """Clip each parameter's gradient on its own before it steps inside backward:
    values into ``[-max_value, max_value]`` (``clip_grad_value_``), then its norm to at
    most ``max_norm`` (``clip_grad_norm_`` over that one parameter). A norm over all
    parameters is not possible here: they never all have gradients at once.

    Raises:
        ValueError: ``optimizer`` does not step in backward, or neither bound is given
            (that would clip nothing).
        TypeError, ValueError: a bound (or ``norm_type``) that is not a positive
            number (``norm_type`` may be ``math.inf``).

    Example:
        >>> import torch
        >>> from ampkit.step_in_backward import clip_each_gradient, enable_step_in_backward
        >>> w = torch.nn.Parameter(torch.zeros(4))
        >>> opt = enable_step_in_backward(torch.optim.SGD([w], lr=1.0))
        >>> clip_each_gradient(opt, max_norm=1.0)
        >>> (w * 10).sum().backward()  # gradient norm 20, clipped to 1
        >>> round(w.norm().item(), 4)
        1.0
    """
    from ampkit.arguments import positive_number

    state = optimizer.__dict__.get(_KEY)
    if not isinstance(state, _InBackward):
        raise ValueError("clip_each_gradient: this optimizer does not step in backward; "
                         "clip with torch.nn.utils.clip_grad_norm_ before optimizer.step()")
    if max_norm is None and max_value is None:
        raise ValueError("clip_each_gradient: give max_norm, max_value or both")
    state.clip = (None if max_norm is None else positive_number(max_norm, "max_norm"),
                  None if max_value is None else positive_number(max_value, "max_value"),
                  norm_type if norm_type == math.inf else positive_number(norm_type,
                                                                          "norm_type"))
