"""The engine's interception point below Python: kernels on the dispatcher's Autocast keys.

For each op a policy decides differently from native autocast, ampkit registers one
kernel per functional overload on the device's Autocast key (``AutocastCPU``,
``AutocastCUDA``, ...), the key native autocast itself uses. The dispatcher calls it only
while autocast is on for that device, and only for those ops: every other op never
leaves C++.

Registrations are process-wide, but what a kernel does is thread-local: it reads the
policy table of the innermost ampkit region entered in the calling thread (see
:func:`activate`). With no table, a table from another device, or a table without the
op, it does exactly what native autocast does: it calls native's kernel (taken from the
dispatcher before ampkit's registration replaced it) or, where native's entry is a
fallthrough, redispatches below the Autocast key. So a registration never changes what
code outside an ampkit region, or in another thread, computes. A policy equal to native
registers nothing.

With a rule, the kernel does what native autocast's kernels do: with the Autocast key
excluded (the op's inner calls and the casts are not autocast again), it casts the
eligible inputs by the rule and calls the op. Casts run above autograd, so they are
differentiated and a parameter's gradient comes back in its own dtype.

Compiled code. A compiled graph has the casts of the policy it was traced under baked
in (AOTAutograd traces through these kernels). Dynamo knows nothing of the thread's
table, so :func:`install_compile_hooks` adds two things to torch.compile: a guard on the
thread's active policy token next to the global-state guard every compiled frame has
(a graph is reused under an equal policy and never under another), and the token in
AOTAutograd's cache key (whose key is the dynamo graph, the same for every policy).
Frames compiled before ``import ampkit`` lack that guard.

Example:
    >>> import torch
    >>> import ampkit
    >>> from ampkit.engine.kernels import registered
    >>> with ampkit.autocast("cpu", torch.bfloat16, custom_black_list={"bmm"}):
    ...     torch.bmm(torch.rand(1, 2, 2), torch.rand(1, 2, 2)).dtype
    torch.float32
    >>> ("AutocastCPU", "aten::bmm") in registered()
    True
    >>> with torch.autocast("cpu", torch.bfloat16):  # outside ampkit: native's kernel
    ...     torch.bmm(torch.rand(1, 2, 2), torch.rand(1, 2, 2)).dtype
    torch.bfloat16
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from ampkit import torch_internals
from ampkit.engine.casting import WeightCastCache, cast_op_args, promote_dtype
from ampkit.policies.registry import AUTOCAST_KEYS, dispatcher_schemas

__all__ = ["activate", "hold", "install_compile_hooks", "let_go", "register", "registered",
           "same_as_native"]


class _Active(threading.local):
    """What the calling thread's innermost ampkit region asks of the kernels."""

    def __init__(self) -> None:
        self.table: Mapping[str, str] | None = None  # canonical op name -> rule
        self.device: str | None = None
        self.token: Any = None  # what compiled frames are guarded on
        self.cache: WeightCastCache | None = None


_active = _Active()


def activate(table: Mapping[str, str] | None, device: str | None, token: Any,
             cache: WeightCastCache | None) -> tuple[Any, ...]:
    """Make ``table`` the calling thread's rules; returns what to pass to :func:`restore`.

    Example:
        >>> from ampkit.engine.kernels import activate, restore
        >>> saved = activate({"add": "lower"}, "cpu", ("cpu", "p"), None)
        >>> restore(saved)
    """
    st = _active
    saved = (st.table, st.device, st.token, st.cache)
    st.table, st.device, st.token, st.cache = table, device, token, cache
    return saved


def restore(saved: tuple[Any, ...]) -> None:
    """Undo :func:`activate`.

    Example:
        >>> from ampkit.engine.kernels import activate, restore
        >>> restore(activate(None, None, None, None))
    """
    st = _active
    st.table, st.device, st.token, st.cache = saved


# -- registration ---------------------------------------------------------------------------

_lock = threading.Lock()
_libraries: dict[str, torch.library.Library] = {}  # namespace -> its IMPL library
_registered: set[tuple[str, str]] = set()  # (dispatch key, "ns::op.overload")


_generation = 0  # bumped by release(): rule tables registered before must register again
# Regions whose rules use the kernels now, in any thread: release() refuses while one
# is live. id(holder) -> (thread ident, what to name in the error).
_holders: dict[int, tuple[int, str]] = {}


def hold(holder: object, what: str) -> None:
    """Mark the kernels as used by ``holder`` (a region, named ``what`` in errors) in
    the calling thread until :func:`let_go`: :func:`release` refuses meanwhile. Holding
    first and then checking :func:`generation` leaves no moment in which another
    thread's ``release()`` could take the kernels from under a region.

    Example:
        >>> from ampkit.engine.kernels import hold, let_go
        >>> token = object()
        >>> hold(token, "a region")
        >>> let_go(token)
    """
    with _lock:
        _holders[id(holder)] = (threading.get_ident(), what)


def let_go(holder: object) -> None:
    """Undo :func:`hold` (no error if ``holder`` holds nothing).

    Example:
        >>> from ampkit.engine.kernels import let_go
        >>> let_go(object())
    """
    with _lock:
        _holders.pop(id(holder), None)


def generation() -> int:
    """How many times :func:`release` has run: a rule table registered at an older
    generation registers its ops again.

    Example:
        >>> from ampkit.engine.kernels import generation
        >>> generation() >= 0
        True
    """
    return _generation


def release() -> None:
    """Take all of ampkit's kernels off the dispatcher.

    While registered, a listed op called under autocast outside any ampkit region pays
    one Python call (the kernel defers to native autocast). This removes them; the next
    region whose policy needs them registers them again. Call it outside any region:
    while a region that uses them is live, in any thread, it raises and changes
    nothing (that region would otherwise silently compute as native autocast does).

    Raises:
        RuntimeError: a live region uses the kernels (each named, with its thread).

    Example:
        >>> import torch
        >>> import ampkit
        >>> from ampkit.engine.kernels import registered, release
        >>> with ampkit.autocast("cpu", custom_black_list={"bmm"}):
        ...     pass
        >>> release()
        >>> registered()
        frozenset()
    """
    global _generation
    with _lock:
        names = {t.ident: t.name for t in threading.enumerate()}
        for key in [k for k, (ident, _) in _holders.items() if ident not in names]:
            del _holders[key]  # a thread that ended inside a region holds nothing
        if _holders:
            users = "; ".join(f"{what} in thread {names[ident]!r}"
                              for ident, what in _holders.values())
            raise RuntimeError(f"release_kernels(): {len(_holders)} live ampkit region(s) "
                               f"use the kernels ({users}); without them the region's "
                               f"lists would silently stop applying. Call it after "
                               f"those regions exit")
        for library in _libraries.values():
            torch_internals.destroy_library(library)
        _libraries.clear()
        _registered.clear()
        _generation += 1


def registered() -> frozenset[tuple[str, str]]:
    """The ``(dispatch key, "ns::op.overload")`` pairs ampkit has kernels on.

    Example:
        >>> from ampkit.engine.kernels import registered
        >>> isinstance(registered(), frozenset)
        True
    """
    return frozenset(_registered)


def _qualname(name: str) -> str:
    return name if "::" in name else f"aten::{name}"


def _overload(qualname: str, schema: Any) -> Any:
    namespace, _, op = qualname.partition("::")
    packet = getattr(getattr(torch.ops, namespace), op)
    return getattr(packet, schema.overload_name or "default")


def _kernel(device: str, key: str, name: str, op: Any, schema: Any) -> Callable[..., Any]:
    """The Autocast kernel of one overload ``op`` of canonical op ``name``."""
    # The key itself (excluded while casting) and what a fallthrough at this key would
    # go on with: the keys after it.
    below, after = torch_internals.redispatch_keysets(key)
    full_name = f"{schema.name}.{schema.overload_name}" if schema.overload_name else schema.name
    native: Any = torch_internals.native_kernel(full_name, key)
    dtype_at = tuple(i for i, a in enumerate(schema.arguments)
                     if a.name == "dtype" and not a.kwarg_only)
    kinds = [str(a.type) for a in schema.arguments]
    # Tensor parameters that Python code may fill with a number (``x / 16``): the
    # dispatcher hands the kernel the number, and a redispatch needs a tensor again.
    # A 0-dim tensor of the number's kind promotes as the wrapped number did.
    number_at = tuple(i for i, a in enumerate(schema.arguments)
                      if kinds[i] == "Tensor" and not a.kwarg_only)
    # Where a cast may apply, read once from the schema (this is the hot path):
    # positional single tensors, positional tensor lists, keyword-only tensors.
    tensor_at = tuple(i for i, a in enumerate(schema.arguments)
                      if kinds[i] in ("Tensor", "Optional[Tensor]") and not a.kwarg_only)
    tensors_at = tuple(i for i, a in enumerate(schema.arguments)
                       if "Tensor" in kinds[i] and "List[" in kinds[i] and not a.kwarg_only)
    has_kw_tensors = any("Tensor" in kinds[i] for i, a in enumerate(schema.arguments)
                         if a.kwarg_only)
    numbers = (bool, int, float, complex)
    tensor_type = torch.Tensor
    float32, float64 = torch.float32, torch.float64
    on_cpu = device == "cpu"
    exclude = torch_internals.ExcludeKeys
    get_dtype = torch.get_autocast_dtype
    is_compiling = torch_internals.compiling
    # the bound builtin, without OpOverload.__call__'s Python frame
    call = torch_internals.op_builtin(op)

    def cast(args: tuple[Any, ...], kwargs: dict[str, Any], dtype: torch.dtype,
             cache: WeightCastCache | None) -> tuple[tuple[Any, ...], dict[str, Any]]:
        # cast_op_args' rule (native autocast's eligibility), specialised by the schema.
        out: list[Any] | None = None
        n = len(args)
        for p in tensor_at:
            if p >= n:
                break
            a = args[p]
            if (type(a) is not tensor_type and not isinstance(a, tensor_type)) or (
                    a.dtype is dtype or a.dtype is float64 or not a.is_floating_point()
                    or not (a.is_cpu if on_cpu else a.device.type == device)):
                continue
            if out is None:
                out = list(args)
            out[p] = cache.cast(a, dtype) if cache is not None and dtype is not float32 \
                else a.to(dtype)
        if tensors_at:
            if out is None:
                out = list(args)
            for p in tensors_at:
                if p < n:
                    out[p] = cast_op_args((args[p],), {}, dtype, device, cache)[0][0]
        if has_kw_tensors and kwargs:
            kwargs = cast_op_args((), kwargs, dtype, device, cache)[1]
        return (args if out is None else tuple(out)), kwargs

    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        st = _active
        table = st.table
        rule = table.get(name) if table is not None and st.device == device else None
        if rule is None:  # not this thread's policy's business: native autocast's
            if native is not None:
                return native.call_boxed(keyset, *args, **kwargs)
            for p in number_at:
                if p < len(args) and isinstance(args[p], numbers):
                    args = (*args[:p], torch.tensor(args[p]), *args[p + 1:])
            return op.redispatch(keyset & after, *args, **kwargs)
        with exclude(below):
            # An explicit dtype, by keyword or by position, is honoured as given.
            explicit = kwargs.get("dtype") is not None if kwargs else False
            for p in dtype_at:
                if p < len(args) and args[p] is not None:
                    explicit = True
            if not explicit:
                if rule == "lower":
                    # The dtype native autocast has now: the region's own, or that of a
                    # torch.autocast nested inside it (docs/policies.md, "Nesting").
                    # Traced code casts weights itself; eager regions share casts.
                    cache = st.cache
                    args, kwargs = cast(args, kwargs, get_dtype(device),
                                        None if cache is None or is_compiling() else cache)
                elif rule == "fp32":
                    args, kwargs = cast(args, kwargs, float32, None)
                elif rule == "promote":
                    target = promote_dtype(args, kwargs, device)
                    if target is not None:
                        args, kwargs = cast_op_args(args, kwargs, target, device, None)
            return call(*args, **kwargs)

    # Called from C++ while a compiled function runs (dynamo's frame callback on), the
    # kernel's frame would be handed to dynamo as a new frame to compile: it must run as
    # plain Python, and so must what it calls (each closure shares this code object).
    torch_internals.skip_code(kernel.__code__, recursive=True)
    return kernel


def _autocast_key(device: str) -> str:
    return AUTOCAST_KEYS.get(device, "AutocastPrivateUse1")


def register(device: str, names: Iterable[str] | Mapping[str, str]) -> None:
    """Put ampkit's kernel on ``device``'s Autocast key for every functional dispatcher
    overload (:func:`ampkit.policies.registry.dispatcher_schemas`) of each op in ``names`` that
    does not have it yet. Given a mapping ``name -> rule``, an overload whose native
    rule is that rule (:func:`same_as_native`) gets no kernel: native's computes the
    same.

    Example:
        >>> from ampkit.engine.kernels import register, registered
        >>> register("cpu", ["baddbmm"])
        >>> ("AutocastCPU", "aten::baddbmm") in registered()
        True
    """
    key = _autocast_key(device)
    rules = names if isinstance(names, Mapping) and skip_native_equal else {}
    # Probed before the lock is taken (each probe calls native's kernel).
    same = {name: same_as_native(name, device, rule) for name, rule in rules.items()
            if rule in _NATIVE_RULES}
    with _lock:
        for name in names:
            qualname = _qualname(name)
            for schema in dispatcher_schemas(name):
                full = (f"{qualname}.{schema.overload_name}" if schema.overload_name
                        else qualname)
                if (key, full) in _registered or (name in same and same[name].get(full)):
                    continue
                namespace, _, op_name = full.partition("::")
                kernel = _kernel(device, key, name, _overload(qualname, schema), schema)
                library = _libraries.get(namespace)
                if library is None:
                    library = _libraries[namespace] = torch.library.Library(namespace, "IMPL")
                with warnings.catch_warnings():
                    # "Overriding a previously registered kernel": by design, and
                    # native's kernel was taken above to defer to.
                    warnings.simplefilter("ignore", UserWarning)
                    library.impl(op_name, kernel, key, with_keyset=True)
                _registered.add((key, full))
    install_compile_hooks()


# -- native's rule for an op, read from native's own kernel -----------------------------------

class _Reached(Exception):  # noqa: N818 - a signal, not an error
    """The probe learnt what it asked: the casts native's kernel made, and whether
    that answers the question (every expected cast made) or the kernel handed on to
    an op first."""

    def __init__(self, casts: list[tuple[torch.dtype, torch.dtype]], complete: bool) -> None:
        super().__init__()
        self.casts, self.complete = casts, complete


class _Probe:
    """The state of one probe call: the casts expected, the casts seen."""

    def __init__(self, expected: list[tuple[torch.dtype, torch.dtype]]) -> None:
        self.expected = expected
        self.casts: list[tuple[torch.dtype, torch.dtype]] = []


class _ProbeTensor(torch.Tensor):
    """A one-element tensor with no data that shows what native's kernel does with it.
    Once the casts the probe expects are made it stops the call (no op runs); another
    op first stops it too. A tensor subclass, not a dispatch mode: entering a mode
    imports torch._dynamo (seconds)."""

    __torch_function__ = torch_internals.disabled_torch_function_impl
    probe: _Probe

    @staticmethod
    def __new__(cls, dtype: torch.dtype, device: torch.device, probe: _Probe) -> _ProbeTensor:
        made: _ProbeTensor = torch_internals.make_wrapper_subclass(
            cls, (1,), dtype=dtype, device=device)
        made.probe = probe
        return made

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (),  # type: ignore[override]
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        first = args[0]
        probe = _probe_of(args, kwargs)
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") is not None:
            probe.casts.append((first.dtype, kwargs["dtype"]))
            if probe.casts == probe.expected:
                raise _Reached(probe.casts, True)
            return _ProbeTensor(kwargs["dtype"], first.device, probe)
        raise _Reached(probe.casts, False)


def _probe_of(args: Any, kwargs: Any) -> _Probe:
    for value in (*args, *kwargs.values()):
        for item in value if isinstance(value, list | tuple) else (value,):
            if isinstance(item, _ProbeTensor):
                return item.probe
    raise AssertionError("a probe call without a probe tensor")  # pragma: no cover


def _native_casts(op: Any, schema: Any, device: str, given: torch.dtype,
                  to: torch.dtype) -> bool:
    """Whether native's Autocast kernel of ``op`` (in a bf16 region), given every tensor
    input in ``given``, casts each of them to ``to`` before it hands on. Unknown (a
    schema the probe cannot fill, a kernel that does something else) is ``False``."""
    required = [a for a in schema.arguments if not a.has_default_value()]
    kinds = [str(a.type) for a in required]
    count = sum(2 if k.startswith("List[") else 1 for k in kinds if "Tensor" in k)
    if not count:
        return False
    probe = _Probe([(given, to)] * count)
    where = torch.device(device)
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for argument, kind in zip(required, kinds):
        value: Any
        if kind in ("Tensor", "Optional[Tensor]"):
            value = _ProbeTensor(given, where, probe)
        elif kind in ("List[Tensor]", "List[Optional[Tensor]]"):
            value = [_ProbeTensor(given, where, probe) for _ in range(2)]
        elif kind.startswith("Optional["):
            value = None
        else:
            value = _PROBE_VALUES.get(kind, _PROBE_VALUES)
            if value is _PROBE_VALUES:
                return False
        if argument.kwarg_only:
            kwargs[argument.name] = value
        else:
            args.append(value)
    saved = activate(None, None, None, None)  # ampkit's kernels, if any: native's way
    try:
        # The user's dispatch modes (a profiler, op counter, NaN checker) must not see the
        # probe's call: it is ampkit's question to torch, not an op of the program.
        with torch_internals.disable_current_modes(), torch.autocast(device, torch.bfloat16):
            op(*args, **kwargs)
    except _Reached as reached:
        return reached.complete
    except Exception:  # the op's own checks refused the probe's inputs: not known
        return False
    finally:
        restore(saved)
    return False


_PROBE_VALUES: dict[str, Any] = {"int": 1, "SymInt": 1, "float": 1.0, "bool": False,
                                 "Scalar": 1, "List[int]": [1], "List[SymInt]": [1]}


def _native_does(op: Any, schema: Any, device: str, rule: str) -> bool:
    """Whether native's kernel of ``op`` applies ``rule`` (``"lower"``: every fp32
    input to the low dtype; ``"fp32"``: every low input to fp32). Not ``"promote"``:
    native's promote refuses a low dtype other than the region's (``cat`` of fp16 and
    fp32 under bf16 raises), where ampkit's promotes to the widest."""
    low, f32 = torch.bfloat16, torch.float32
    if rule == "lower":
        # An op native runs in fp32 does not lower. Asked first, that probe stops at
        # native's cast; the "lower" probe would run such an op's own body on fp32
        # inputs, and its warnings (deprecated qr, lu_solve; stft without a window)
        # would reach the user of a program that never called it.
        return (not _native_casts(op, schema, device, low, f32)
                and _native_casts(op, schema, device, f32, low))
    if rule == "fp32":
        return _native_casts(op, schema, device, low, f32)
    return False


_native_same: dict[tuple[str, str, str], dict[str, bool]] = {}
#: False: native-equal entries take ampkit's kernels all the same. For tests that check
#: ampkit's casts against native's op by op (clear ``_compile_rules``' cache around).
skip_native_equal = True
#: The rules of ampkit's that a native kernel can apply exactly (see _native_does).
_NATIVE_RULES = frozenset({"lower", "fp32"})


def same_as_native(name: str, device: str, rule: str) -> dict[str, bool]:
    """For each functional overload of op ``name`` (``"ns::op.overload"``), whether
    native autocast's kernel on ``device`` already applies ``rule`` to it. Read from
    native's own Autocast kernel: called on data-less one-element tensors, it shows
    which inputs it casts to what, and is stopped before any op runs. An ampkit entry
    needs no kernel where native already does the same.

    Example:
        >>> from ampkit.engine.kernels import same_as_native
        >>> same_as_native("mse_loss", "cpu", "fp32")
        {'aten::mse_loss': True}
        >>> same_as_native("mm", "cpu", "lower")  # mm.dtype: no native kernel
        {'aten::mm': True, 'aten::mm.dtype': False}
        >>> same_as_native("mm", "cpu", "fp32")
        {'aten::mm': False, 'aten::mm.dtype': False}
    """
    key = (name, device, rule)
    cached = _native_same.get(key)
    if cached is not None:
        return cached
    autocast_key = _autocast_key(device)
    qualname = _qualname(name)
    try:
        available = torch.amp.is_autocast_available(device) and (
            device == "cpu" or bool(getattr(torch, device).is_available()))
    except (AttributeError, RuntimeError):
        available = False
    same: dict[str, bool] = {}
    for schema in dispatcher_schemas(name):
        full = f"{qualname}.{schema.overload_name}" if schema.overload_name else qualname
        native = f"{schema.name}.{schema.overload_name}" if schema.overload_name \
            else schema.name
        same[full] = bool(
            rule in _NATIVE_RULES and available
            and torch_internals.has_kernel(native, autocast_key)
            and _native_does(_overload(qualname, schema), schema, device, rule))
    _native_same[key] = same
    return same


# -- torch.compile: a guard on the thread's policy, and the policy in the cache key -----------

def _token() -> Any:
    return _active.token


def install_compile_hooks() -> None:
    """Make torch.compile guard on (and cache by) the calling thread's ampkit policy:
    now for what is imported, on import for the rest (the patches of dynamo's classes
    are :mod:`ampkit.torch_internals.dynamo`'s). Idempotent.

    Example:
        >>> from ampkit.engine.kernels import install_compile_hooks
        >>> install_compile_hooks()
    """
    torch_internals.install_compile_hooks(_token)
