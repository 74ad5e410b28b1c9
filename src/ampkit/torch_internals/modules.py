"""torch.nn's private base classes and module-hook tables, and the wrapper-subclass
constructor: the torch internals ampkit's conversion and probes read (see
:mod:`ampkit.torch_internals`).

Example:
    >>> import torch.nn as nn
    >>> from ampkit.torch_internals.modules import BatchNormBase
    >>> issubclass(nn.BatchNorm2d, BatchNormBase)
    True
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.nn.modules import batchnorm as _batchnorm
from torch.nn.modules import instancenorm as _instancenorm
from torch.nn.modules import module as _module

from ampkit.torch_internals.entries import Unavailable, fail, register_entry, resolve

__all__ = ["BatchNormBase", "InstanceNormBase", "NormBase", "global_backward_hooks",
           "global_backward_pre_hooks", "global_forward_hooks",
           "global_forward_pre_hooks", "make_wrapper_subclass"]

#: the base of every BatchNorm (1d/2d/3d, lazy, sync)
BatchNormBase: Any = resolve("norm_bases", "BatchNormBase", lambda: _batchnorm._BatchNorm)
#: the base of every InstanceNorm (1d/2d/3d, lazy)
InstanceNormBase: Any = resolve("norm_bases", "InstanceNormBase",
                                lambda: _instancenorm._InstanceNorm)
#: the base of the norms with running statistics (BatchNorm and InstanceNorm)
NormBase: Any = resolve("norm_bases", "NormBase", lambda: _batchnorm._NormBase)


@register_entry("norm_bases", ("torch.nn.modules.batchnorm._BatchNorm",
                               "torch.nn.modules.batchnorm._NormBase",
                               "torch.nn.modules.instancenorm._InstanceNorm"),
                "recognise every norm class of a kind (the levels keep norms fp32; a norm "
                "with running statistics computes with fp32 parameters)",
                "none: the public classes (nn.BatchNorm1d/2d/3d, SyncBatchNorm, the lazy "
                "ones) share only these private bases",
                provides=("BatchNormBase", "InstanceNormBase", "NormBase"))
def _check_norm_bases() -> None:
    kinds = {BatchNormBase: (nn.BatchNorm1d, nn.BatchNorm2d, nn.SyncBatchNorm),
             InstanceNormBase: (nn.InstanceNorm1d, nn.InstanceNorm2d),
             NormBase: (nn.BatchNorm1d, nn.InstanceNorm3d)}
    for base, classes in kinds.items():
        if not all(issubclass(c, base) for c in classes):
            raise fail("norm_bases", f"{base.__name__} is not the base of {classes}")


# The process-wide module hooks (torch.nn.modules.module.register_module_forward_hook
# and its kin add to them): dicts torch mutates in place and never rebinds, read the way
# nn.Module._call_impl reads them.
#: the process-wide forward pre-hooks of every module
global_forward_pre_hooks: dict[int, Any] = resolve(
    "global_module_hooks", "global_forward_pre_hooks",
    lambda: _module._global_forward_pre_hooks)
#: the process-wide forward hooks of every module
global_forward_hooks: dict[int, Any] = resolve(
    "global_module_hooks", "global_forward_hooks", lambda: _module._global_forward_hooks)
#: the process-wide backward pre-hooks of every module
global_backward_pre_hooks: dict[int, Any] = resolve(
    "global_module_hooks", "global_backward_pre_hooks",
    lambda: _module._global_backward_pre_hooks)
#: the process-wide backward hooks of every module
global_backward_hooks: dict[int, Any] = resolve(
    "global_module_hooks", "global_backward_hooks", lambda: _module._global_backward_hooks)


class _MayHoldHooks(Unavailable):
    """Stands for a global hook table this torch does not let ampkit read: true, so a
    converted module always takes ``nn.Module``'s ordinary call, which runs whatever
    hooks there are (slower, the same result); any other use raises."""

    __slots__ = ()

    def __bool__(self) -> bool:
        return True


_HOOK_TABLES = ("global_forward_pre_hooks", "global_forward_hooks",
                "global_backward_pre_hooks", "global_backward_hooks")


@register_entry("global_module_hooks",
                ("torch.nn.modules.module._global_forward_pre_hooks",
                 "torch.nn.modules.module._global_forward_hooks",
                 "torch.nn.modules.module._global_backward_pre_hooks",
                 "torch.nn.modules.module._global_backward_hooks"),
                "a converted module's fast call path runs the hooks nn.Module's own call "
                "would (it skips the ordinary call only when there are none)",
                "torch.nn.modules.module.register_module_*_hook registers them; nothing "
                "public reads them", provides=_HOOK_TABLES,
                fallbacks={n: _MayHoldHooks("global_module_hooks", n) for n in _HOOK_TABLES})
def _check_global_module_hooks() -> None:
    handle = nn.modules.module.register_module_forward_hook(lambda *a: None)
    try:
        if handle.id not in global_forward_hooks:
            raise fail("global_module_hooks", "are not where registration puts them")
    finally:
        handle.remove()
    if handle.id in global_forward_hooks:
        raise fail("global_module_hooks", "keep a removed hook")
    if _module._global_forward_hooks is not global_forward_hooks:
        raise fail("global_module_hooks", "were rebound")


#: builds a tensor subclass that holds no data of its own (a probe, a wrapper)
make_wrapper_subclass: Any = resolve("wrapper_subclass", "make_wrapper_subclass",
                                     lambda: torch.Tensor._make_wrapper_subclass)


@register_entry("wrapper_subclass", ("torch.Tensor._make_wrapper_subclass",),
                "native autocast's kernels are probed with data-less one-element tensors "
                "(which casts they make), without running any op",
                "none: torch's documentation of tensor subclasses uses this constructor",
                provides=("make_wrapper_subclass",))
def _check_wrapper_subclass() -> None:
    class Probe(torch.Tensor):
        @classmethod
        def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (),  # type: ignore[override]
                               kwargs: Any = None) -> Any:
            raise NotImplementedError  # never called: the check runs no op

    made = make_wrapper_subclass(Probe, (1,), dtype=torch.bfloat16, device="cpu")
    if type(made) is not Probe or made.dtype != torch.bfloat16 or tuple(made.shape) != (1,):
        raise fail("wrapper_subclass", "builds another tensor")
