"""The subclasses a converted module gets. A module with a boundary, one whose
parameters are cast on use and one that casts its inputs each get a subclass of their
own class, with the same name, module and qualified name, whose ``__call__`` does that
module's part of the conversion (:func:`converted_call`, :func:`cast_call`,
:func:`input_cast_call`). A converted model's class also runs its ``generate`` inside the
model's boundary (:data:`ENTRY_METHODS`). A class is made once per (class, call), pickles and deep
copies rebuild it (:func:`rebuild_converted`), and :func:`original_class` sees through
it (and through FSDP2's ``FSDP<Name>`` on top).

Example:
    >>> import torch
    >>> import ampkit
    >>> from ampkit.conversion.classes import original_class
    >>> model = ampkit.convert_model(torch.nn.Linear(2, 2), "O2", torch.bfloat16)
    >>> type(model).__name__, type(model) is torch.nn.Linear, original_class(type(model))
    ('Linear', False, <class 'torch.nn.modules.linear.Linear'>)
"""

from __future__ import annotations

import functools
import inspect
import threading
import types
from collections.abc import Iterator
from typing import Any, Protocol

import torch
import torch.nn as nn

from ampkit import torch_internals
from ampkit.common.compile_frames import skip_frame_only
from ampkit.conversion.config import record_of
from ampkit.conversion.parameter_casts import (
    Swapped,
    keep_cast_last,
    own_cast_hooks,
    restore_swapped,
    strip_hold,
    swap_params,
    true_parameter,
)
from ampkit.engine.casting import cast_tree
from ampkit.torch_internals import global_backward_hooks as _global_backward_hooks
from ampkit.torch_internals import global_backward_pre_hooks as _global_backward_pre_hooks
from ampkit.torch_internals import global_forward_hooks as _global_forward_hooks
from ampkit.torch_internals import global_forward_pre_hooks as _global_forward_pre_hooks

__all__ = ["ENTRY_METHODS", "BoundaryCall", "cast_call", "cast_inputs_hook", "cast_inputs_to",
           "converted_call", "give_boundary", "give_cast_call", "input_cast_call",
           "original_class", "rebuild_converted"]


class BoundaryCall(Protocol):
    """What :func:`converted_call` asks of a module's boundary
    (:class:`ampkit.conversion.boundary.Boundary`)."""

    root: bool

    def enter(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
              cast_inputs: bool = True
              ) -> tuple[list[Any], int, tuple[Any, ...], dict[str, Any]]: ...

    def leave(self, entered: list[Any], swaps: int) -> None: ...

    def call_traced(self, module: nn.Module, call: Any, args: tuple[Any, ...],
                    kwargs: dict[str, Any], cast_inputs: bool = True) -> Any: ...


def original_class(cls: type) -> type:
    """``cls`` without the subclasses FSDP2 (``FSDP<Name>``) and a converted model's
    own class swap put on top of the module's class."""
    while (cls in _converted_classes or any(b.__name__ == "FSDPModule" for b in cls.__bases__)
           ) and cls.__bases__:
        cls = _converted_classes.get(cls) or cls.__bases__[-1]
    return cls


def converted_call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``__call__`` of a module with a boundary (the converted model, a kept-fp32 or
    white-listed module): the module's own call, inside its boundary, as one
    ``try``/``finally``.

    ``torch.compile(model)`` runs this frame and the boundary's bookkeeping as plain
    Python (see :func:`skip_frame_only`) and compiles the module call it makes, so the
    model's region is in effect when dynamo traces the forward: its policy is traced
    and guarded on, with no graph break, and one graph serves every call under that
    policy. Called from compiled code, it is traced
    (:meth:`ampkit.conversion.boundary.Boundary.call_traced`)."""
    boundary: BoundaryCall | None = self.__dict__.get(_BOUNDARY)
    call = super(_converted_in(type(self)), self).__call__  # type: ignore[arg-type]
    if boundary is None:  # a copy made without the record: a plain module again
        return call(*args, **kwargs)
    if torch_internals.compiling_here():
        return boundary.call_traced(self, call, args, kwargs)
    entered, swaps, args, kwargs = boundary.enter(self, args, kwargs)
    try:
        return call(*args, **kwargs)
    finally:
        boundary.leave(entered, swaps)


skip_frame_only(converted_call.__code__)
_BOUNDARY = "_ampkit_boundary"

#: Methods of a converted model that call its modules from outside its own forward,
#: run inside the model's boundary: its region and its forward pass, without the
#: input and output casts (the model's own calls inside still make theirs).
#: Hugging Face's ``generate`` calls the encoder of an encoder-decoder model directly
#: (``model.get_encoder()(...)``, wherever the encoder sits), so without this the
#: encoder would compute outside the level's region: in fp32 at O1, where native
#: ``torch.autocast`` around ``generate`` runs it in low precision, and failing at
#: O2, where a module mixes its low-precision copies with fp32 activations that only
#: the region's casts reconcile (T5's feed-forward). Inside the region the whole
#: ``generate`` computes as under native autocast around it (its logits processing
#: included), and one pass spans it, so O2 casts each weight once per ``generate``,
#: as native autocast's weight cache does once per region (nothing can change a
#: parameter during ``generate``). The rule is a method's, not a submodule's: giving
#: the children a boundary of their own would cost every call inside the forward a
#: check, and miss an encoder nested deeper (BART's ``model.model.encoder``).
ENTRY_METHODS = ("generate",)


def _entry_method(method: Any) -> Any:
    """``method`` of a converted model's class run inside the model's boundary (the
    root's; a kept or white-listed module with such a method runs it as it was)."""

    def in_boundary(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        boundary: BoundaryCall | None = self.__dict__.get(_BOUNDARY)
        if boundary is None or not boundary.root:
            return method(self, *args, **kwargs)
        if torch_internals.compiling_here():
            return boundary.call_traced(self, functools.partial(method, self), args,
                                        kwargs, cast_inputs=False)
        entered, swaps, args, kwargs = boundary.enter(self, args, kwargs,
                                                      cast_inputs=False)
        try:
            return method(self, *args, **kwargs)
        finally:
            boundary.leave(entered, swaps)

    # As converted_call: torch.compile meeting this frame runs it as Python (the region
    # entered eagerly) and compiles what it calls.
    skip_frame_only(in_boundary.__code__)
    return functools.wraps(method)(in_boundary)


def cast_call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``__call__`` of a module whose parameters are cast on use (and that has no
    boundary): while the pair of forward hooks :class:`CastParametersOnUse` installed
    are its only hooks (and no global module hooks are set), their work done here
    instead, around the module's forward, as ``nn.Module.__call__`` would call it.

    Host cost: a module with hooks takes ``nn.Module._call_impl``'s slow path and two
    Python hook calls; here, one frame and a ``try``/``finally``. The outcome is the
    hooks': the copies are swapped in where the pre-hook (first of the module's) would
    swap them, and the parameters are back before anything after the forward runs,
    exceptions of every kind (``KeyboardInterrupt`` too) included. With any other
    hook on the module (FSDP2's unshard, which must come before the swap, a user's, a
    checkpointing hook) or under tracing (``torch.compile``, ``torch.jit.trace``), or
    with ``module.compile()``, the module's ordinary call runs, hooks and all."""
    # Compiling first: traced, the ordinary call, and own_cast_hooks (plain Python when
    # a frame of its own) is never reached inside a graph.
    own = None if torch_internals.compiling_here() else own_cast_hooks(self)
    if (own is None or torch.jit.is_tracing()
            or torch_internals.backward_pre_hooks(self) or torch_internals.backward_hooks(self)
            or torch_internals.compiled_call_impl(self) is not None
            or _global_forward_pre_hooks or _global_forward_hooks
            or _global_backward_pre_hooks or _global_backward_hooks):
        return super(_converted_in(type(self)), self).__call__(  # type: ignore[arg-type]
            *args, **kwargs)
    swapped: Swapped = []
    try:
        # (CastParametersOnUse.swap_in, not asking is_compiling again)
        swap_params(self, swapped, own.dtype, False, own.keep, own.bare_fp32,
                    (args, kwargs))
        return self.forward(*args, **kwargs)
    finally:
        record = record_of(self)
        restore_swapped(self, swapped, record.name if record is not None else "")


# Run as plain Python when dynamo meets it as a frame of its own
# (torch.compile(module) of such a module: the swap made eagerly and the forward
# compiled, as the hooks were); traced, taking the ordinary call, inside compiled code.
skip_frame_only(cast_call.__code__)
_INPUT_DTYPE = "_ampkit_input_dtype"


def input_cast_call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``__call__`` of a module that casts its floating inputs to its parameters'
    low-precision dtype (O3 in a model that keeps float32 buffers; see
    ``_cast_inputs_past_buffers`` in :mod:`ampkit.conversion.plan`): the cast, then the
    module's ordinary call, hooks and all. One frame and one walk of the arguments, not
    a boundary's region bookkeeping: nothing else happens at this boundary."""
    dtype = self.__dict__.get(_INPUT_DTYPE)
    if dtype is not None:
        args, kwargs = cast_tree((args, kwargs), dtype)
    return super(_converted_in(type(self)), self).__call__(  # type: ignore[arg-type]
        *args, **kwargs)


def cast_inputs_hook(module: nn.Module, args: Any, kwargs: Any) -> Any:
    """The same cast as a forward pre-hook, for a module whose class has a ``__call__``
    of its own (or was given another by the conversion)."""
    dtype = module.__dict__.get(_INPUT_DTYPE)
    return None if dtype is None else cast_tree((args, kwargs), dtype)


# converted class -> the class it was made from (and its inverse below)
_converted_classes: dict[type, type] = {}
_converted_of: dict[tuple[type, Any], type] = {}
_converted_lock = threading.Lock()


def _converted_in(cls: type) -> type:
    """The converted class in ``cls``'s MRO (``cls`` itself, or FSDP2's subclass of it)."""
    return next(klass for klass in cls.__mro__ if klass in _converted_classes)


def rebuild_converted(base: type, call: Any = None) -> nn.Module:
    """Unpickling a converted model: an empty instance of its converted class
    (``call``: its ``__call__``; ``None``, as pickles made before it was recorded have
    it: :func:`converted_call`)."""
    return object.__new__(_converted_class(base, call or converted_call))


def _reduce_converted(self: nn.Module, protocol: int) -> Any:
    converted = _converted_in(type(self))
    if converted is not type(self):  # a further subclass (FSDP2's): pickled its own way
        return super(converted, self).__reduce_ex__(protocol)  # type: ignore[arg-type]
    call = converted.__dict__["__call__"]
    base = _converted_classes[converted]
    # The base class's own state (an RNN's leaves out its weak references, and its
    # __setstate__ makes them again on loading), its __dict__ for a class with none.
    getstate = getattr(self, "__getstate__", None)
    state = getstate() if getstate is not None else self.__dict__.copy()
    if state is self.__dict__:
        state = state.copy()
    # (a forward another thread runs now has its low-precision copies and its hold
    # mark in the module: the copy gets the fp32 parameters and no mark)
    if isinstance(state, dict):
        state = strip_hold(self, state)
    return (rebuild_converted, (base,) if call is converted_call else (base, call), state)


def _own_forward_frame(forward: Any) -> Any:
    """A ``forward`` that calls torch's own (``nn.Sequential.forward``, ...) from a frame
    of ampkit's. ``torch.compile`` of a module whose forward is torch's traces its call
    from a frame of its own (the boundary then runs inside the graph); with this
    forward it runs the module's call (its boundary, the region entered) as Python and
    compiles the forward, as for a model class of the user's own: one graph, whatever
    the policy."""

    def forward_frame(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return forward(self, *args, **kwargs)

    forward_frame.__doc__ = forward.__doc__
    return forward_frame


def _register_forward_pre_hook(self: nn.Module, hook: Any, *, prepend: bool = False,
                               with_kwargs: bool = False) -> Any:
    """``register_forward_pre_hook`` of a converted module: the hook, wherever it asks
    to go, runs before ampkit's cast, which stays the last
    (:func:`ampkit.conversion.parameter_casts.keep_cast_last`)."""
    handle = super(_converted_in(type(self)), self).register_forward_pre_hook(  # type: ignore[arg-type]
        hook, prepend=prepend, with_kwargs=with_kwargs)
    keep_cast_last(self)
    return handle


def _named_parameters(self: nn.Module, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Any:
    """``named_parameters`` of a converted module: inside a converted forward, the fp32
    parameters where a module's ``_parameters`` hold low-precision copies
    (:func:`ampkit.conversion.parameter_truth.truths`); ``parameters()`` goes through it."""
    # (the true walk whenever copies may be held: a forward on another thread may
    # swap a module's copies in after a check made before the walk)
    if torch_internals.compiling_here():
        return super(_converted_in(type(self)), self).named_parameters(  # type: ignore[arg-type]
            prefix, recurse, remove_duplicate)
    return _true_named_parameters(self, prefix, recurse, remove_duplicate)


def _true_named_parameters(self: nn.Module, prefix: str, recurse: bool,
                           remove_duplicate: bool) -> Iterator[tuple[str, Any]]:
    # torch's walk, each module's entries read by name (true_parameter): a copy another
    # thread's forward puts in or takes out during the walk is seen as its parameter.
    modules = (self.named_modules(prefix=prefix, remove_duplicate=remove_duplicate)
               if recurse else [(prefix, self)])
    seen: set[int] = set()
    for module_prefix, module in modules:
        for name in list(torch_internals.module_parameters(module)):
            param = true_parameter(module, name)
            if param is None:
                continue
            if remove_duplicate:
                if id(param) in seen:
                    continue
                seen.add(id(param))
            yield (module_prefix + "." if module_prefix else "") + name, param


def _get_parameter(self: nn.Module, target: str) -> Any:
    """``get_parameter`` of a converted module: the fp32 parameter where the module
    that holds it runs its forward with a low-precision copy in its place (torch's
    own refuses the copy: it is not an ``nn.Parameter``)."""
    path, _, name = target.rpartition(".")
    param = true_parameter(self.get_submodule(path), name)
    if isinstance(param, nn.Parameter):
        return param
    return super(_converted_in(type(self)), self).get_parameter(  # type: ignore[arg-type]
        target)


def _converted_class(base: type, call: Any = converted_call) -> type:
    """The subclass of ``base`` a converted model gets: the same name, with ``call``
    (:func:`converted_call` for a boundary, :func:`cast_call` for a module cast on
    use) as its ``__call__`` (made once per class and call)."""
    with _converted_lock:
        cls = _converted_of.get((base, call))
        if cls is None:
            namespace = {"__call__": call, "__reduce_ex__": _reduce_converted,
                         "__module__": base.__module__, "__qualname__": base.__qualname__,
                         "__doc__": base.__doc__,
                         "register_forward_pre_hook": _register_forward_pre_hook,
                         "named_parameters": _named_parameters,
                         "get_parameter": _get_parameter}
            forward = getattr(base, "forward", None)
            if call is converted_call and getattr(forward, "__module__", "").startswith(
                    "torch."):
                namespace["forward"] = _own_forward_frame(forward)
            if call is converted_call:
                for name in ENTRY_METHODS:
                    # (an instance method only: a static or class method has no model)
                    method = inspect.getattr_static(base, name, None)
                    if isinstance(method, types.FunctionType):
                        namespace[name] = _entry_method(method)
            cls = type(base.__name__, (base,), namespace)
            _converted_of[(base, call)] = cls
            _converted_classes[cls] = base
        return cls


def give_boundary(module: nn.Module, boundary: BoundaryCall) -> None:
    """Give ``module`` the class whose call runs inside ``boundary``, and the boundary."""
    base = type(module)
    if base.__dict__.get("__call__") is not converted_call:
        module.__class__ = _converted_class(_converted_classes.get(base, base))
    object.__setattr__(module, _BOUNDARY, boundary)


def give_cast_call(module: nn.Module) -> None:
    """Give a module whose parameters are cast on use (hooks installed) the class whose
    call does the hooks' work itself (:func:`cast_call`), where its class has the
    plain ``nn.Module`` call and no conversion class yet."""
    if type(module) not in _converted_classes and type(module).__call__ is \
            nn.Module.__call__:
        module.__class__ = _converted_class(type(module), cast_call)


def cast_inputs_to(module: nn.Module, dtype: torch.dtype | None) -> None:
    """Make ``module`` cast its floating inputs to ``dtype``: through its class's call
    (:func:`input_cast_call`) where it has the plain ``nn.Module`` call, else through a
    forward pre-hook (:func:`cast_inputs_hook`), the first of its own."""
    object.__setattr__(module, _INPUT_DTYPE, dtype)
    if type(module) not in _converted_classes and type(module).__call__ is \
            nn.Module.__call__:
        module.__class__ = _converted_class(type(module), input_cast_call)
    else:
        module.register_forward_pre_hook(cast_inputs_hook, prepend=True,
                                         with_kwargs=True)
