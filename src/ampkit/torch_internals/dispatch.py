"""The dispatcher, op objects, Python-level dispatch, pytree, autograd state and DTensor
offsets: the torch internals ampkit's engine and tools read (see
:mod:`ampkit.torch_internals`).

Example:
    >>> from ampkit.torch_internals.dispatch import has_kernel
    >>> has_kernel("aten::mm", "AutocastCPU")
    True
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ampkit.torch_internals.entries import fail, register_entry, resolve

# Each private name is read through resolve(): a torch that lacks it gets a stand-in that
# raises TorchInternalsError where it is used, and the entry is disabled at import.

# -- the dispatcher ----------------------------------------------------------------------------

_C: Any = torch._C  # private bindings, not all in torch's stubs
#: a guard that excludes a dispatch key set from dispatch while it is held
ExcludeKeys: Any = resolve("dispatcher", "ExcludeKeys", lambda: _C._ExcludeDispatchKeyGuard)

__all__ = ["OpOverload", "OpOverloadPacket", "TorchDispatchMode", "current_autograd_node",
           "disable_current_modes", "disabled_torch_function_impl", "has_kernel",
           "lazy_check_dispatch_mode", "local_shape_and_offset", "native_kernel",
           "op_object_qualname", "redispatch_keysets", "registrations", "saved_tensors_hooks_free",
           "schema_exists", "schemas_of", "tree_leaves", "tree_map"]


def redispatch_keysets(key: str) -> tuple[Any, Any]:
    """For dispatch key ``key`` (``"AutocastCPU"``): the key set an Autocast kernel
    excludes while it casts and calls the op (the key itself), and the keys a
    fallthrough at the key would go on with (those after it, less the Python
    dispatcher, which tracing enables and which would resolve the op to this key again).

    Example:
        >>> from ampkit.torch_internals import redispatch_keysets
        >>> below, after = redispatch_keysets("AutocastCPU")
    """
    dispatch_key = getattr(_C.DispatchKey, key)
    return (_C.DispatchKeySet(dispatch_key),
            _C._dispatch_keyset_full_after(dispatch_key).remove(
                _C.DispatchKey.PythonDispatcher))


def has_kernel(op: str, key: str) -> bool:
    """Whether overload ``op`` (``"aten::mm"``, ``"aten::add.Tensor"``) has a kernel of
    its own (not a fallthrough) at dispatch key ``key``.

    Example:
        >>> from ampkit.torch_internals import has_kernel
        >>> has_kernel("aten::mm", "AutocastCPU"), has_kernel("aten::view", "AutocastCPU")
        (True, False)
    """
    return bool(_C._dispatch_has_kernel_for_dispatch_key(op, key)
                and not _C._dispatch_kernel_for_dispatch_key_is_fallthrough(op, key))


def native_kernel(op: str, key: str) -> Any:
    """The kernel overload ``op`` has at ``key`` (public ``torch.library.get_kernel``),
    or ``None`` where it has none of its own.

    Example:
        >>> from ampkit.torch_internals import native_kernel
        >>> native_kernel("aten::view", "AutocastCPU") is None
        True
    """
    return torch.library.get_kernel(op, key) if has_kernel(op, key) else None


def registrations(key: str) -> list[str]:
    """The ops (``"aten::mm"``, ``"ns::op.overload"``) with a registration at dispatch
    key ``key``; empty where torch knows no such key.

    Example:
        >>> from ampkit.torch_internals import registrations
        >>> "aten::mm" in registrations("AutocastCPU")
        True
    """
    try:
        return list(_C._dispatch_get_registrations_for_dispatch_key(key))
    except RuntimeError:
        return []


def schemas_of(qualname: str) -> list[Any]:
    """The schemas of every overload of op ``qualname`` (``"aten::add"``).

    Example:
        >>> from ampkit.torch_internals import schemas_of
        >>> sorted(s.overload_name for s in schemas_of("aten::mm"))[:2]
        ['', 'dtype']
    """
    return list(_C._jit_get_schemas_for_operator(qualname))


def schema_exists(qualname: str, overload: str) -> bool:
    """Whether the dispatcher has overload ``overload`` of ``qualname`` (TorchScript
    knows a few schemas the dispatcher lacks).

    Example:
        >>> from ampkit.torch_internals import schema_exists
        >>> schema_exists("aten::mm", ""), schema_exists("aten::mm", "nope")
        (True, False)
    """
    try:
        _C._dispatch_find_schema_or_throw(qualname, overload)
    except AttributeError as error:  # a torch without it: say so, naming the entry
        raise fail("schemas", f"is missing ({error})") from error
    except RuntimeError:
        return False
    return True


@register_entry("dispatcher", ("torch._C.DispatchKey", "torch._C.DispatchKeySet",
                       "torch._C._dispatch_keyset_full_after",
                       "torch._C._dispatch_has_kernel_for_dispatch_key",
                       "torch._C._dispatch_kernel_for_dispatch_key_is_fallthrough",
                       "torch._C._dispatch_get_registrations_for_dispatch_key",
                       "torch._C._ExcludeDispatchKeyGuard"),
        "read which ops native autocast registers on a device and whether an op has a "
        "kernel of its own there; ampkit's Autocast kernels exclude their key and "
        "redispatch past it",
        "torch.library.Library.impl registers the kernels and torch.library.get_kernel "
        "reads one; nothing public lists a key's registrations or redispatches",
        provides=("ExcludeKeys", "redispatch_keysets", "has_kernel", "native_kernel",
                  "registrations"))
def _check_dispatcher() -> None:
    regs = registrations("AutocastCPU")
    if "aten::mm" not in regs or "aten::view" in regs:
        raise fail("dispatcher", "lists AutocastCPU's registrations otherwise (aten::mm "
                   "registered, aten::view not)")
    if not has_kernel("aten::mm", "AutocastCPU") or has_kernel("aten::view", "AutocastCPU"):
        raise fail("dispatcher", "answers otherwise whether aten::mm / aten::view have an "
                   "AutocastCPU kernel")
    below, after = redispatch_keysets("AutocastCPU")
    if not below.has(_C.DispatchKey.AutocastCPU) or after.has(_C.DispatchKey.AutocastCPU):
        raise fail("dispatcher", "builds other key sets around AutocastCPU")
    with torch.autocast("cpu", torch.bfloat16), ExcludeKeys(below):
        if torch.mm(torch.ones(1, 1), torch.ones(1, 1)).dtype != torch.float32:
            raise fail("dispatcher", "does not exclude AutocastCPU under the guard")


def _schemas_by_op_objects(qualname: str) -> list[Any]:
    """:func:`schemas_of` where the operator registry cannot be read: each overload's
    op object built (about 0.3 ms an overload; the same schemas)."""
    namespace, _, name = qualname.partition("::")
    try:
        packet = getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        return []
    return [getattr(packet, overload)._schema for overload in packet.overloads()]


@register_entry("schemas", ("torch._C._jit_get_schemas_for_operator",
                    "torch._C._dispatch_find_schema_or_throw"),
        "read an op's overloads and argument types (views, dtype arguments, tensors)",
        "torch.ops.<ns>.<op>.<overload>._schema per overload, which does not list a "
        "packet's overloads by schema", provides=("schemas_of",),
        fallbacks={"schemas_of": _schemas_by_op_objects})
def _check_schemas() -> None:
    names = {s.overload_name for s in schemas_of("aten::add")}
    if "Tensor" not in names or not schema_exists("aten::add", "Tensor") or schema_exists(
            "aten::add", "no_such_overload"):
        raise fail("schemas", f"lists aten::add's overloads otherwise ({sorted(names)})")


# -- op objects -----------------------------------------------------------------------------

OpOverload: Any = resolve("op_objects", "OpOverload", lambda: torch._ops.OpOverload)
OpOverloadPacket: Any = resolve("op_objects", "OpOverloadPacket",
                                lambda: torch._ops.OpOverloadPacket)


def op_object_qualname(entry: Any) -> str | None:
    """``"ns::name"`` of a torch.library op object (``torch.library.custom_op``'s
    result, an ``OpOverloadPacket`` or an ``OpOverload``), else ``None``.

    Example:
        >>> import torch
        >>> from ampkit.torch_internals import op_object_qualname
        >>> op_object_qualname(torch.ops.aten.mm.default), op_object_qualname(len)
        ('aten::mm', None)
    """
    from torch._library.custom_ops import CustomOpDef

    if isinstance(entry, CustomOpDef):
        entry = entry._opoverload
    if isinstance(entry, OpOverload):
        return str(entry._schema.name)
    if isinstance(entry, OpOverloadPacket):
        return str(entry._qualified_op_name)
    return None


@register_entry("op_objects", ("torch._ops.OpOverload", "torch._ops.OpOverloadPacket",
                       "torch._library.custom_ops.CustomOpDef"),
        "name the op a torch.ops object or a custom_op stands for (a policy may list op "
        "objects)", "none: torch.ops objects have no public class or name accessor",
        provides=("OpOverload", "OpOverloadPacket", "op_object_qualname"))
def _check_op_objects() -> None:
    got = (op_object_qualname(torch.ops.aten.add.Tensor),
           op_object_qualname(torch.ops.aten.add))
    if got != ("aten::add", "aten::add"):
        raise fail("op_objects", f"name aten.add otherwise ({got})")


# -- Python-level dispatch and torch functions -----------------------------------------------

def _python_dispatch(name: str) -> Any:
    return getattr(importlib.import_module("torch.utils._python_dispatch"), name)


if TYPE_CHECKING:  # the class torch documents, for the modes' types
    from torch.utils._python_dispatch import TorchDispatchMode
else:
    #: the base class of a dispatch mode (it sees every op)
    TorchDispatchMode = resolve("python_dispatch", "TorchDispatchMode",
                                lambda: _python_dispatch("TorchDispatchMode"))
#: a ``__torch_function__`` that turns torch-function handling off for a subclass
disabled_torch_function_impl: Any = resolve("python_dispatch", "disabled_torch_function_impl",
                                            lambda: _C._disabled_torch_function_impl)
#: a context that turns torch-function handling off
DisableTorchFunction: Any = resolve("python_dispatch", "DisableTorchFunction",
                                    lambda: _C.DisableTorchFunction)
#: a context in which no dispatch mode is active (the modes are put back after)
disable_current_modes: Callable[[], Any] = resolve(
    "python_dispatch", "disable_current_modes",
    lambda: _python_dispatch("_disable_current_modes"))


@register_entry("python_dispatch", ("torch.utils._python_dispatch.TorchDispatchMode",
                            "torch.utils._python_dispatch._disable_current_modes",
                            "torch._C._disabled_torch_function_impl",
                            "torch._C.DisableTorchFunction"),
        "the op-level tools observe every op (a dispatch mode); ampkit's own probe calls "
        "are hidden from the user's modes; probe tensors and clones skip torch functions",
        "none: TorchDispatchMode is documented but lives in a private module; "
        "torch.overrides has no context that disables torch functions",
        provides=("TorchDispatchMode", "disabled_torch_function_impl", "DisableTorchFunction",
                  "disable_current_modes", "lazy_check_dispatch_mode"))
def _check_python_dispatch() -> None:
    calls: list[Any] = []

    class Plain(torch.Tensor):
        __torch_function__ = disabled_torch_function_impl

    class Counted(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            calls.append(func)
            return super().__torch_function__(  # type: ignore[no-untyped-call]
                func, types, args, kwargs or {})

    if not callable(disable_current_modes) or not isinstance(TorchDispatchMode, type):
        raise fail("python_dispatch", "has no TorchDispatchMode / _disable_current_modes")
    if type(torch.ones(1).as_subclass(Plain) + 1) is not torch.Tensor:
        raise fail("python_dispatch", "keeps torch functions of a subclass that disables "
                   "them")
    counted = torch.ones(1).as_subclass(Counted)
    with DisableTorchFunction(), disable_current_modes():
        counted + 1
    if calls:
        raise fail("python_dispatch", "calls torch functions inside DisableTorchFunction")


def lazy_check_dispatch_mode() -> None:
    """The behavioural half of ``python_dispatch`` (a mode sees an op; entering a mode
    imports torch._dynamo, so the test suite runs it, not ``import ampkit``).

    Example:
        >>> from ampkit.torch_internals import lazy_check_dispatch_mode
        >>> lazy_check_dispatch_mode()
    """
    seen: list[Any] = []

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Mode():  # type: ignore[no-untyped-call]
        torch.ones(1) + 1
    if torch.ops.aten.add.Tensor not in seen:
        raise fail("python_dispatch", f"dispatch mode did not see aten.add ({seen})")


# -- pytree -----------------------------------------------------------------------------------

tree_leaves: Callable[..., list[Any]] = resolve(
    "pytree", "tree_leaves",
    lambda: importlib.import_module("torch.utils._pytree").tree_leaves)
tree_map: Callable[..., Any] = resolve(
    "pytree", "tree_map", lambda: importlib.import_module("torch.utils._pytree").tree_map)


@register_entry("pytree", ("torch.utils._pytree.tree_leaves", "torch.utils._pytree.tree_map"),
        "walk the tensors of a model's inputs and outputs the way torch does (its "
        "registered containers included) in the tools",
        "torch.utils.pytree (public) is not in torch 2.11-2.14",
        provides=("tree_leaves", "tree_map"))
def _check_pytree() -> None:
    t = torch.ones(1)
    if tree_leaves({"a": [t, (t,)]}) != [t, t] or tree_map(
            lambda x: 2, {"a": [1]}) != {"a": [2]}:
        raise fail("pytree", "walks containers otherwise")


# -- autograd ---------------------------------------------------------------------------------

def current_autograd_node() -> Any:
    """The autograd node running now (in a backward pass), else ``None``.

    Example:
        >>> from ampkit.torch_internals import current_autograd_node
        >>> current_autograd_node() is None
        True
    """
    return _C._current_autograd_node()


def saved_tensors_hooks_free() -> bool:
    """True when saved-tensor hooks may be installed and no others are active
    (activation checkpointing and offloading use them; ampkit's must not shadow theirs).
    False where this torch lacks the means to tell.

    Example:
        >>> from ampkit.torch_internals import saved_tensors_hooks_free
        >>> saved_tensors_hooks_free()
        True
    """
    autograd: Any = _C._autograd
    try:
        return bool(autograd._saved_tensors_hooks_is_enabled()
                    and autograd._top_saved_tensors_default_hooks(False) is None)
    except (AttributeError, TypeError):
        return False


@register_entry("autograd_state", ("torch._C._current_autograd_node",
                           "torch._C._autograd._saved_tensors_hooks_is_enabled",
                           "torch._C._autograd._top_saved_tensors_default_hooks"),
        "the numerics checker tells forward from backward ops; the kept-fp32 norms save "
        "their low-precision input only where no other saved-tensor hooks are active",
        "none: torch.autograd.graph has saved_tensors_hooks but no query of the active "
        "ones, and no current node", provides=("current_autograd_node",
                                               "saved_tensors_hooks_free"),
        # without the query, the kept-fp32 norms save their fp32 input (more memory,
        # the same numbers), as where other saved-tensor hooks are active
        fallbacks={"saved_tensors_hooks_free": lambda: False})
def _check_autograd_state() -> None:
    if not saved_tensors_hooks_free():
        raise fail("autograd_state", "reports saved-tensor hooks outside any")
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        if saved_tensors_hooks_free():
            raise fail("autograd_state", "misses the active saved-tensor hooks")
    nodes: list[Any] = []
    x = torch.ones(1, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: nodes.append(current_autograd_node()))
    y.sum().backward()
    if current_autograd_node() is not None or not nodes or nodes[0] is None:
        raise fail("autograd_state", "has no current node in the backward pass")


# -- DTensor ----------------------------------------------------------------------------------

def local_shape_and_offset(dt: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The local shape and global offset of this rank's shard of DTensor ``dt``.

    Example:
        >>> from ampkit.torch_internals import local_shape_and_offset
        >>> callable(local_shape_and_offset)
        True
    """
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh,
                                                          tuple(dt.placements))
    return tuple(shape), tuple(offset)


@register_entry("dtensor_offsets", ("torch.distributed.tensor._utils."
                            "compute_local_shape_and_global_offset",),
        "stochastic rounding draws each element's random bits from its global position, "
        "so a sharded parameter rounds as the unsharded one would",
        "none: DTensor has no public offset of the local shard",
        lazy=True)  # imports torch.distributed.tensor (and sympy): not at import ampkit
def _check_dtensor_offsets() -> None:
    if not torch.distributed.is_available():
        return  # a build without torch.distributed has no DTensor to round
    from torch.distributed.tensor import _utils

    if not callable(getattr(_utils, "compute_local_shape_and_global_offset", None)):
        raise fail("dtensor_offsets", "is gone")
