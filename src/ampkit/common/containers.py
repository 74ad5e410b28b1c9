"""The one walk over nested containers: lists, tuples, namedtuples, dicts and dataclass
instances.

Everything else is a *leaf*: tensors, numbers, strings, ``None``, other objects. Every
layer that looks inside a model's inputs or outputs, an op's arguments or a set of
gradients walks them with these functions, so a dataclass output (or a namedtuple, or
a dict subclass) is seen the same way by the casts, the overflow check, the scaler and
the tools.

Order: list and tuple items in order, dict values in insertion order, dataclass fields
in declaration order (those left out of ``__init__`` too).

A rebuilt container is the one it was with its items replaced, and nothing of the
user's code runs to make it: it keeps its type and its instance attributes, and is
made through the library class it derives from (``object``, ``dict``, ``OrderedDict``,
``defaultdict`` with its ``default_factory``, ``list``, ``tuple``), never through the
class's own ``__init__``, ``__post_init__`` or ``__new__``; a dataclass (frozen or
not) gets its fields set directly. So a namedtuple, an ``OrderedDict``, a
``defaultdict``, a Hugging Face ``ModelOutput`` (an ``OrderedDict`` and a dataclass,
whose items and attributes stay the same objects) and a dataclass whose
``__post_init__`` transforms its fields come back as they behaved. A container none
of whose items changed is handed back itself, not a copy.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from ampkit import torch_internals
from ampkit.common.compile_frames import not_traced

__all__ = ["is_container", "iter_leaves", "iter_tensors", "map_leaves", "map_tensors"]

T = TypeVar("T")


def is_container(obj: Any) -> bool:
    """Whether the walk looks inside ``obj`` (a list, tuple, dict or dataclass instance).

    Example:
        >>> from ampkit.common.containers import is_container
        >>> is_container({"a": 1}), is_container("ab")
        (True, False)
    """
    return isinstance(obj, list | tuple | dict) or _is_dataclass_instance(obj)


def _is_dataclass_instance(obj: Any) -> bool:
    # dataclasses.is_dataclass without its class check: a class's type is its metaclass,
    # which has no dataclass fields.
    return hasattr(type(obj), "__dataclass_fields__")


def _fields(obj: Any) -> list[str]:
    # Every field, those left out of __init__ (set by __post_init__) too: the rebuild
    # below does not go through __init__, so what the object holds is what is walked.
    return [f.name for f in dataclasses.fields(obj)]


def _collect(obj: Any, out: list[Any], tensors_only: bool) -> None:
    # Appends instead of nested generators: this runs on every patched call and every
    # promote op, where a generator per level costs more than the walk itself.
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, list | tuple):
        for item in obj:
            _collect(item, out, tensors_only)
    elif isinstance(obj, dict):
        for item in obj.values():
            _collect(item, out, tensors_only)
    elif _is_dataclass_instance(obj):
        for name in _fields(obj):
            _collect(getattr(obj, name), out, tensors_only)
    elif not tensors_only:
        out.append(obj)


def iter_leaves(obj: Any) -> Iterator[Any]:
    """Every leaf inside ``obj`` (``obj`` itself when it is a leaf), in walk order.

    Example:
        >>> from ampkit.common.containers import iter_leaves
        >>> list(iter_leaves([1, (2, {"k": 3}), None]))
        [1, 2, 3, None]
    """
    out: list[Any] = []
    _collect(obj, out, False)
    return iter(out)


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside ``obj``, in walk order.

    Example:
        >>> import dataclasses, torch
        >>> from ampkit.common.containers import iter_tensors
        >>> @dataclasses.dataclass
        ... class Out:
        ...     logits: torch.Tensor
        ...     extra: dict
        >>> [t.tolist() for t in iter_tensors(Out(torch.ones(1), {"b": torch.zeros(1)}))]
        [[1.0], [0.0]]
    """
    out: list[torch.Tensor] = []
    _collect(obj, out, True)
    return iter(out)


# The library classes whose construction a rebuilt container goes through (never a
# class of the user's, whose __new__, __init__ or __post_init__ may do anything).
_LIBRARY_MODULES = frozenset({"builtins", "collections"})


def _library_base(cls: type) -> Any:
    return next(klass for klass in cls.__mro__ if klass.__module__ in _LIBRARY_MODULES)


def _copy_state(obj: Any, new: Any) -> None:
    """Copy ``obj``'s instance attributes (its ``__dict__`` and slots) onto ``new``,
    as they are, through no code of its class."""
    state = getattr(obj, "__dict__", None)
    if state:
        new.__dict__.update(state)
    for klass in type(obj).__mro__:
        slots = klass.__dict__.get("__slots__", ())
        for slot in (slots,) if isinstance(slots, str) else slots:
            if slot in ("__dict__", "__weakref__"):
                continue
            descriptor = klass.__dict__.get(slot)
            if descriptor is None or not hasattr(descriptor, "__set__"):
                continue
            try:
                value = descriptor.__get__(obj, klass)
            except AttributeError:  # an unset slot
                continue
            descriptor.__set__(new, value)


def _blank_like(obj: Any, items: list[Any] | None = None) -> Any:
    """A new instance of ``type(obj)`` holding ``obj``'s instance attributes, made by the
    library base class it derives from (``object``, ``dict``, ``OrderedDict``,
    ``defaultdict``, ``list``, ``tuple``: no ``__init__``, ``__post_init__`` or
    ``__new__`` of the user's runs); ``items``: a tuple's items (a sequence is
    otherwise left empty for the caller to fill)."""
    cls = type(obj)
    base = _library_base(cls)
    if base is tuple:
        try:
            new = tuple.__new__(cls, items or ())
        except TypeError:  # a C struct sequence (torch.return_types): its constructor
            return cls(items)
    else:
        new = base.__new__(cls)
        if isinstance(obj, collections.defaultdict):
            collections.defaultdict.__init__(new, obj.default_factory)
        elif base is not object:
            base.__init__(new)
    _copy_state(obj, new)
    return new


def _map(obj: Any, fn: Callable[[Any], Any], tensors_only: bool,
         memo: dict[int, Any]) -> Any:
    # A container whose every item comes back as it was is handed back itself (an
    # input the model returns untouched stays the same object); a tensor reached twice
    # (a dict-and-dataclass ModelOutput holds each value as an item and an attribute)
    # maps once, to one object.
    if isinstance(obj, torch.Tensor):
        found = memo.get(id(obj))
        if found is None:
            found = memo[id(obj)] = fn(obj)
        return found
    cls = type(obj)
    if isinstance(obj, list | tuple):
        items = [_map(v, fn, tensors_only, memo) for v in obj]
        if all(a is b for a, b in zip(items, obj, strict=True)):
            return obj
        if cls is tuple:
            return tuple(items)
        if cls is list:
            return items
        if isinstance(obj, tuple):
            return _blank_like(obj, items)
        new = _blank_like(obj)
        list.extend(new, items)
        return new
    if isinstance(obj, dict):
        values = {k: _map(v, fn, tensors_only, memo) for k, v in obj.items()}
        fields = ({n: _map(getattr(obj, n), fn, tensors_only, memo) for n in _fields(obj)}
                  if _is_dataclass_instance(obj) else {})
        if all(values[k] is v for k, v in obj.items()) and all(
                fields[n] is getattr(obj, n) for n in fields):
            return obj
        if cls is dict:
            return values
        new = _blank_like(obj)
        setitem = _library_base(cls).__setitem__
        for k, v in values.items():
            setitem(new, k, v)
        for n, v in fields.items():
            object.__setattr__(new, n, v)
        return new
    if _is_dataclass_instance(obj):
        fields = {n: _map(getattr(obj, n), fn, tensors_only, memo) for n in _fields(obj)}
        if all(v is getattr(obj, n) for n, v in fields.items()):
            return obj
        new = _blank_like(obj)
        for n, v in fields.items():
            object.__setattr__(new, n, v)  # (a frozen dataclass's too)
        return new
    return obj if tensors_only else fn(obj)


def _plain_namedtuple(cls: type) -> bool:
    # A class collections.namedtuple or typing.NamedTuple made, not a subclass of one
    # (which may add a __new__, an __init__ or instance attributes of its own).
    # (getattr, not hasattr: dynamo on torch 2.11 traces only the one on a class)
    return cls.__bases__ == (tuple,) and getattr(cls, "_fields", None) is not None


def _map_traced(obj: Any, fn: Callable[[Any], Any], tensors_only: bool,
                memo: list[tuple[torch.Tensor, Any]]) -> tuple[Any, bool]:
    # What torch.compile traces: the walk above in the constructions dynamo follows,
    # with the same results (an unchanged container handed back itself, a tensor reached
    # twice mapped once, no user code run); (the result, whether anything in it
    # changed), since dynamo compares tensors by identity but not containers. A
    # container that dynamo cannot rebuild that way (a dict, list or tuple subclass of
    # the user's, a Hugging Face ModelOutput) is rebuilt by the eager walk outside the
    # graph, never approximately inside it.
    if isinstance(obj, torch.Tensor):
        # (a list searched by identity: dynamo cannot take the id() of a tensor made
        # inside the graph)
        for seen, mapped in memo:
            if seen is obj:
                return mapped, mapped is not obj
        mapped = fn(obj)
        memo.append((obj, mapped))
        return mapped, mapped is not obj
    cls = type(obj)
    if cls is list or cls is tuple or (isinstance(obj, tuple) and (
            _plain_namedtuple(cls) or cls.__module__ == "torch.return_types")):
        pairs = [_map_traced(v, fn, tensors_only, memo) for v in obj]
        if not any(changed for _, changed in pairs):
            return obj, False
        items = [v for v, _ in pairs]
        if cls is list:
            return items, True
        if cls is tuple:
            return tuple(items), True
        if cls.__module__ == "torch.return_types":  # a C struct sequence
            return cls(items), True
        # (the __new__ namedtuple generated: typing.NamedTuple forbids one of the user's)
        return cls(*items), True
    if cls is dict or cls is collections.OrderedDict or cls is collections.defaultdict:
        keys = list(obj.keys())
        pairs = [_map_traced(obj[k], fn, tensors_only, memo) for k in keys]
        if not any(changed for _, changed in pairs):
            return obj, False
        new: dict[Any, Any]
        if cls is collections.defaultdict:
            new = collections.defaultdict(obj.default_factory)
        else:
            new = {} if cls is dict else collections.OrderedDict()
        for k, (v, _) in zip(keys, pairs, strict=True):
            new[k] = v
        return new, True
    if _is_dataclass_instance(obj) and not isinstance(obj, list | tuple | dict):
        names = _fields(obj)
        pairs = [_map_traced(getattr(obj, n), fn, tensors_only, memo) for n in names]
        if not any(changed for _, changed in pairs):
            return obj, False
        if _INSTANCE_DICT_LISTED:
            state = getattr(obj, "__dict__", None)
        elif cls.__dictoffset__:
            return _dataclass_rebuilt_outside_the_graph(obj, fn, tensors_only), True
        else:
            # (the class, not getattr, says that a slotted one has no __dict__: 2.11's
            # dynamo answers getattr(obj, "__dict__") with a stand-in even there)
            state = None
        new = object.__new__(cls)
        if state is not None:
            for n, v in state.items():  # attributes beyond the fields, as they are
                if n not in names:
                    object.__setattr__(new, n, v)
        for n, (v, _) in zip(names, pairs, strict=True):
            object.__setattr__(new, n, v)  # (a frozen or slotted dataclass's too)
        return new, True
    if is_container(obj):
        return _rebuilt_outside_the_graph(obj, fn, tensors_only), True
    # (another leaf: dynamo compares only tensors by identity)
    return (obj, False) if tensors_only else (fn(obj), True)


# Torch 2.11's dynamo cannot list an instance's __dict__ (its items, keys or length; it
# only looks names up in it), and a dataclass instance's may hold attributes beyond
# its fields, which the rebuilt one must keep: there, such an instance is rebuilt by
# the eager walk outside the graph (a slotted dataclass has no __dict__ and stays in).
_INSTANCE_DICT_LISTED = tuple(map(int, torch.__version__.split(".")[:2])) >= (2, 12)


@not_traced
def _dataclass_rebuilt_outside_the_graph(obj: Any, fn: Callable[[Any], Any],
                                         tensors_only: bool) -> Any:
    """Where this torch's compiled code cannot list a dataclass instance's
    attributes: the eager walk, run as Python (a graph break; ``fullgraph=True``: the
    error naming this)."""
    return _map(obj, fn, tensors_only, {})


@not_traced
def _rebuilt_outside_the_graph(obj: Any, fn: Callable[[Any], Any], tensors_only: bool) -> Any:
    """Where compiled code hands a container it cannot rebuild to the walk: the eager
    walk, run as Python (a graph break; ``fullgraph=True``: the error naming this)."""
    return _map(obj, fn, tensors_only, {})


def map_leaves(obj: T, fn: Callable[[Any], Any]) -> T:
    """``obj`` rebuilt with ``fn`` applied to every leaf.

    Example:
        >>> from collections import namedtuple
        >>> from ampkit.common.containers import map_leaves
        >>> Pair = namedtuple("Pair", "a b")
        >>> map_leaves(Pair(1, [2, {"k": 3}]), lambda x: x * 10)
        Pair(a=10, b=[20, {'k': 30}])
    """
    if torch.compiler.is_compiling():
        return _map_traced(obj, fn, False, [])[0]  # type: ignore[no-any-return]
    return _map(obj, fn, False, {})  # type: ignore[no-any-return]


def map_tensors(obj: T, fn: Callable[[torch.Tensor], Any]) -> T:
    """``obj`` rebuilt with ``fn`` applied to every tensor; other leaves are kept.

    Example:
        >>> import torch
        >>> from ampkit.common.containers import map_tensors
        >>> map_tensors({"x": torch.ones(1), "tag": "a"}, lambda t: t + 1)
        {'x': tensor([2.]), 'tag': 'a'}
    """
    if torch.compiler.is_compiling():
        return _map_traced(obj, fn, True, [])[0]  # type: ignore[no-any-return]
    return _map(obj, fn, True, {})  # type: ignore[no-any-return]


torch_internals.mark_dynamo_disabled(
    _rebuilt_outside_the_graph,
    "ampkit: a container that compiled code cannot rebuild without running its class's "
    "code (a dict, list or tuple subclass, such as a Hugging Face ModelOutput) holds a "
    "tensor the model's boundary casts; it is rebuilt as Python, outside the graph, as "
    "in eager mode. Compile the model itself (torch.compile(model)), or return a "
    "dataclass, a dict, an OrderedDict, a defaultdict or a named tuple, to get one graph")
torch_internals.mark_dynamo_disabled(
    _dataclass_rebuilt_outside_the_graph,
    "ampkit: compiled code of this torch (2.11) cannot list the attributes of a "
    "dataclass instance (its __dict__, which may hold attributes beyond its fields), so "
    "one holding a tensor the model's boundary casts is rebuilt as Python, outside the "
    "graph, as in eager mode. Use torch 2.12 or later, or declare the dataclass with "
    "slots=True, to get one graph")
