"""Parameters cast on use: the low-precision copies O2 computes with.

At O2 the fp32 parameters are the truth. They stay the module's own ``nn.Parameter``
objects, which the user's optimizer steps, DDP and FSDP2 reduce and shard, and
``state_dict`` saves. While a module runs its forward, each of its floating fp32
parameters is replaced by a low-precision copy (``param.to(dtype)``, differentiable,
so the gradient reaches the fp32 ``.grad`` through autograd and accumulates there in
fp32); the forward's end puts the parameter back. This is what FSDP2's
``MixedPrecisionPolicy(param_dtype=...)`` and MindSpore's O2 do ("parameters are
converted to low precision on use, results converted back").

Casting every forward would recast every weight for every micro-batch of gradient
accumulation. So a copy is kept, per parameter, and reused while it is sure to be the
parameter's value rounded:

* within one forward pass of the converted model (a weight used twice is cast once
  and both uses share one autograd node), and
* across the micro-batches of one optimizer step, for a parameter that a
  ``torch.optim.Optimizer`` has stepped before: until that optimizer's next step, as
  long as the parameter is unchanged in place (its version counter) and keeps its
  storage (``param.data = ...`` replaces it).

A copy is dropped when any ``torch.optim.Optimizer`` steps the parameter (a global
step post-hook), so nothing is held between steps (the parameter's slot in the cache,
which holds no tensor, stays for the next step's copy). A parameter no torch optimizer steps
(a hand-written update loop, a frozen or inference-only model) is cast once per forward
pass, as native autocast does: only an optimizer's step is a sure sign of its change.
A copy made under ``no_grad`` has no autograd history and is never used by a forward
that builds a graph; under ``inference_mode`` nothing is cached. Under
``torch.compile`` nothing is cached either: the graph casts the weights itself. Nor in
modules FSDP2 manages: their parameters in a forward are the unsharded ones FSDP frees
after it (and with :mod:`ampkit.fsdp`'s policy they arrive in low precision already,
leaving nothing to cast).

An optimizer built over the parameters before FSDP2's ``fully_shard`` replaced them
with sharded ones would step tensors the model no longer uses: its first step raises
``RuntimeError`` instead (build the optimizer after sharding).

Limit: an in-place edit through ``param.data`` between two micro-batches of the same
optimizer step is not seen (``.data`` has its own version counter) until the next step;
edit parameters under ``torch.no_grad()`` instead, which bumps the version.

Example:
    >>> import torch
    >>> from ampkit.parameter_casts import CastParametersOnUse
    >>> lin = torch.nn.Linear(3, 2)
    >>> CastParametersOnUse(torch.bfloat16).install(lin)
    >>> lin(torch.ones(1, 3, dtype=torch.bfloat16)).dtype
    torch.bfloat16
    >>> lin.weight.dtype                      # the parameter itself is untouched
    torch.float32
    >>> lin(torch.ones(1, 3, dtype=torch.bfloat16)).sum().backward()
    >>> lin.weight.grad.dtype
    torch.float32
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any

import torch
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

from ampkit.compile_frames import skip_recursively

__all__ = ["CAST_HOOKS", "CastParametersOnUse", "cached_casts", "cast_parameter",
           "end_forward_pass", "forget_casts", "is_cached", "new_forward_pass",
           "restore_swapped", "restore_to", "restore_until", "swap_depth",
           "swap_params"]


class _Entry:
    """One parameter's slot in the cache: its low-precision copy (``None`` when it has
    none) and what the copy was made from. The slot outlives the copy: an optimizer's
    step drops the copy and keeps the slot (with its weak reference), so the next
    forward refills it instead of making both again."""

    __slots__ = ("dtype", "forward", "has_graph", "low", "ptr", "ref", "stepped",
                 "version")

    def __init__(self, ref: weakref.ref[torch.Tensor]) -> None:
        self.ref = ref
        self.low: torch.Tensor | None = None
        self.dtype: torch.dtype | None = None
        self.version = -1
        self.ptr = -1
        self.forward = -1
        self.has_graph = False
        # some torch.optim.Optimizer has stepped the parameter: its changes are
        # announced by the step post-hook, so its copy may outlive one forward pass
        self.stepped = False


class _ById:
    """Parameter -> :class:`_Entry`, keyed by tensor identity, dropping an entry when
    its tensor dies.

    ``WeakIdKeyDictionary`` makes a weak reference object for every lookup; this runs
    for every parameter in every forward, so the lookup here is a plain ``dict`` keyed
    by ``id()``, the tensor's weak reference kept in the entry (checked on each read:
    an id reused by a new tensor is not a hit) and its callback removing the entry."""

    __slots__ = ("data",)

    def __init__(self) -> None:
        self.data: dict[int, _Entry] = {}

    def get(self, key: torch.Tensor) -> _Entry | None:
        found = self.data.get(id(key))
        return found if found is not None and found.ref() is key else None

    def slot(self, key: torch.Tensor) -> _Entry:
        """``key``'s entry, made (empty) when it has none."""
        found = self.data.get(id(key))
        if found is not None and found.ref() is key:
            return found
        ident = id(key)
        data = self.data

        def drop(ref: Any, ident: int = ident, data: dict[int, _Entry] = data) -> None:
            found = data.get(ident)
            if found is not None and found.ref is ref:
                del data[ident]

        entry = data[ident] = _Entry(weakref.ref(key, drop))
        return entry

    def values(self) -> list[_Entry]:
        return list(self.data.values())


# parameter -> _Entry (by identity: a parameter that is gone takes its entry with it)
_CACHE = _ById()
_CACHE_DATA = _CACHE.data
_LOCK = threading.Lock()
_forwards = itertools.count(1)
# parameters whose copy was made in the current pass and that no optimizer has stepped
# (see end_forward_pass)
_pass_only: list[_Entry] = []
_current_forward = 0
_hook_handle: Any = None
# parameter -> (weakref to the module that holds it, its name there), for every
# parameter cast on use: to tell an optimizer built over parameters that FSDP2 has since
# replaced (see _check_not_replaced)
_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()
_CHECKED: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
# The instance attribute install() sets: (the CastParametersOnUse, the ids of its
# forward pre-hook and forward hook on the module).
CAST_HOOKS = "_ampkit_cast_on_use"


def new_forward_pass() -> None:
    """Start a new forward pass of a converted model: copies made in earlier passes are
    reused only where a gradient is being accumulated (see the module doc).

    Example:
        >>> from ampkit.parameter_casts import new_forward_pass
        >>> new_forward_pass()
    """
    global _current_forward
    _current_forward = next(_forwards)


def end_forward_pass() -> None:
    """End a converted model's forward pass: drop the copies of parameters no torch
    optimizer steps, which no later pass may reuse. (A copy that requires grad holds
    its parameter through its autograd node, so a cache entry kept longer would keep a
    discarded model's parameters alive.) Copies of stepped parameters stay until the
    optimizer's step, for the micro-batches of gradient accumulation.

    Example:
        >>> from ampkit.parameter_casts import cached_casts, end_forward_pass
        >>> end_forward_pass()
        >>> cached_casts() >= 0
        True
    """
    with _LOCK:
        while _pass_only:
            entry = _pass_only.pop()
            if not entry.stepped:
                entry.low = None


def forget_casts(params: Any = None) -> None:
    """Drop the cached copies of ``params`` (an iterable of tensors), or of every
    parameter when ``None``.

    Example:
        >>> import torch
        >>> from ampkit.parameter_casts import cached_casts, forget_casts
        >>> forget_casts()
        >>> cached_casts()
        0
    """
    with _LOCK:
        if params is None:
            for entry in _CACHE.values():
                entry.low = None
            return
        for p in params:
            found = _CACHE.get(p)
            if found is not None:
                found.low = None


def cached_casts() -> int:
    """How many parameters have a cached low-precision copy right now.

    Example:
        >>> from ampkit.parameter_casts import cached_casts
        >>> cached_casts() >= 0
        True
    """
    return sum(entry.low is not None for entry in _CACHE.values())


def is_cached(param: torch.Tensor) -> bool:
    """True when ``param`` has a cached low-precision copy right now.

    Example:
        >>> import torch
        >>> from ampkit.parameter_casts import is_cached
        >>> is_cached(torch.nn.Parameter(torch.ones(1)))
        False
    """
    entry = _CACHE.get(param)
    return entry is not None and entry.low is not None


def _forget_stepped(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    # A global optimizer step post-hook: the stepped parameters changed, and holding
    # their copies until the next forward would cost memory between steps.
    # The slot stays (see _Entry): only the copy goes.
    data = _CACHE_DATA
    with _LOCK:
        for group in optimizer.param_groups:
            for p in group["params"]:
                entry = data.get(id(p))
                if entry is None or entry.ref() is not p:
                    entry = _CACHE.slot(p)
                entry.low = None
                entry.stepped = True


def _is_sharded(t: Any) -> bool:
    return hasattr(t, "placements") and hasattr(t, "device_mesh")  # a DTensor


def _check_not_replaced(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    # A global optimizer step pre-hook, checking each optimizer once, at its first step.
    # fully_shard replaces every parameter of the model with a sharded DTensor one; an
    # optimizer built before it steps the old tensors, which no longer receive gradients:
    # training would change nothing, with no error.
    if optimizer in _CHECKED:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            owner = _OWNERS.get(p)
            module = None if owner is None else owner[0]()
            if module is None or _is_sharded(p):
                continue
            now = module._parameters.get(owner[1])
            if now is not None and now is not p and _is_sharded(now):
                raise RuntimeError(
                    f"this optimizer steps a parameter ({type(module).__name__}."
                    f"{owner[1]}) that the model no longer holds: fully_shard replaced "
                    f"it with a sharded DTensor parameter after the optimizer was built, "
                    f"so its steps would change nothing the model uses. Build the "
                    f"optimizer after sharding, over model.parameters()")
    _CHECKED.add(optimizer)


def _ensure_step_hook() -> None:
    global _hook_handle
    if _hook_handle is None:
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        register_optimizer_step_pre_hook(_check_not_replaced)
        _hook_handle = register_optimizer_step_post_hook(_forget_stepped)


def cast_parameter(param: torch.Tensor, dtype: torch.dtype, *, cache: bool = True
                   ) -> torch.Tensor:
    """``param.to(dtype)``, shared with earlier uses while it is still the parameter's
    value rounded (see the module doc); ``cache=False``: a fresh copy, not kept.

    Example:
        >>> import torch
        >>> from ampkit.parameter_casts import cast_parameter, new_forward_pass
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> new_forward_pass()
        >>> cast_parameter(w, torch.float16) is cast_parameter(w, torch.float16)
        True
    """
    if not cache or torch.compiler.is_compiling() or torch.is_inference_mode_enabled():
        return param.to(dtype)
    return _cached_cast(param, dtype, torch.is_grad_enabled())


# The same cast as param.to(dtype) (a differentiable copy), with less of ``Tensor.to``'s
# overload resolution among its signatures: about 1 us less per cast of a small
# parameter (measured on a 16x16 weight, CPU).
_CASTS: dict[torch.dtype, Any] = {torch.bfloat16: torch.Tensor.bfloat16,
                                  torch.float16: torch.Tensor.half}


def _cached_cast(param: torch.Tensor, dtype: torch.dtype, grad_mode: bool) -> torch.Tensor:
    # Runs for every parameter in every forward: the checks inline, the slot's
    # attributes read once.
    entry = _CACHE_DATA.get(id(param))
    if entry is None or entry.ref() is not param:
        entry = _CACHE.slot(param)
    else:
        low = entry.low
        if (low is not None and entry.dtype is dtype and entry.version == param._version
                and entry.ptr == param.data_ptr()
                # Across forward passes only for parameters a torch optimizer steps:
                # its step (the hook) or an in-place change (the version) ends the
                # copy's life.
                and (entry.forward == _current_forward or entry.stepped)
                # A copy made under no_grad has no history for this graph's backward.
                and (entry.has_graph or not grad_mode or not param.requires_grad)):
            return low
    cast = _CASTS.get(dtype)
    low = cast(param) if cast is not None else param.to(dtype=dtype)
    entry.low = low
    entry.dtype = dtype
    entry.version = param._version
    entry.ptr = param.data_ptr()
    entry.forward = _current_forward
    entry.has_graph = low.requires_grad
    if not entry.stepped:
        _pass_only.append(entry)
    return low


class CastParametersOnUse:
    """Forward hooks that run a module with low-precision copies of its own floating
    fp32 parameters (those in ``module._parameters``; children get hooks of their own).
    Holds no reference to the module, so ``copy.deepcopy`` and ``torch.save`` of the
    model carry working hooks.

    Example:
        >>> import torch
        >>> from ampkit.parameter_casts import CastParametersOnUse
        >>> emb = torch.nn.Embedding(4, 2)
        >>> CastParametersOnUse(torch.float16).install(emb)
        >>> emb(torch.tensor([1])).dtype, emb.weight.dtype
        (torch.float16, torch.float32)
    """

    __slots__ = ("dtype",)

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __getstate__(self) -> dict[str, Any]:
        return {"dtype": self.dtype}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.dtype = state["dtype"]

    def swap_in(self, module: nn.Module, swapped: list[tuple[str, torch.Tensor]]) -> None:
        """Put low-precision copies of ``module``'s floating fp32 parameters in its
        ``_parameters``, appending ``(name, fp32 parameter)`` to ``swapped`` as each one
        goes in (so that a failure half-way leaves ``swapped`` naming what to put back:
        :func:`restore_swapped`).

        Example:
            >>> import torch
            >>> from ampkit.parameter_casts import CastParametersOnUse, restore_swapped
            >>> lin, swapped = torch.nn.Linear(2, 2), []
            >>> CastParametersOnUse(torch.float16).swap_in(lin, swapped)
            >>> lin.weight.dtype, [name for name, _ in swapped]
            (torch.float16, ['weight', 'bias'])
            >>> restore_swapped(lin, swapped)
            >>> lin.weight.dtype
            torch.float32
        """
        swap_params(module, swapped, self.dtype, torch.compiler.is_compiling())

    def before(self, module: nn.Module, args: Any) -> None:
        swapped: list[tuple[str, torch.Tensor]] = []
        # On the stack first: whatever got swapped before a failure is put back.
        _swaps.stack.append((module, swapped))
        self.swap_in(module, swapped)

    def after(self, module: nn.Module, args: Any, output: Any) -> None:
        # always_call: runs when the forward raised too, so parameters always come back.
        restore_until(module)

    def install(self, module: nn.Module) -> None:
        _ensure_step_hook()
        for name, p in module._parameters.items():
            if p is not None and p.is_floating_point():
                _OWNERS.setdefault(p, (weakref.ref(module), name))
        before = module.register_forward_pre_hook(self.before, prepend=True)
        after = module.register_forward_hook(self.after, always_call=True)
        # What a module's own __call__ may do instead of the hooks while they are the
        # only ones it has (see ampkit.conversion's _cast_call).
        object.__setattr__(module, CAST_HOOKS, (self, before.id, after.id))


def swap_params(module: nn.Module, swapped: list[tuple[str, torch.Tensor]],
                dtype: torch.dtype, compiling: bool) -> None:
    """:meth:`CastParametersOnUse.swap_in` with its settings given (``compiling``:
    :func:`torch.compiler.is_compiling`, which a caller may know already).

    Example:
        >>> import torch
        >>> from ampkit.parameter_casts import restore_swapped, swap_params
        >>> lin, swapped = torch.nn.Linear(2, 2), []
        >>> swap_params(lin, swapped, torch.bfloat16, compiling=False)
        >>> lin.bias.dtype
        torch.bfloat16
        >>> restore_swapped(lin, swapped)
    """
    # Any: the low-precision copies put here are plain tensors, not Parameters.
    params: dict[str, Any] = module._parameters
    # A module FSDP2 manages holds, during its forward, the unsharded parameters FSDP
    # all-gathered (fp32 when its policy has no param_dtype) and frees after it: a
    # copy kept past this forward would keep alive a whole layer FSDP has just freed,
    # and its optimizer steps the shards, never these tensors. (FSDP2 sets the flag as
    # a plain instance attribute: a dict lookup, not Module.__getattr__'s miss path.)
    cache = not (compiling or module.__dict__.get("_is_fsdp_managed_module", False)
                 or torch.is_inference_mode_enabled())
    grad_mode = torch.is_grad_enabled()
    append = swapped.append
    for name, p in params.items():
        if p is not None and p.dtype is torch.float32:
            # Straight into the dict: the copy is not an nn.Parameter, and
            # Module.__setattr__ would refuse it. (cast_parameter, with the per-call
            # checks made once per module.)
            params[name] = _cached_cast(p, dtype, grad_mode) if cache else p.to(dtype)
            append((name, p))


class _Swaps(threading.local):
    def __init__(self) -> None:
        # (module, [(name, fp32 parameter)]) for every module whose forward is running
        self.stack: list[tuple[nn.Module, list[tuple[str, torch.Tensor]]]] = []


_swaps = _Swaps()


def _eager_when_a_frame() -> None:
    # The hooks of a model's own parameters run outside the graph under
    # torch.compile(model) (torch runs the model's hooks, then compiles its forward):
    # plain Python there, rather than graphs of their own; traced where compiled code
    # calls the module.
    for hook in (CastParametersOnUse.before, CastParametersOnUse.after,
                 CastParametersOnUse.swap_in, swap_params):
        skip_recursively(hook.__code__)


_eager_when_a_frame()


def restore_swapped(module: nn.Module, swapped: list[tuple[str, torch.Tensor]]) -> None:
    """Put back the fp32 parameters :meth:`CastParametersOnUse.swap_in` swapped out of
    ``module``.

    Example:
        >>> import torch
        >>> from ampkit.parameter_casts import restore_swapped
        >>> restore_swapped(torch.nn.Linear(1, 1), [])
    """
    params: dict[str, Any] = module._parameters
    for name, p in swapped:
        params[name] = p


def restore_until(module: nn.Module | None) -> None:
    """Put the fp32 parameters back in every module swapped since ``module``'s forward
    began, ``module``'s own included (``None``: every module of this thread).

    Example:
        >>> from ampkit.parameter_casts import restore_until
        >>> restore_until(None)
    """
    stack = _swaps.stack
    if stack and stack[-1][0] is module:  # the usual case: its own swap, innermost
        restore_swapped(module, stack.pop()[1])
        return
    if module is not None and not any(m is module for m, _ in stack):
        return
    while stack:
        owner, swapped = stack.pop()
        restore_swapped(owner, swapped)
        if owner is module:
            return


def restore_to(depth: int) -> None:
    """Put the fp32 parameters back in every module of this thread swapped since
    :func:`swap_depth` was ``depth`` (the model's boundary calls this on its way out,
    whatever ended the forward: forward post-hooks do not run on a
    ``KeyboardInterrupt``).

    Example:
        >>> from ampkit.parameter_casts import restore_to, swap_depth
        >>> restore_to(swap_depth())
    """
    stack = _swaps.stack
    while len(stack) > depth:
        owner, swapped = stack.pop()
        restore_swapped(owner, swapped)


def swap_depth() -> int:
    """How many module forwards of this thread run with swapped parameters right now.

    Example:
        >>> from ampkit.parameter_casts import swap_depth
        >>> swap_depth()
        0
    """
    return len(_swaps.stack)
