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
    >>> from ampkit.registry import resolve_op, entry_points
    >>> resolve_op(torch.nn.functional.conv2d)
    ('conv2d',)
    >>> torch.Tensor.add in entry_points("add")
    True
    >>> resolve_op("elementwise_add", framework="paddle")
    ('add',)
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType, ModuleType
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "FRAMEWORK_ALIASES",
    "MODULE_OPS",
    "OpEntry",
    "all_op_names",
    "entry_points",
    "op_name_of",
    "resolve_op",
    "resolve_ops",
]

#: A list entry: a canonical op name, an alias, an op's callable, an nn.Module class, or
#: a custom op (its ``torch.library`` object, ``torch.ops.ns.name``, or ``"ns::name"``).
OpEntry = str | Callable[..., Any] | type

# Operator dunders whose Python-level function differs from the Tensor method they
# lower to. (``a + b`` already reaches __torch_function__ as ``Tensor.add``.)
_DUNDERS: Mapping[str, str] = {
    "__add__": "add", "__radd__": "add",
    "__sub__": "sub", "__rsub__": "sub",
    "__mul__": "mul", "__rmul__": "mul",
    "__matmul__": "matmul", "__rmatmul__": "matmul",
    "__truediv__": "div", "__rtruediv__": "div", "__div__": "div", "__rdiv__": "div",
    "__floordiv__": "floor_divide", "__rfloordiv__": "floor_divide",
    "__mod__": "remainder", "__rmod__": "remainder",
    "__pow__": "pow", "__rpow__": "pow",
    "__neg__": "neg", "__abs__": "abs",
}

# Different Python names of one aten op; listing either covers both.
_SYNONYMS: Mapping[str, str] = {
    "concat": "cat", "concatenate": "cat",
    "multiply": "mul", "divide": "div", "true_divide": "div", "subtract": "sub",
    "clip": "clamp", "absolute": "abs", "negative": "neg", "ger": "outer",
    "arccos": "acos", "arcsin": "asin", "arctan": "atan", "arctan2": "atan2",
    "arccosh": "acosh", "arcsinh": "asinh", "arctanh": "atanh",
    "greater": "gt", "greater_equal": "ge", "less": "lt", "less_equal": "le",
    "not_equal": "ne", "fix": "trunc", "special_expit": "sigmoid", "special_exp2": "exp2",
    "special_expm1": "expm1", "special_log1p": "log1p", "special_round": "round",
    "special_log_softmax": "log_softmax", "special_softmax": "softmax",
}

# Prefixed sub-namespaces, named the way native autocast's lists name them.
_PREFIXED: tuple[tuple[str, str], ...] = (("linalg", "linalg_"), ("fft", "fft_"),
                                          ("special", "special_"))

#: nn.Module classes accepted as list entries, mapped to the op their forward runs.
MODULE_OPS: Mapping[type, str] = MappingProxyType({
    nn.Linear: "linear", nn.Bilinear: "bilinear",
    nn.Conv1d: "conv1d", nn.Conv2d: "conv2d", nn.Conv3d: "conv3d",
    nn.ConvTranspose1d: "conv_transpose1d", nn.ConvTranspose2d: "conv_transpose2d",
    nn.ConvTranspose3d: "conv_transpose3d",
    nn.BatchNorm1d: "batch_norm", nn.BatchNorm2d: "batch_norm", nn.BatchNorm3d: "batch_norm",
    nn.LayerNorm: "layer_norm", nn.GroupNorm: "group_norm",
    nn.InstanceNorm1d: "instance_norm", nn.InstanceNorm2d: "instance_norm",
    nn.InstanceNorm3d: "instance_norm",
    nn.Embedding: "embedding", nn.EmbeddingBag: "embedding_bag",
    nn.Softmax: "softmax", nn.LogSoftmax: "log_softmax",
    nn.ReLU: "relu", nn.GELU: "gelu", nn.PReLU: "prelu", nn.SiLU: "silu",
    nn.CrossEntropyLoss: "cross_entropy", nn.NLLLoss: "nll_loss", nn.MSELoss: "mse_loss",
    nn.LSTM: "lstm", nn.GRU: "gru", nn.LSTMCell: "lstm_cell", nn.GRUCell: "gru_cell",
    nn.RNNCell: "rnn_tanh_cell",
})

#: Other frameworks' op names, translated to canonical names. One alias may stand
#: for several torch ops (MXNet's ``Convolution`` covers conv1d/2d/3d).
FRAMEWORK_ALIASES: Mapping[str, Mapping[str, tuple[str, ...]]] = MappingProxyType({
    "paddle": MappingProxyType({
        "elementwise_add": ("add",), "elementwise_sub": ("sub",),
        "elementwise_mul": ("mul",), "elementwise_div": ("div",),
        "elementwise_pow": ("pow",), "elementwise_max": ("maximum",),
        "elementwise_min": ("minimum",), "elementwise_mod": ("remainder",),
        "matmul_v2": ("matmul", "mm", "bmm", "linear", "addmm", "baddbmm"),
        # Paddle's legacy ``mul`` op is the fully-connected matrix product.
        "mul": ("mm", "linear", "addmm"),
        "fc": ("linear",), "depthwise_conv2d": ("conv2d",),
        "conv2d_transpose": ("conv_transpose2d",), "conv3d_transpose": ("conv_transpose3d",),
        "max_pool2d_with_index": ("max_pool2d",), "pool2d": ("avg_pool2d", "max_pool2d"),
        "pool3d": ("avg_pool3d", "max_pool3d"),
        "lookup_table": ("embedding",), "lookup_table_v2": ("embedding",),
        "softmax_with_cross_entropy": ("cross_entropy",), "c_softmax_with_cross_entropy":
            ("cross_entropy",),
        "cross_entropy": ("cross_entropy",), "cross_entropy2": ("cross_entropy",),
        "sigmoid_cross_entropy_with_logits": ("binary_cross_entropy_with_logits",),
        "reduce_sum": ("sum",), "reduce_mean": ("mean",), "reduce_prod": ("prod",),
        "reduce_max": ("amax",), "reduce_min": ("amin",),
        "squared_l2_norm": ("norm",), "p_norm": ("norm",),
        "bilinear_interp": ("interpolate",), "bilinear_interp_v2": ("interpolate",),
        "nearest_interp": ("interpolate",), "nearest_interp_v2": ("interpolate",),
        "bicubic_interp": ("interpolate",), "bicubic_interp_v2": ("interpolate",),
        "linear_interp": ("interpolate",), "linear_interp_v2": ("interpolate",),
        "trilinear_interp": ("interpolate",), "trilinear_interp_v2": ("interpolate",),
        "scatter": ("scatter",), "scatter_nd_add": ("index_add",),
        "concat": ("cat",), "sync_batch_norm": ("batch_norm",),
        "huber_loss": ("huber_loss",), "bce_loss": ("binary_cross_entropy",),
        "kldiv_loss": ("kl_div",), "mse_loss": ("mse_loss",),
        "fused_attention": ("scaled_dot_product_attention",),
        "flash_attn": ("scaled_dot_product_attention",),
        "sigmoid": ("sigmoid",), "tanh": ("tanh",),
        # names on Paddle's default AMP lists (python/paddle/amp/amp_lists.py)
        "fused_gemm_epilogue": ("linear",), "tanh_shrink": ("tanhshrink",),
        "pnorm": ("norm",), "frobenius_norm": ("norm",), "cos_sim": ("cosine_similarity",),
        "log_loss": ("binary_cross_entropy",),
    }),
    "mxnet": MappingProxyType({
        "Convolution": ("conv1d", "conv2d", "conv3d"),
        "Deconvolution": ("conv_transpose1d", "conv_transpose2d", "conv_transpose3d"),
        "FullyConnected": ("linear",), "Dense": ("linear",),
        "RNN": ("lstm", "gru", "rnn_tanh", "rnn_relu"),
        "dot": ("matmul", "mm"), "batch_dot": ("bmm",),
        "elemwise_add": ("add",), "elemwise_sub": ("sub",), "elemwise_mul": ("mul",),
        "elemwise_div": ("div",), "broadcast_add": ("add",), "broadcast_sub": ("sub",),
        "broadcast_mul": ("mul",), "broadcast_div": ("div",), "broadcast_plus": ("add",),
        "broadcast_minus": ("sub",), "_plus": ("add",), "_minus": ("sub",),
        "_mul": ("mul",), "_div": ("div",), "add_n": ("add",), "ElementWiseSum": ("add",),
        "Concat": ("cat",), "concat": ("cat",), "stack": ("stack",), "where": ("where",),
        "softmax": ("softmax",), "log_softmax": ("log_softmax",),
        "SoftmaxOutput": ("cross_entropy",), "SoftmaxActivation": ("softmax",),
        "LayerNorm": ("layer_norm",), "InstanceNorm": ("instance_norm",),
        "GroupNorm": ("group_norm",), "BatchNorm": ("batch_norm",),
        "L2Normalization": ("normalize",), "norm": ("norm",),
        "exp": ("exp",), "expm1": ("expm1",), "log": ("log",), "log1p": ("log1p",),
        "log2": ("log2",), "log10": ("log10",), "pow": ("pow",), "power": ("pow",),
        "_power": ("pow",), "sum": ("sum",), "mean": ("mean",), "prod": ("prod",),
        "nansum": ("nansum",), "sqrt": ("sqrt",),
        "rsqrt": ("rsqrt",), "square": ("square",), "reciprocal": ("reciprocal",),
        "topk": ("topk",), "Embedding": ("embedding",),
        "Activation": ("relu", "sigmoid", "tanh", "softplus", "softsign"),
        "LeakyReLU": ("leaky_relu", "elu", "selu", "prelu", "gelu"),
        "smooth_l1": ("smooth_l1_loss",), "MakeLoss": (),
        "linalg_gemm": ("addmm",), "linalg_gemm2": ("matmul",),
        "linalg_potrf": ("linalg_cholesky",), "linalg_potri": ("cholesky_inverse",),
        "linalg_trsm": ("linalg_solve_triangular",), "linalg_inverse": ("linalg_inv",),
        "linalg_det": ("linalg_det",), "linalg_slogdet": ("linalg_slogdet",),
        "linalg_syrk": ("matmul",), "linalg_sumlogdiag": ("logdet",),
        "arccos": ("acos",), "arcsin": ("asin",), "cosh": ("cosh",), "sinh": ("sinh",),
        "tan": ("tan",), "arctan": ("atan",), "degrees": ("rad2deg",),
        "radians": ("deg2rad",), "erfinv": ("erfinv",), "gamma": ("lgamma",),
        "gammaln": ("lgamma",), "cumsum": ("cumsum",),
        # names on MXNet's AMP lists (python/mxnet/contrib/amp/lists/symbol_fp16.py)
        "_Plus": ("add",), "_Minus": ("sub",), "_sub": ("sub",),
        "_Mul": ("mul",), "_Div": ("div",), "_mod": ("remainder",), "_Mod": ("remainder",),
        "broadcast_mod": ("remainder",), "_equal": ("eq",), "_Equal": ("eq",),
        "broadcast_equal": ("eq",), "_not_equal": ("ne",), "_Not_Equal": ("ne",),
        "broadcast_not_equal": ("ne",), "_greater": ("gt",), "_Greater": ("gt",),
        "broadcast_greater": ("gt",), "_greater_equal": ("ge",), "_Greater_Equal": ("ge",),
        "broadcast_greater_equal": ("ge",), "_lesser": ("lt",), "_Lesser": ("lt",),
        "broadcast_lesser": ("lt",), "_lesser_equal": ("le",), "_Lesser_Equal": ("le",),
        "broadcast_lesser_equal": ("le",), "_logical_and": ("logical_and",),
        "_Logical_And": ("logical_and",), "broadcast_logical_and": ("logical_and",),
        "_logical_or": ("logical_or",), "_Logical_Or": ("logical_or",),
        "broadcast_logical_or": ("logical_or",), "_logical_xor": ("logical_xor",),
        "_Logical_Xor": ("logical_xor",), "broadcast_logical_xor": ("logical_xor",),
        "_maximum": ("maximum",), "_Maximum": ("maximum",), "broadcast_maximum": ("maximum",),
        "_minimum": ("minimum",), "_Minimum": ("minimum",), "broadcast_minimum": ("minimum",),
        "broadcast_power": ("pow",), "_Power": ("pow",), "_hypot": ("hypot",),
        "_Hypot": ("hypot",), "broadcast_hypot": ("hypot",), "sum_axis": ("sum",),
        "moments": ("var_mean",), "linalg_syevd": ("linalg_eigh",),
        "linalg_makediag": ("diag_embed",), "Softmax": ("cross_entropy",),
        "softmax_cross_entropy": ("cross_entropy",), "LRN": ("local_response_norm",),
        "CTCLoss": ("ctc_loss",), "ctc_loss": ("ctc_loss",), "UpSampling": ("interpolate",),
        "Dropout": ("dropout",),
    }),
    "mindspore": MappingProxyType({
        "MatMul": ("matmul", "mm", "linear"), "BatchMatMul": ("bmm", "matmul", "baddbmm"),
        "Conv2D": ("conv2d",), "Conv3D": ("conv3d",),
        "Conv2DTranspose": ("conv_transpose2d",), "Conv3DTranspose": ("conv_transpose3d",),
        "PReLU": ("prelu",), "ReLU": ("relu",), "Ger": ("outer",), "Dense": ("linear",),
        "Conv1d": ("conv1d",), "Conv2d": ("conv2d",), "Conv3d": ("conv3d",),
        "Conv1dTranspose": ("conv_transpose1d",), "Conv2dTranspose": ("conv_transpose2d",),
        "Conv3dTranspose": ("conv_transpose3d",), "LayerNorm": ("layer_norm",),
        "BatchNorm1d": ("batch_norm",), "BatchNorm2d": ("batch_norm",),
        "BatchNorm3d": ("batch_norm",), "Softmax": ("softmax",), "LogSoftmax": ("log_softmax",),
        "Add": ("add",), "Mul": ("mul",), "Sub": ("sub",), "Div": ("div",),
        "Exp": ("exp",), "Log": ("log",), "Pow": ("pow",), "ReduceSum": ("sum",),
        "ReduceMean": ("mean",), "Concat": ("cat",), "Stack": ("stack",),
        "LSTMCell": ("lstm_cell",), "GRUCell": ("gru_cell",), "RNNCell": ("rnn_tanh_cell",),
    }),
})


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
        name = _SYNONYMS.get(name, name)
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
    for name, fn in _public_callables(torch._C._nn):  # the builtins behind F.*
        if not name.endswith("_"):
            add(name, fn)
    for ns_name, prefix in _PREFIXED:
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
    for dunder, name in _DUNDERS.items():
        add(name, getattr(torch.Tensor, dunder))
    # The composite entry point native autocast lists by this name.
    add("_convolution", torch._convolution)

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
    name = _SYNONYMS.get(name, name)
    return _tables()[2].get(name, name)


def all_op_names() -> frozenset[str]:
    """Every canonical op name the registry knows.

    Example:
        >>> from ampkit.registry import all_op_names
        >>> {"linear", "softmax", "add"} <= all_op_names()
        True
    """
    return frozenset(_tables()[0])


def entry_points(name: str) -> tuple[Callable[..., Any], ...]:
    """Every Python callable that reaches the op ``name`` (a canonical name, or a custom
    op's ``"ns::name"``).

    Example:
        >>> import torch
        >>> from ampkit.registry import entry_points
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
    from torch._library.custom_ops import CustomOpDef

    if isinstance(entry, CustomOpDef):
        entry = entry._opoverload
    if isinstance(entry, torch._ops.OpOverload):
        return str(entry._schema.name)
    if isinstance(entry, torch._ops.OpOverloadPacket):
        return str(entry._qualified_op_name)
    return None


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
        >>> from ampkit.registry import op_name_of
        >>> op_name_of(torch.Tensor.__matmul__)
        'matmul'
    """
    try:
        name = _tables()[1].get(fn)
    except TypeError:  # unhashable callables are never registered ops
        return None
    if name is None and isinstance(fn, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
        qualname = _op_object_name(fn)
        # aten overloads are what compiled graphs call: not an entry point of their op
        if qualname is not None and not qualname.startswith("aten::"):
            return qualname
    return name


def _unknown(name: str, argument: str, framework: str | None = None) -> ValueError:
    known = set(_tables()[0])
    if framework is not None:
        known |= set(FRAMEWORK_ALIASES[framework])
    close = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
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
        >>> from ampkit.registry import resolve_op
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
        name = op_name_of(entry)
        if name is not None:
            return (name,)
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
        >>> from ampkit.registry import resolve_ops
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
