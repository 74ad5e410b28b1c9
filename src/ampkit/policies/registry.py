"""The op registry: canonical op names and every Python entry point of each op.

Canonical names are PyTorch's own (``linear``, ``conv2d``, ``matmul``, ``softmax``,
``add``, ``cat``, ...). One name stands for every way Python code reaches the op:
``torch.X``, ``torch.nn.functional.X``, ``Tensor.X`` and the operator dunders that
land on it (``a + b`` arrives as ``Tensor.add``). Names from ``torch.linalg``,
``torch.fft`` and ``torch.special`` carry the prefix native autocast uses
(``linalg_inv``, ``fft_fft``, ``special_erf``).

In-place variants (``add_``, ``F.relu_``, ``Tensor.elu_``, ``a += b``) are deliberately
absent: no rule ever applies to them (an in-place op writes into its input, in the
input's dtype, as under native autocast), so listing one is a ``ValueError`` that names
its out-of-place twin rather than a silent no-op.

Other frameworks' names (Paddle's ``elementwise_add``, MXNet's ``FullyConnected``,
MindSpore's ``MatMul``) live in per-framework alias tables, because the same word
means different ops in different frameworks (Paddle's ``mul`` is a matrix product).

Custom ops (``torch.library.custom_op``, ``torch.library.Library.define``) are ops like
any other: their name is their qualified name, ``"ns::name"``, and their entry points
are ``torch.ops.ns.name`` and each of its overloads (what a ``TorchFunctionMode`` sees
when the op's object or ``torch.ops.ns.name`` is called). ``"aten::name"`` is the
canonical ``name``.

Example:
    >>> import torch
    >>> from ampkit.policies.registry import resolve_op, entry_points
    >>> resolve_op(torch.nn.functional.conv2d)
    ('conv2d',)
    >>> torch.Tensor.add in entry_points("add")
    True
    >>> resolve_op("elementwise_add", framework="paddle")
    ('add',)
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType, ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from ampkit import torch_internals
from ampkit.common.arguments import did_you_mean
from ampkit.policies.op_names import DUNDERS, FRAMEWORK_ALIASES, MODULE_OPS, PREFIXED, SYNONYMS

__all__ = [
    "AUTOCAST_FP32_OPS",
    "AUTOCAST_KEYS",
    "FRAMEWORK_ALIASES",
    "MODULE_OPS",
    "OpEntry",
    "aliases_input",
    "all_op_names",
    "autocast_fp32_ops",
    "dispatcher_schemas",
    "entry_points",
    "is_compute",
    "native_op_names",
    "op_name_of",
    "op_schemas",
    "resolve_op",
    "resolve_ops",
]

#: A list entry: a canonical op name, an alias, an op's callable, an nn.Module class, or
#: a custom op (its ``torch.library`` object, ``torch.ops.ns.name``, or ``"ns::name"``).
OpEntry = str | Callable[..., Any] | type



def _public_callables(namespace: ModuleType | type) -> Iterable[tuple[str, Any]]:
    for name in dir(namespace):
        if name.startswith("_"):
            continue
        try:
            obj = getattr(namespace, name)
        except Exception:  # some lazy attributes raise on access
            continue
        if isinstance(obj, ModuleType | type) or not callable(obj):
            continue
        yield name, obj


@functools.cache
def _tables() -> tuple[Mapping[str, tuple[Callable[..., Any], ...]], Mapping[Any, str],
                       Mapping[str, str]]:
    """Build ``name -> entry points``, ``entry point -> name`` and the synonyms found on
    the way, once, on first use."""
    pairs: list[tuple[str, Any]] = []
    # Keyed by equality, not identity: some builtins are one C function under two names
    # (torch.dsmm == torch.mm). The engine's rule table is keyed the same way, so such
    # callables must belong to one name, or one name's rule would overwrite the other's.
    groups: dict[Any, list[str]] = {}

    def add(name: str, fn: Any) -> None:
        name = SYNONYMS.get(name, name)
        try:
            names = groups.setdefault(fn, [])
        except TypeError:  # unhashable callables are never dispatched by identity
            return
        if name not in names:
            names.append(name)
        pairs.append((name, fn))

    for name, fn in _public_callables(torch):
        if not name.endswith("_") and not name[0].isupper():
            add(name, fn)
    # No trailing-underscore names anywhere (F.relu_, torch._C._nn.elu_, Tensor.x_):
    # in-place ops are never part of a family, so that no rule ever runs one on a cast
    # copy (which would silently drop its effect on the input).
    for name, fn in _public_callables(F):
        if not name.endswith("_"):
            add(name, fn)
    for name, fn in _public_callables(torch_internals.nn_builtins):  # the builtins behind F.*
        if not name.endswith("_"):
            add(name, fn)
    for ns_name, prefix in PREFIXED:
        for name, fn in _public_callables(getattr(torch, ns_name)):
            add(prefix + name, fn)
    for name in dir(torch.Tensor):
        if name.startswith("_") or name.endswith("_"):
            continue
        fn = inspect.getattr_static(torch.Tensor, name, None)
        if fn is None or isinstance(fn, property) or not callable(getattr(torch.Tensor, name)):
            continue
        if type(fn).__name__ == "getset_descriptor":
            continue
        add(name, getattr(torch.Tensor, name))
    for dunder, name in DUNDERS.items():
        add(name, getattr(torch.Tensor, dunder))
    # The composite entry point native autocast lists by this name.
    add("_convolution", torch_internals.convolution)

    # One name per group: the aten op's name when there is one (native autocast's lists
    # use those), else the first name met.
    owner = {fn: next((n for n in names if hasattr(torch.ops.aten, n)), names[0])
             for fn, names in groups.items()}
    by_name: dict[str, list[Callable[..., Any]]] = {}
    for _, fn in pairs:
        fns = by_name.setdefault(owner[fn], [])
        if all(fn is not f for f in fns):
            fns.append(fn)
    frozen = {name: tuple(fns) for name, fns in by_name.items()}
    synonyms = {name: owner[fn] for name, fn in pairs
                if name != owner[fn] and name not in frozen}
    return MappingProxyType(frozen), MappingProxyType(owner), MappingProxyType(synonyms)


def _canonical(name: str) -> str:
    name = SYNONYMS.get(name, name)
    return _tables()[2].get(name, name)


def all_op_names() -> frozenset[str]:
    """Every canonical op name the registry knows.

    Example:
        >>> from ampkit.policies.registry import all_op_names
        >>> {"linear", "softmax", "add"} <= all_op_names()
        True
    """
    return frozenset(_tables()[0])


def entry_points(name: str) -> tuple[Callable[..., Any], ...]:
    """Every Python callable that reaches the op ``name`` (a canonical name, or a custom
    op's ``"ns::name"``).

    Example:
        >>> import torch
        >>> from ampkit.policies.registry import entry_points
        >>> torch.nn.functional.softmax in entry_points("softmax")
        True
    """
    by_name = _tables()[0]
    if name in by_name:
        return by_name[name]
    if "::" in name:
        return _custom_entry_points(name)
    raise _unknown(name, "name")


def _custom_packet(qualname: str) -> Any:
    """``torch.ops.ns.name`` for ``"ns::name"``, or ``None`` when no such op exists."""
    namespace, _, op = qualname.partition("::")
    if not namespace or not op or "." in op:
        return None
    try:
        return getattr(getattr(torch.ops, namespace), op)
    except (AttributeError, RuntimeError):
        return None


@functools.cache
def _custom_entry_points(qualname: str) -> tuple[Callable[..., Any], ...]:
    packet = _custom_packet(qualname)
    if packet is None:
        raise ValueError(f"name: unknown custom op {qualname!r}: no op of that name is "
                         f"registered (import the library that defines it first)")
    # The packet (torch.ops.ns.name(...)) and every overload: calling a custom_op's
    # object reaches a TorchFunctionMode as its overload, ``torch.ops.ns.name.default``.
    return (packet, *(getattr(packet, o) for o in packet.overloads()))


def _op_object_name(entry: Any) -> str | None:
    """``"ns::name"`` of a torch.library op object (``custom_op``'s result, an
    ``OpOverloadPacket`` or an ``OpOverload``), else ``None``."""
    return torch_internals.op_object_qualname(entry)


def _qualified(qualname: str, argument: str, framework: str | None) -> tuple[str, ...]:
    """Resolve ``"ns::name"`` (an overload suffix, ``".default"``, is dropped: lists name
    ops, not overloads): an aten op by its canonical name, a custom op by itself."""
    namespace, _, op = qualname.partition("::")
    op = op.split(".", 1)[0]
    qualname = f"{namespace}::{op}"
    if namespace == "aten":
        name = _canonical(op)
        if name in _tables()[0]:
            return (name,)
        raise _unknown(qualname, argument, framework)
    if _custom_packet(qualname) is None:
        raise ValueError(f"{argument}: unknown custom op {qualname!r}: no op of that name is "
                         f"registered (import the library that defines it first); custom "
                         f"ops are listed as 'namespace::name'")
    return (qualname,)


def op_name_of(fn: Any) -> str | None:
    """The canonical name of an entry point, or ``None`` if it is not an op.

    Example:
        >>> import torch
        >>> from ampkit.policies.registry import op_name_of
        >>> op_name_of(torch.Tensor.__matmul__)
        'matmul'
    """
    try:
        name = _tables()[1].get(fn)
    except TypeError:  # unhashable callables are never registered ops
        return None
    if name is None and isinstance(fn, torch_internals.OpOverload
                                   | torch_internals.OpOverloadPacket):
        qualname = _op_object_name(fn)
        # aten overloads are what compiled graphs call: not an entry point of their op
        if qualname is not None and not qualname.startswith("aten::"):
            return qualname
    return name


def _unknown(name: str, argument: str, framework: str | None = None) -> ValueError:
    known = set(_tables()[0])
    if framework is not None:
        known |= set(FRAMEWORK_ALIASES[framework])
    hint = did_you_mean(name, known)
    where = f" (or a {framework} alias)" if framework else ""
    return ValueError(f"{argument}: unknown op name {name!r}: not a canonical PyTorch op "
                      f"name{where}{hint}")


def _in_place(what: str, twin: str, argument: str) -> ValueError:
    return ValueError(f"{argument}: {what} is an in-place op; lists never apply to in-place "
                      f"ops (they keep their input's dtype, as under native autocast), list "
                      f"its out-of-place twin {twin!r} instead")


def resolve_op(entry: OpEntry, *, framework: str | None = None,
               argument: str = "op") -> tuple[str, ...]:
    """Translate one list entry into canonical op names.

    ``entry`` may be a canonical name (``"conv2d"``), a synonym (``"concat"``), an
    alias of ``framework`` (``"elementwise_add"`` for ``"paddle"``), an op's callable
    (``torch.nn.functional.conv2d``, ``torch.Tensor.add``) or an ``nn.Module`` class
    (``torch.nn.Linear``). ``argument`` names the caller's argument in errors.

    Example:
        >>> import torch
        >>> from ampkit.policies.registry import resolve_op
        >>> resolve_op("FullyConnected", framework="mxnet")
        ('linear',)
        >>> resolve_op(torch.nn.Conv2d)
        ('conv2d',)
    """
    if framework is not None and framework not in FRAMEWORK_ALIASES:
        raise ValueError(f"framework must be one of {sorted(FRAMEWORK_ALIASES)} or None, "
                         f"got {framework!r}")
    if isinstance(entry, str):
        if framework is not None and entry in FRAMEWORK_ALIASES[framework]:
            return FRAMEWORK_ALIASES[framework][entry]
        if "::" in entry:
            return _qualified(entry, argument, framework)
        name = _canonical(entry)
        if name in _tables()[0]:
            return (name,)
        if name.endswith("_") and _canonical(name[:-1]) in _tables()[0]:
            raise _in_place(repr(entry), _canonical(name[:-1]), argument)
        raise _unknown(entry, argument, framework)
    if isinstance(entry, type):
        for cls in entry.__mro__:
            if cls in MODULE_OPS:
                return (MODULE_OPS[cls],)
        raise TypeError(f"{argument}: module class {entry.__qualname__} has no registered op; "
                        f"accepted classes: {sorted(c.__name__ for c in MODULE_OPS)}")
    qualname = _op_object_name(entry)
    if qualname is not None:
        return _qualified(qualname, argument, framework)
    if callable(entry):
        found = op_name_of(entry)
        if found is not None:
            return (found,)
        fn_name = getattr(entry, "__name__", "")
        if isinstance(fn_name, str) and fn_name.endswith("_") and not fn_name.endswith("__"):
            twin = _canonical(fn_name[:-1])
            if twin in _tables()[0]:
                raise _in_place(f"{getattr(entry, '__qualname__', fn_name)}", twin, argument)
        raise TypeError(f"{argument}: {entry!r} is not a known op entry point; pass a canonical "
                        f"op name such as 'linear', a torch / torch.nn.functional / Tensor "
                        f"callable, or a custom op ('ns::name' or its torch.library object)")
    raise TypeError(f"{argument}: expected an op name (str), an op callable or an nn.Module "
                    f"class, got {type(entry).__name__}")


def resolve_ops(entries: Iterable[OpEntry] | None, *, framework: str | None = None,
                argument: str = "ops") -> frozenset[str]:
    """Translate a whole list (set, list or tuple) of entries into canonical names.

    Example:
        >>> import torch
        >>> from ampkit.policies.registry import resolve_ops
        >>> sorted(resolve_ops(["softmax", torch.Tensor.add]))
        ['add', 'softmax']
    """
    if entries is None:
        return frozenset()
    if isinstance(entries, str | bytes) or not isinstance(entries, Iterable):
        raise TypeError(f"{argument}: expected a set, list or tuple of op entries, "
                        f"got {type(entries).__name__}")
    names: set[str] = set()
    for entry in entries:
        names.update(resolve_op(entry, framework=framework, argument=argument))
    return frozenset(names)


# -- op classification: what the schema says about an op --------------------------------

@functools.cache
def op_schemas(name: str) -> tuple[Any, ...]:
    """The schemas of op ``name``'s functional overloads (no ``out=``, no in-place), or
    ``()`` for a Python-level op with no dispatcher op of its own (``F.interpolate``).

    Example:
        >>> from ampkit.policies.registry import op_schemas
        >>> op_schemas("linear")[0].name, op_schemas("interpolate")
        ('aten::linear', ())
    """
    qualname = name if "::" in name else f"aten::{name}"
    # Read from the operator registry: building each OpOverload object instead costs
    # ~0.3 ms an overload, a third of a second for a policy's first region.
    return tuple(s for s in torch_internals.schemas_of(qualname)
                 if not any(a.alias_info is not None and a.alias_info.is_write
                            for a in s.arguments))  # out= / in-place: never autocast


@functools.cache
def dispatcher_schemas(name: str) -> tuple[Any, ...]:
    """Those of :func:`op_schemas` that are dispatcher ops (an Autocast kernel can sit on
    them); the rest are TorchScript-only (``aten::cpu``, ``aten::add.t``).

    Example:
        >>> from ampkit.policies.registry import dispatcher_schemas
        >>> [s.overload_name for s in dispatcher_schemas("linear")], dispatcher_schemas("cpu")
        ([''], ())
    """
    qualname = name if "::" in name else f"aten::{name}"
    found = []
    for schema in op_schemas(name):
        if torch_internals.schema_exists(qualname, schema.overload_name):
            found.append(schema)
    return tuple(found)


def aliases_input(name: str) -> bool:
    """Whether op ``name`` returns a view or an alias of its input (by its schema), so
    casting its input would hand back a copy instead.

    Example:
        >>> from ampkit.policies.registry import aliases_input
        >>> aliases_input("transpose"), aliases_input("linear")
        (True, False)
    """
    return _returns_view(op_schemas(name))


def _returns_view(schemas: tuple[Any, ...]) -> bool:
    # ``Tensor(a) self -> Tensor(a)``: the result aliases the input (a view, or the input
    # itself). Casting such an op's input would hand back a copy instead.
    return any(r.alias_info is not None and not r.alias_info.is_write
               for s in schemas for r in s.returns)


def _returns_tensor(schemas: tuple[Any, ...]) -> bool:
    return any("Tensor" in str(r.type) for s in schemas for r in s.returns)


# Ops that are neither views nor queries by their schema, but move, convert, compare or
# index data rather than compute on its values, and Python-level conversions with no
# dispatcher op of their own (``x.float()``). A policy's rule for unlisted ops leaves
# them alone; listing one applies its list's rule.
_MOVES_OR_COMPARES = frozenset({
    # conversions, copies, creation from another tensor's metadata
    "float", "double", "half", "bfloat16", "int", "long", "short", "bool", "byte", "char",
    "cpu", "cuda", "type", "type_as", "clone", "numpy", "tolist", "new_tensor",
    "empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like",
    "randint_like",
    # data movement
    "flip", "fliplr", "flipud", "rot90", "roll", "tile", "repeat", "repeat_interleave",
    "index_select", "gather", "take", "masked_select", "pad", "broadcast_tensors",
    "atleast_1d", "atleast_2d", "atleast_3d", "dropout",
    # comparisons and index results: a cast would only change which values tie
    "eq", "ne", "lt", "le", "gt", "ge", "isclose", "isfinite", "isinf", "isnan", "sign",
    "any", "all", "count_nonzero", "nonzero", "where", "argmax", "argmin", "argsort",
    "sort", "topk", "max", "min",
    # Python-level tensor plumbing with no dispatcher op
    "data_ptr", "dim_order", "nelement", "record_stream", "register_hook", "retain_grad",
    "storage", "untyped_storage", "is_shared", "to_dlpack",
})
# Name prefixes of state and layout helpers (torch.get_default_dtype(), x.new_zeros(..),
# x.to_dense(), torch.set_rng_state(..)): never compute, never cast by an unlisted rule.
_NOT_COMPUTE_PREFIXES = ("is_", "has_", "get_", "set_", "new_", "to_")


@functools.cache
def is_compute(name: str) -> bool:
    """Whether an unlisted rule may cast op ``name``'s inputs: not a view or an alias of
    its input (by the schema), not a query returning no tensor (by the schema), not a
    conversion, move or comparison.

    Example:
        >>> from ampkit.policies.registry import is_compute
        >>> is_compute("matmul"), is_compute("view"), is_compute("argmax")
        (True, False, False)
    """
    if name in _MOVES_OR_COMPARES or name.startswith(_NOT_COMPUTE_PREFIXES):
        return False
    schemas = op_schemas(name)
    if not schemas:
        return True  # a Python-level composite (F.interpolate, F.softmin): it computes
    return not _returns_view(schemas) and _returns_tensor(schemas)


#: The dispatcher key of native autocast per device type.
AUTOCAST_KEYS: Mapping[str, str] = MappingProxyType({
    "cpu": "AutocastCPU", "cuda": "AutocastCUDA", "xpu": "AutocastXPU", "mps": "AutocastMPS",
    "hpu": "AutocastHPU", "xla": "AutocastXLA", "mtia": "AutocastMTIA", "ipu": "AutocastIPU"})


@functools.cache
def native_op_names(device_type: str) -> frozenset[str]:
    """Canonical names of the ops native autocast changes on ``device_type``.

    Read from the dispatcher's registrations for the device's autocast key, so it is
    exact for the running torch build. Custom ops with an autocast kernel
    (``torch.library.register_autocast``) appear as ``"ns::name"``.

    Example:
        >>> from ampkit.policies.registry import native_op_names
        >>> {"linear", "conv2d"} <= native_op_names("cpu")
        True
    """
    key = AUTOCAST_KEYS.get(device_type, "AutocastPrivateUse1")
    names = set()
    for reg in torch_internals.registrations(key):
        namespace, _, op = reg.partition("::")
        op = op.split(".", 1)[0]
        names.add(op if namespace == "aten" else f"{namespace}::{op}")
    return frozenset(names)


#: The ops native autocast runs in float32 on CUDA, by canonical name: the fp32 lists of
#: torch's ``aten/src/ATen/autocast_mode.h`` (its ``fp32``, ``fp32_set_opt_dtype`` and
#: ``fp32_append_dtype`` policies), which torch's AMP documentation gives as the CUDA ops
#: that autocast to float32. The dispatcher says which ops native autocast changes on a
#: device (:func:`native_op_names`) but not to which dtype, so this list is data: CUDA's
#: fp32 list over the supported torch releases. The suite checks it against the running
#: torch's CUDA registrations; a release that does not register one of its ops yet
#: (torch 2.11: ``rms_norm``) leaves that op alone where O2 keeps it fp32. CPU
#: autocast's own float32 list holds losses, linear algebra and FFTs only (no softmax,
#: norm, exp or pow), so level O2, whose activations are low precision end to end,
#: keeps this list on every device (:func:`ampkit.conversion.levels.keep_native_fp32`).
AUTOCAST_FP32_OPS: frozenset[str] = frozenset({
    # pointwise transcendentals and powers: range and rounding in 16 bits
    "acos", "asin", "cosh", "sinh", "tan", "erfinv", "exp", "expm1", "log", "log10",
    "log1p", "log2", "pow", "reciprocal", "rsqrt", "softplus",
    # softmax and reductions accumulate over many values
    "softmax", "log_softmax", "logsumexp", "sum", "prod", "cumsum", "cumprod",
    # norms
    "layer_norm", "native_layer_norm", "group_norm", "rms_norm", "norm", "frobenius_norm",
    "nuclear_norm", "linalg_vector_norm", "linalg_matrix_norm", "renorm", "dist", "pdist",
    "cdist", "cosine_similarity",
    # losses
    "binary_cross_entropy_with_logits", "cosine_embedding_loss", "hinge_embedding_loss",
    "huber_loss", "kl_div", "l1_loss", "margin_ranking_loss", "mse_loss",
    "multi_margin_loss", "multilabel_margin_loss", "nll_loss", "nll_loss2d",
    "poisson_nll_loss", "smooth_l1_loss", "soft_margin_loss", "triplet_margin_loss",
    # resampling
    "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "upsample_linear1d",
    "upsample_bilinear2d", "upsample_bicubic2d", "upsample_trilinear3d",
})


@functools.cache
def autocast_fp32_ops() -> frozenset[str]:
    """:data:`AUTOCAST_FP32_OPS`, less any name the running torch does not have.

    Example:
        >>> from ampkit.policies.registry import autocast_fp32_ops
        >>> {"softmax", "log_softmax", "layer_norm", "exp", "pow"} <= autocast_fp32_ops()
        True
    """
    return AUTOCAST_FP32_OPS & all_op_names()
