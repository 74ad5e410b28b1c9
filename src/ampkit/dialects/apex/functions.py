"""apex's function registration: ``register_{half,float,promote}_function`` and their
decorator forms, over :func:`ampkit.engine.function_patching.register_function`, and
``disable_casts``.

Example:
    >>> import torch
    >>> import ampkit
    >>> from ampkit.dialects.apex.functions import disable_casts
    >>> with ampkit.autocast("cpu", torch.float16), disable_casts():
    ...     torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype
    torch.float32
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from ampkit.engine.function_patching import CastRule, cast_function, register_function
from ampkit.engine.regions import autocast

__all__ = ["disable_casts", "float_function", "half_function", "promote_function",
           "register_float_function", "register_half_function", "register_promote_function"]

F = TypeVar("F", bound=Callable[..., Any])


def register_half_function(module: Any, function_name: str) -> None:
    """Make ``module.function_name`` run in the low-precision dtype inside autocast.

    Raises:
        ValueError: ``module`` has no such function.

    Example:
        >>> import types, torch
        >>> import ampkit
        >>> import ampkit.apex as amp
        >>> ext = types.SimpleNamespace(scale2=lambda x: x * 2)
        >>> amp.register_half_function(ext, "scale2")
        >>> with ampkit.autocast("cpu", torch.float16):
        ...     ext.scale2(torch.ones(1)).dtype
        torch.float16
    """
    register_function(module, function_name, CastRule.LOWER)


def register_float_function(module: Any, function_name: str) -> None:
    """Make ``module.function_name`` run in float32 inside autocast.

    Example:
        >>> import types, torch
        >>> import ampkit
        >>> import ampkit.apex as amp
        >>> ext = types.SimpleNamespace(total=lambda x: x.sum())
        >>> amp.register_float_function(ext, "total")
        >>> with ampkit.autocast("cpu", torch.float16):
        ...     ext.total(torch.ones(2, dtype=torch.float16)).dtype
        torch.float32
    """
    register_function(module, function_name, CastRule.FP32)


def register_promote_function(module: Any, function_name: str) -> None:
    """Make ``module.function_name`` run in the widest floating dtype of its arguments
    inside autocast.

    Example:
        >>> import types, torch
        >>> import ampkit
        >>> import ampkit.apex as amp
        >>> ext = types.SimpleNamespace(mix=lambda a, b: torch.cat([a, b]))
        >>> amp.register_promote_function(ext, "mix")
        >>> with ampkit.autocast("cpu", torch.float16):
        ...     ext.mix(torch.ones(1, dtype=torch.float16), torch.ones(1)).dtype
        torch.float32
    """
    register_function(module, function_name, CastRule.PROMOTE)


def half_function(fn: F) -> F:
    """Decorator form of :func:`register_half_function`.

    Example:
        >>> import torch
        >>> import ampkit
        >>> import ampkit.apex as amp
        >>> @amp.half_function
        ... def double(x):
        ...     return x * 2
        >>> with ampkit.autocast("cpu", torch.float16):
        ...     double(torch.ones(1)).dtype
        torch.float16
    """
    return cast_function(CastRule.LOWER)(fn)


def float_function(fn: F) -> F:
    """Decorator form of :func:`register_float_function`.

    Example:
        >>> import torch
        >>> import ampkit
        >>> import ampkit.apex as amp
        >>> @amp.float_function
        ... def total(x):
        ...     return x.sum()
        >>> with ampkit.autocast("cpu", torch.float16):
        ...     total(torch.ones(2, dtype=torch.float16)).dtype
        torch.float32
    """
    return cast_function(CastRule.FP32)(fn)


def promote_function(fn: F) -> F:
    """Decorator form of :func:`register_promote_function`.

    Example:
        >>> import torch
        >>> import ampkit
        >>> import ampkit.apex as amp
        >>> @amp.promote_function
        ... def mix(a, b):
        ...     return a * b
        >>> with ampkit.autocast("cpu", torch.float16):
        ...     mix(torch.ones(1, dtype=torch.float16), torch.ones(1)).dtype
        torch.float32
    """
    return cast_function(CastRule.PROMOTE)(fn)


@contextlib.contextmanager
def disable_casts() -> Iterator[None]:
    """Inside this context no autocast casts apply (ops run in their inputs' dtype,
    registered functions too), on every device where autocast was on.

    Example:
        >>> import torch
        >>> import ampkit
        >>> import ampkit.apex as amp
        >>> with ampkit.autocast("cpu", torch.float16):
        ...     with amp.disable_casts():
        ...         torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype
        torch.float32
    """
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    with contextlib.ExitStack() as stack:
        for device in devices:
            if torch.is_autocast_enabled(device):
                stack.enter_context(autocast(device, enabled=False))
        yield
