"""Parameters cast on use: the low-precision copies O2 computes with.

At O2 the fp32 parameters are the truth. They stay the module's own ``nn.Parameter``
objects, which the user's optimizer steps, DDP and FSDP2 reduce and shard, and
``state_dict`` saves. While a module runs its forward, each of its floating fp32
parameters is replaced by a low-precision copy (``param.to(dtype)``, differentiable,
so the gradient reaches the fp32 ``.grad`` through autograd and accumulates there in
fp32); the forward's end puts the parameter back. This is what FSDP2's
``MixedPrecisionPolicy(param_dtype=...)`` and MindSpore's O2 do ("parameters are
converted to low precision on use, results converted back").

**A copy lives for one forward of the converted model**: the outermost call of a
converted model on this thread, as native autocast's weight cache lives for its
outermost region. Within it, a weight used twice (tied weights, a layer called twice)
is cast once and both uses share one autograd node. When the outermost call returns,
every copy it made is dropped, so the next forward casts each parameter again from
whatever the parameter holds then. No change made between two forwards can be missed,
whatever its route: the optimizer's step, an in-place edit through ``param.data``
(which bumps no version counter), ``param.data = t`` (even a tensor at the same
address), an edit of a base tensor that parameters view (``vector_to_parameters``),
``load_state_dict``, a perturbation between the two forwards of one step (SAM). Each
micro-batch of gradient accumulation is a forward of its own, so it casts each weight
once, as native autocast does. Nothing is held between forwards.

These copies and the autocast engine's (:class:`ampkit.engine.casting.WeightCastCache`, kept
for one outermost region) follow one rule, :func:`ampkit.engine.casting.copy_serves`, in two
stores, one per kind of pass; the module doc of :mod:`ampkit.engine.casting` says why two.

The one opt-in exception is :func:`reuse_casts`: a block that spans several forwards
(the micro-batches of one optimizer step) is one pass, so each weight is cast once for
the whole block. Its contract: nothing changes a parameter inside the block (the
optimizer steps after it), because a change there is not seen until the block ends.

A copy made under ``no_grad`` has no autograd history and is not reused by a use in the
same forward that builds a graph. A module called outside any converted model's forward
(a submodule called on its own, a checkpointed block recomputed in the backward pass)
casts on each call (but an O2 module called on its own with fp32 inputs, outside any
autocast region, computes in fp32 from its parameters: :func:`called_on_its_own`), and
so does a forward under ``inference_mode``, under ``torch.compile`` (the graph casts the
weights itself) or in a module FSDP2 manages (its parameters in a forward are the
unsharded ones FSDP frees after it; with :mod:`ampkit.fsdp`'s policy they arrive in low
precision already, leaving nothing to cast).

An optimizer built over the parameters before FSDP2's ``fully_shard`` replaced them
with sharded ones would step tensors the model no longer uses: its first step raises
``RuntimeError`` instead (build the optimizer after sharding;
:mod:`ampkit.conversion.parameter_owners`).

Example:
    >>> import torch
    >>> from ampkit.conversion.parameter_casts import CastParametersOnUse
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

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

from ampkit import torch_internals
from ampkit.common.compile_frames import skip_recursively
from ampkit.common.containers import iter_tensors
from ampkit.conversion.parameter_owners import record_owners
from ampkit.engine.casting import copy_serves

__all__ = ["CastParametersOnUse", "cached_casts", "called_on_its_own", "cast_parameter",
           "casting_on_use", "check_copies_unedited", "copies_held", "true_parameter",
           "keep_cast_last", "truth_in_state_dict",
           "own_cast_hooks", "reuse_casts", "truth_of",
           "end_forward_pass", "forget_casts", "is_cached", "new_forward_pass",
           "restore_swapped", "restore_to", "restore_until", "swap_depth",
           "swap_params"]


class _Pass(threading.local):
    """This thread's forward of a converted model: how deep in nested converted
    forwards it is, and the copies made since the outermost one began
    (``id(parameter) -> (parameter, copy)``; ``None`` outside any forward). The
    parameter is held beside its copy, so its id cannot be reused while the entry
    lives."""

    def __init__(self) -> None:
        self.depth = 0
        self.copies: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None


_pass = _Pass()
_LOW = (torch.float16, torch.bfloat16)
#: What a module's swap records, one entry per parameter swapped out: its name, the fp32
#: parameter, and the version of the copy put in its place (``-1``: not checked).
Swapped = list[tuple[str, torch.Tensor, int]]
# The instance attribute install() sets: (the CastParametersOnUse, the ids of its
# forward pre-hook and forward hook on the module); read by own_cast_hooks.
_CAST_HOOKS = "_ampkit_cast_on_use"


def new_forward_pass() -> None:
    """Enter a converted model's forward on this thread (the model's boundary calls
    it): the outermost one starts a new set of copies, which every module of the
    forward shares. Each call is paired with :func:`end_forward_pass`.

    Example:
        >>> from ampkit.conversion.parameter_casts import cached_casts, end_forward_pass
        >>> from ampkit.conversion.parameter_casts import new_forward_pass
        >>> new_forward_pass()
        >>> cached_casts()
        0
        >>> end_forward_pass()
    """
    state = _pass
    if state.depth == 0:
        state.copies = {}
    state.depth += 1


def end_forward_pass() -> None:
    """Leave a converted model's forward on this thread: when it is the outermost one,
    every copy it made is dropped (the next forward casts again from the parameters as
    they are then).

    Example:
        >>> from ampkit.conversion.parameter_casts import cached_casts, end_forward_pass
        >>> end_forward_pass()
        >>> cached_casts()
        0
    """
    state = _pass
    if state.depth > 0:
        state.depth -= 1
    if state.depth == 0:
        state.copies = None


@contextlib.contextmanager
def reuse_casts() -> Iterator[None]:
    """Keep O2's low-precision copies across the forwards run inside the block (this
    thread's), instead of one forward each: for gradient accumulation, where every
    micro-batch's forward would cast every weight again. The block is one pass of the
    cast cache, as an outer ``torch.autocast`` region is one lifetime of native
    autocast's weight cache; its end drops every copy.

    **Contract**: no parameter changes inside the block. Run the optimizer's step, and
    any edit of a parameter (``.data``, ``load_state_dict``, a SAM perturbation, an
    EMA swap), outside it: a change inside is not seen by later forwards of the block.
    A copy made under ``no_grad`` is still not used where a graph is built.

    Example:
        >>> import torch
        >>> import ampkit
        >>> from ampkit.conversion.parameter_casts import reuse_casts
        >>> model = ampkit.initialize(torch.nn.Linear(4, 2), level="O2", dtype="bfloat16")
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> with reuse_casts():                  # one cast per weight for both
        ...     for micro_batch in torch.rand(2, 3, 4):
        ...         model(micro_batch).sum().backward()
        >>> opt.step()                           # outside the block
    """
    new_forward_pass()
    try:
        yield
    finally:
        end_forward_pass()


def forget_casts(params: Any = None) -> None:
    """Drop the copies the current forward (this thread's) holds of ``params`` (an
    iterable of tensors), or every copy when ``None``: for a parameter changed in the
    middle of a forward, whose later uses in that forward must see the change.

    Example:
        >>> import torch
        >>> from ampkit.conversion.parameter_casts import cached_casts, forget_casts
        >>> forget_casts()
        >>> cached_casts()
        0
    """
    copies = _pass.copies
    if not copies:
        return
    if params is None:
        copies.clear()
        return
    for p in params:
        found = copies.get(id(p))
        if found is not None and found[0] is p:
            del copies[id(p)]


def cached_casts() -> int:
    """How many parameters have a low-precision copy in this thread's current forward
    (0 outside any converted model's forward).

    Example:
        >>> from ampkit.conversion.parameter_casts import cached_casts
        >>> cached_casts()
        0
    """
    copies = _pass.copies
    return 0 if copies is None else len(copies)


def is_cached(param: torch.Tensor) -> bool:
    """True when ``param`` has a low-precision copy in this thread's current forward.

    Example:
        >>> import torch
        >>> from ampkit.conversion.parameter_casts import is_cached
        >>> is_cached(torch.nn.Parameter(torch.ones(1)))
        False
    """
    copies = _pass.copies
    found = None if copies is None else copies.get(id(param))
    return found is not None and found[0] is param


def casting_on_use() -> bool:
    """True while this thread runs a converted model's forward, or the forward of a
    module cast on use through its hooks (a submodule called on its own): where a
    parameter's value is being used, so a value computed from parameters (a
    parametrization's result) is cast on use too.

    Example:
        >>> from ampkit.conversion.parameter_casts import casting_on_use
        >>> casting_on_use()
        False
    """
    return _pass.depth > 0 or bool(_swaps.stack)


def cast_parameter(param: torch.Tensor, dtype: torch.dtype, *, cache: bool = True
                   ) -> torch.Tensor:
    """``param.to(dtype)``, shared with earlier uses in the same forward of a converted
    model (see the module doc); ``cache=False``, or outside any such forward: a fresh
    copy, not kept.

    Example:
        >>> import torch
        >>> from ampkit.conversion.parameter_casts import cast_parameter, end_forward_pass
        >>> from ampkit.conversion.parameter_casts import new_forward_pass
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> new_forward_pass()
        >>> cast_parameter(w, torch.float16) is cast_parameter(w, torch.float16)
        True
        >>> end_forward_pass()
        >>> cast_parameter(w, torch.float16) is cast_parameter(w, torch.float16)
        False
    """
    copies = _pass.copies
    if (not cache or copies is None or torch_internals.compiling_here()
            or torch.is_inference_mode_enabled()):
        return param.to(dtype)
    return _cached_cast(param, dtype, torch.is_grad_enabled(), copies)


# The same cast as param.to(dtype) (a differentiable copy), with less of ``Tensor.to``'s
# overload resolution among its signatures: about 1 us less per cast of a small
# parameter (measured on a 16x16 weight, CPU).
_CASTS: dict[torch.dtype, Any] = {torch.bfloat16: torch.Tensor.bfloat16,
                                  torch.float16: torch.Tensor.half}


def _cached_cast(param: torch.Tensor, dtype: torch.dtype, grad_mode: bool,
                 copies: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    # Runs for every parameter in every forward: one lookup, two checks.
    hit = copies.get(id(param))
    if hit is not None:
        low = hit[1]
        # (hit[0] is param: the entry holds its parameter, so the id is not reused.)
        # A copy made under no_grad has no history for this graph's backward.
        if copy_serves(low, dtype, param, grad_mode):
            return low
    cast = _CASTS.get(dtype)
    low = cast(param) if cast is not None else param.to(dtype=dtype)
    copies[id(param)] = (param, low)
    return low


class CastParametersOnUse:
    """Forward hooks that run a module with low-precision copies of its own floating
    fp32 parameters (those in ``module._parameters``; children get hooks of their own).
    Holds no reference to the module, so ``copy.deepcopy`` and ``torch.save`` of the
    model carry working hooks.

    Example:
        >>> import torch
        >>> from ampkit.conversion.parameter_casts import CastParametersOnUse
        >>> emb = torch.nn.Embedding(4, 2)
        >>> CastParametersOnUse(torch.float16).install(emb)
        >>> emb(torch.tensor([1])).dtype, emb.weight.dtype
        (torch.float16, torch.float32)
    """

    __slots__ = ("bare_fp32", "dtype", "keep")

    def __init__(self, dtype: torch.dtype, *, keep: frozenset[str] = frozenset(),
                 bare_fp32: bool = False) -> None:
        self.dtype = dtype
        # names of parameters left as they are (a legacy spectral_norm/weight_norm
        # hook computes the weight from them, in fp32: see ampkit.conversion)
        self.keep = keep
        # True: called on its own with no low-precision input (see swap_params), the
        # module computes from its fp32 parameters, in fp32 (O2, where the parameters
        # are the fp32 truth)
        self.bare_fp32 = bare_fp32

    def __getstate__(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "keep": self.keep, "bare_fp32": self.bare_fp32}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.dtype = state["dtype"]
        self.keep = state.get("keep", frozenset())
        self.bare_fp32 = state.get("bare_fp32", False)

    def swap_in(self, module: nn.Module, swapped: Swapped, inputs: Any = None) -> None:
        """Put low-precision copies of ``module``'s floating fp32 parameters in its
        ``_parameters``, appending ``(name, fp32 parameter)`` to ``swapped`` as each one
        goes in (so that a failure half-way leaves ``swapped`` naming what to put back:
        :func:`restore_swapped`).

        Example:
            >>> import torch
            >>> from ampkit.conversion.parameter_casts import CastParametersOnUse, restore_swapped
            >>> lin, swapped = torch.nn.Linear(2, 2), []
            >>> CastParametersOnUse(torch.float16).swap_in(lin, swapped)
            >>> lin.weight.dtype, [name for name, _, _ in swapped]
            (torch.float16, ['weight', 'bias'])
            >>> restore_swapped(lin, swapped)
            >>> lin.weight.dtype
            torch.float32
        """
        swap_params(module, swapped, self.dtype, torch_internals.compiling_here(), self.keep,
                    self.bare_fp32, inputs)

    def before(self, module: nn.Module, args: Any) -> None:
        swapped: Swapped = []
        # On the stack first: whatever got swapped before a failure is put back.
        _swaps.stack.append((module, swapped))
        self.swap_in(module, swapped, args)

    def before_renorming(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        """:meth:`before` for an ``nn.Embedding``/``nn.EmbeddingBag``: with ``max_norm``
        set, its forward renormalises the rows it looks up, in place. That edit is
        made here, on the fp32 weight, before the cast (as fp32 training makes it, with
        the same kernel), so the truth the optimizer steps is renormalised and the copy
        is made from it; the forward's own renormalisation then meets rows already
        within ``max_norm`` (up to the copy's rounding, which it may trim: the only
        edit of a copy that is not checked).

        Example:
            >>> import torch
            >>> from ampkit.conversion.parameter_casts import CastParametersOnUse
            >>> emb = torch.nn.Embedding(4, 2, max_norm=1.0)
            >>> CastParametersOnUse(torch.bfloat16).install(emb)
            >>> _ = emb(torch.tensor([1]))
            >>> emb.weight.dtype, emb.weight[1].norm().item() <= 1.0
            (torch.float32, True)
        """
        max_norm = module.__dict__.get("max_norm")
        weight = torch_internals.module_parameters(module).get("weight")
        if (max_norm is not None and weight is not None and weight.dtype is torch.float32
                and "weight" not in self.keep):
            indices = args[0] if args else kwargs.get("input")
            if isinstance(indices, torch.Tensor):
                with torch.no_grad():
                    torch.embedding_renorm_(weight.detach(), indices.contiguous(),
                                            max_norm, module.__dict__.get("norm_type", 2.0))
                forget_casts((weight,))  # a use earlier in this forward saw the old rows
        swapped: Swapped = []
        _swaps.stack.append((module, swapped))
        self.swap_in(module, swapped, (args, kwargs))
        if max_norm is not None:
            for i, (name, p, _) in enumerate(swapped):
                if name == "weight":
                    swapped[i] = (name, p, -1)

    def after(self, module: nn.Module, args: Any, output: Any) -> None:
        # always_call: runs when the forward raised too, so parameters always come back.
        restore_until(module)

    def install(self, module: nn.Module) -> None:
        # where its parameters sit: an optimizer built before FSDP2 replaced them is
        # refused (a model's conversion records them again under the model's names)
        record_owners(module, keep_existing=True, recurse=False)
        # The cast is the last of the module's forward pre-hooks (and stays last: see
        # keep_cast_last), as late as it can be: a user's pre-hook sees the fp32
        # parameters, as in fp32 training, and what it edits is the truth.
        renorms = isinstance(module, nn.Embedding | nn.EmbeddingBag)
        before = (module.register_forward_pre_hook(self.before_renorming, with_kwargs=True)
                  if renorms else module.register_forward_pre_hook(self.before))
        after = module.register_forward_hook(self.after, always_call=True)
        # What a module's own __call__ may do instead of the hooks while they are the
        # only ones it has (own_cast_hooks; ampkit.conversion.classes.cast_call); not an
        # embedding's, whose hook does more.
        object.__setattr__(module, _CAST_HOOKS, (self, before.id, after.id, not renorms))
        # (first of its state_dict post-hooks: one that reports another dtype sees the
        # truth)
        module.register_state_dict_pre_hook(_state_dict_begins)
        module.register_state_dict_post_hook(truth_in_state_dict)
        # load_state_dict waits for a forward another thread runs in the module, and
        # holds it while loading: the values land in the fp32 parameters
        module.register_load_state_dict_pre_hook(_load_begins)
        module.register_load_state_dict_post_hook(_load_ends)


def own_cast_hooks(module: nn.Module) -> CastParametersOnUse | None:
    """The :class:`CastParametersOnUse` installed on ``module`` when its pair of hooks
    are the only forward hooks the module has, else ``None``. Then a module's own call
    may do their work itself around ``module.forward`` (:func:`swap_params` with the
    returned settings, the forward, :func:`restore_swapped` in a ``finally``), as
    O2's fast call does, instead of ``nn.Module``'s hook path; with any other forward
    hook, the hooks must run in their order among the others.

    Example:
        >>> import torch
        >>> from ampkit.conversion.parameter_casts import CastParametersOnUse, own_cast_hooks
        >>> lin = torch.nn.Linear(2, 2)
        >>> CastParametersOnUse(torch.bfloat16).install(lin)
        >>> own_cast_hooks(lin).dtype
        torch.bfloat16
        >>> _ = lin.register_forward_hook(lambda *args: None)
        >>> own_cast_hooks(lin) is None
        True
    """
    own = module.__dict__.get(_CAST_HOOKS)
    # (own[-1]: True where the fast call may stand in; an older pickle has no flag)
    pre, post = torch_internals.forward_pre_hooks(module), torch_internals.forward_hooks(module)
    if (own is None or own[-1] is not True or len(pre) != 1 or len(post) != 1
            or own[1] not in pre or own[2] not in post):
        return None
    cast: CastParametersOnUse = own[0]
    return cast


def swap_params(module: nn.Module, swapped: Swapped,
                dtype: torch.dtype, compiling: bool, keep: frozenset[str] = frozenset(),
                bare_fp32: bool = False, inputs: Any = None) -> None:
    """:meth:`CastParametersOnUse.swap_in` with its settings given (``compiling``:
    :func:`torch.compiler.is_compiling`, which a caller may know already; ``keep``:
    names of parameters left as they are; ``bare_fp32``: swap nothing where
    :func:`called_on_its_own` says so for the module's ``inputs``, so that it computes
    in fp32 from its fp32 parameters, as before the conversion).

    Example:
        >>> import torch
        >>> from ampkit.conversion.parameter_casts import restore_swapped, swap_params
        >>> lin, swapped = torch.nn.Linear(2, 2), []
        >>> swap_params(lin, swapped, torch.bfloat16, compiling=False)
        >>> lin.bias.dtype
        torch.bfloat16
        >>> restore_swapped(lin, swapped)
    """
    # Any: the low-precision copies put here are plain tensors, not Parameters.
    params: dict[str, Any] = torch_internals.module_parameters(module)
    if bare_fp32 and not compiling and _pass.depth == 0 and not _region_on(params) and (
            not _has_low(inputs)):
        return  # (called_on_its_own, for the device of the module's parameters)
    # A module FSDP2 manages holds, during its forward, the unsharded parameters FSDP
    # all-gathered (fp32 when its policy has no param_dtype) and frees after it: a
    # copy kept to the end of the model's forward would keep alive a whole layer FSDP
    # has just freed. (FSDP2 sets the flag as a plain instance attribute: a dict
    # lookup, not Module.__getattr__'s miss path.) No copies outside a converted
    # model's forward either: a fresh one each call.
    copies = _pass.copies
    # Versions are checked in eager autograd-tracking mode only: an inference tensor
    # has no version counter, and a graph being traced has no eager copy to check.
    # (compiling first: dynamo cannot trace is_inference_mode_enabled)
    unchecked = compiling or torch.is_inference_mode_enabled()
    if copies is not None and (unchecked or module.__dict__.get(
            "_is_fsdp_managed_module", False)):
        copies = None
    if not compiling:
        _hold(module, swapped)
    grad_mode = torch.is_grad_enabled()
    append = swapped.append
    for name, p in params.items():
        if p is not None and p.dtype is torch.float32 and not (keep and name in keep):
            # Straight into the dict: the copy is not an nn.Parameter, and
            # Module.__setattr__ would refuse it. (cast_parameter, with the per-call
            # checks made once per module.)
            low = (p.to(dtype) if copies is None
                   else _cached_cast(p, dtype, grad_mode, copies))
            # (its version now: restore_swapped tells an in-place edit made during the
            # forward, which would otherwise land on the copy and never reach p;
            # recorded before the copy goes in, so that a reader on another thread
            # that finds the copy in _parameters finds its parameter in the record)
            append((name, p, -1 if unchecked else torch_internals.tensor_version(low)))
            params[name] = low


# The instance attribute that says which thread's forward holds a module's copies in
# its _parameters right now: (thread ident, that forward's Swapped list, the thread's
# _ThreadToken). The token, not the ident, says whose mark it is: an ident is reused
# once its thread has exited, a token dies with its thread.
_HELD = "_ampkit_held_by"


class _ThreadToken:
    """One thread's identity in a hold mark: ``alive`` turns False when the thread
    exits (its thread-local state is dropped), and a copy or unpickled mark's token is
    never alive, so a mark copied with its module never makes that copy's forward wait."""

    __slots__ = ("alive",)

    def __init__(self, alive: bool = True) -> None:
        self.alive = alive

    def __reduce__(self) -> tuple[Any, ...]:
        return (_ThreadToken, (False,))


class _TokenGuard:
    """Kept in this thread's thread-local state only: freed when the thread exits,
    which marks its token dead."""

    __slots__ = ("token",)

    def __init__(self) -> None:
        self.token = _ThreadToken()

    def __del__(self) -> None:
        self.token.alive = False


class _Tokens(threading.local):
    def __init__(self) -> None:
        self.guard = _TokenGuard()
        self.token = self.guard.token


_tokens = _Tokens()


def _stale(held: tuple[Any, ...]) -> bool:
    """Whether the mark ``held`` names a thread that has exited (or came with a copy or
    a pickle of its module): nothing will release it."""
    return len(held) < 3 or not held[2].alive


def _take_over(module: nn.Module, held: tuple[Any, ...]) -> None:
    """Put back the fp32 parameters a stale mark's forward left behind its copies."""
    params: dict[str, Any] = torch_internals.module_parameters(module)
    if held[1] is not _LOADING:
        for name, p, _ in held[1]:
            if name in params and params[name] is not p:
                params[name] = p
    _held.pop(id(module), None)


def strip_hold(module: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (a copy of ``module.__dict__``, for ``copy.deepcopy`` or pickling)
    without a forward's hold mark and with the fp32 parameters in ``_parameters``
    where a forward, on any thread, has its low-precision copies in place: a copy of
    the module is the module outside forwards, whatever another thread runs now.

    Example:
        >>> import copy, torch
        >>> import ampkit
        >>> lin = ampkit.initialize(torch.nn.Linear(2, 2), level="O2", dtype="bfloat16")
        >>> copy.deepcopy(lin).weight.dtype
        torch.float32
    """
    state.pop(_HELD, None)
    params = torch_internals.state_parameters(state)
    if params is not None:
        torch_internals.set_state_parameters(
            state, {name: true_parameter(module, name) for name in list(params)})
    return state


def _hold(module: nn.Module, swapped: Swapped) -> None:
    """Mark ``module``'s ``_parameters`` as holding this thread's copies for the swap
    recorded in ``swapped``; where another thread's forward (or ``load_state_dict``)
    holds them, wait until it is done (:func:`_wait_to_hold`).

    The copies live in the module's own ``_parameters``, which every thread shares: a
    second thread's forward of the same module would compute with the first's copies
    (or put its own, made without autograd history under ``no_grad``, where the first
    one's backward needs them) and put the parameters back while the first still
    runs. (``dict.setdefault`` is one atomic step under the GIL: of two threads, one
    holds the module and the other sees it held.) A nested forward of the same module
    on the same thread swaps nothing and leaves the mark to the outer one."""
    me, token = threading.get_ident(), _tokens.token
    held = module.__dict__.setdefault(_HELD, (me, swapped, token))
    if held[1] is swapped:
        _held[id(module)] = module
    elif len(held) < 3 or held[2] is not token:
        _wait_to_hold(module, swapped, me)
    elif held[1] is _LOADING and not _loading_here():
        # (this thread's load_state_dict ended by an exception before its post-hook)
        module.__dict__[_HELD] = (me, swapped, token)
        _held[id(module)] = module


# One condition for every wait: a module's release notifies it when a thread waits.
_wait = threading.Condition(threading.Lock())
# thread ident -> the module it waits to hold (only while it waits; under _wait)
_waiting: dict[int, nn.Module] = {}
# How often a waiting thread looks again at what the holder does (a release wakes it
# at once): whether the wait could still end.
_POLL_S = 0.02
# How long a holder may stay blocked in a wait of Python's threading, queue or
# concurrent.futures (or in a backward) inside its forward before a thread waiting for
# the module is refused: the holder may be waiting for that very thread.
_BLOCKED_S = 0.5
#: The Swapped list of a mark made by ``load_state_dict`` (no copies are in place).
_LOADING: Swapped = []


def _wait_to_hold(module: nn.Module, swapped: Swapped, me: int) -> None:
    """Wait until no other thread holds ``module``, then hold it; raise
    ``RuntimeError`` instead where the wait could never end (:func:`_never_ends`)."""
    blocked_since: dict[tuple[int, int], float] = {}
    token = _tokens.token
    mine = (me, swapped, token)
    with _wait:
        _waiting[me] = module
        try:
            while True:
                held = module.__dict__.setdefault(_HELD, mine)
                if held is not mine and _stale(held):
                    # (its thread has exited, or the mark came with a copy of the
                    # module: nothing will release it; its copies go back first)
                    _take_over(module, held)
                    module.__dict__[_HELD] = held = mine
                elif held[1] is _LOADING and held[2] is not token and not _loading_in(
                        held[0]):
                    # (that thread's load_state_dict ended by an exception before its
                    # post-hook: nothing is in place, the mark is stale)
                    module.__dict__[_HELD] = held = mine
                if held is mine:
                    if swapped is not _LOADING:
                        _held[id(module)] = module
                    return
                refusal = _never_ends(module, held[0], me, blocked_since)
                if refusal is not None:
                    raise RuntimeError(refusal)
                _wait.wait(_POLL_S)
        finally:
            del _waiting[me]


_WAITS = {("threading", "wait"), ("threading", "join"), ("threading", "acquire"),
          ("threading", "_wait_for_tstate_lock"), ("queue", "get"), ("queue", "put"),
          ("_base", "result"), ("_base", "wait"), ("_base", "exception"),
          ("graph", "_engine_run_backward")}


def _blocked_in(ident: int) -> str | None:
    """What thread ``ident`` is blocked in, where its innermost Python frame is a wait
    of ``threading``, ``queue`` or ``concurrent.futures``, or autograd's run of a
    backward (a backward called inside a forward): ``"module.function"``; else None."""
    frame = sys._current_frames().get(ident)
    if frame is None:
        return None
    code = frame.f_code
    module_name = code.co_filename.rsplit("/", 1)[-1].removesuffix(".py")
    if (module_name, code.co_name) in _WAITS:
        return f"{module_name}.{code.co_name}"
    return None


def _never_ends(module: nn.Module, holder: int, me: int,
                blocked_since: dict[tuple[int, int], float]) -> str | None:
    """Why this thread's wait for ``module``, held by thread ``holder``, might never
    end, or None. Follows the chain of waits (the holder waiting for a module another
    thread holds, ...): a chain back to this thread is a deadlock; a chain ending in a
    thread blocked (for ``_BLOCKED_S``) in a wait inside its forward may be one, if
    what it waits for is this thread."""
    thread, seen = holder, set()
    while thread not in seen:
        seen.add(thread)
        waits_for = _waiting.get(thread)
        if waits_for is None:
            where = _blocked_in(thread)
            if where is None:
                blocked_since.pop((thread, 0), None)
                return None
            since = blocked_since.setdefault((thread, 0), time.monotonic())
            if time.monotonic() - since < _BLOCKED_S:
                return None
            return _wait_refused(module, holder, (
                f"thread {_thread_name(thread)} has been blocked in {where} for "
                f"{_BLOCKED_S} s while inside a forward: it may be waiting for this "
                f"thread, which would then wait for ever"))
        held = waits_for.__dict__.get(_HELD)
        if held is None or _stale(held):
            return None  # about to be released (or taken over): the waiter is woken
        if held[2] is _tokens.token:
            return _wait_refused(module, holder, (
                f"thread {_thread_name(thread)} waits for {type(waits_for).__name__!r}, "
                f"which this thread is inside: the two would wait for each other (the "
                f"modules are entered in opposite orders)"))
        thread = held[0]
    return None


def _thread_name(ident: int) -> str:
    name = next((t.name for t in threading.enumerate() if t.ident == ident), str(ident))
    return repr(name)


def _wait_refused(module: nn.Module, holder: int, why: str) -> str:
    return (
        f"two threads ran the forward of one O2-converted module at once: thread "
        f"{threading.current_thread().name!r} entered {type(module).__name__!r} while "
        f"thread {_thread_name(holder)} is inside its forward (or its load_state_dict). "
        f"At O2 a module computes with low-precision copies of its fp32 parameters, "
        f"which its forward puts in the module's own _parameters, shared by every "
        f"thread, so a second thread waits until the first is done; this wait is "
        f"refused because {why}. Retry the forward, or give each thread a converted "
        f"model of its own (serving = copy.deepcopy(model), refreshed with "
        f"serving.load_state_dict(model.state_dict()))")


# Torch 2.11's dynamo cannot trace deleting an item of a module's __dict__ (``del``,
# ``pop``: an unsupported-method graph break, an error under ``fullgraph=True``) where a
# mark set eagerly is released in compiled code; it traces ``delattr``. Elsewhere the
# item is deleted directly: ``delattr`` would run ``nn.Module.__delattr__`` (and a
# subclass's override of it) on every forward.
_DELATTR_WHEN_TRACED = tuple(map(int, torch.__version__.split(".")[:2])) < (2, 12)


def _release(module: nn.Module, swapped: Swapped) -> None:
    # Only the swap that made the mark removes it (a nested one on the same thread
    # leaves it).
    held = module.__dict__.get(_HELD)
    if held is not None and held[1] is swapped:
        _held.pop(id(module), None)
        if _DELATTR_WHEN_TRACED and torch.compiler.is_dynamo_compiling():
            delattr(module, _HELD)
        else:
            del module.__dict__[_HELD]
        # (a waiter registers before it looks at the mark: one that has not yet
        # registered will find the mark gone)
        if _waiting:
            with _wait:
                _wait.notify_all()


class _Loads(threading.local):
    def __init__(self) -> None:
        # the modules this thread's load_state_dict holds, innermost last
        self.stack: list[nn.Module] = []


_loads = _Loads()


def _loading_here() -> bool:
    """Whether this thread runs ``nn.Module.load_state_dict`` now."""
    return _loading_in(threading.get_ident())


def _loading_in(ident: int) -> bool:
    """Whether thread ``ident`` runs ``nn.Module.load_state_dict`` now."""
    frame: Any = sys._current_frames().get(ident)
    load = nn.Module.load_state_dict.__code__
    while frame is not None:
        if frame.f_code is load:
            return True
        frame = frame.f_back
    return False


def _load_begins(module: nn.Module, *args: Any) -> None:
    """``load_state_dict`` pre-hook of a module cast on use: hold the module (waiting
    for a forward another thread runs in it) until its own entries are loaded, so that
    they land in the fp32 parameters, not in a forward's low-precision copies."""
    me, token = threading.get_ident(), _tokens.token
    held = module.__dict__.setdefault(_HELD, (me, _LOADING, token))
    if held[1] is _LOADING and len(held) > 2 and held[2] is token:
        pass
    elif len(held) < 3 or held[2] is not token:
        _wait_to_hold(module, _LOADING, me)
    else:
        return  # inside this thread's own forward of the module: its rule applies
    _loads.stack.append(module)


def _load_ends(module: nn.Module, incompatible: Any) -> None:
    stack = _loads.stack
    if stack and stack[-1] is module:
        stack.pop()
        _release(module, _LOADING)


# id(module) -> module, for every module whose _parameters hold copies now, whichever
# thread's: so that a read of the parameters from anywhere (another thread's
# parameters() or state_dict()) finds the truth behind a copy. Empty outside forwards.
_held: dict[int, nn.Module] = {}


def true_parameter(module: nn.Module, name: str) -> Any:
    """The parameter ``module`` holds under ``name`` (``None`` for none), the fp32 one
    where a forward, on any thread, has a low-precision copy in its place.

    Example:
        >>> import torch
        >>> from ampkit.conversion.parameter_casts import true_parameter
        >>> lin = torch.nn.Linear(1, 1)
        >>> true_parameter(lin, "weight") is lin.weight
        True
    """
    value: Any = None
    # Twice: a forward on another thread may put its copy in, or the parameter back,
    # between the two reads (its record goes in before its copy, and comes out after
    # the parameter is back).
    for _ in range(2):
        held = module.__dict__.get(_HELD)
        if held is not None:
            for held_name, param, _ in held[1]:
                if held_name == name:
                    return param
        value = torch_internals.module_parameters(module).get(name)
        if value is None or isinstance(value, nn.Parameter):
            return value
    return truth_of(value)


def copies_held() -> bool:
    """True while any module's ``_parameters`` hold low-precision copies (a converted
    forward runs on some thread).

    Example (inside an O2 forward, the module's copies are held):
        >>> import torch
        >>> import ampkit
        >>> from ampkit.conversion.parameter_casts import copies_held
        >>> seen = []
        >>> class Probe(torch.nn.Linear):
        ...     def forward(self, x):
        ...         seen.append(copies_held())
        ...         return super().forward(x)
        >>> probe = ampkit.initialize(Probe(2, 2), level="O2", dtype="bfloat16")
        >>> _ = probe(torch.ones(1, 2))
        >>> seen
        [True]
    """
    return bool(_held)


class _KeepVars(threading.local):
    def __init__(self) -> None:
        # keep_vars of each state_dict() call running on this thread, innermost last
        self.stack: list[bool] = []


_keep_vars = _KeepVars()


def _state_dict_begins(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    _keep_vars.stack.append(keep_vars)


def truth_in_state_dict(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                        local_metadata: Any) -> None:
    """``state_dict`` post-hook of a module cast on use: where a forward, on any thread,
    holds a copy in the module's ``_parameters``, the entry is the fp32 parameter
    (detached, or the parameter itself with ``keep_vars=True``), as outside forwards.

    Example:
        >>> import torch
        >>> from ampkit.conversion.parameter_casts import truth_in_state_dict
        >>> lin = torch.nn.Linear(1, 1)
        >>> sd = lin.state_dict()
        >>> truth_in_state_dict(lin, sd, "", None)
        >>> sorted(sd)
        ['bias', 'weight']
    """
    stack = _keep_vars.stack
    keep_vars = stack.pop() if stack else False
    for name in list(torch_internals.module_parameters(module)):
        key = prefix + name
        value = state_dict.get(key)
        if value is None:
            continue
        param = true_parameter(module, name)
        if param is None or value is param or (
                value.dtype is param.dtype and value.data_ptr() == param.data_ptr()):
            continue  # the parameter, or its detached self
        state_dict[key] = param if keep_vars else param.detach()


def called_on_its_own(device_type: str, inputs: Any) -> bool:
    """Whether an O2 module (a submodule of the model, ``model.net(x)``) called with
    ``inputs`` computes in fp32 from its fp32 parameters, as before the conversion:
    outside every converted model's forward on this thread, outside any autocast
    region on ``device_type``, with no low-precision floating tensor in ``inputs``.
    Called with the level's low-precision activations, or inside a region (the
    user's ``torch.autocast`` or ``ampkit.autocast``, the one a checkpointed block's
    recomputation restores), it computes with the level's copies, as in the model.

    Example:
        >>> import torch
        >>> from ampkit.conversion.parameter_casts import called_on_its_own
        >>> called_on_its_own("cpu", (torch.ones(2),))
        True
        >>> called_on_its_own("cpu", (torch.ones(2, dtype=torch.bfloat16),))
        False
        >>> with torch.autocast("cpu", torch.bfloat16):
        ...     called_on_its_own("cpu", (torch.ones(2),))
        False
    """
    return (_pass.depth == 0 and not torch.is_autocast_enabled(device_type)
            and not _has_low(inputs))


def _has_low(inputs: Any) -> bool:
    return any(t.dtype in _LOW for t in iter_tensors(inputs))


def _region_on(params: dict[str, Any]) -> bool:
    """Whether autocast is on for the device of the first of ``params``."""
    for p in params.values():
        if p is not None:
            return torch.is_autocast_enabled(p.device.type)
    return False


class _Swaps(threading.local):
    def __init__(self) -> None:
        # (module, [(name, fp32 parameter)]) for every module whose forward is running
        self.stack: list[tuple[nn.Module, Swapped]] = []


_swaps = _Swaps()


def _eager_when_a_frame() -> None:
    # The hooks of a model's own parameters run outside the graph under
    # torch.compile(model) (torch runs the model's hooks, then compiles its forward):
    # plain Python there, rather than graphs of their own; traced where compiled code
    # calls the module.
    for hook in (CastParametersOnUse.before, CastParametersOnUse.before_renorming,
                 CastParametersOnUse.after,
                 CastParametersOnUse.swap_in, swap_params, own_cast_hooks):
        skip_recursively(hook.__code__)


_eager_when_a_frame()


def restore_swapped(module: nn.Module, swapped: Swapped, where: str = "") -> None:
    """Put back the fp32 parameters :meth:`CastParametersOnUse.swap_in` swapped out of
    ``module``; then raise ``RuntimeError`` if the forward edited a copy in place (its
    version moved and its values are no longer the cast of the parameter): the edit
    would have reached the copy only, never the truth the optimizer steps and
    ``state_dict`` saves (see :mod:`ampkit.conversion.parameter_truth`). ``where`` is the module's
    name in its model, for that error.

    Example:
        >>> import torch
        >>> from ampkit.conversion.parameter_casts import restore_swapped
        >>> restore_swapped(torch.nn.Linear(1, 1), [])
    """
    params: dict[str, Any] = torch_internals.module_parameters(module)
    edited = None
    # (traced, a copy swapped in eagerly has a symbolic version: not checked there)
    checked = not torch_internals.compiling_here()
    for name, p, version in swapped:
        low = params[name]
        params[name] = p
        if checked and version >= 0 and low is not p and (
                torch_internals.tensor_version(low) != version):
            edited = edited or []
            edited.append((name, p, low))
    if swapped and isinstance(module, nn.RNNBase):
        # An RNN's forward refreshes its ``_flat_weights`` from ``_parameters`` when
        # they changed (it then held the copies): refresh them back to the parameters,
        # or the module would keep the low-precision copies (non-leaf tensors, which
        # neither pickle nor deepcopy) past its forward.
        torch_internals.init_flat_weights(module)
    # (last: another thread may swap the module the moment the mark is gone)
    _release(module, swapped)
    if edited:
        check_copies_unedited(module, edited, where)


def restore_until(module: nn.Module | None) -> None:
    """Put the fp32 parameters back in every module swapped since ``module``'s forward
    began, ``module``'s own included (``None``: every module of this thread).

    Example:
        >>> from ampkit.conversion.parameter_casts import restore_until
        >>> restore_until(None)
    """
    stack = _swaps.stack
    if stack and stack[-1][0] is module:  # the usual case: its own swap, innermost
        restore_swapped(module, stack.pop()[1])
        return
    if module is not None and not any(m is module for m, _ in stack):
        return
    _restore_while(lambda owner: owner is module)


def _restore_while(last: Any, depth: int = 0) -> None:
    """Pop and restore the stack down to ``depth`` or through the module ``last`` says;
    every module is restored even when one raises (the first error is raised last)."""
    stack = _swaps.stack
    error: BaseException | None = None
    while len(stack) > depth:
        owner, swapped = stack.pop()
        try:
            restore_swapped(owner, swapped)
        except BaseException as e:  # (after every module is restored)
            error = error or e
        if last(owner):
            break
    if error is not None:
        raise error


def restore_to(depth: int) -> None:
    """Put the fp32 parameters back in every module of this thread swapped since
    :func:`swap_depth` was ``depth`` (the model's boundary calls this on its way out,
    whatever ended the forward: forward post-hooks do not run on a
    ``KeyboardInterrupt``).

    Example:
        >>> from ampkit.conversion.parameter_casts import restore_to, swap_depth
        >>> restore_to(swap_depth())
    """
    _restore_while(lambda owner: False, depth)


def swap_depth() -> int:
    """How many module forwards of this thread run with swapped parameters right now.

    Example:
        >>> from ampkit.conversion.parameter_casts import swap_depth
        >>> swap_depth()
        0
    """
    return len(_swaps.stack)


def check_copies_unedited(module: nn.Module,
                          edited: list[tuple[str, torch.Tensor, torch.Tensor]],
                          where: str = "") -> None:
    """Raise ``RuntimeError`` for the copies in ``edited`` (``(name, fp32 parameter,
    copy)`` whose version counter moved during ``module``'s forward) whose values are
    no longer the cast of the parameter: the edit reached the copy only
    (:mod:`ampkit.conversion.parameter_truth`). A version moved with the values unchanged (a
    kernel that rewrites a weight's storage as it was) is no edit. ``where`` is the
    module's name in its model (the conversion knows it; this layer does not), for the
    error.

    Example:
        >>> import torch
        >>> from ampkit.conversion.parameter_casts import check_copies_unedited
        >>> lin = torch.nn.Linear(2, 2)
        >>> copy = lin.weight.detach().to(torch.bfloat16)
        >>> check_copies_unedited(lin, [("weight", lin.weight, copy)])
        >>> _ = copy.mul_(2)
        >>> check_copies_unedited(lin, [("weight", lin.weight, copy)])
        Traceback (most recent call last):
        ...
        RuntimeError: module 'Linear' edited its parameter 'weight' in place ...
    """
    with torch.no_grad():
        names = [name for name, param, low in edited
                 if not torch.equal(low, param.detach().to(low.dtype))]
    if not names:
        return
    raise RuntimeError(
        f"module {f'{where!r} ' if where else ''}{type(module).__name__!r} edited its parameter"
        f"{'s' if len(names) > 1 else ''} {', '.join(map(repr, names))} in place during "
        f"its forward, but there the module holds low-precision copies made for the "
        f"compute: the edit reached the copy, not the fp32 parameter the optimizer "
        f"steps and state_dict saves. Make the edit in a forward pre-hook "
        f"(module.register_forward_pre_hook), which runs before the cast and edits the "
        f"fp32 parameter, or between steps")


def truth_of(tensor: torch.Tensor) -> torch.Tensor:
    """The fp32 parameter whose low-precision copy ``tensor`` is in this thread's
    running forward, else ``tensor`` itself.

    Example:
        >>> import torch
        >>> from ampkit.conversion.parameter_casts import truth_of
        >>> w = torch.nn.Parameter(torch.ones(1))
        >>> truth_of(w) is w
        True
    """
    if isinstance(tensor, nn.Parameter):
        return tensor
    for module, swapped in reversed(_swaps.stack):
        params = torch_internals.module_parameters(module)
        for name, param, _ in swapped:
            if params.get(name) is tensor:
                return param
    copies = _pass.copies
    if copies:
        for param, low in copies.values():
            if low is tensor:
                return param
    for module in list(_held.values()):  # another thread's forward holds it
        held = module.__dict__.get(_HELD)
        params = torch_internals.module_parameters(module)
        record: Swapped = [] if held is None else held[1]
        for name, truth, _ in record:
            if params.get(name) is tensor:
                return truth
    return tensor


def keep_cast_last(module: nn.Module) -> None:
    """Move ampkit's cast back to the end of ``module``'s forward pre-hooks (after a
    hook was registered), so that every user's pre-hook runs before it, on the fp32
    parameters. A converted module's ``register_forward_pre_hook`` calls it.

    Example:
        >>> import torch
        >>> import ampkit
        >>> lin = ampkit.initialize(torch.nn.Linear(2, 2), level="O2", dtype="bfloat16")
        >>> _ = lin.register_forward_pre_hook(lambda m, a: print(m.weight.dtype))
        >>> _ = lin(torch.ones(1, 2))
        torch.float32
    """
    own = module.__dict__.get(_CAST_HOOKS)
    hooks = torch_internals.forward_pre_hooks(module)
    if own is not None and own[1] in hooks:
        hooks.move_to_end(own[1])  # type: ignore[attr-defined]


# A pickled (or deep-copied) converted model names these by the package,
# ``ampkit.conversion``, as it names the package's other objects (see its own note):
# a definition can then move between the package's files without breaking a pickle.
for _named in (CastParametersOnUse, _load_begins, _load_ends, _state_dict_begins,
               truth_in_state_dict):
    _named.__module__ = "ampkit.conversion"
del _named
