"""MXNet's ``init`` (and ampkit's ``deinit``): the process-wide AMP settings, with the
loss scaler that ``init_trainer`` hands out first, and the calling thread's
:class:`ampkit.autocast` region they open.

Example:
    >>> import torch
    >>> from ampkit.dialects.mxnet.region import deinit, init
    >>> init("bfloat16", device_type="cpu")
    >>> torch.nn.functional.linear(torch.ones(2, 3), torch.ones(4, 3)).dtype
    torch.bfloat16
    >>> deinit()
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable, Sequence

import torch

from ampkit.dialects.mxnet.lists import build_policy, parse_target_dtype
from ampkit.dialects.mxnet.loss_scaler import LossScaler
from ampkit.engine.regions import autocast, current_policy
from ampkit.policies.policy import Policy
from ampkit.policies.registry import OpEntry

__all__ = ["deinit", "init"]


# -- init ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Init:
    policy: Policy
    device_type: str
    scaler: LossScaler


class _ThreadRegion(threading.local):
    def __init__(self) -> None:
        self.region: autocast | None = None


init_lock = threading.Lock()
_init: _Init | None = None
_thread = _ThreadRegion()


def _default_device() -> str:
    # MXNet's default context is the CPU until `with mx.gpu():`; torch's counterpart is
    # the default device, so a model on the CPU is cast even when CUDA is present.
    return torch.get_default_device().type


def init(target_dtype: str | torch.dtype = "float16",
         target_precision_ops: Iterable[OpEntry] | None = None,
         conditional_fp32_ops: Sequence[tuple[str, str, Sequence[str]]] | None = None,
         fp32_ops: Iterable[OpEntry] | None = None, *,
         device_type: str | None = None) -> None:
    """Turn AMP on for the calling thread: ops in ``target_precision_ops`` run in
    ``target_dtype``, ops in ``fp32_ops`` (and conditional ones) in float32, the
    widest-type ops in the widest input type, every other op as it is.

    Args:
        target_dtype: ``'float16'`` or ``'bfloat16'`` (or the torch dtype).
        target_precision_ops: replaces MXNet's default low-precision list.
        conditional_fp32_ops: replaces the default ``(op, parameter, values)`` list;
            translated to torch ops by :data:`CONDITIONAL_OPS`.
        fp32_ops: replaces MXNet's default float32 list.
        device_type: an ampkit extra: the device whose ops are cast; ``None`` is
            torch's default device (``torch.get_default_device()``: ``"cpu"`` unless
            ``torch.set_default_device`` changed it, like MXNet's default context),
            also when CUDA is present; pass ``"cuda"`` for a model on the GPU.

    Raises:
        ValueError: a bad dtype, an unknown op name or triple, an op on two lists.
        RuntimeError: ``init`` was already called with other arguments.

    Example:
        >>> import torch
        >>> import ampkit.mxnet as amp
        >>> amp.init("bfloat16", device_type="cpu")
        >>> torch.nn.functional.linear(torch.rand(2, 3), torch.rand(4, 3)).dtype
        torch.bfloat16
        >>> torch.rand(3).exp().dtype, torch.rand(2, 2).matmul(torch.rand(2, 2)).dtype
        (torch.float32, torch.float32)
        >>> amp.deinit()
    """
    low = parse_target_dtype(target_dtype)
    device = device_type or _default_device()
    policy = build_policy(low, target_precision_ops, fp32_ops, conditional_fp32_ops,
                           "target_precision_ops")
    global _init
    with init_lock:
        if _init is None:
            _init = _Init(policy, device, LossScaler(device=device))
        elif (_init.policy, _init.device_type) != (policy, device):
            raise RuntimeError("amp.init() was already called with other arguments; MXNet "
                               "AMP is initialized once per process (call amp.deinit() "
                               "first to start over)")
        current = _init
    if _thread.region is None:
        # No weight-cast cache: the region never closes, so cached low-precision copies
        # of the weights would outlive the optimizer steps that change the weights.
        region = autocast(current.device_type, current.policy.dtype, policy=current.policy,
                          cache_enabled=False)
        region.__enter__()
        _thread.region = region


def deinit() -> None:
    """An ampkit extra: close the region :func:`init` opened in the calling thread and
    forget the settings, so ``init`` may be called again. A no-op when not initialized.

    Raises:
        RuntimeError: another autocast region opened after ``init`` is still open.

    Example:
        >>> import torch
        >>> import ampkit.mxnet as amp
        >>> amp.init(device_type="cpu")
        >>> amp.deinit()
        >>> torch.nn.functional.linear(torch.rand(2, 3), torch.rand(4, 3)).dtype
        torch.float32
    """
    global _init
    with init_lock:
        state = _init
    region = _thread.region
    if region is not None:
        if state is None or current_policy(region.device_type) is not region.policy:
            raise RuntimeError("amp.deinit(): another autocast region is open inside the "
                               "one amp.init() opened; leave it first")
        region.__exit__(None, None, None)
        _thread.region = None
    with init_lock:
        _init = None


def require_init(caller: str) -> _Init:
    with init_lock:
        state = _init
    if state is None:
        raise RuntimeError(f"amp.{caller}(): AMP is not initialized; call amp.init() first")
    return state
