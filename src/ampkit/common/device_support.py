"""Whether this machine can compute in a low-precision dtype on a device: asked of the
hardware that is present, never of the build (a CPU-only machine has a torch build
whose autocast knows ``"cuda"``, but no GPU to run it on).

A CUDA GPU runs float16 from compute capability 5.3 and bfloat16 from 8.0 (the
capabilities from which NVIDIA's GPUs have arithmetic in those types); ampkit's
autocast runs both on any CPU.

Example:
    >>> import torch
    >>> from ampkit.common.device_support import device_supports_dtype
    >>> device_supports_dtype("cpu", torch.bfloat16)
    True
    >>> device_supports_dtype("cuda", torch.float16) == (
    ...     torch.cuda.is_available() and torch.cuda.get_device_capability() >= (5, 3))
    True
"""

from __future__ import annotations

import torch

from ampkit.common.arguments import LOW_PRECISION, parse_dtype

__all__ = ["DEVICE_TYPES", "device_supports_dtype"]

#: The device types this module answers for.
DEVICE_TYPES: tuple[str, ...] = ("cpu", "cuda", "xpu")

# The lowest CUDA compute capability that has arithmetic in each dtype.
_CUDA_CAPABILITY = {torch.float16: (5, 3), torch.bfloat16: (8, 0)}


def device_supports_dtype(device: str | torch.device, dtype: torch.dtype | str) -> bool:
    """Whether ``device`` on this machine computes in ``dtype`` (float16 or bfloat16).

    Args:
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"xpu"``, ``"xpu:0"`` or a
            ``torch.device``; a device index that is not present answers ``False``.
        dtype: ``torch.float16`` or ``torch.bfloat16`` (or their names).

    Raises:
        ValueError: a device type other than those above; a bad ``dtype``.
        TypeError: ``device`` neither a string nor a ``torch.device``.

    Example:
        >>> import torch
        >>> from ampkit.common.device_support import device_supports_dtype
        >>> device_supports_dtype("cpu", "float16")
        True
        >>> device_supports_dtype("cuda:7", torch.float16) == (torch.cuda.device_count() > 7
        ...     and torch.cuda.get_device_capability(7) >= (5, 3))
        True
    """
    low = parse_dtype(dtype, "dtype", accept=LOW_PRECISION)
    if isinstance(device, str):
        try:
            device = torch.device(device)
        except RuntimeError:  # "Invalid device string"
            raise ValueError(f"device must be one of {list(DEVICE_TYPES)} (with an optional "
                             f"':index'), got {device!r}") from None
    if not isinstance(device, torch.device):
        raise TypeError(f"device must be a device name such as 'cpu' or 'cuda:0', or a "
                        f"torch.device, got {type(device).__name__}")
    if device.type not in DEVICE_TYPES:
        raise ValueError(f"device must be one of {list(DEVICE_TYPES)} (with an optional "
                         f"':index'), got {str(device)!r}")
    if device.type == "cpu":
        return True
    index = 0 if device.index is None else device.index
    if device.type == "cuda":
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            return False
        return torch.cuda.get_device_capability(index) >= _CUDA_CAPABILITY[low]
    xpu = getattr(torch, "xpu", None)
    if xpu is None or not xpu.is_available() or index >= xpu.device_count():
        return False
    return low is torch.float16 or bool(xpu.is_bf16_supported())
