"""User functions with a fixed cast rule inside autocast regions.

Some functions are not torch ops the policy knows: a custom CUDA extension, a fused
kernel from another library, a helper that must see float32. :func:`register_function`
replaces ``module.name`` by a wrapper that, whenever autocast is on for the device of
its floating tensor arguments (an :class:`ampkit.autocast` region, a plain
``torch.autocast`` one, a converted model's forward), casts those arguments by a
:class:`CastRule` and runs the function with autocast off, so it computes in exactly
that dtype. Outside autocast it is the original function, unchanged.

* ``CastRule.LOWER``: to the region's low-precision dtype (apex ``register_half_function``);
* ``CastRule.FP32``: to float32 (apex ``register_float_function``);
* ``CastRule.PROMOTE``: to the widest floating dtype among the arguments (apex
  ``register_promote_function``);
* ``CastRule.REFUSE_LOW``: nothing is cast; a call with a float16 or bfloat16 argument
  raises ``NotImplementedError`` (apex's banned functions, and in-place versions of
  float32-list ops, which could only compute in the low precision). Other calls run
  as they are.

Eligibility is native autocast's: only floating tensors on the autocast device that are
not float64 are cast, inside nested lists, tuples and dicts too. ``policy`` narrows a
rule to the regions running one named policy (apex's refusals hold only under its own
O1 lists, ``"apex-O1"``). :func:`cast_function`
makes the same wrapper without replacing anything (a decorator).

Example:
    >>> import torch
    >>> import ampkit
    >>> from ampkit.engine.function_patching import CastRule, cast_function
    >>> @cast_function(CastRule.FP32)
    ... def precise_norm(x):
    ...     return x.norm()
    >>> with ampkit.autocast("cpu", torch.bfloat16):
    ...     precise_norm(torch.ones(4, dtype=torch.bfloat16)).dtype
    torch.float32
"""

from __future__ import annotations

import contextlib
import enum
import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from ampkit.common.containers import iter_tensors
from ampkit.engine.casting import cast_tree, eligible_dtypes, is_eligible, widest_float_dtype
from ampkit.engine.regions import autocast, current_policy
from ampkit.policies.registry import all_op_names

__all__ = [
    "CastRule",
    "cast_function",
    "register_function",
    "registered_functions",
    "unregister_function",
]

F = TypeVar("F", bound=Callable[..., Any])


class CastRule(enum.Enum):
    """How a registered function's floating arguments are cast inside autocast."""

    LOWER = "lower"  # the region's low-precision dtype
    FP32 = "fp32"  # float32
    PROMOTE = "promote"  # the widest floating dtype among the arguments
    REFUSE_LOW = "refuse low precision"  # NotImplementedError on a float16/bfloat16 input


def _devices(args: Any) -> set[str]:
    """Device types of the eligible floating tensors in ``args`` whose autocast is on."""
    found = {t.device.type for t in iter_tensors(args)
             if t.is_floating_point() and t.dtype is not torch.float64}
    return {d for d in found if torch.is_autocast_enabled(d)}


@functools.lru_cache(maxsize=16)
def _autocast_off(device_type: str) -> autocast:
    # One reusable object per device: ampkit.autocast keeps its state on a thread-local
    # stack, so it can be entered by nested calls and other threads.
    return autocast(device_type, enabled=False)


def _low_precision_argument(args: Any, devices: set[str]) -> torch.Tensor | None:
    """The first float16/bfloat16 tensor in ``args`` on one of ``devices``, if any."""
    for t in iter_tensors(args):
        if t.dtype in (torch.float16, torch.bfloat16) and t.device.type in devices:
            return t
    return None


def _runs_policy(device: str, name: str) -> bool:
    current = current_policy(device)
    return current is not None and current.name in (name, f"{name}+custom")


def cast_function(rule: CastRule, *, message: str | None = None,
                  policy: str | None = None) -> Callable[[F], F]:
    """A decorator: inside autocast, cast the function's floating arguments by ``rule``
    and run it with autocast off; outside, call it as it is. With
    ``CastRule.REFUSE_LOW``, a call with a low-precision argument raises
    ``NotImplementedError`` (``message`` says why; a default names the function).
    ``policy`` (a preset name) limits the rule to ampkit regions running that policy
    (or it with custom lists).

    Example:
        >>> import torch
        >>> import ampkit
        >>> from ampkit.engine.function_patching import CastRule, cast_function
        >>> add = cast_function(CastRule.PROMOTE)(lambda a, b: a + b)
        >>> with ampkit.autocast("cpu", torch.bfloat16):
        ...     add(torch.ones(1, dtype=torch.bfloat16), torch.ones(1)).dtype
        torch.float32
        >>> exp_ = cast_function(CastRule.REFUSE_LOW, message="no in-place exp")(
        ...     torch.Tensor.exp_)
        >>> with ampkit.autocast("cpu", torch.bfloat16):
        ...     exp_(torch.ones(1, dtype=torch.bfloat16))
        Traceback (most recent call last):
        ...
        NotImplementedError: no in-place exp
    """
    _check_rule(rule, message)
    if policy is not None and not isinstance(policy, str):
        raise TypeError(f"policy must be None or a policy name (str), got {policy!r}")

    def decorate(fn: F) -> F:
        if not callable(fn):
            raise TypeError(f"expected a callable, got {type(fn).__name__}")

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            devices = _devices((args, kwargs))
            if policy is not None:
                devices = {d for d in devices if _runs_policy(d, policy)}
            if not devices:
                return fn(*args, **kwargs)
            if rule is CastRule.REFUSE_LOW:
                low = _low_precision_argument((args, kwargs), devices)
                if low is not None:
                    name = getattr(fn, "__qualname__", getattr(fn, "__name__", repr(fn)))
                    raise NotImplementedError(
                        message or f"{name} refuses {low.dtype} arguments inside autocast: "
                                   f"it could only compute in that precision")
                return fn(*args, **kwargs)
            for device in sorted(devices):
                target: torch.dtype | None
                if rule is CastRule.LOWER:
                    target = torch.get_autocast_dtype(device)
                elif rule is CastRule.FP32:
                    target = torch.float32
                else:
                    target = widest_float_dtype(eligible_dtypes((args, kwargs), device))
                if target is not None:
                    args, kwargs = cast_tree(
                        (args, kwargs), target,
                        functools.partial(lambda d, t: is_eligible(t, d), device))
            with contextlib.ExitStack() as stack:
                for device in devices:
                    stack.enter_context(_autocast_off(device))
                return fn(*args, **kwargs)

        wrapper.__ampkit_cast_rule__ = rule  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return decorate


def _check_rule(rule: Any, message: Any) -> None:
    if not isinstance(rule, CastRule):
        raise TypeError(f"rule must be a CastRule ({[r.name for r in CastRule]}), got "
                        f"{rule!r}")
    if message is not None and (rule is not CastRule.REFUSE_LOW
                                or not isinstance(message, str)):
        raise ValueError(f"message is the error text of CastRule.REFUSE_LOW: a str with "
                         f"that rule, None otherwise; got {message!r} with {rule}")


_lock = threading.Lock()
# (id(owner), name) -> (owner, name, original function, rule)
_registered: dict[tuple[int, str], tuple[Any, str, Callable[..., Any], CastRule]] = {}


def register_function(module: Any, name: str, rule: CastRule, *,
                      message: str | None = None, policy: str | None = None) -> None:
    """Replace ``module.name`` by a wrapper that casts by ``rule`` inside autocast.

    ``module`` is any object holding the function (a module, a class, an object).
    Registering the same function again replaces its rule. ``message`` is the error
    text of ``CastRule.REFUSE_LOW``; ``policy`` limits the rule to regions running the
    policy of that name (see :func:`cast_function`).

    Raises:
        ValueError: ``module`` has no attribute ``name``; ``message`` with another rule.
        TypeError: the attribute is not callable, or ``rule`` is not a :class:`CastRule`.

    Example:
        >>> import types, torch
        >>> import ampkit
        >>> from ampkit.engine.function_patching import CastRule, register_function
        >>> from ampkit.engine.function_patching import unregister_function
        >>> ext = types.SimpleNamespace(fused=lambda x: x * 2)
        >>> register_function(ext, "fused", CastRule.LOWER)
        >>> with ampkit.autocast("cpu", torch.bfloat16):
        ...     ext.fused(torch.ones(2)).dtype
        torch.bfloat16
        >>> ext.fused(torch.ones(2)).dtype
        torch.float32
        >>> unregister_function(ext, "fused")
    """
    _check_rule(rule, message)
    if not isinstance(name, str) or not hasattr(module, name):
        raise ValueError(f"no function named {name!r} in {module!r}")
    # Build the op registry first, so it never records a wrapper as a torch op.
    all_op_names()
    with _lock:
        key = (id(module), name)
        entry = _registered.get(key)
        original = entry[2] if entry is not None else getattr(module, name)
        if not callable(original):
            raise TypeError(f"{module!r}.{name} is not callable, got "
                            f"{type(original).__name__}")
        setattr(module, name, cast_function(rule, message=message, policy=policy)(original))
        _registered[key] = (module, name, original, rule)


def unregister_function(module: Any, name: str) -> None:
    """Put back the function :func:`register_function` replaced.

    Raises:
        ValueError: ``module.name`` was not registered.

    Example:
        >>> import types
        >>> from ampkit.engine.function_patching import CastRule, register_function
        >>> from ampkit.engine.function_patching import unregister_function
        >>> f = lambda x: x
        >>> ns = types.SimpleNamespace(f=f)
        >>> register_function(ns, "f", CastRule.FP32)
        >>> unregister_function(ns, "f")
        >>> ns.f is f
        True
    """
    with _lock:
        entry = _registered.pop((id(module), name), None)
        if entry is None:
            raise ValueError(f"{module!r}.{name} is not registered")
        setattr(module, name, entry[2])


def registered_functions() -> dict[str, CastRule]:
    """The registered functions, as ``"module.name" -> rule``.

    Example:
        >>> from ampkit.engine.function_patching import registered_functions
        >>> isinstance(registered_functions(), dict)
        True
    """
    with _lock:
        return {f"{getattr(m, '__name__', type(m).__name__)}.{n}": rule
                for m, n, _, rule in _registered.values()}
