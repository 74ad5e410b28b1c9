"""MXNet's explicit casts: ``amp_cast`` (one tensor, between a low-precision float and
float32, other dtypes passed through) and ``amp_multicast`` (several tensors, to the
widest float among them, or the narrowest with ``cast_narrow=True``).

Example:
    >>> import torch
    >>> from ampkit.dialects.mxnet.casts import amp_cast
    >>> amp_cast(torch.ones(2), "bfloat16").dtype
    torch.bfloat16
"""

from __future__ import annotations

from typing import Any

import torch

from ampkit.common.arguments import parse_dtype
from ampkit.engine import casting

__all__ = ["amp_cast", "amp_multicast"]


# The dtypes of the seed's amp_cast (mx.symbol.amp_cast), plus bfloat16.
_CAST_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16, "float32": torch.float32, "float64": torch.float64,
    "int32": torch.int32, "int64": torch.int64, "int8": torch.int8, "uint8": torch.uint8,
    "bfloat16": torch.bfloat16,
}


# -- casts ---------------------------------------------------------------------------------

def _cast_dtype(dtype: Any) -> torch.dtype:
    try:  # numpy spellings too: np.float16, np.dtype("int8")
        return parse_dtype(dtype, "dtype", accept=_CAST_DTYPES.values(), aliases=False)
    except ValueError:  # MXNet's list of names
        raise ValueError(f"dtype must be one of {list(_CAST_DTYPES)} (or the torch/numpy "
                         f"dtype), got {dtype!r}") from None


def _check_tensor(data: Any, argument: str) -> torch.Tensor:
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"{argument} must be a torch.Tensor, got {type(data).__name__}")
    return data


def amp_cast(data: torch.Tensor, dtype: str | torch.dtype) -> torch.Tensor:
    """MXNet's ``amp_cast``: cast between a low-precision float (float16, bfloat16) and
    float32 only; any other input or target dtype returns ``data`` unchanged.

    Args:
        data: a tensor.
        dtype: ``'float16'``, ``'float32'``, ``'float64'``, ``'int32'``, ``'int64'``,
            ``'int8'``, ``'uint8'`` (the seed's set) or ``'bfloat16'``; torch and numpy
            dtypes of these are accepted too.

    Raises:
        ValueError: any other ``dtype``, listing the accepted ones.
        TypeError: ``data`` is not a tensor.

    Example:
        >>> import torch
        >>> import ampkit.mxnet as amp
        >>> amp.amp_cast(torch.ones(1, dtype=torch.bfloat16), "float32").dtype
        torch.float32
        >>> amp.amp_cast(torch.ones(1, dtype=torch.float64), "float16").dtype
        torch.float64
    """
    target = _cast_dtype(dtype)
    return casting.amp_cast(_check_tensor(data, "data"), target)


def amp_multicast(*data: torch.Tensor, num_outputs: int, cast_narrow: bool = False
                  ) -> torch.Tensor | list[torch.Tensor]:
    """MXNet's ``amp_multicast``: cast the float16/bfloat16/float32 inputs to the widest
    such type present (the narrowest with ``cast_narrow``); others pass through.

    Returns a list of ``num_outputs`` tensors, or the tensor itself when there is one
    (MXNet's single-output ops return an array, not a list).

    Raises:
        ValueError: ``num_outputs`` differs from the number of inputs.
        TypeError: an input is not a tensor, or ``cast_narrow`` is not a bool.

    Example:
        >>> import torch
        >>> import ampkit.mxnet as amp
        >>> a, b = amp.amp_multicast(torch.ones(1), torch.ones(1, dtype=torch.float16),
        ...                          num_outputs=2, cast_narrow=True)
        >>> a.dtype, b.dtype
        (torch.float16, torch.float16)
    """
    if isinstance(num_outputs, bool) or not isinstance(num_outputs, int) or (
            num_outputs != len(data)):
        raise ValueError(f"num_outputs must equal the number of inputs ({len(data)}), "
                         f"got {num_outputs!r}")
    if not isinstance(cast_narrow, bool):
        raise TypeError(f"cast_narrow must be a bool, got {type(cast_narrow).__name__}")
    for i, d in enumerate(data):
        _check_tensor(d, f"data[{i}]")
    out = list(casting.amp_multicast(*data, cast_narrow=cast_narrow))
    return out[0] if len(out) == 1 else out
