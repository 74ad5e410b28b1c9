"""Which modules of a model a setting applies to: module selectors, checked once and
matched while walking ``model.named_modules()``. Used by :mod:`ampkit.conversion`
(``keep_fp32_modules``, ``low_precision_modules``) and :mod:`ampkit.fsdp` (``blocks``).

A selector is an ``nn.Module`` subclass (matches instances of it and of its
subclasses), a qualified module name as in ``model.named_modules()`` (``"encoder.0"``;
``""`` is the model itself) or a module instance inside the model.

Example:
    >>> import torch.nn as nn
    >>> from ampkit.common.module_selection import (
    ...     parse_module_selectors, resolve_module_selectors, selects)
    >>> model = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
    >>> chosen = resolve_module_selectors(model, parse_module_selectors(nn.LayerNorm, "keep"),
    ...                                   "keep")
    >>> [name for name, m in model.named_modules() if selects(m, name, chosen)]
    ['1']
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

import torch.nn as nn

from ampkit.torch_internals import Unavailable

__all__ = ["ModuleSelector", "ResolvedSelectors", "parse_module_selectors",
           "resolve_module_selectors", "selects"]

#: A module selector: an ``nn.Module`` subclass (matches instances of it and of its
#: subclasses), a qualified module name as in ``model.named_modules()`` (``"encoder.0"``;
#: ``""`` is the model itself) or a module instance inside the model.
ModuleSelector = type | str | nn.Module

#: Selectors split by kind: classes, qualified names, ids of module instances.
ResolvedSelectors = tuple[tuple[type, ...], set[str], set[int]]


def parse_module_selectors(value: Any, argument: str) -> tuple[ModuleSelector, ...] | None:
    """``value`` (one selector or an iterable of them; ``None``) as a tuple, checked.

    Example:
        >>> import torch.nn as nn
        >>> from ampkit.common.module_selection import parse_module_selectors
        >>> parse_module_selectors(nn.LayerNorm, "keep_fp32_modules")
        (<class 'torch.nn.modules.normalization.LayerNorm'>,)
    """
    if value is None:
        return None
    items = (value,) if isinstance(value, type | str | nn.Module) else value
    if not isinstance(items, Iterable):
        raise TypeError(f"{argument} must be a module class, a qualified module name, a "
                        f"module, or a list/tuple of them, got {type(value).__name__}")
    out = []
    for item in items:
        if isinstance(item, str | nn.Module) or (isinstance(item, type)
                                                  and issubclass(item, nn.Module)):
            out.append(item)
        elif isinstance(item, Unavailable):
            item()  # a torch internal this torch lacks (a default's norm base): say so
        else:
            raise TypeError(f"{argument}: expected nn.Module subclasses, qualified module "
                            f"names (str) or module instances, got {item!r}")
    return tuple(out)


def resolve_module_selectors(model: nn.Module, selectors: Iterable[ModuleSelector],
                             argument: str) -> ResolvedSelectors:
    """Split selectors into classes, qualified names and instance ids; check that every
    name and instance is in the model.

    Example:
        >>> import torch.nn as nn
        >>> from ampkit.common.module_selection import resolve_module_selectors
        >>> net = nn.Sequential(nn.Linear(1, 1))
        >>> resolve_module_selectors(net, [nn.Linear, "0"], "blocks")[:2]
        ((<class 'torch.nn.modules.linear.Linear'>,), {'0'})
        >>> resolve_module_selectors(net, ["1"], "blocks")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: blocks: the model has no module named '1' (names are as in ...
    """
    selectors = tuple(selectors)
    names = {name for name, _ in model.named_modules(remove_duplicate=False)}
    modules = {id(m) for m in model.modules()}
    classes = tuple(s for s in selectors if isinstance(s, type))
    wanted = {s for s in selectors if isinstance(s, str)}
    for name in sorted(wanted - names):
        close = difflib.get_close_matches(name, sorted(names), n=3)
        hint = f"; did you mean {close}?" if close else ""
        raise ValueError(f"{argument}: the model has no module named {name!r}{hint} (names "
                         f"are as in model.named_modules(); '' is the model itself)")
    instances = {id(s) for s in selectors if isinstance(s, nn.Module)}
    if instances - modules:
        raise ValueError(f"{argument}: a module instance given is not part of the model")
    return classes, wanted, instances


def selects(module: nn.Module, name: str, resolved: ResolvedSelectors) -> bool:
    """Whether ``module`` (named ``name`` in its model) is one of ``resolved``.

    Example:
        >>> import torch.nn as nn
        >>> from ampkit.common.module_selection import selects
        >>> selects(nn.Linear(1, 1), "0", ((nn.Linear,), set(), set()))
        True
    """
    classes, names, instances = resolved
    return (isinstance(module, classes) if classes else False) or name in names or (
        id(module) in instances)
