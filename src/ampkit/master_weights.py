"""fp32 master weights: the optimizer updates fp32 copies of low-precision parameters.

:class:`MasterWeightOptimizer` turns a torch optimizer, in place, into one that keeps
fp32 masters:

* its ``param_groups`` hold the fp32 masters instead of the low-precision model
  parameters (fp32 parameters, such as norms kept in fp32, stay as they are), so LR
  schedulers, ``state_dict()``/``load_state_dict()`` and ``isinstance(opt, Adam)`` keep
  working, and the optimizer state (Adam's moments) is fp32;
* ``step()`` runs the optimizer's own step on the masters, then refreshes the model
  parameters from them (rounded to their dtype). A closure (LBFGS) sees the weights
  being tried: the model follows the masters before each evaluation. A step that is
  never called (an overflow skipped by a loss scaler) leaves the model, the masters and
  the optimizer state exactly as they were;
* ``zero_grad()`` clears the model's gradients too.

The gradient life cycle is plain PyTorch's. The model parameters' ``.grad`` is the
gradient: backward passes accumulate into it (gradient accumulation), and
``model.zero_grad()``, ``optimizer.zero_grad()`` or ``p.grad = None`` clear it. Each
master's ``.grad`` is an fp32 copy derived from it at the end of every backward pass and
again before each step, so whatever reads or edits gradients between ``backward()`` and
``step()`` works through either side: ``clip_grad_norm_(model.parameters(), ...)``,
clipping the optimizer's parameters (Lightning does), norm logging, NaN checks. An edit
made on the masters (clipping, a loss scaler's unscaling) is what the step uses as long
as the model's gradient is not changed afterwards (clearing or replacing the model's
gradient discards it, as it would in fp32); a loss scaler unscales the model's
gradients in the same pass as the masters' (:func:`agreed_model_grads`), so both sides
read the unscaled values. Editing one gradient
in place on both sides before they next agree (clipping through both, or accumulating
another backward pass into gradients clipped through the masters) has no right answer
and is a ``RuntimeError`` at the next backward pass or step.

The masters are the ones :func:`ampkit.conversion.convert_model` made from the original
fp32 values when converting with master weights (so nothing was lost to rounding), or,
for parameters converted without (or changed since without their masters), copies of
their current values. Between steps the model parameters are the masters rounded; to
change weights by hand, change :func:`master_params` (the next step would overwrite a
change made to the model parameters only). ``copy.deepcopy`` of the model, or of the
model and the optimizer together, keeps the masters.

Example:
    >>> import torch
    >>> from ampkit.master_weights import MasterWeightOptimizer, master_params
    >>> model = torch.nn.Linear(2, 1).to(torch.bfloat16)
    >>> opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3))
    >>> isinstance(opt, torch.optim.SGD), [p.dtype for p in master_params(opt)]
    (True, [torch.float32, torch.float32])
    >>> model(torch.ones(1, 2, dtype=torch.bfloat16)).sum().backward()
    >>> model.weight.grad.dtype, next(master_params(opt)).grad.dtype
    (torch.bfloat16, torch.float32)
    >>> model.zero_grad()  # clears the gradient the next step uses, masters' included
    >>> opt.step()
    >>> model.weight.grad, next(master_params(opt)).grad
    (None, None)
"""

from __future__ import annotations

import copy
import functools
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn

from ampkit.conversion import master_copy, register_master

__all__ = [
    "MasterWeightOptimizer",
    "agreed_model_grads",
    "clip_master_grad_norm_",
    "master_params",
    "model_params",
    "publish_master_grads",
    "put_grads_back",
    "set_grads_aside",
    "sync_master_grads",
]

_LOW = (torch.float16, torch.bfloat16)


# -- gradient marks ---------------------------------------------------------------------
# A mark records which tensor a ``.grad`` held and its version counter when the two sides
# were last made to agree, so any later change (a new tensor, ``None``, an in-place edit
# such as clipping) is seen. A weak reference, not ``id()``: a freed gradient's id can be
# reused by the next one.

_Mark = tuple[Any, int]
_NO_GRAD: _Mark = (None, -1)


def _mark(grad: torch.Tensor | None) -> _Mark:
    return _NO_GRAD if grad is None else (weakref.ref(grad), grad._version)


def _unchanged(mark: _Mark, grad: torch.Tensor | None) -> bool:
    ref, version = mark
    if ref is None:
        return grad is None
    return grad is not None and ref() is grad and grad._version == version


class _Pair:
    """A low-precision model parameter, its fp32 master, and the marks of both
    gradients when they last agreed."""

    __slots__ = ("master", "master_mark", "model", "model_mark")

    def __init__(self, model: torch.Tensor, master: nn.Parameter) -> None:
        self.model = model
        self.master = master
        self.model_mark = _NO_GRAD  # a gradient the model already holds is pulled first
        self.master_mark = _mark(master.grad)

    def agree(self) -> None:
        self.model_mark = _mark(self.model.grad)
        self.master_mark = _mark(self.master.grad)

    def agree_on_master(self) -> None:
        """Take the master's gradient as it is now (the model's is known unchanged)."""
        self.master_mark = _mark(self.master.grad)


def _copy_grads(pairs: list[_Pair], *, to_master: bool) -> None:
    """Make one side's ``.grad`` a copy of the other's (rounded to the destination's dtype):
    into the existing gradient where it fits, else into a new one, with one multi-tensor
    copy per device either way."""
    by_device: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    with torch.no_grad():
        for pair in pairs:
            src_param, dst_param = ((pair.model, pair.master) if to_master
                                    else (pair.master, pair.model))
            src, dst = src_param.grad, dst_param.grad
            if src is None:
                dst_param.grad = None
                continue
            if src.device != dst_param.device:
                raise RuntimeError(
                    f"a model parameter is on {pair.model.device} but its fp32 master "
                    f"is on {pair.master.device}: move the model to its device before "
                    f"ampkit.initialize / MasterWeightOptimizer")
            if src.is_sparse:
                dst_param.grad = src.to(dst_param.dtype, copy=True)
                continue
            if (dst is None or dst.is_sparse or dst.shape != src.shape
                    or dst.device != src.device or dst.stride() != src.stride()):
                # A new gradient, laid out as the source (a step after zero_grad()).
                dst = torch.empty_like(src, dtype=dst_param.dtype)
                dst_param.grad = dst
            dsts, srcs = by_device.setdefault(dst.device, ([], []))
            dsts.append(dst)
            srcs.append(src)
        for dsts, srcs in by_device.values():
            torch._foreach_copy_(dsts, srcs)


def _queue_after_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the running backward pass is over, after the callbacks
    queued so far: DDP queues its gradient all-reduce's completion during the pass, so a
    callback that re-queues itself runs after it and sees the reduced gradients."""
    engine = torch.autograd.Variable._execution_engine
    engine.queue_callback(lambda: engine.queue_callback(callback))


def _graph_task_id() -> int:
    current = getattr(torch._C, "_current_graph_task_id", None)
    return -2 if current is None else int(current())


class _Masters:
    """The model parameters an optimizer manages and their masters, pairwise, and the
    rules that keep their gradients in step.

    The model's ``.grad`` is the gradient: backward passes accumulate into it, and
    ``model.zero_grad()`` or ``p.grad = None`` clear it, exactly as without ampkit. Each
    master's ``.grad`` is an fp32 copy derived from it (:meth:`pull`): at the end of
    every backward pass that reaches the model (so clipping or logging through the
    optimizer's parameters before ``step()`` sees the gradients), and again at
    ``step()``, at unscaling and at clipping through ampkit. A master gradient changed in
    place since (clipped, unscaled) is kept while its model gradient stays unchanged.
    After a change made through the masters that the model must show (clipping through
    ampkit), :meth:`push` copies the masters' gradients back.
    """

    __slots__ = ("__weakref__", "_queued_for", "pairs")

    def __init__(self) -> None:
        self.pairs: list[_Pair] = []
        self._queued_for: int | None = None

    @property
    def models(self) -> list[torch.Tensor]:
        return [pair.model for pair in self.pairs]

    @property
    def masters(self) -> list[nn.Parameter]:
        return [pair.master for pair in self.pairs]

    def adopt(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The masters standing in for ``params`` (fp32 ones stand for themselves)."""
        out: list[torch.Tensor] = []
        for p in params:
            if p.dtype in _LOW:
                pair = next((pair for pair in self.pairs if pair.model is p), None)
                if pair is None:
                    master = master_copy(p, create=True)
                    assert master is not None  # created for every low-precision parameter
                    pair = self._add(p, master)
                out.append(pair.master)
            else:
                out.append(p)
        return out

    def _add(self, model: torch.Tensor, master: nn.Parameter) -> _Pair:
        pair = _Pair(model, master)
        self.pairs.append(pair)
        if model.requires_grad:
            ref = weakref.ref(self)

            def after_accumulation(param: torch.Tensor) -> None:
                masters = ref()
                if masters is not None:
                    masters._after_backward()

            model.register_post_accumulate_grad_hook(after_accumulation)
        return pair

    def _after_backward(self) -> None:
        task = _graph_task_id()
        if task != self._queued_for or task == -2:
            self._queued_for = task

            def pull() -> None:
                self._queued_for = None
                self.pull()

            _queue_after_backward(pull)

    def pull(self) -> None:
        """Derive each master's gradient from its model parameter's, where that changed."""
        stale: list[_Pair] = []
        for pair in self.pairs:
            grad = pair.model.grad
            if _unchanged(pair.model_mark, grad):
                continue
            # A model gradient cleared or replaced (zero_grad, p.grad = ...) discards
            # whatever was there, edits on the master included. One edited in place on
            # both sides (clipped twice, accumulated after clipping the masters) has no
            # right answer.
            edited_in_place = grad is not None and pair.model_mark[0] is not None and (
                pair.model_mark[0]() is grad)
            if edited_in_place and not _unchanged(pair.master_mark, pair.master.grad):
                raise RuntimeError(
                    f"the gradient of a parameter of shape {tuple(pair.model.shape)} was "
                    f"changed in place both on the model and on its fp32 master (the "
                    f"optimizer's parameter) since they last agreed (after a backward "
                    f"pass, a step or an unscale): edit gradients through "
                    f"model.parameters() or through the optimizer's parameters, not both")
            stale.append(pair)
        if stale:
            _copy_grads(stale, to_master=True)
            for pair in stale:
                pair.agree()

    def push(self, *, every_pair: bool = False) -> None:
        """Copy the masters' gradients back onto the model parameters, rounded: those
        changed since the two last agreed, or all of them."""
        changed = [pair for pair in self.pairs
                   if every_pair or not _unchanged(pair.master_mark, pair.master.grad)]
        if changed:
            _copy_grads(changed, to_master=False)
            for pair in changed:
                pair.agree()

    def agree_all(self) -> None:
        for pair in self.pairs:
            pair.agree()

    @torch.no_grad()
    def refresh_models(self) -> None:
        by_device: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for pair in self.pairs:
            dst, src = by_device.setdefault(pair.model.device, ([], []))
            dst.append(pair.model)
            src.append(pair.master)
        for dst, src in by_device.values():
            torch._foreach_copy_(dst, src)  # rounds each fp32 master to its model's dtype

    def __deepcopy__(self, memo: dict[int, Any]) -> _Masters:
        # Copied with the model (copy.deepcopy((model, optimizer))): the copies pair up,
        # and the copied parameters get their hooks and their masters' registration.
        copied = _Masters()
        memo[id(self)] = copied
        for pair in self.pairs:
            model = copy.deepcopy(pair.model, memo)
            master = copy.deepcopy(pair.master, memo)
            register_master(model, master)
            copied._add(model, master)
        return copied


def _remap_cached_params(optimizer: torch.optim.Optimizer, masters: _Masters) -> None:
    """Optimizers that keep their own list of the parameters (LBFGS's ``_params``)
    must update the masters too, not the model parameters behind them."""
    master_of = {id(pair.model): pair.master for pair in masters.pairs}
    for name, value in list(vars(optimizer).items()):
        if (name not in ("param_groups", "state") and isinstance(value, list) and value
                and all(isinstance(p, torch.Tensor) for p in value)
                and any(id(p) in master_of for p in value)):
            setattr(optimizer, name, [master_of.get(id(p), p) for p in value])


@functools.cache
def _wrapped_optimizer_class(wrapper: type, cls: type) -> type:
    """``cls`` with ``wrapper``'s methods in front (``MasterWeightAdamW``, ...), made
    once per pair so that every wrapped optimizer of a class shares one class."""
    prefix = wrapper.__name__.removesuffix("Optimizer")
    return type(f"{prefix}{cls.__name__}", (wrapper, cls), {"__module__": wrapper.__module__})


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
    ``param_groups`` hold the fp32 masters, whose gradients follow the model's (see the
    module docstring); ``step()`` steps them and refreshes the model parameters;
    ``zero_grad()`` clears both. Any
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

    def __new__(cls, *args: Any) -> Any:
        if not args and cls is not MasterWeightOptimizer:
            # copy.deepcopy / copy.copy of a managed optimizer rebuilds it from its state.
            return object.__new__(cls)
        if len(args) != 1:
            raise TypeError(f"MasterWeightOptimizer takes one optimizer, got {len(args)} "
                            f"arguments")
        optimizer = args[0]
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        if isinstance(optimizer, MasterWeightOptimizer):
            return optimizer
        _check_step_attribute(optimizer)  # before changing anything
        masters = _Masters()
        for group in optimizer.param_groups:
            group["params"] = masters.adopt(list(group["params"]))
        _remap_cached_params(optimizer, masters)
        for model, master in zip(masters.models, masters.masters):
            if model in optimizer.state:  # it already stepped: keep its state, in fp32
                optimizer.state[master] = {
                    k: v.float() if isinstance(v, torch.Tensor) and v.dtype in _LOW else v
                    for k, v in optimizer.state.pop(model).items()}
        object.__setattr__(optimizer, "_ampkit_masters", masters)
        optimizer.__class__ = _wrapped_optimizer_class(MasterWeightOptimizer, type(optimizer))
        _rewrap_scheduler_step(optimizer)
        return optimizer

    def __init__(self, *args: Any) -> None:
        # Everything happened in __new__, which returns the optimizer itself.
        pass

    def __getstate__(self) -> dict[str, Any]:
        # torch's Optimizer keeps only defaults, state and param_groups; copies of a
        # managed optimizer need their masters' pairing too.
        state = super().__getstate__()  # type: ignore[misc]
        state["_ampkit_masters"] = self._ampkit_masters
        return state

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """Step the optimizer on the masters (with gradients derived from the model's),
        then refresh the model parameters from them.

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
        masters.pull()
        if closure is None:
            loss = super().step(**kwargs)  # type: ignore[misc]
        else:
            def closure_on_current_weights() -> Any:
                # LBFGS and line searches evaluate the closure between updates of the
                # masters: the model must compute with the weights being tried.
                masters.refresh_models()
                with torch.enable_grad():
                    value = closure()
                masters.pull()
                return value

            loss = super().step(closure_on_current_weights, **kwargs)  # type: ignore[misc]
        masters.refresh_models()
        # The step leaves the model's gradients alone, but a fused one may rewrite the
        # masters' in place (unscaling them): those are the agreed values now.
        for pair in masters.pairs:
            pair.agree_on_master()
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
        for pair in self._ampkit_masters.pairs:
            grad = pair.model.grad
            if grad is not None:
                if set_to_none:
                    pair.model.grad = None
                else:
                    grad.detach_().requires_grad_(False)
                    grad.zero_()
            pair.agree()

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
    """Bring the fp32 masters' gradients of ``optimizer`` up to date with the model's.

    Returns ``True`` when ``optimizer`` keeps master weights, ``False`` (doing nothing)
    when it does not. It happens by itself at the end of each backward pass and before
    each step; call it after setting model gradients by hand (``p.grad = ...``) if you
    then read the masters' gradients. Syncing again changes nothing.

    Example:
        >>> import torch
        >>> from ampkit.master_weights import MasterWeightOptimizer, sync_master_grads
        >>> w = torch.nn.Parameter(torch.ones(1, dtype=torch.bfloat16))
        >>> opt = MasterWeightOptimizer(torch.optim.SGD([w], lr=0.1))
        >>> w.grad = torch.full((1,), 2.0, dtype=torch.bfloat16)
        >>> sync_master_grads(opt), sync_master_grads(opt)
        (True, True)
        >>> opt.param_groups[0]["params"][0].grad, w.grad
        (tensor([2.]), tensor([2.], dtype=torch.bfloat16))
        >>> sync_master_grads(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1))
        False
    """
    masters = _masters_of(optimizer)
    if masters is None:
        return False
    masters.pull()
    return True


def publish_master_grads(optimizer: torch.optim.Optimizer) -> bool:
    """Copy the masters' gradients of ``optimizer`` back onto the model parameters
    (rounded to their dtype), after an edit made on the masters that the model's
    gradients must show too (``clip_master_grad_norm_`` does). Returns whether
    ``optimizer`` keeps master weights.

    Example:
        >>> import torch
        >>> from ampkit.master_weights import (MasterWeightOptimizer, master_params,
        ...                                    publish_master_grads)
        >>> w = torch.nn.Parameter(torch.ones(1, dtype=torch.float16))
        >>> opt = MasterWeightOptimizer(torch.optim.SGD([w], lr=0.1))
        >>> w.grad = torch.full((1,), 1024.0, dtype=torch.float16)
        >>> master = next(master_params(opt))
        >>> sync_master_grads(opt) and master.grad.div_(1024.0) is not None
        True
        >>> publish_master_grads(opt), w.grad
        (True, tensor([1.], dtype=torch.float16))
    """
    masters = _masters_of(optimizer)
    if masters is None:
        return False
    # Every pair: torch's fused unscale kernel edits in place without bumping the
    # gradients' version counters, so a change cannot be told from none.
    masters.push(every_pair=True)
    return True


def agreed_model_grads(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The gradients of the low-precision model parameters behind ``optimizer``'s fp32
    masters, made to agree with the masters' first (empty without master weights).

    A loss scaler unscales these in the same pass as the masters' own gradients, so that
    ``model.parameters()`` shows the unscaled gradient too (for clipping or logging
    through the model) without a copy of every master gradient back to low precision.
    Scaling by the same factor in fp32 arithmetic and rounding once gives the model the
    masters' values rounded to its dtype, as a copy would.

    Example:
        >>> import torch
        >>> from ampkit.master_weights import (MasterWeightOptimizer, agreed_model_grads,
        ...                                    master_params)
        >>> w = torch.nn.Parameter(torch.ones(1, dtype=torch.float16))
        >>> opt = MasterWeightOptimizer(torch.optim.SGD([w], lr=0.1))
        >>> w.grad = torch.full((1,), 1024.0, dtype=torch.float16)
        >>> grads = agreed_model_grads(opt)
        >>> grads[0] is w.grad, next(master_params(opt)).grad
        (True, tensor([1024.]))
        >>> agreed_model_grads(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1))
        []
    """
    masters = _masters_of(optimizer)
    if masters is None:
        return []
    masters.pull()
    masters.push()  # master gradients edited by hand since they agreed, if any
    return [pair.model.grad for pair in masters.pairs if pair.model.grad is not None]


def set_grads_aside(optimizer: torch.optim.Optimizer) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Take the gradients out of ``optimizer``'s parameters (and, with master weights,
    out of the model parameters behind them) so that the next backward pass starts from
    none; returns ``(parameter, gradient)`` for :func:`put_grads_back`. Loss scaling
    uses it to keep gradients already unscaled apart from a new loss's scaled ones.

    Example:
        >>> import torch
        >>> from ampkit.master_weights import put_grads_back, set_grads_aside
        >>> w = torch.nn.Parameter(torch.ones(1))
        >>> opt = torch.optim.SGD([w], lr=0.1)
        >>> w.grad = torch.ones(1)
        >>> aside = set_grads_aside(opt)
        >>> w.grad is None
        True
        >>> (2 * w).sum().backward()
        >>> put_grads_back(opt, aside, add=True)
        >>> w.grad
        tensor([3.])
    """
    masters = _masters_of(optimizer)
    if masters is not None:
        masters.pull()  # the masters hold the gradients so far, in fp32
    aside = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                aside.append((p, p.grad))
                p.grad = None
    if masters is not None:
        for pair in masters.pairs:
            pair.model.grad = None
        masters.agree_all()
    return aside


def put_grads_back(optimizer: torch.optim.Optimizer,
                   aside: list[tuple[torch.Tensor, torch.Tensor]], *, add: bool) -> None:
    """Undo :func:`set_grads_aside`: add the gradients set aside to those there now
    (``add=True``), or put them back in place of those (``add=False``). With master
    weights the model's gradients then show the masters' again.

    Example:
        >>> import torch
        >>> from ampkit.master_weights import put_grads_back, set_grads_aside
        >>> w = torch.nn.Parameter(torch.ones(1))
        >>> opt = torch.optim.SGD([w], lr=0.1)
        >>> w.grad = torch.ones(1)
        >>> aside = set_grads_aside(opt)
        >>> w.grad = torch.full((1,), 7.0)
        >>> put_grads_back(opt, aside, add=False)
        >>> w.grad
        tensor([1.])
    """
    masters = _masters_of(optimizer)
    if masters is not None and add:
        masters.pull()  # gradients of the model's made since, not yet on the masters
    returned = {id(p) for p, _ in aside}
    with torch.no_grad():
        if not add:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if id(p) not in returned:
                        p.grad = None
        for p, grad in aside:
            if add and p.grad is not None:
                p.grad.add_(grad)
            else:
                p.grad = grad
    if masters is not None:
        masters.push()  # the gradients just added or put back


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
    master weights, brought up to date with the model's first, and the clipped values
    copied back onto the model's gradients) to a total norm of ``max_norm``; returns the
    total norm before clipping, like ``torch.nn.utils.clip_grad_norm_``.

    Example:
        >>> import torch
        >>> from ampkit.master_weights import MasterWeightOptimizer, clip_master_grad_norm_
        >>> w = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
        >>> opt = MasterWeightOptimizer(torch.optim.SGD([w], lr=1.0))
        >>> w.grad = torch.tensor([3.0, 4.0], dtype=torch.bfloat16)
        >>> clip_master_grad_norm_(opt, 1.0).item()
        5.0
        >>> opt.param_groups[0]["params"][0].grad, w.grad
        (tensor([0.6000, 0.8000]), tensor([0.6016, 0.8008], dtype=torch.bfloat16))
    """
    sync_master_grads(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(list(master_params(optimizer)), max_norm,
                                          norm_type, error_if_nonfinite=error_if_nonfinite,
                                          foreach=foreach)
    publish_master_grads(optimizer)
    return norm
