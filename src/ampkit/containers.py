"""The one walk over nested containers: lists, tuples, namedtuples, dicts and dataclass
instances.

Everything else is a *leaf*: tensors, numbers, strings, ``None``, other objects. Every
layer that looks inside a model's inputs or outputs, an op's arguments or a set of
gradients walks them with these functions, so a dataclass output (or a namedtuple, or
a dict subclass) is seen the same way by the casts, the overflow check, the scaler and
the tools.

Order: list and tuple items in order, dict values in insertion order, dataclass fields
that take part in ``__init__`` in declaration order. Rebuilt containers keep their type
(namedtuples, dict subclasses that construct without arguments, dataclasses through
``dataclasses.replace``); a list subclass comes back as a list.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

__all__ = ["is_container", "iter_leaves", "iter_tensors", "map_leaves", "map_tensors"]

T = TypeVar("T")


def is_container(obj: Any) -> bool:
    """Whether the walk looks inside ``obj`` (a list, tuple, dict or dataclass instance).

    Example:
        >>> from ampkit.containers import is_container
        >>> is_container({"a": 1}), is_container("ab")
        (True, False)
    """
    return isinstance(obj, list | tuple | dict) or _is_dataclass_instance(obj)


def _is_dataclass_instance(obj: Any) -> bool:
    # dataclasses.is_dataclass without its class check: a class's type is its metaclass,
    # which has no dataclass fields.
    return hasattr(type(obj), "__dataclass_fields__")


def _fields(obj: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(obj) if f.init]


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
        >>> from ampkit.containers import iter_leaves
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
        >>> from ampkit.containers import iter_tensors
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


def _map(obj: Any, fn: Callable[[Any], Any], tensors_only: bool) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, list):
        return [_map(v, fn, tensors_only) for v in obj]
    if isinstance(obj, tuple):
        items = [_map(v, fn, tensors_only) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, dict):
        out = type(obj)() if type(obj) is not dict else {}
        for k, v in obj.items():
            out[k] = _map(v, fn, tensors_only)
        return out
    if _is_dataclass_instance(obj):
        return dataclasses.replace(obj, **{n: _map(getattr(obj, n), fn, tensors_only)
                                           for n in _fields(obj)})
    return obj if tensors_only else fn(obj)


def map_leaves(obj: T, fn: Callable[[Any], Any]) -> T:
    """``obj`` rebuilt with ``fn`` applied to every leaf.

    Example:
        >>> from collections import namedtuple
        >>> from ampkit.containers import map_leaves
        >>> Pair = namedtuple("Pair", "a b")
        >>> map_leaves(Pair(1, [2, {"k": 3}]), lambda x: x * 10)
        Pair(a=10, b=[20, {'k': 30}])
    """
    return _map(obj, fn, False)  # type: ignore[no-any-return]


def map_tensors(obj: T, fn: Callable[[torch.Tensor], Any]) -> T:
    """``obj`` rebuilt with ``fn`` applied to every tensor; other leaves are kept.

    Example:
        >>> import torch
        >>> from ampkit.containers import map_tensors
        >>> map_tensors({"x": torch.ones(1), "tag": "a"}, lambda t: t + 1)
        {'x': tensor([2.]), 'tag': 'a'}
    """
    return _map(obj, fn, True)  # type: ignore[no-any-return]
