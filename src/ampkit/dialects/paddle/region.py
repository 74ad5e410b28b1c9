"""Paddle's ``auto_cast`` region and what it runs: the global AMP dtype that the last
region entered records (``GradScaler.scale`` reads it), the default white and black
lists in Paddle's op names, and whether a device supports float16 or bfloat16.

Example:
    >>> import torch
    >>> from ampkit.dialects.paddle.region import auto_cast
    >>> with auto_cast(custom_white_list={"elementwise_add"}, level="O2"):
    ...     (torch.ones(2) + torch.ones(2)).dtype
    torch.float16
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import torch

from ampkit.common.arguments import parse_dtype
from ampkit.common.device_support import device_supports_dtype
from ampkit.engine.regions import autocast, innermost_region_dtype
from ampkit.policies.policy import Policy
from ampkit.policies.presets import (
    PADDLE_BLACK_LIST,
    PADDLE_EXTRA_BLACK_LIST,
    PADDLE_O1,
    PADDLE_O2,
    PADDLE_O2_NO_PROMOTE,
    PADDLE_OD,
    PADDLE_WHITE_LIST,
)
from ampkit.policies.registry import OpEntry

__all__ = ["auto_cast", "black_list", "get_autocast_cpu_dtype", "get_autocast_dtype",
           "get_autocast_gpu_dtype", "is_autocast_enabled", "is_bfloat16_supported",
           "is_float16_supported", "white_list"]


_DTYPES: dict[str, torch.dtype] = {"float16": torch.float16, "bfloat16": torch.bfloat16}


_LEVELS = ("O0", "OD", "O1", "O2")


def parse_low_dtype(dtype: Any) -> torch.dtype:
    try:
        return parse_dtype(dtype, "dtype", accept=_DTYPES.values(), aliases=False)
    except ValueError:  # Paddle's wording
        raise ValueError(f"dtype should be 'float16' or 'bfloat16' (or torch.float16 / "
                         f"torch.bfloat16), got {dtype!r}") from None


def check_bool(value: Any, argument: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{argument} must be a bool, got {type(value).__name__}")
    return value


def _level_policy(level: str, use_promote: bool) -> Policy:
    if level == "OD":
        return PADDLE_OD
    if level == "O2":
        return PADDLE_O2 if use_promote else PADDLE_O2_NO_PROMOTE
    return PADDLE_O1  # O1, and O0 (a disabled region)


def auto_cast(enable: bool = True, custom_white_list: Iterable[OpEntry] | None = None,
              custom_black_list: Iterable[OpEntry] | None = None, level: str = "O1",
              dtype: str | torch.dtype = "float16", use_promote: bool = True, *,
              device_type: str | None = None) -> autocast:
    """Paddle's ``auto_cast``: a context manager (and decorator) that runs ops in mixed
    precision by Paddle's lists and level.

    Args:
        enable: ``False`` runs everything as it is (float32 stays float32).
        custom_white_list: ops to run in ``dtype`` (set, list or tuple of Paddle or
            torch op names, callables, module classes).
        custom_black_list: ops to run in float32.
        level: ``'O1'`` (mixed), ``'OD'`` (only the white list low precision),
            ``'O2'`` (pure low precision, with :func:`decorate`) or ``'O0'`` (off).
        dtype: ``'float16'`` or ``'bfloat16'`` (or the torch dtype).
        use_promote: at O2, an op with a float32 input runs in float32.
        device_type: an ampkit extra: the device whose ops are cast. ``None`` follows
            torch's global default device (``torch.get_default_device()``, ``"cpu"``
            unless ``torch.set_default_device`` changed it), as Paddle's region follows
            its global place: on a machine with CUDA, ``auto_cast()`` casts the ops of a
            model on the CPU; pass ``device_type="cuda"`` (or set the default device,
            Paddle's ``paddle.set_device("gpu")``) for a model on the GPU.

    Raises:
        ValueError: a bad ``level`` or ``dtype``, an op in both custom lists, an
            unknown op name (with the closest known names).
        TypeError: ``enable`` or ``use_promote`` not a bool; a list that is not a set,
            list or tuple.

    Example:
        >>> import torch
        >>> import ampkit.paddle as amp
        >>> a, b = torch.rand(2, 3), torch.rand(2, 3)
        >>> with amp.auto_cast(custom_white_list={"elementwise_add"}, level="O2"):
        ...     (a + b).dtype
        torch.float16
        >>> with amp.auto_cast(level="OD"):
        ...     torch.softmax(a.half(), -1).dtype     # OD: all but the white list fp32
        torch.float32
    """
    check_bool(enable, "enable")
    check_bool(use_promote, "use_promote")
    if level not in _LEVELS:
        raise ValueError(f"level should be one of {list(_LEVELS)}, got {level!r}")
    low = parse_low_dtype(dtype)
    policy = _level_policy(level, use_promote).with_lists(
        custom_white_list, custom_black_list, framework="paddle")
    device = device_type or torch.get_default_device().type
    return _Region(device, low, enabled=enable and level != "O0", policy=policy)


# Paddle's global AMP state: the dtype of the auto_cast entered last (enabled or not),
# which GradScaler.scale reads.
_amp_lock = threading.Lock()
_amp_dtype = "float16"


def last_amp_dtype() -> str:
    with _amp_lock:
        return _amp_dtype


class _Region(autocast):
    """``auto_cast``'s region: ``ampkit.autocast`` that, like Paddle's ``amp_guard``,
    records its dtype as the global AMP dtype on entry."""

    def __enter__(self) -> autocast:
        global _amp_dtype
        with _amp_lock:
            _amp_dtype = str(self.dtype).removeprefix("torch.")
        return super().__enter__()


def white_list() -> dict[str, dict[str, set[str]]]:
    """Paddle's default white lists, ``{dtype: {level: set of op names}}`` (copies):
    the ops ``auto_cast`` runs in low precision at each level, in Paddle's names. The
    names without a torch counterpart are left out (``docs/migration.md``); bfloat16
    uses float16's lists.

    Example:
        >>> import ampkit.paddle as amp
        >>> "matmul_v2" in amp.white_list()["float16"]["OD"]
        True
    """
    return {dtype: {level: set(PADDLE_WHITE_LIST) for level in ("OD", "O1", "O2")}
            for dtype in ("float16", "bfloat16")}


def black_list() -> dict[str, dict[str, set[str]]]:
    """Paddle's default black lists, ``{dtype: {level: set of op names}}`` (copies):
    the ops ``auto_cast`` keeps in float32 (none at OD, where every op off the white
    list is float32; only the extra black list at O2).

    Example:
        >>> import ampkit.paddle as amp
        >>> sorted(amp.black_list()["float16"]["O2"])[:2]
        ['bicubic_interp_v2', 'bilinear_interp_v2']
    """
    levels = {"OD": set(), "O1": {*PADDLE_BLACK_LIST, *PADDLE_EXTRA_BLACK_LIST},
              "O2": set(PADDLE_EXTRA_BLACK_LIST)}
    return {dtype: {level: set(ops) for level, ops in levels.items()}
            for dtype in ("float16", "bfloat16")}


# Paddle's device names -> torch's device types ("cuda" is accepted as torch spells it).
_DEVICES = {"cpu": "cpu", "gpu": "cuda", "cuda": "cuda", "xpu": "xpu"}


def _torch_device(device: Any) -> str:
    """Paddle's ``device`` argument (``None``, ``'cpu'``, ``'gpu'``, ``'gpu:1'``,
    ``'xpu:0'``) as a torch device string; anything else is Paddle's ``ValueError``."""
    if device is None:
        return torch.get_default_device().type
    kind, colon, index = device.partition(":") if isinstance(device, str) else ("", "", "")
    if kind not in _DEVICES or (colon and not index.isdigit()):
        raise ValueError(f"device must be None or one of 'cpu', 'gpu', 'gpu:x', 'xpu', "
                         f"'xpu:x' (x a device index; torch's 'cuda' too), got {device!r}")
    return _DEVICES[kind] + (f":{index}" if index else "")


def is_float16_supported(device: str | None = None) -> bool:
    """Whether ``device`` on this machine computes in float16 under ``auto_cast``
    (``None``: torch's default device; Paddle's ``'gpu'`` is torch's ``'cuda'``). Asked
    of the hardware: a GPU needs compute capability 5.3 (a machine without one answers
    ``False``); the CPU always can, in ampkit (Paddle's own CPU kernels answer
    ``False``).

    Raises:
        ValueError: a device name other than those above, or not a string.

    Example:
        >>> import torch
        >>> import ampkit.paddle as amp
        >>> amp.is_float16_supported("cpu")
        True
        >>> amp.is_float16_supported("gpu") == torch.cuda.is_available()
        True
    """
    return device_supports_dtype(_torch_device(device), torch.float16)


def is_bfloat16_supported(device: str | None = None) -> bool:
    """Whether ``device`` on this machine computes in bfloat16 under ``auto_cast``: a
    GPU with compute capability 8.0, or the CPU (see :func:`is_float16_supported`).

    Example:
        >>> import ampkit.paddle as amp
        >>> amp.is_bfloat16_supported("cpu")
        True
    """
    return device_supports_dtype(_torch_device(device), torch.bfloat16)


def _check_device_type(device_type: Any) -> None:
    # Paddle takes the argument and ignores it (one AMP state for every device); a
    # value that names no device is still an error.
    if device_type is not None:
        _torch_device(device_type)


def is_autocast_enabled(device_type: str | None = None) -> bool:
    """Whether the innermost region entered in this thread (``auto_cast``, or any
    ampkit region) casts ops. As in Paddle, one state answers for every device: a
    valid ``device_type`` is accepted and does not change the answer.

    Example:
        >>> import ampkit.paddle as amp
        >>> amp.is_autocast_enabled()
        False
        >>> with amp.auto_cast():
        ...     amp.is_autocast_enabled(), amp.is_autocast_enabled("gpu")
        (True, True)
        >>> with amp.auto_cast(enable=False):
        ...     amp.is_autocast_enabled()
        False
    """
    _check_device_type(device_type)
    return innermost_region_dtype() is not None


def get_autocast_dtype(device_type: str | None = None) -> str:
    """The dtype name (``'float16'`` or ``'bfloat16'``) the innermost enabled region
    casts to, or Paddle's default AMP dtype ``'float16'`` outside one (see
    :func:`is_autocast_enabled` for ``device_type``).

    Example:
        >>> import ampkit.paddle as amp
        >>> amp.get_autocast_dtype()
        'float16'
        >>> with amp.auto_cast(dtype="bfloat16"):
        ...     amp.get_autocast_dtype()
        'bfloat16'
    """
    _check_device_type(device_type)
    dtype = innermost_region_dtype()
    return "float16" if dtype is None else str(dtype).removeprefix("torch.")


def get_autocast_gpu_dtype() -> str:
    """:func:`get_autocast_dtype` (Paddle's name kept from torch's API).

    Example:
        >>> import ampkit.paddle as amp
        >>> with amp.auto_cast(dtype="bfloat16"):
        ...     amp.get_autocast_gpu_dtype()
        'bfloat16'
    """
    return get_autocast_dtype()


def get_autocast_cpu_dtype(device_type: str | None = None) -> str:
    """:func:`get_autocast_dtype` (Paddle's name kept from torch's API).

    Example:
        >>> import ampkit.paddle as amp
        >>> amp.get_autocast_cpu_dtype("cpu")
        'float16'
    """
    return get_autocast_dtype(device_type)
