"""The op-level autocast engine: ``ampkit.autocast``.

How it works, in one paragraph: every region enters native ``torch.autocast``, which
keeps doing what it already does, at native speed. Only the ops whose rule under the
region's :class:`~ampkit.policy.Policy` differs from native autocast are intercepted,
by one ``TorchFunctionMode`` per thread; an intercepted op has its inputs cast by the
policy's rule and then runs with native autocast switched off for that one call. A
policy equal to native autocast (the default, ``"torch"``) pushes no mode at all.

Because interception happens above autograd, casts are differentiated and each
parameter's gradient comes back in that parameter's own dtype. The mode stack is
thread-local, so two threads can run different policies; an inner region (including
``enabled=False``) overrides the outer one until it exits.

Python-level composite functions (``F.multi_head_attention_forward``,
``F.interpolate``) are one op to the engine: their own rule (if any) applies to their
inputs, and the ops they call inside are left to native autocast.

Example:
    >>> import torch
    >>> import ampkit
    >>> a, b = torch.rand(2, 3), torch.rand(2, 3)
    >>> with ampkit.autocast("cpu", torch.float16, custom_white_list={"add"}):
    ...     (a + b).dtype
    torch.float16
    >>> conv = torch.nn.Conv2d(3, 2, 3, bias=False)
    >>> x = torch.rand(1, 3, 8, 8)
    >>> with ampkit.autocast("cpu", torch.float16, custom_black_list={"conv2d"}):
    ...     conv(x).dtype
    torch.float32
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import torch
from torch.overrides import TorchFunctionMode

from ampkit.casting import WeightCastCache, cast_op_args, promote_dtype
from ampkit.policy import Policy, as_dtype
from ampkit.presets import get_policy
from ampkit.registry import OpEntry, all_op_names, entry_points

__all__ = ["autocast", "current_policy", "native_op_names"]

F = TypeVar("F", bound=Callable[..., Any])

# Ops that move, view or describe data rather than compute on it. A policy's rule for
# unlisted ops never touches them: casting the input of ``x.view(...)`` would turn a
# view into a copy.
_NOT_COMPUTE = frozenset({
    "to", "type", "type_as", "float", "double", "half", "bfloat16", "int", "long", "short",
    "bool", "byte", "char", "cpu", "cuda", "size", "dim", "numel", "nelement", "element_size",
    "stride", "storage_offset", "data_ptr", "is_contiguous", "is_floating_point",
    "is_complex", "is_same_size", "view", "view_as", "reshape", "reshape_as", "expand",
    "expand_as", "permute", "transpose", "swapaxes", "swapdims", "moveaxis", "movedim", "t",
    "contiguous", "clone", "detach", "squeeze", "unsqueeze", "flatten", "unflatten",
    "narrow", "select", "chunk", "split", "tensor_split", "unbind", "item", "tolist",
    "numpy", "requires_grad", "retain_grad", "backward", "register_hook", "get_device",
    "new_empty", "new_zeros", "new_ones", "new_full", "new_tensor", "empty_like",
    "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "randint_like",
    "pin_memory", "share_memory", "record_stream", "untyped_storage", "storage",
    "as_strided", "diagonal", "unfold", "roll", "flip", "fliplr", "flipud", "rot90", "tile",
    "repeat", "repeat_interleave", "index_select", "gather", "take", "masked_select",
    "nonzero", "argmax", "argmin", "argsort", "sort", "topk", "max", "min", "eq", "ne",
    "lt", "le", "gt", "ge", "equal", "allclose", "isclose", "isfinite", "isinf", "isnan",
    "is_nonzero", "sign", "any", "all", "count_nonzero", "where", "broadcast_to",
    "broadcast_tensors", "atleast_1d", "atleast_2d", "atleast_3d", "pad", "dropout",
})

# Name prefixes of queries and layout/metadata helpers (x.is_pinned(), x.new_empty(...),
# x.to_dense(), torch.get_default_dtype()): never compute, never cast by an unlisted rule.
_NOT_COMPUTE_PREFIXES = ("is_", "has_", "get_", "set_", "new_", "to_", "dim_")


def _is_compute(name: str) -> bool:
    return name not in _NOT_COMPUTE and not name.startswith(_NOT_COMPUTE_PREFIXES)


_AUTOCAST_KEYS = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA", "xpu": "AutocastXPU",
                  "mps": "AutocastMPS", "hpu": "AutocastHPU", "xla": "AutocastXLA",
                  "mtia": "AutocastMTIA", "ipu": "AutocastIPU"}


@functools.cache
def native_op_names(device_type: str) -> frozenset[str]:
    """Canonical names of the ops native autocast changes on ``device_type``.

    Read from the dispatcher's registrations for the device's autocast key, so it is
    exact for the running torch build.

    Example:
        >>> from ampkit.autocast_mode import native_op_names
        >>> {"linear", "conv2d"} <= native_op_names("cpu")
        True
    """
    key = _AUTOCAST_KEYS.get(device_type, "AutocastPrivateUse1")
    try:
        regs = torch._C._dispatch_get_registrations_for_dispatch_key(key)
    except RuntimeError:
        return frozenset()
    return frozenset(r.split("::", 1)[-1].split(".", 1)[0] for r in regs)


# ``entry point -> position of its inplace parameter`` (F.relu(x, inplace=True), ...).
# Such a call writes into its input: no rule applies to it, as to F.relu_ itself.
_INPLACE_ARG: dict[Any, int] = {}


def _fill_inplace_table() -> None:
    """Fill ``_INPLACE_ARG`` for every registry entry point, once: a table that never
    changes afterwards keeps compiled code's guard on it valid."""
    if _INPLACE_ARG:
        return
    for name in all_op_names():
        for fn in entry_points(name):
            if not inspect.isfunction(fn):
                continue
            try:
                params = list(inspect.signature(fn, follow_wrapped=False).parameters)
            except (TypeError, ValueError):  # a builtin behind a Python wrapper
                continue
            if "inplace" in params:
                _INPLACE_ARG[fn] = params.index("inplace")


def _is_inplace_call(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if func not in _INPLACE_ARG:
        return False
    pos = _INPLACE_ARG[func]
    if len(args) > pos:
        return bool(args[pos])
    return bool(kwargs["inplace"]) if "inplace" in kwargs else False


@functools.lru_cache(maxsize=64)
def _compile_rules(policy: Policy, device_type: str) -> Mapping[Any, str]:
    """``entry point -> rule`` for the ops this policy decides differently from native
    autocast. Empty for a native-equal policy: then nothing is intercepted."""
    if policy.is_native:
        return {}
    _fill_inplace_table()
    native = native_op_names(device_type) & all_op_names()
    listed = policy.lower_precision_ops | policy.fp32_ops | policy.promote_ops
    if policy.unlisted == "native":
        names: Iterable[str] = listed
    elif policy.unlisted == "keep":
        names = listed | native  # native's own casts must be switched off for these
    else:
        names = listed | native | {n for n in all_op_names() if _is_compute(n)}
    rules: dict[Any, str] = {}
    for name in names:
        rule = policy.rule_for(name)
        if name not in listed and not _is_compute(name):
            rule = "keep"  # an unlisted rule never casts data-movement ops or queries
        if rule == "native" or (rule == "keep" and name not in native):
            continue
        for fn in entry_points(name):
            rules[fn] = rule
    # A plain dict (not a MappingProxyType): torch.compile can guard on a dict whose
    # keys are functions, and nobody outside this module mutates it.
    return rules


_NO_RULES: Mapping[Any, str] = {}

_LIST_TYPES = (list, tuple, set, frozenset)


@functools.lru_cache(maxsize=256)
def _cached_with_lists(base: Policy, white: tuple[Any, ...] | None,
                       black: tuple[Any, ...] | None) -> Policy:
    return base.with_lists(white, black)


def _region_policy(base: Policy, white: Any, black: Any) -> Policy:
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


class _PolicyMode(TorchFunctionMode):
    """The one interception point of a thread; regions swap its rules."""

    def __init__(self) -> None:
        super().__init__()
        # The active policy's table, shared by every region with an equal policy
        # (``_compile_rules`` is cached by the policy's value), so torch.compile's guard
        # on it holds from one region to the next and a compiled graph is reused.
        self.rules: Mapping[Any, str] = _NO_RULES
        self.device_type = "cpu"
        self.dtype = torch.bfloat16
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

    def _apply(self, rule: str, func: Any, args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> Any:
        device = self.device_type
        if not torch.is_autocast_enabled(device) or _is_inplace_call(func, args, kwargs):
            # An inner torch.autocast(enabled=False), or an in-place call: it keeps its
            # effect on the input, in the input's dtype, as under native autocast.
            return func(*args, **kwargs)
        # Native eligibility: an explicit dtype= is honoured as given (out= calls never
        # get here: __torch_function__ passes them through).
        if kwargs.get("dtype") is None:
            if rule == "lower":
                # A traced graph casts weights itself (and the cache's id() bookkeeping
                # cannot be traced); eager regions share casts across calls.
                cache = None if torch.compiler.is_compiling() else self.cache
                args, kwargs = cast_op_args(args, kwargs, self.dtype, device, cache)
            elif rule == "fp32":
                args, kwargs = cast_op_args(args, kwargs, torch.float32, device, None)
            elif rule == "promote":
                target = promote_dtype(args, kwargs, device)
                if target is not None:
                    args, kwargs = cast_op_args(args, kwargs, target, device, None)
        if torch.compiler.is_compiling():
            # Dynamo traces the context manager on every supported torch; before 2.13
            # it refuses torch.set_autocast_enabled (a graph break, fullgraph fails).
            with torch.autocast(device, enabled=False):
                return func(*args, **kwargs)
        torch.set_autocast_enabled(device, False)  # eager: cheaper than the manager
        try:
            return func(*args, **kwargs)
        finally:
            torch.set_autocast_enabled(device, True)


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.mode: _PolicyMode | None = None
        self.stack: list[tuple[Any, ...]] = []
        self.cache = WeightCastCache()
        self.policies: list[tuple[str, Policy | None]] = []


_state = _ThreadState()


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _autocast_available(device_type: str) -> bool:
    try:
        return bool(torch._C._is_autocast_available(device_type))
    except RuntimeError:  # not a device type torch knows at all
        return False


def _check_device(device_type: Any) -> str:
    if not isinstance(device_type, str) or not _autocast_available(device_type):
        accepted = [d for d in _AUTOCAST_KEYS if _autocast_available(d)]
        raise ValueError(f"device_type must be a device type that torch.autocast supports, "
                         f"one of {accepted}, got {device_type!r}")
    return device_type


def current_policy(device_type: str = "cpu") -> Policy | None:
    """The policy of the innermost enabled ampkit region for ``device_type`` in this
    thread, or ``None`` outside any (or inside an ``enabled=False`` one).

    Example:
        >>> import ampkit
        >>> from ampkit.autocast_mode import current_policy
        >>> with ampkit.autocast("cpu", policy="conservative"):
        ...     current_policy("cpu").name
        'conservative'
        >>> current_policy("cpu") is None
        True
    """
    for dev, policy in reversed(_state.policies):
        if dev == device_type:
            return policy
    return None


class autocast:
    """Run ops in mixed precision by a policy: native ``torch.autocast`` plus custom
    lists. A context manager and a decorator.

    Args:
        device_type: ``"cpu"``, ``"cuda"`` or any device ``torch.autocast`` supports;
            ``None`` picks ``"cuda"`` when available, else ``"cpu"``.
        dtype: ``torch.float16`` or ``torch.bfloat16`` (or their names); ``None`` takes
            the policy's dtype, else the device's autocast default.
        enabled: ``False`` turns autocast off inside the region (overriding outer ones).
        policy: a preset name (``"torch"``, ``"conservative"``, ...) or a
            :class:`~ampkit.policy.Policy`.
        custom_white_list: ops to run in ``dtype`` (names, callables, module classes).
        custom_black_list: ops to run in float32.
        cache_enabled: keep low-precision casts of weights for the outermost region.

    Example:
        >>> import torch
        >>> import ampkit
        >>> lin = torch.nn.Linear(4, 4)
        >>> @ampkit.autocast("cpu", torch.bfloat16, custom_black_list=[torch.nn.Linear])
        ... def forward(x):
        ...     return lin(x)
        >>> forward(torch.rand(2, 4)).dtype
        torch.float32
    """

    # Dynamo must not trace ampkit's own bookkeeping (thread-local state, rule tables):
    # inside compiled code a region's entry and exit are graph breaks, and the ops in
    # between are traced with the region active. A region around the compiled call
    # costs no graph break at all.
    @torch.compiler.disable
    def __init__(self, device_type: str | None = None, dtype: torch.dtype | str | None = None,
                 *, enabled: bool = True, policy: str | Policy = "torch",
                 custom_white_list: Iterable[OpEntry] | None = None,
                 custom_black_list: Iterable[OpEntry] | None = None,
                 cache_enabled: bool = True) -> None:
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
        if not isinstance(cache_enabled, bool):
            raise TypeError(f"cache_enabled must be a bool, got {type(cache_enabled).__name__}")
        self.device_type = _check_device(_default_device() if device_type is None
                                         else device_type)
        base = get_policy(policy)
        chosen = as_dtype(dtype)
        self.policy: Policy = _region_policy(base, custom_white_list, custom_black_list)
        self.dtype: torch.dtype = (chosen or self.policy.dtype
                                   or torch.get_autocast_dtype(self.device_type))
        self.enabled = enabled
        self.cache_enabled = cache_enabled
        self._rules = _compile_rules(self.policy, self.device_type) if enabled else {}

    @torch.compiler.disable
    def __enter__(self) -> autocast:
        st = _state
        cache = self.cache_enabled
        if cache and torch.is_autocast_enabled(self.device_type) and (
                torch.get_autocast_dtype(self.device_type) != self.dtype):
            # Native autocast keys its weight cache by tensor only, so an inner region
            # with another dtype would get the outer dtype's casts (a dtype-mismatch
            # error in torch.autocast). Not caching in that inner region avoids it.
            cache = False
        native = torch.autocast(self.device_type, self.dtype, enabled=self.enabled,
                                cache_enabled=cache)
        native.__enter__()
        mode, pushed = st.mode, False
        saved = None
        if self._rules and mode is None:
            mode = st.mode = _PolicyMode()
            mode.__enter__()
            pushed = True
        if mode is not None:
            saved = (mode.rules, mode.device_type, mode.dtype, mode.cache)
            mode.rules, mode.device_type, mode.dtype = self._rules, self.device_type, self.dtype
            mode.cache = st.cache if self.cache_enabled else None
        st.stack.append((native, pushed, saved))
        st.policies.append((self.device_type, self.policy if self.enabled else None))
        return self

    @torch.compiler.disable
    def __exit__(self, *exc: Any) -> None:
        st = _state
        native, pushed, saved = st.stack.pop()
        st.policies.pop()
        mode = st.mode
        if mode is not None and saved is not None:
            mode.rules, mode.device_type, mode.dtype, mode.cache = saved
        if pushed and mode is not None:
            mode.__exit__(*exc)
            st.mode = None
        if not st.stack:
            st.cache.clear()
        native.__exit__(*exc)

    def __call__(self, fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self:
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    def __repr__(self) -> str:
        return (f"ampkit.autocast(device_type={self.device_type!r}, dtype={self.dtype}, "
                f"enabled={self.enabled}, policy={self.policy.name!r})")
