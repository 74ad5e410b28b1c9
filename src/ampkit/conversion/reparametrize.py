"""The legacy ``torch.nn.utils.spectral_norm``/``weight_norm`` hooks (those that predate
``torch.nn.utils.parametrizations``) on a module whose parameters are cast on use (O2):
the hook computes the weight from the module's fp32 parameters with autocast off, then
the weight is cast to the compute dtype, the copy the module's forward uses. The hook's
class becomes a subclass of its own, so ``remove_spectral_norm`` and
``remove_weight_norm`` still find it.

Example:
    >>> import torch
    >>> from ampkit.conversion.reparametrize import legacy_reparametrizations
    >>> lin = torch.nn.utils.spectral_norm(torch.nn.Linear(2, 2))
    >>> [type(hook).__name__ for hook in legacy_reparametrizations(lin)]
    ['SpectralNorm']
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ampkit import torch_internals
from ampkit.conversion.boundary import compute_device_type, region_autocast

__all__ = ["SpectralNormInFp32", "WeightNormInFp32", "legacy_reparametrizations",
           "reparametrization_sources", "reparametrize_in_fp32"]


def legacy_reparametrizations(module: nn.Module) -> list[Any]:
    """The forward pre-hooks of ``torch.nn.utils.spectral_norm``/``weight_norm`` (the
    hooks that predate ``torch.nn.utils.parametrizations``) on ``module``."""
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm

    return [hook for hook in torch_internals.forward_pre_hooks(module).values()
            if isinstance(hook, SpectralNorm | WeightNorm)]


def reparametrization_sources(hook: Any) -> tuple[str, ...]:
    """The parameters a legacy hook computes its weight from."""
    from torch.nn.utils.spectral_norm import SpectralNorm

    if isinstance(hook, SpectralNorm):
        return (hook.name + "_orig",)
    return (hook.name + "_g", hook.name + "_v")


class _ReparametrizeInFp32:
    """A legacy ``spectral_norm``/``weight_norm`` hook on a module cast on use: the
    hook computes the weight from its fp32 parameters with autocast off (spectral
    norm's power iteration in fp32, on its fp32 ``u``/``v`` buffers), then the result
    is cast to the compute dtype, the low-precision copy the module's forward uses. The
    hook's class becomes a subclass of its own (``remove_spectral_norm`` and
    ``remove_weight_norm`` still find it); ``_ampkit_dtype`` is set on the hook."""

    name: str
    _ampkit_dtype: torch.dtype

    def __call__(self, module: nn.Module, inputs: Any) -> None:
        device_type = compute_device_type(module, inputs)
        compute = super().__call__  # type: ignore[misc]
        if not torch.is_autocast_enabled(device_type):
            compute(module, inputs)
        elif torch_internals.compiling_here():
            with torch.autocast(device_type, enabled=False):
                compute(module, inputs)
        else:
            with region_autocast(device_type, None, None):
                compute(module, inputs)
        weight = getattr(module, self.name)
        if weight.dtype is torch.float32:
            setattr(module, self.name, weight.to(self._ampkit_dtype))


def reparametrize_in_fp32(hook: Any, dtype: torch.dtype) -> None:
    """Make a legacy hook compute its weight in fp32 and hand it on in ``dtype``."""
    from torch.nn.utils.spectral_norm import SpectralNorm

    hook.__class__ = (SpectralNormInFp32 if isinstance(hook, SpectralNorm)
                      else WeightNormInFp32)
    hook._ampkit_dtype = dtype


def _legacy_classes() -> tuple[type, type]:
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm

    spectral = type("SpectralNormInFp32", (_ReparametrizeInFp32, SpectralNorm),
                    {"__module__": __name__})
    weight = type("WeightNormInFp32", (_ReparametrizeInFp32, WeightNorm),
                  {"__module__": __name__})
    return spectral, weight


# Module-level names, so that a pickled or deep-copied hook finds its class (the
# package re-exports them: ampkit.conversion is the module they are pickled under).
SpectralNormInFp32, WeightNormInFp32 = _legacy_classes()
