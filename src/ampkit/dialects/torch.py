"""``ampkit.torch``: ``torch.amp``'s own API, drop-in, with ampkit's policies on top.

* :class:`autocast` is ``torch.autocast`` (same signature, same defaults, same
  behaviour: it *is* native autocast under the default policy ``"torch"``), plus a
  keyword ``policy`` that picks another op table, e.g. ``"torch-cpu-legacy"``, the older
  CPU lists of the ``torch.cpu.amp`` documentation (seed 003).
* :class:`cpu_autocast` is the seed's ``torch.cpu.amp.autocast(enabled=True,
  dtype=torch.bfloat16, cache_enabled=True)``.
* :data:`GradScaler` is :class:`ampkit.GradScaler` (``torch.amp.GradScaler``'s
  contract; its ``device`` defaults to CUDA when available, else CPU, where torch's
  defaults to ``"cuda"`` and disables itself without CUDA).
* ``custom_fwd``, ``custom_bwd`` and ``is_autocast_available`` are torch's own: they
  work unchanged inside ampkit regions.

As in torch, a ``dtype`` that the device's autocast does not support (``torch.float32``
on CPU, say) warns and disables autocast in the region; with ``enabled=False`` any
``torch.dtype`` is accepted silently. An unknown ``device_type`` is a ``RuntimeError``
(:class:`ampkit.engine.regions.UnsupportedDeviceError`), as in torch.

Example:
    >>> import torch
    >>> import ampkit.torch as amp
    >>> lin = torch.nn.Linear(4, 4)
    >>> x = torch.rand(2, 4)
    >>> with amp.autocast("cpu", dtype=torch.bfloat16):
    ...     lin(x).dtype, (x @ x.T).dtype
    (torch.bfloat16, torch.bfloat16)
    >>> with amp.autocast("cpu", dtype=torch.bfloat16, policy="torch-cpu-legacy"):
    ...     lin(x).dtype, (x @ x.T).dtype      # the old CPU list had no matmul
    (torch.bfloat16, torch.float32)
"""

from __future__ import annotations

import warnings

import torch
from torch.amp import custom_bwd, custom_fwd, is_autocast_available

import ampkit.engine.regions as _engine
from ampkit.policies.policy import LOW_PRECISION_DTYPES, Policy
from ampkit.scaling.grad_scaler import GradScaler

__all__ = [
    "GradScaler",
    "autocast",
    "cpu_autocast",
    "custom_bwd",
    "custom_fwd",
    "is_autocast_available",
]


class autocast(_engine.autocast):
    """``torch.autocast(device_type, dtype=None, enabled=True, cache_enabled=None)``,
    with an op table chosen by ``policy``. A context manager and a decorator.

    Args:
        device_type: ``"cpu"``, ``"cuda"``, ... (required, as in torch).
        dtype: ``torch.float16`` or ``torch.bfloat16``; ``None`` is the device's
            autocast default (``torch.get_autocast_dtype``). Another ``torch.dtype``
            warns and disables autocast in the region, as torch does.
        enabled: ``False`` turns autocast off in the region.
        cache_enabled: cache low-precision casts of weights in the region; ``None``
            follows ``torch.is_autocast_cache_enabled()``.
        policy: ``"torch"`` (native autocast: the default), ``"torch-cpu-legacy"`` (the
            seed's older CPU lists) or any ampkit preset name or
            :class:`~ampkit.policies.policy.Policy`.

    Example:
        >>> import torch
        >>> import ampkit.torch as amp
        >>> @amp.autocast("cpu")
        ... def double_mm(a):
        ...     return a @ a
        >>> double_mm(torch.rand(2, 2)).dtype
        torch.bfloat16
    """

    def __init__(self, device_type: str, dtype: torch.dtype | None = None,
                 enabled: bool = True, cache_enabled: bool | None = None, *,
                 policy: str | Policy = "torch") -> None:
        if cache_enabled is None:
            cache_enabled = torch.is_autocast_cache_enabled()
        if enabled and isinstance(dtype, torch.dtype) and (
                dtype not in LOW_PRECISION_DTYPES.values()):
            # torch.autocast's own answer to an unsupported dtype: warn, then disable. A
            # region that is disabled anyway never looks at its dtype: no warning, as in
            # torch.
            warnings.warn(f"autocast on {device_type!r} supports torch.float16 and "
                          f"torch.bfloat16, got {dtype}; disabling autocast in this "
                          f"region", UserWarning, stacklevel=2)
            enabled = False
        super().__init__(device_type, dtype, enabled, cache_enabled, policy=policy)

    @property
    def device(self) -> str:
        """The device type (torch's attribute name).

        Example:
            >>> import ampkit.torch as amp
            >>> amp.autocast("cpu").device
            'cpu'
        """
        return self.device_type

    @property
    def fast_dtype(self) -> torch.dtype:
        """The low-precision dtype of the region (torch's attribute name).

        Example:
            >>> import torch
            >>> import ampkit.torch as amp
            >>> amp.autocast("cpu", torch.float16).fast_dtype
            torch.float16
        """
        return self.dtype


class cpu_autocast(autocast):
    """The seed's ``torch.cpu.amp.autocast(enabled=True, dtype=torch.bfloat16,
    cache_enabled=True)``: :class:`autocast` on ``"cpu"``.

    Deprecated as torch deprecates ``torch.cpu.amp.autocast``: it issues torch's
    ``FutureWarning`` (use ``autocast("cpu", ...)``) and otherwise works unchanged.

    Example:
        >>> import torch
        >>> import warnings
        >>> from ampkit.torch import cpu_autocast
        >>> with warnings.catch_warnings(record=True) as caught, cpu_autocast():
        ...     torch.mm(torch.rand(2, 2), torch.rand(2, 2)).dtype
        torch.bfloat16
        >>> caught[0].category.__name__
        'FutureWarning'
    """

    def __init__(self, enabled: bool = True, dtype: torch.dtype = torch.bfloat16,
                 cache_enabled: bool = True, *, policy: str | Policy = "torch") -> None:
        # torch's own words first (code that checks for torch's warning finds it), then
        # what they mean here.
        warnings.warn("`torch.cpu.amp.autocast(args...)` is deprecated. Please use "
                      "`torch.amp.autocast('cpu', args...)` instead. (Here: "
                      "`ampkit.torch.cpu_autocast(args...)` -> "
                      "`ampkit.torch.autocast('cpu', args...)`.)", FutureWarning, stacklevel=2)
        super().__init__("cpu", dtype, enabled, cache_enabled, policy=policy)

