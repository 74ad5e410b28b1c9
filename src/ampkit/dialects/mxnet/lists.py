"""MXNet's op lists (``list_lp16_ops``, ``list_fp32_ops``, ...) in MXNet's op names, the
torch ops each translates to, and the :class:`ampkit.Policy` that ``init`` and the
model conversion build from them (MXNet's rules on its names checked first).

Example:
    >>> from ampkit.dialects.mxnet.lists import list_lp16_ops
    >>> "FullyConnected" in list_lp16_ops("float16")
    True
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ampkit.common.arguments import parse_dtype
from ampkit.policies.policy import Policy
from ampkit.policies.presets import (
    MXNET_BF16_BF16_FP32_FUNCS,
    MXNET_BF16_FP32_FUNCS,
    MXNET_BF16_FUNCS,
    MXNET_CONDITIONAL_FP32_FUNCS,
    MXNET_FP16_FP32_FUNCS,
    MXNET_FP16_FUNCS,
    MXNET_FP32_FUNCS,
    MXNET_LOSS_OUTPUT_FUNCTIONS,
    MXNET_WIDEST_TYPE_CASTS,
)
from ampkit.policies.registry import OpEntry, resolve_ops

__all__ = ["CONDITIONAL_OPS", "list_conditional_fp32_ops", "list_fp16_ops",
           "list_fp32_ops", "list_loss_output_functions", "list_lp16_fp32_ops",
           "list_lp16_ops", "list_lp16_use_fp32_params", "list_widest_type_cast"]


_TARGET_DTYPES: dict[str, torch.dtype] = {"float16": torch.float16,
                                          "bfloat16": torch.bfloat16}

#: MXNet's (op, parameter, value) triples, each a separate op in torch.
CONDITIONAL_OPS: dict[tuple[str, str, str], str] = {
    ("Activation", "act_type", "relu"): "relu",
    ("Activation", "act_type", "sigmoid"): "sigmoid",
    ("Activation", "act_type", "tanh"): "tanh",
    ("Activation", "act_type", "softrelu"): "softplus",
    ("Activation", "act_type", "softsign"): "softsign",
    ("LeakyReLU", "act_type", "leaky"): "leaky_relu",
    ("LeakyReLU", "act_type", "elu"): "elu",
    ("LeakyReLU", "act_type", "selu"): "selu",
    ("LeakyReLU", "act_type", "prelu"): "prelu",
    ("LeakyReLU", "act_type", "rrelu"): "rrelu",
    ("LeakyReLU", "act_type", "gelu"): "gelu",
}


# -- lists ---------------------------------------------------------------------------------

def parse_target_dtype(target_dtype: Any) -> torch.dtype:
    try:  # np.float16 too
        return parse_dtype(target_dtype, "target_dtype", accept=_TARGET_DTYPES.values(),
                           aliases=False)
    except ValueError:  # MXNet's wording
        raise ValueError(f"target_dtype must be 'float16' or 'bfloat16' (or torch.float16 "
                         f"/ torch.bfloat16), got {target_dtype!r}") from None


def list_lp16_ops(target_dtype: str | torch.dtype = "float16") -> list[str]:
    """MXNet's default list of ops run in ``target_dtype`` (the names ampkit
    translates to torch ops).

    Example:
        >>> import ampkit.mxnet as amp
        >>> amp.list_lp16_ops("float16")
        ['Convolution', 'Deconvolution', 'FullyConnected', 'RNN']
    """
    low = parse_target_dtype(target_dtype)
    return list(MXNET_FP16_FUNCS if low is torch.float16 else MXNET_BF16_FUNCS)


def list_fp16_ops(target_dtype: str | torch.dtype = "float16") -> list[str]:
    """MXNet 1.x's name for :func:`list_lp16_ops`.

    Example:
        >>> import ampkit.mxnet as amp
        >>> amp.list_fp16_ops("bfloat16")
        ['Convolution', 'Deconvolution', 'FullyConnected']
    """
    return list_lp16_ops(target_dtype)


def list_fp32_ops(target_dtype: str | torch.dtype = "float16") -> list[str]:
    """MXNet's default list of ops run in float32 (the names ampkit translates).

    Example:
        >>> import ampkit.mxnet as amp
        >>> {"softmax", "LayerNorm", "exp"} <= set(amp.list_fp32_ops())
        True
    """
    low = parse_target_dtype(target_dtype)
    return list(MXNET_FP32_FUNCS if low is torch.float16 else MXNET_BF16_FP32_FUNCS)


def list_lp16_fp32_ops(target_dtype: str | torch.dtype = "float16") -> list[str]:
    """MXNet's default list of ops that run in ``target_dtype`` or float32 alike: ampkit
    runs them in their inputs' dtype (no cast). The names with a torch counterpart; no
    name is on two of the list functions' lists.

    Example:
        >>> import ampkit.mxnet as amp
        >>> {"reshape", "relu", "BatchNorm"} <= set(amp.list_lp16_fp32_ops("float16"))
        True
        >>> "reshape" in amp.list_lp16_fp32_ops("bfloat16")
        True
    """
    low = parse_target_dtype(target_dtype)
    return list(MXNET_FP16_FP32_FUNCS if low is torch.float16 else MXNET_BF16_BF16_FP32_FUNCS)


def list_loss_output_functions(target_dtype: str | torch.dtype = "float16") -> list[str]:
    """MXNet's loss output ops (``SoftmaxOutput``, ...), each a torch loss here
    (``cross_entropy``, ``mse_loss``, ``binary_cross_entropy_with_logits``,
    ``l1_loss``). MXNet scaled their gradients by the loss scale; in ampkit
    :func:`scale_loss` scales the loss itself, which is the same product.

    Example:
        >>> import ampkit.mxnet as amp
        >>> amp.list_loss_output_functions("bfloat16")[0]
        'SoftmaxOutput'
    """
    parse_target_dtype(target_dtype)
    return list(MXNET_LOSS_OUTPUT_FUNCTIONS)


def list_lp16_use_fp32_params(target_dtype: str | torch.dtype = "float16"
                              ) -> dict[str, list[str]] | None:
    """MXNet's ops whose parameters stay float32 with a low-precision input: ``None``
    for float16; for bfloat16, ``BatchNorm``'s (torch's names: ``weight``, ``bias``,
    ``running_mean``, ``running_var``; MXNet's ``gamma``, ``beta``, ``moving_mean``,
    ``moving_var``). :func:`convert_hybrid_block` with ``cast_optional_params`` keeps
    them float32 for both dtypes (batch_norm is on no low-precision list).

    Example:
        >>> import ampkit.mxnet as amp
        >>> amp.list_lp16_use_fp32_params("float16") is None
        True
        >>> amp.list_lp16_use_fp32_params("bfloat16")
        {'BatchNorm': ['weight', 'bias', 'running_mean', 'running_var']}
    """
    low = parse_target_dtype(target_dtype)
    if low is torch.float16:
        return None
    return {"BatchNorm": ["weight", "bias", "running_mean", "running_var"]}


def list_conditional_fp32_ops(target_dtype: str | torch.dtype = "float16"
                              ) -> list[tuple[str, str, list[str]]]:
    """MXNet's default conditional fp32 ops: ``(op, parameter, values)``.

    Example:
        >>> import ampkit.mxnet as amp
        >>> amp.list_conditional_fp32_ops()
        [('Activation', 'act_type', ['softrelu']), ('LeakyReLU', 'act_type', ['elu', 'selu'])]
    """
    parse_target_dtype(target_dtype)
    return [(op, param, list(values)) for op, param, values in MXNET_CONDITIONAL_FP32_FUNCS]


def list_widest_type_cast(target_dtype: str | torch.dtype = "float16") -> list[str]:
    """MXNet's ops that run in the widest type of their inputs (amp_multicast).

    Example:
        >>> import ampkit.mxnet as amp
        >>> {"elemwise_add", "Concat", "dot", "where"} <= set(amp.list_widest_type_cast())
        True
    """
    parse_target_dtype(target_dtype)
    return list(MXNET_WIDEST_TYPE_CASTS)


def _conditional(entries: Any, argument: str) -> frozenset[str]:
    if isinstance(entries, str | bytes) or not isinstance(entries, Iterable):
        raise TypeError(f"{argument} must be a list of (op name, parameter name, list of "
                        f"values) triples, got {type(entries).__name__}")
    ops: set[str] = set()
    for entry in entries:
        if (not isinstance(entry, list | tuple) or len(entry) != 3
                or not all(isinstance(x, str) for x in entry[:2])
                or isinstance(entry[2], str) or not isinstance(entry[2], Iterable)):
            raise TypeError(f"{argument}: each entry must be (op name, parameter name, list "
                            f"of values), got {entry!r}")
        op, param, values = entry
        for value in values:
            torch_op = CONDITIONAL_OPS.get((op, param, value))
            if torch_op is None:
                known = sorted(f"({o!r}, {p!r}, {v!r})" for o, p, v in CONDITIONAL_OPS)
                raise ValueError(f"{argument}: ({op!r}, {param!r}, {value!r}) has no torch "
                                 f"counterpart; known triples: {', '.join(known)}")
            ops.add(torch_op)
    return frozenset(ops)


def _check_mxnet_names(low: torch.dtype, target_ops: Any, fp32_ops: Any,
                       conditional_fp32_ops: Any, target_argument: str) -> None:
    """MXNet's own rules on its op names, which the torch ops they translate to cannot
    show: a conditional op's name (``"Activation"``) on no other list, and an MXNet
    name taken only from the four choosable lists (a widest-type op such as
    ``"elemwise_add"`` cannot be forced to one dtype)."""
    names = {argument: {e for e in entries if isinstance(e, str)}
             for argument, entries in ((target_argument, target_ops), ("fp32_ops", fp32_ops))
             if entries is not None and not isinstance(entries, str | bytes)
             and isinstance(entries, Iterable)}
    conditional = ({e[0] for e in conditional_fp32_ops if isinstance(e, list | tuple) and e
                    and isinstance(e[0], str)}
                   if isinstance(conditional_fp32_ops, list | tuple) else set())
    for argument, given in names.items():
        both = given & conditional
        if both:
            raise ValueError(f"ops {sorted(both)} are in both {argument} and "
                             f"conditional_fp32_ops; an op may be on one list only")
    choosable = (set(list_lp16_ops(low)) | set(list_fp32_ops(low))
                 | set(list_lp16_fp32_ops(low))
                 | {op for op, _, _ in MXNET_CONDITIONAL_FP32_FUNCS})
    for argument, given in names.items():
        widest = sorted((given & set(MXNET_WIDEST_TYPE_CASTS)) - choosable)
        if widest:
            raise ValueError(
                f"{argument}: {widest} run in the widest type of their inputs "
                f"(list_widest_type_cast()) and cannot be put on a list; choose ops from "
                f"list_lp16_ops(), list_fp32_ops(), list_lp16_fp32_ops() or "
                f"list_conditional_fp32_ops()")


def build_policy(low: torch.dtype, target_ops: Iterable[OpEntry] | None,
                  fp32_ops: Iterable[OpEntry] | None, conditional_fp32_ops: Any,
                  target_argument: str) -> Policy:
    bf16 = low is torch.bfloat16
    _check_mxnet_names(low, target_ops, fp32_ops, conditional_fp32_ops, target_argument)
    lower = resolve_ops(
        (MXNET_BF16_FUNCS if bf16 else MXNET_FP16_FUNCS) if target_ops is None
        else target_ops, framework="mxnet", argument=target_argument)
    fp32 = resolve_ops(
        (MXNET_BF16_FP32_FUNCS if bf16 else MXNET_FP32_FUNCS) if fp32_ops is None
        else fp32_ops, framework="mxnet", argument="fp32_ops")
    conditional = _conditional(
        MXNET_CONDITIONAL_FP32_FUNCS if conditional_fp32_ops is None
        else conditional_fp32_ops, "conditional_fp32_ops")
    for a, a_ops, b, b_ops in ((target_argument, lower, "fp32_ops", fp32),
                               (target_argument, lower, "conditional_fp32_ops", conditional)):
        both = a_ops & b_ops
        if both:
            raise ValueError(f"ops {sorted(both)} are in both {a} and {b}; an op may be on "
                             f"one list only")
    fp32 = fp32 | conditional
    # The listed ops win over the widest-type casts, as in MXNet (its cast to the target
    # type is applied after the multicast).
    widest = resolve_ops(MXNET_WIDEST_TYPE_CASTS, framework="mxnet") - lower - fp32
    return Policy(name="mxnet", dtype=low, lower_precision_ops=lower, fp32_ops=fp32,
                  promote_ops=widest, unlisted="keep",
                  description="MXNet contrib.amp lists (ampkit.mxnet)")
