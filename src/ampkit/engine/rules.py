"""The rules an :class:`ampkit.autocast` region applies, compiled from its policy: which
ops the Autocast kernels cast differently from native autocast (ops with a dispatcher
op), which Python entry points the thread's one ``TorchFunctionMode`` intercepts
(composites without one), and that mode itself. Compiled once per policy value and
device, so equal policies share one table and torch.compile's guards on it hold.

Example:
    >>> from ampkit.engine.rules import compile_rules
    >>> from ampkit.policies.presets import get_policy
    >>> rules = compile_rules(get_policy("apex-O1"), "cpu")
    >>> rules is compile_rules(get_policy("apex-O1"), "cpu"), bool(rules)
    (True, True)
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.amp.autocast_mode import autocast as _native_autocast
from torch.overrides import TorchFunctionMode

from ampkit import torch_internals
from ampkit.engine import kernels
from ampkit.engine.casting import WeightCastCache, cast_op_args, promote_dtype
from ampkit.policies.policy import Policy
from ampkit.policies.registry import (
    all_op_names,
    dispatcher_schemas,
    entry_points,
    native_op_names,
)
from ampkit.policies.registry import is_compute as _is_compute
from ampkit.policies.registry import op_schemas as _op_schemas

__all__ = ["NO_RULES", "PolicyMode", "Rules", "Spec", "compile_rules", "region_policy"]


# -- what the schema says about an op: the registry's classification ------------------------

def _call_positions(fn: Any, name: str) -> tuple[tuple[int, ...], int]:
    """Where ``fn`` takes an explicit ``dtype`` positionally, and the position of an
    ``inplace`` parameter (``F.relu(x, inplace=True)``; -1 if none). A Python function's
    signature says both (``F.softmax(x, 1, 3, torch.float32)``); for a builtin the
    op's schemas say where the dtype sits (``torch.log_softmax(x, -1, torch.float32)``;
    a Tensor method's ``self`` is the schema's first argument too)."""
    if inspect.isfunction(fn):
        try:
            params = list(inspect.signature(fn, follow_wrapped=False).parameters.values())
        except (TypeError, ValueError):  # a builtin behind a Python wrapper
            return (), -1
        names = [p.name for p in params]
        return (tuple(i for i, p in enumerate(params) if p.name == "dtype" and p.kind in (
            p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)),
            names.index("inplace") if "inplace" in names else -1)
    if isinstance(fn, torch_internals.OpOverload):
        schemas: tuple[Any, ...] = (torch_internals.op_schema(fn),)
    else:
        schemas = _op_schemas(name)
    return tuple(sorted({i for s in schemas for i, a in enumerate(s.arguments)
                         if a.name == "dtype" and not a.kwarg_only})), -1


# -- rule tables --------------------------------------------------------------------------

#: ``entry point -> (rule, positions of a positional dtype, position of inplace or -1)``.
Spec = tuple[str, tuple[int, ...], int]

@dataclasses.dataclass(eq=False)
class Rules:
    """What a policy intercepts on one device. Compared by identity: ``compile_rules``
    is cached by the policy's value, so equal policies share one object."""

    #: Autocast kernels: canonical op name -> rule (ops with a dispatcher op).
    ops: Mapping[str, str]
    #: The Python mode: entry point -> spec (composites with no dispatcher op).
    entry: Mapping[Any, Spec]
    #: What compiled frames are guarded on while the kernels apply these rules.
    token: Any
    #: The ``kernels.generation()`` at which ``ops`` were registered (-1: not yet).
    registered: int = -1

    def __bool__(self) -> bool:
        return bool(self.ops or self.entry)


@functools.lru_cache(maxsize=64)
def compile_rules(policy: Policy, device_type: str) -> Rules:
    """The ops this policy decides differently from native autocast, split by where
    they are intercepted. Empty for a native-equal policy: then nothing is intercepted
    and nothing is registered."""
    if policy.is_native:
        return NO_RULES
    native = native_op_names(device_type)
    listed = policy.lower_precision_ops | policy.fp32_ops | policy.promote_ops
    if policy.unlisted == "native":
        names: Iterable[str] = listed
    elif policy.unlisted == "keep":
        names = listed | (native & all_op_names())  # native's own casts switched off
    else:
        names = listed | (native & all_op_names()) | {
            n for n in all_op_names() if _is_compute(n)}
    ops: dict[str, str] = {}
    entry: dict[Any, Spec] = {}
    for name in names:
        rule = policy.rule_for(name)
        if name not in listed and not _is_compute(name):
            rule = "keep"  # an unlisted rule never casts views, queries, moves
        if rule == "native" or (rule == "keep" and name not in native):
            continue
        if dispatcher_schemas(name):
            if name in native and kernels.skip_native_equal and all(
                    kernels.same_as_native(name, device_type, rule).values()):
                # Native's kernel already does exactly this (re-listing linear in a
                # white list): no kernel, no Python call per op, the same numerics.
                continue
            ops[name] = rule
            continue
        for fn in entry_points(name):
            entry[fn] = (rule, *_call_positions(fn, name))
    # Plain dicts (not MappingProxyType): torch.compile can guard on a dict whose keys
    # are functions, and nobody outside this module mutates them.
    return Rules(ops, entry, (device_type, policy) if ops else None)


NO_RULES = Rules({}, {}, None)

_LIST_TYPES = (list, tuple, set, frozenset)


@functools.lru_cache(maxsize=256)
def _cached_with_lists(base: Policy, white: tuple[Any, ...] | None,
                       black: tuple[Any, ...] | None) -> Policy:
    return base.with_lists(white, black)


def region_policy(base: Policy, white: Any, black: Any) -> Policy:
    """``base.with_lists(white, black)``, memoised on the lists' contents: a training
    loop that writes its lists inline builds the same policy every step, and resolving
    names is most of a region's entry cost."""
    if (white is None or isinstance(white, _LIST_TYPES)) and (
            black is None or isinstance(black, _LIST_TYPES)):
        try:
            return _cached_with_lists(base, None if white is None else tuple(white),
                                      None if black is None else tuple(black))
        except TypeError as exc:
            if "unhashable" not in str(exc):
                raise  # a real error from with_lists, not from the cache key
    return base.with_lists(white, black)


class PolicyMode(TorchFunctionMode):
    """The one interception point of a thread; regions swap its rules."""

    def __init__(self) -> None:
        super().__init__()
        # The active policy's table, shared by every region with an equal policy
        # (``compile_rules`` is cached by the policy's value), so torch.compile's guard
        # on it holds from one region to the next and a compiled graph is reused.
        self.rules: Mapping[Any, Spec] = NO_RULES.entry
        self.device_type = "cpu"
        self.cache: WeightCastCache | None = None

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        # Plain ``in`` and subscription on a dict, no bound builtin method: dynamo has
        # traced these on constant dicts for every torch this package supports, while a
        # stored ``dict.get`` is a skipped function to some versions (a graph break).
        rules = self.rules
        if func not in rules:
            return func(*args, **kwargs) if kwargs else func(*args)
        if kwargs and "out" in kwargs and kwargs["out"] is not None:
            # out= is never cast (native autocast's rule); it is also how the code
            # torch.compile generates calls its matmuls, which run here on every step.
            return func(*args, **kwargs)
        return self._apply(rules[func], func, args, kwargs or {})

    def _apply(self, spec: Spec, func: Any, args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> Any:
        rule, dtype_at, inplace_at = spec
        device = self.device_type
        if not torch.is_autocast_enabled(device) or (inplace_at >= 0 and (
                bool(args[inplace_at]) if len(args) > inplace_at
                else bool(kwargs.get("inplace", False)))):
            # An inner torch.autocast(enabled=False), or an in-place call: it keeps its
            # effect on the input, in the input's dtype, as under native autocast.
            return func(*args, **kwargs)
        # Native eligibility: an explicit dtype, by keyword or by position, is honoured
        # as given (out= calls never get here: __torch_function__ passes them through).
        # Inline, not a helper: this runs on every intercepted call.
        explicit = bool(kwargs) and kwargs.get("dtype") is not None
        for p in dtype_at:
            if p < len(args) and isinstance(args[p], torch.dtype):
                explicit = True
        if not explicit:
            if rule == "lower":
                # The dtype native autocast has now: the region's own, or that of a
                # torch.autocast nested inside it (docs/policies.md, "Nesting").
                low = torch.get_autocast_dtype(device)
                # A traced graph casts weights itself (and the cache's id() bookkeeping
                # cannot be traced); eager regions share casts across calls.
                cache = None if torch_internals.compiling() else self.cache
                args, kwargs = cast_op_args(args, kwargs, low, device, cache)
            elif rule == "fp32":
                args, kwargs = cast_op_args(args, kwargs, torch.float32, device, None)
            elif rule == "promote":
                target = promote_dtype(args, kwargs, device)
                if target is not None:
                    args, kwargs = cast_op_args(args, kwargs, target, device, None)
        if torch_internals.compiling():
            # Dynamo traces the context manager on every supported torch; before 2.13
            # it refuses torch.set_autocast_enabled (a graph break, fullgraph fails).
            with _native_autocast(device, enabled=False):
                return func(*args, **kwargs)
        torch.set_autocast_enabled(device, False)  # eager: cheaper than the manager
        try:
            return func(*args, **kwargs)
        finally:
            torch.set_autocast_enabled(device, True)


# A frame compiled after this line guards on the thread's ampkit policy, whether or not a
# policy region was ever entered (its graph may later run inside one).
kernels.install_compile_hooks()
