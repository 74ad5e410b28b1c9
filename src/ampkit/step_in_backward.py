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

Where it works: one process, and under FSDP2 (``fully_shard``), tensor parallelism
(``parallelize_module``) and both together. FSDP2 calls a sharded parameter's
post-accumulate-grad hooks itself, after the reduce-scatter (and HSDP's all-reduce),
so each shard steps on its reduced gradient (torch 2.11 to 2.14); tensor parallelism's
DTensor gradients are whole when autograd accumulates them. Under FSDP2, build the
optimizer after sharding and hand it to ``ampkit.fsdp.prepare_optimizer``, which
applies ``initialize``'s ``step_in_backward=True``.

Where it matches the ordinary step without being asked: parameter groups added later
(``add_param_group``, any iterable of parameters), frozen parameters (skipped while
they hold no gradient, as torch skips them, and stepped once unfrozen),
``zero_grad(set_to_none=False)`` of the optimizer or of a watched model (a parameter
left out of a later backward, frozen or not, steps on its kept zero gradient, as the
ordinary step does), non-reentrant checkpointing, reentrant checkpointing where each
parameter gets its gradient from one backward (one checkpoint around the whole model
too), no-grad forwards in other threads during backward, and pickling the model (the
copy's hooks do nothing).

What it refuses (each with a message):

* ``optimizer.step()``: the steps already ran inside ``backward()``; a call raises. So
  does ``scaler.step(optimizer)``.
* gradient accumulation over several backward passes: every ``backward()`` steps, and
  the first ``optimizer.step()`` of such a loop raises;
* a closure, and optimizers whose step needs one (``LBFGS``): they re-evaluate the loss
  over all parameters;
* loss scaling (float16): an overflow is known only once every gradient exists, and by
  then the parameters have stepped;
* a global gradient norm: ``torch.nn.utils.clip_grad_norm_`` (and
  ``clip_grad_value_``, ``clip_grads_with_norm_``) over these parameters raise, as
  their gradients are gone after ``backward()``. Per-parameter clipping works:
  :func:`clip_each_gradient`;
* DistributedDataParallel (and ``torch.distributed.fsdp.FullyShardedDataParallel``):
  they average the gradients after the hooks have run, so each rank would step on its
  own gradient. Refused at the first hook, before anything steps;
* a parameter that gets a second gradient in one backward after it stepped (reentrant
  checkpointing with a weight used inside and outside the block);
* a second backward over the same forward (``retain_graph=True``, or two losses
  backwarded one after the other through a shared parameter); a backward the ordinary
  loop would have thrown away (a GAN's generator loss reaching D) cannot be told from
  a real one: see the docs.

**An exception in the middle of backward** (a user's hook that finds a NaN) leaves the
parameters whose hooks already ran stepped and the others not: nothing can be undone
without keeping every gradient, which is what this mode exists to avoid. The next use
says so instead of training on: the next forward of the model (the models given to
``initialize`` or ``prepare_optimizer``; :func:`watch_models` for others), the next
backward and ``optimizer.state_dict()`` raise, naming how many of the optimizer's
parameters stepped. :func:`partial_step` gives the count; recover with
``model.load_state_dict``/``optimizer.load_state_dict`` from a checkpoint, or go on
from the partial step with :func:`accept_partial_step`.

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

import gc
import math
import sys
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ampkit import torch_internals

__all__ = ["accept_partial_step", "check_step_in_backward", "clip_each_gradient",
           "enable_step_in_backward", "mark_step_in_backward", "marked_step_in_backward",
           "partial_step", "steps_in_backward", "watch_models"]

_KEY = "_ampkit_in_backward"
_REFUSED_STEP = (
    "this optimizer steps inside backward (step_in_backward=True): every parameter "
    "was stepped as its gradient was accumulated and the gradient freed, so "
    "optimizer.step() has nothing to do. Remove the call (and scaler.step(optimizer)); "
    "gradient accumulation over several backward passes and closures cannot work in "
    "this mode: use step_in_backward=False for them")
_REENTRANT = (
    "step_in_backward: a parameter of shape {shape} received a second gradient in one "
    "backward, after it had stepped on the first. A backward ran inside this backward "
    "(checkpoint(..., use_reentrant=True), or an autograd Function whose backward calls "
    "torch.autograd.backward/grad) and the parameter is used both inside and outside "
    "it, or in two of them: their gradients reach it one after the other, and the "
    "ordinary step would have stepped once on their sum. Use "
    "torch.utils.checkpoint.checkpoint(..., use_reentrant=False) (torch's "
    "recommendation, same memory: one pass accumulates the whole gradient), or "
    "step_in_backward=False.")
_SECOND_PASS = (
    "step_in_backward: a parameter of shape {shape} received a gradient in a second "
    "backward pass over the same forward, after it had stepped in the first "
    "(loss.backward(retain_graph=True) then another backward, or two losses backwarded "
    "one after the other). The ordinary step would have stepped once on the sum of "
    "their gradients; here the first pass has already stepped and freed its gradient. "
    "Sum the losses and call backward once, or use step_in_backward=False.")
_NORM_FUNCTIONS = ("clip_grad_norm_", "clip_grad_norm", "clip_grad_value_",
                   "clip_grads_with_norm_", "get_total_norm")

# The parameters of optimizers stepping in backward, each with its optimizer's state:
# torch's gradient clipping over them is refused (their gradients are gone), and a
# parameter already stepping in backward for another optimizer is refused.
_PARAMS: WeakIdKeyDictionary = WeakIdKeyDictionary()
# The models initialize set up to step in backward: an optimizer built over them later
# (after FSDP2 sharding) is made to step in backward by ampkit.fsdp.prepare_optimizer.
_MODELS: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()
# torch's gradient-clipping functions as torch.nn.utils exports them, by name, once
# replaced there by the refusing ones (:func:`_guard_norm_functions`): once per process.
_NORM_ORIGINALS: dict[str, Callable[..., Any]] = {}


def _ddp_holders(params: list[torch.Tensor]) -> str | None:
    """The data-parallel wrapper holding one of ``params`` whose gradient averaging
    runs after the gradient hooks (DDP, the FSDP of ``torch.distributed.fsdp``), named,
    or ``None``. Such wrappers mark nothing on the parameters: the live modules are
    searched, once per layout of the optimizer."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    wanted = {id(p) for p in params}
    kinds = (DistributedDataParallel, FullyShardedDataParallel)
    for obj in gc.get_objects():
        # type(), not isinstance(): an object's __class__ may be a deprecation proxy
        if (issubclass(type(obj), kinds)
                and any(id(p) in wanted for p in obj.parameters())):
            return type(obj).__name__
    return None


def _distributed_reason(params: list[torch.Tensor]) -> str | None:
    """Why stepping in backward cannot work for ``params`` here, or ``None``: under a
    wrapper that averages (DistributedDataParallel) or reduces (FSDP1) gradients after
    the gradient hooks fire. FSDP2's sharded parameters and tensor parallelism's
    DTensors step on their reduced gradients (FSDP2 runs their hooks after the
    reduce-scatter) and plain parameters of a process that no such wrapper holds step
    on what the ordinary step would see."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    holder = _ddp_holders(params)
    if holder is None:
        return None
    return _held_reason(holder)


def _held_reason(holder: str) -> str:
    """The refusal's reason when ``holder`` (a wrapper's class name) holds the
    parameters."""
    return (f"its parameters are held by {holder}, which averages the ranks' gradients "
            f"after the gradient hooks have run: each parameter would step on its own "
            f"rank's gradient and the replicas would drift apart. FSDP2 "
            f"(torch.distributed.fsdp.fully_shard, ampkit.fsdp.fully_shard) and tensor "
            f"parallelism step in backward on the reduced gradients")


def check_step_in_backward(optimizer: Any, *, loss_scale: Any = None,
                           argument: str = "optimizer", held_by: str | None = None) -> None:
    """Raise the error :func:`enable_step_in_backward` would raise, changing nothing
    (``initialize`` checks before converting anything; ``loss_scale``: the run's
    loss scaling, ``None`` when off). ``optimizer=None`` checks the settings alone.
    ``held_by``: the class name of a data-parallel wrapper that is to hold the
    parameters (``"DistributedDataParallel"``), to learn before wrapping what the first
    hook would raise once it does (``ampkit.plan`` checks DDP this way: it never builds
    one).

    Raises:
        TypeError: ``optimizer`` is not an optimizer.
        ValueError: loss scaling is on, or the optimizer's step needs a closure, or a
            parameter already steps in backward for another optimizer.
        RuntimeError: a data-parallel wrapper that averages gradients after the hooks
            (DistributedDataParallel) holds the parameters.

    Example:
        >>> import torch
        >>> from ampkit.step_in_backward import check_step_in_backward
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> check_step_in_backward(torch.optim.LBFGS([w]))
        Traceback (most recent call last):
        ...
        ValueError: step_in_backward: LBFGS's step needs a closure, which re-evaluates ...
        >>> check_step_in_backward(None, held_by="DistributedDataParallel")
        Traceback (most recent call last):
        ...
        RuntimeError: step_in_backward cannot work here: its parameters are held by ...
    """
    if held_by in ("DistributedDataParallel", "FullyShardedDataParallel"):
        raise RuntimeError(f"step_in_backward cannot work here: {_held_reason(held_by)}. "
                           f"Use step_in_backward=False")
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
    params = [p for g in optimizer.param_groups for p in g["params"]]
    _check_not_taken(optimizer, params)
    reason = _distributed_reason(params)
    if reason is not None:
        raise RuntimeError(f"step_in_backward cannot work here: {reason}. Use "
                           f"step_in_backward=False")


def _check_not_taken(optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor]) -> None:
    for p in params:
        owner = _PARAMS.get(p)
        live = None if owner is None else owner()
        if live is not None and live.opt() is not optimizer:
            raise ValueError(f"step_in_backward: a parameter of shape {tuple(p.shape)} "
                             f"already steps inside backward for another optimizer; "
                             f"each parameter can step in backward for one optimizer only")


def _reentrant() -> bool:
    """Whether this gradient hook runs in a backward started inside another backward
    (reentrant checkpointing): walking out from here, a call of
    ``torch.autograd.backward``/``grad`` is met, and beyond it the backward of a
    Python autograd Function. (FSDP2 calls the hooks from a Function's backward too,
    but of the outer pass: no ``backward``/``grad`` call lies between.)"""
    engine = {torch.autograd.backward.__code__, torch.autograd.grad.__code__}
    function_backward = torch.autograd.function.BackwardCFunction.apply.__code__
    frame = sys._getframe(2)
    called = False
    while frame is not None:
        code = frame.f_code
        if code in engine:
            called = True
        elif called and code is function_backward:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


class _InBackward:
    """What an optimizer stepping in backward keeps: the hooks' handles, the
    per-parameter clipping, the pure optimizer's rounding keys (the whole optimizer's,
    cached while its groups keep their parameters) and the backward pass under way
    (its graph tasks, what stepped in it), so that a pass stopped by an exception is
    told at the next use."""

    __slots__ = (
        "__weakref__",
        "broken",
        "checked",
        "clip",
        "covered",
        "fresh",
        "had_grad",
        "handles",
        "hook",
        "hooked",
        "indices",
        "keep_zeros",
        "layout",
        "lock",
        "open",
        "opt",
        "partial",
        "pass_max",
        "since_forward",
        "stepped",
        "steps",
    )

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.opt = weakref.ref(optimizer)
        self.handles: list[Any] = []
        self.hooked: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.fresh: set[int] = set()  # hooked since the last pass ended
        self.clip: tuple[float | None, float | None, float] = (None, None, 2.0)
        self.layout: tuple[tuple[int, ...], ...] = ()
        self.checked: tuple[tuple[int, ...], ...] | None = None
        self.indices: dict[int, tuple[int, int]] = {}
        self.open: set[int] = set()  # graph tasks of the pass under way
        self.stepped: set[int] = set()  # ids of the parameters stepped in it
        self.broken: str | None = None  # a pass stopped part-way: the next use says so
        self.keep_zeros = False  # zero_grad(set_to_none=False) was the last zeroing
        self.had_grad: set[int] = set()  # stepped since the last zeroing to None
        self.hook: Callable[[torch.Tensor], None] | None = None
        self.partial: tuple[int, int] | None = None  # (stepped, total) of a stopped pass
        self.pass_max = -1  # the newest graph task seen in the pass (reentrant ones too)
        # held while a step narrows the optimizer's groups, so that no reader of ours in
        # another thread sees the narrowed groups
        self.lock = threading.RLock()
        self.steps = 0  # parameters stepped so far, all passes
        # parameters whose module's forward is watched, and those of them stepped since
        # their module's last forward: a gradient for one of those comes from a second
        # backward over the same forward
        self.covered: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.since_forward: set[int] = set()

    def params(self) -> list[torch.Tensor]:
        opt = self.opt()
        with self.lock:
            return [] if opt is None else [p for g in opt.param_groups for p in g["params"]]

    def hook_params(self) -> None:
        """Register the hook on each parameter that trains and has none yet (frozen
        parameters get theirs once unfrozen, as torch skips them until then)."""
        assert self.hook is not None
        for p in self.params():
            if p.requires_grad and p not in self.hooked:
                handle = p.register_post_accumulate_grad_hook(self.hook)
                self.hooked[p] = handle
                self.fresh.add(id(p))  # its gradient so far came before its hook
                self.handles.append(handle)
                _PARAMS[p] = weakref.ref(self)

    def check_broken(self) -> None:
        """Raise if the last backward pass stopped part-way. (A pass that stops drops
        its end callback, which tells :meth:`dropped`; a pass still running in another
        thread is not a stopped one.)"""
        if self.broken is not None:
            raise RuntimeError(self.broken)

    def dropped(self, task: int) -> None:
        """The end callback of pass ``task`` was freed: if it never ran, the pass
        stopped with an exception."""
        if task in self.open:
            self.stopped()

    def before_forward(self) -> None:
        """A forward of a watched model: the last pass must have finished, every
        gradient been stepped, and a pass of reentrant backwards only (no hook outside
        them, so no end callback) is ended here."""
        from ampkit.torch_internals import graph_task_id

        if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
            return  # serving or evaluation, maybe in another thread: no training step
        if graph_task_id() != -1:
            self.recomputed()
            return
        with self.lock:
            self.check_broken()
            if self.stepped and not self.open:
                self.pass_ended(None)
            self.hook_params()  # a parameter unfrozen since: hooked before its backward
            self.check_all_stepped()

    def forwarded(self, ids: frozenset[int]) -> None:
        """A forward of a module of a watched model, owning the parameters ``ids``
        (as they were when watched: FSDP2 swaps in unsharded ones during forward): a
        later backward may step them again."""
        from ampkit.torch_internals import graph_task_id

        if not torch.is_grad_enabled():
            return
        if self.since_forward:
            self.since_forward.difference_update(ids)
        if graph_task_id() != -1:
            self.recomputed()

    def stopped(self) -> None:
        """The pass under way will never finish (an exception left it): say so at
        every next use, if it stepped anything."""
        done, total = len(self.stepped), len(self.params())
        self.open.clear()
        self.stepped = set()
        if done:
            self.partial = (done, total)
            self.broken = (
                f"step_in_backward: the last backward stopped with an exception after "
                f"{done} of the optimizer's {total} parameters had stepped inside it, so "
                f"the model is part-way through a step. Reload the last checkpoint "
                f"(model.load_state_dict and optimizer.load_state_dict), or call "
                f"ampkit.step_in_backward.accept_partial_step(optimizer) to go on from "
                f"these parameters (the gradients the others had are dropped)")

    def check_all_stepped(self) -> None:
        """Between passes every gradient has been stepped and freed; one left means its
        hook never ran (a wrapper or torch release that does not call a parameter's
        post-accumulate-grad hooks), and the ordinary step would have stepped it."""
        left = [tuple(p.shape) for p in self.params()
                if p.grad is not None and p in self.hooked and id(p) not in self.fresh]
        self.fresh.clear()  # from this forward on, their gradients come through hooks
        if left:
            raise RuntimeError(
                f"step_in_backward: {len(left)} parameter(s) (shapes {left[:3]}) hold a "
                f"gradient that was never stepped: their post-accumulate-grad hooks did "
                f"not run in the last backward (FSDP2 runs a sharded parameter's hooks "
                f"after its reduce-scatter on torch 2.11 to 2.14; this is torch "
                f"{torch.__version__}), or a gradient was set by hand. Use "
                f"step_in_backward=False here")

    def open_pass(self, task: int) -> None:
        """Backward pass ``task`` (not a reentrant one) reaches these parameters."""
        from ampkit.torch_internals import at_backward_end

        if self.open:  # the last pass stopped part-way
            self.stopped()
        elif not (self.stepped and task < self.pass_max):
            # (a task older than a reentrant backward seen is the pass that
            # encloses it, hooking late: the same pass)
            self.stepped = set()
        if self.broken is not None:
            raise RuntimeError(self.broken)
        self.open.add(task)
        self.pass_max = max(self.pass_max, task)
        # the engine holds the callback until the pass is over: freed without
        # having run, the pass stopped with an exception (told in any thread)
        end = _PassEnd(self, task)
        weakref.finalize(end, _pass_dropped, weakref.ref(self), task)
        at_backward_end(end)

    def recomputed(self) -> None:
        """A forward inside backward (checkpointing's recomputation). Outside any
        reentrant backward it runs in the pass that will reach these parameters: the
        pass is opened here, so that its end is known even where every parameter gets
        its gradient in a reentrant backward (no hook of theirs fires in the pass)."""
        from ampkit.torch_internals import graph_task_id

        task = graph_task_id()
        if self.opt() is not None and task not in self.open and not _reentrant():
            with self.lock:
                self.open_pass(task)

    def zeroed(self, module: torch.nn.Module | None, set_to_none: bool) -> None:
        """``zero_grad`` of the optimizer (``module`` None) or of a watched model:
        ``set_to_none=False`` keeps a zero gradient on every parameter that had one,
        and the ordinary step steps those the next backward leaves out (momentum,
        weight decay): the end of each pass does the same."""
        self.keep_zeros = not set_to_none
        if set_to_none:
            if module is None:
                self.had_grad.clear()
            else:
                self.had_grad.difference_update(id(p) for p in module.parameters())

    def hook_fired(self, p: torch.Tensor) -> None:
        from ampkit.torch_internals import graph_task_id

        if self.opt() is None:
            return
        task = graph_task_id()
        if task not in self.open:
            if _reentrant():
                # a backward inside this pass (reentrant checkpointing): its gradients
                # are whole for the parameters used only inside it; the pass goes on
                if self.broken is not None:
                    raise RuntimeError(self.broken)
                self.pass_max = max(self.pass_max, task)
            else:
                self.open_pass(task)
        if id(p) in self.since_forward and id(p) not in self.stepped:
            # stepped in an earlier pass, and its module ran no forward since
            shape = tuple(p.shape)
            self.stopped()
            told = "" if self.broken is None else f" Also: {self.broken}"
            raise RuntimeError(_SECOND_PASS.format(shape=shape) + told)
        if id(p) in self.stepped:
            # a second gradient for a parameter that has stepped in this pass
            shape = tuple(p.shape)
            self.stopped()
            told = "" if self.broken is None else f" Also: {self.broken}"
            raise RuntimeError(_REENTRANT.format(shape=shape) + told)
        self.step_one(p)

    def pass_ended(self, task: int | None) -> None:
        """The end of a backward pass: step what the ordinary step would also have
        stepped and no hook did (a parameter unfrozen or added without its hook
        firing; zero gradients kept by ``zero_grad(set_to_none=False)``)."""
        if task is not None:
            self.open.discard(task)
        if self.open:
            return
        try:
            self.hook_params()
            for p in self.params():
                # frozen ones too: torch steps any parameter holding a gradient (a
                # kept zero one included: weight decay, moments)
                if id(p) in self.stepped:
                    continue
                if p.grad is not None:
                    self.step_one(p)
                elif self.keep_zeros and id(p) in self.had_grad:
                    p.grad = torch.zeros_like(p)
                    self.step_one(p)
        finally:
            self.stepped = set()

    def layout_changed(self) -> None:
        opt = self.opt()
        assert opt is not None
        layout = tuple(tuple(map(id, g["params"])) for g in opt.param_groups)
        if layout == self.layout:
            return
        from ampkit.pure.optimizer import rounding_keys

        params = self.params()
        if self.checked != layout:
            reason = _distributed_reason(params)
            if reason is not None:
                raise RuntimeError(f"step_in_backward cannot work here: {reason}. Use "
                                   f"step_in_backward=False")
            self.checked = layout
        self.layout, self.indices = layout, rounding_keys(opt)

    def step_one(self, p: torch.Tensor) -> None:
        opt = self.opt()
        if opt is None or p.grad is None:
            return
        self.layout_changed()
        max_norm, max_value, norm_type = self.clip
        # torch's own functions (the public names refuse these parameters)
        if max_value is not None:
            _NORM_ORIGINALS["clip_grad_value_"]([p], max_value)
        if max_norm is not None:
            total = _NORM_ORIGINALS["get_total_norm"]([p.grad], norm_type)
            _NORM_ORIGINALS["clip_grads_with_norm_"]([p], max_norm, total)
        with self.lock:
            lists = [g["params"] for g in opt.param_groups]
            saved = [list(ps) for ps in lists]
            mine = next(i for i, ids in enumerate(self.layout) if id(p) in ids)
            opt.__dict__["_ampkit_indices"] = self.indices
            try:
                for i, ps in enumerate(lists):
                    ps[:] = [p] if i == mine else []
                type(opt).step(opt)  # the class's step: the instance's refuses
            finally:
                for ps, original in zip(lists, saved):
                    ps[:] = original
                del opt.__dict__["_ampkit_indices"]
        torch_internals.mark_optimizer_called(opt)  # LR schedulers' flag
        self.steps += 1
        self.stepped.add(id(p))
        if p in self.covered:
            self.since_forward.add(id(p))
        self.had_grad.add(id(p))
        p.grad = None


class _PassEnd:
    """The end-of-pass callback handed to the engine (its freeing unrun tells that
    the pass stopped)."""

    __slots__ = ("__weakref__", "state", "task")

    def __init__(self, state: _InBackward, task: int) -> None:
        self.state, self.task = weakref.ref(state), task

    def __call__(self) -> None:
        live = self.state()
        if live is not None:
            live.pass_ended(self.task)


def _pass_dropped(ref: weakref.ref[_InBackward], task: int) -> None:
    live = ref()
    if live is not None:
        live.dropped(task)


class _Inert:
    """What a watched model's hooks become in a pickled or deep-copied model: its
    parameters are new ones that no optimizer steps in backward (an optimizer over
    them set up with ``initialize`` or :func:`watch_models` adds its own hooks)."""

    def __call__(self, *args: Any) -> None:
        return None


class _Watch:
    """The hooks of a watched model, as module-level objects holding the optimizer's
    state weakly, so that the model still pickles (``torch.save(model)``)."""

    __slots__ = ("ids", "kind", "state")

    def __init__(self, state: _InBackward, kind: str, ids: frozenset[int] = frozenset(),
                 ) -> None:
        self.state, self.kind, self.ids = weakref.ref(state), kind, ids

    def __call__(self, module: torch.nn.Module, args: Any, *output: Any) -> None:
        live = self.state()
        if live is None:
            return
        if self.kind == "before":
            live.before_forward()
        elif self.kind == "module":
            live.forwarded(self.ids)
        elif torch.is_grad_enabled():  # "after": the outputs of the model's forward
            outs = output[0]
            items = (outs.values() if isinstance(outs, dict)
                     else outs if isinstance(outs, (tuple, list)) else (outs,))
            for out in items:
                # one per output: two outputs backwarded one after the other may reach
                # different parameters (the parameters' own check covers shared ones)
                if isinstance(out, torch.Tensor) and out.requires_grad:
                    out.register_hook(_Reached(live))

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Inert, ())


class _Reached:
    """A tensor hook on a watched model's output: a second backward pass through the
    same output (``retain_graph=True``) after the first stepped is refused before it
    reaches any parameter (torch would otherwise fail on a stale saved weight, or,
    where none is saved, step again)."""

    __slots__ = ("first", "state", "steps")

    def __init__(self, state: _InBackward) -> None:
        self.state = weakref.ref(state)
        self.first: int | None = None
        self.steps = 0

    def __call__(self, grad: torch.Tensor) -> None:
        from ampkit.torch_internals import graph_task_id

        live = self.state()
        if live is None:
            return
        task = graph_task_id()
        if self.first is None:
            self.first, self.steps = task, live.steps
        elif task != self.first and live.steps != self.steps:
            raise RuntimeError(_SECOND_PASS.format(shape="").replace(
                "a parameter of shape  received a gradient",
                "a model's output was reached"))


class _ZeroGrad:
    """A watched model's ``zero_grad``, set on the instance: tells the optimizer's
    state whether zero gradients are kept, then runs the class's."""

    __slots__ = ("module", "state")

    def __init__(self, state: _InBackward, module: torch.nn.Module) -> None:
        self.state, self.module = weakref.ref(state), module

    def __call__(self, set_to_none: bool = True) -> None:
        live = self.state()
        if live is not None:
            live.zeroed(self.module, set_to_none)
        type(self.module).zero_grad(self.module, set_to_none)

    def __reduce__(self) -> tuple[Any, ...]:
        # a pickled or copied model's parameters step for no optimizer: torch's own
        return (_PlainZeroGrad, (self.module,))


class _PlainZeroGrad:
    """What :class:`_ZeroGrad` becomes in a pickled or deep-copied model."""

    __slots__ = ("module",)

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def __call__(self, set_to_none: bool = True) -> None:
        type(self.module).zero_grad(self.module, set_to_none)


def _any_live() -> bool:
    return any(owner() is not None for owner in list(_PARAMS.values()))


def _refusing(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def refuse_or_clip(parameters: Any, *args: Any, **kwargs: Any) -> Any:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if name == "get_total_norm":
            # it takes gradients, which are gone: an empty list here is most likely
            # [p.grad for p in params if p.grad is not None] after backward
            if not params and _any_live():
                raise RuntimeError(
                    "torch.nn.utils.get_total_norm: no gradient given, and an optimizer "
                    "in this process steps inside backward (step_in_backward=True), "
                    "which frees each gradient during backward: the norm would read 0. "
                    "Clip each gradient before its step with "
                    "ampkit.step_in_backward.clip_each_gradient, or use "
                    "step_in_backward=False for a norm over all parameters")
            return original(params, *args, **kwargs)
        for p in params:
            owner = _PARAMS.get(p) if isinstance(p, torch.Tensor) else None
            if owner is not None and owner() is not None:
                raise RuntimeError(
                    f"torch.nn.utils.{name}: these parameters step inside backward "
                    f"(step_in_backward=True): each gradient was used by its step and "
                    f"freed during backward, so none is left to measure or clip (the call "
                    f"would see no gradient and return 0). Clip each gradient before its "
                    f"step with ampkit.step_in_backward.clip_each_gradient(optimizer, "
                    f"max_norm=..., max_value=...), or use step_in_backward=False for a "
                    f"norm over all parameters")
        return original(params, *args, **kwargs)

    refuse_or_clip.__name__ = refuse_or_clip.__qualname__ = name
    refuse_or_clip.__doc__ = original.__doc__
    refuse_or_clip.__wrapped__ = original  # type: ignore[attr-defined]
    return refuse_or_clip


def _guard_norm_functions() -> None:
    """Make torch's gradient-clipping functions refuse parameters that step in
    backward (they would see no gradient and report a norm of 0): replaced in
    ``torch.nn.utils`` and ``torch.nn.utils.clip_grad``, once per process; the same
    functions for every other parameter. ``clip_grad_norm_`` bound before this (an
    import at the top of a script) reaches the refusal through the scaling step it
    looks up at each call; the per-parameter clipping inside backward calls torch's
    functions kept here."""
    if _NORM_ORIGINALS:
        return
    clip_grad = torch.nn.utils.clip_grad
    for name in _NORM_FUNCTIONS:
        original = getattr(torch.nn.utils, name, None)
        if original is None:
            continue
        _NORM_ORIGINALS[name] = original
        refusing = _refusing(name, original)
        setattr(torch.nn.utils, name, refusing)
        if getattr(clip_grad, name, None) is original:
            setattr(clip_grad, name, refusing)
    torch_internals.replace_clip_grads_with_norm(
        lambda original: _refusing("clip_grad_norm_", original))


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
            live.hook_fired(p)

    state.hook = hook
    state.hook_params()
    _guard_norm_functions()

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(_REFUSED_STEP)

    # An LR scheduler wraps optimizer.step to see it called: mark this one as such, so
    # that a scheduler neither warns about it nor wraps it (the hooks set the flag).
    torch_internals.mark_wrapped_by_lr_scheduler(refuse)
    optimizer.__dict__[_KEY] = state
    optimizer.step = refuse  # type: ignore[method-assign]
    # A loss scaler then hands the step its found_inf instead of asserting that it saw
    # no gradients: the call reaches this step, which refuses in words.
    torch_internals.set_step_supports_amp_scaling(optimizer, True)
    cls = type(optimizer)

    def add_param_group(param_group: dict[str, Any]) -> None:
        # a group added later (progressive unfreezing) steps in backward like the rest
        live = ref()
        if live is not None:
            params = param_group["params"]
            if not isinstance(params, torch.Tensor):
                # any iterable torch accepts (module.parameters(), a generator): read
                # once here and handed on as the list, so torch still sees every one
                param_group = {**param_group, "params": list(params)}
            _check_not_taken(optimizer, param_group["params"]
                             if not isinstance(param_group["params"], torch.Tensor)
                             else [param_group["params"]])
        cls.add_param_group(optimizer, param_group)
        if live is not None:
            live.hook_params()

    def zero_grad(set_to_none: bool = True) -> None:
        live = ref()
        if live is not None:
            live.zeroed(None, set_to_none)
        cls.zero_grad(optimizer, set_to_none)

    optimizer.add_param_group = add_param_group  # type: ignore[method-assign]
    optimizer.zero_grad = zero_grad  # type: ignore[method-assign]

    def loaded(opt: torch.optim.Optimizer) -> None:
        live = ref()
        if live is not None:  # a checkpoint reloaded: the partial step is undone
            live.broken = live.partial = None
            live.open.clear()
            live.since_forward.clear()
            live.stepped = set()

    def saving(opt: torch.optim.Optimizer) -> None:
        live = ref()
        if live is not None:
            live.check_broken()

    state.handles.append(optimizer.register_load_state_dict_post_hook(loaded))
    state.handles.append(optimizer.register_state_dict_pre_hook(saving))
    return optimizer


def watch_models(optimizer: torch.optim.Optimizer, models: Iterable[torch.nn.Module]) -> None:
    """Check, before each forward of ``models``, that the last backward finished: one
    stopped by an exception after some parameters stepped raises there
    (``initialize`` and ``ampkit.fsdp.prepare_optimizer`` watch the models they get).

    Example:
        >>> import torch
        >>> from ampkit.step_in_backward import enable_step_in_backward, watch_models
        >>> net = torch.nn.Linear(2, 1)
        >>> opt = enable_step_in_backward(torch.optim.SGD(net.parameters(), lr=0.1))
        >>> watch_models(opt, [net])
        >>> net(torch.ones(1, 2)).shape
        torch.Size([1, 1])
    """
    state = optimizer.__dict__.get(_KEY)
    if not isinstance(state, _InBackward):
        raise ValueError("watch_models: this optimizer does not step in backward")
    mine = {id(p) for p in state.params()}
    for model in models:
        # its zero_grad(set_to_none=False) keeps zero gradients, as the optimizer's does
        model.zero_grad = _ZeroGrad(state, model)  # type: ignore[method-assign]
        state.handles.append(model.register_forward_pre_hook(_Watch(state, "before")))
        state.handles.append(model.register_forward_hook(_Watch(state, "after")))
        for module in model.modules():
            own = [p for p in module.parameters(recurse=False) if id(p) in mine]
            if own:
                state.handles.append(module.register_forward_pre_hook(
                    _Watch(state, "module", frozenset(id(p) for p in own))))
                for p in own:
                    state.covered[p] = True


def mark_step_in_backward(models: Iterable[torch.nn.Module]) -> None:
    """Record that ``models`` step their optimizers in backward
    (``initialize(..., step_in_backward=True)``): ``ampkit.fsdp.prepare_optimizer``
    then makes an optimizer built over them later (after sharding) step in backward.

    Example:
        >>> import torch
        >>> from ampkit.step_in_backward import marked_step_in_backward, mark_step_in_backward
        >>> net = torch.nn.Linear(2, 1)
        >>> mark_step_in_backward([net])
        >>> marked_step_in_backward(net), marked_step_in_backward(torch.nn.Linear(2, 1))
        (True, False)
    """
    for model in models:
        _MODELS[model] = True


def marked_step_in_backward(model: torch.nn.Module) -> bool:
    """Whether ``initialize`` set ``model`` up to step in backward.

    Example:
        >>> import torch
        >>> from ampkit.step_in_backward import marked_step_in_backward
        >>> marked_step_in_backward(torch.nn.Linear(2, 1))
        False
    """
    return bool(_MODELS.get(model, False))


def partial_step(optimizer: torch.optim.Optimizer) -> tuple[int, int] | None:
    """``(stepped, total)`` when the last backward stopped with an exception after
    ``stepped`` of the optimizer's ``total`` parameters had stepped inside it (the
    model is part-way through a step), else ``None``.

    Example:
        >>> import torch
        >>> from ampkit.step_in_backward import enable_step_in_backward, partial_step
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> opt = enable_step_in_backward(torch.optim.SGD([w], lr=0.5))
        >>> (w * w).sum().backward()
        >>> partial_step(opt) is None
        True
    """
    state = _state(optimizer, "partial_step")
    return None if state.broken is None else state.partial


def accept_partial_step(optimizer: torch.optim.Optimizer) -> None:
    """Go on after a backward that stopped part-way: the parameters that stepped keep
    their step, the others keep their values and lose what gradient they had, and the
    next backward steps every parameter again. (Reloading a checkpoint with
    ``optimizer.load_state_dict`` also clears the refusal.)

    Example:
        >>> import torch
        >>> from ampkit.step_in_backward import accept_partial_step, enable_step_in_backward
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> opt = enable_step_in_backward(torch.optim.SGD([w], lr=0.5))
        >>> accept_partial_step(opt)  # nothing to accept: no effect
    """
    state = _state(optimizer, "accept_partial_step")
    state.open.clear()
    state.since_forward.clear()
    state.stepped = set()
    state.broken = state.partial = None
    for p in state.params():
        p.grad = None


def _state(optimizer: torch.optim.Optimizer, function: str) -> _InBackward:
    state = optimizer.__dict__.get(_KEY)
    if not isinstance(state, _InBackward):
        raise ValueError(f"{function}: this optimizer does not step in backward")
    return state


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
    from ampkit.common.arguments import positive_number

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
