"""Distributed agreement: one overflow on any rank skips the step on every rank.

Under DDP every rank holds the same all-reduced gradients, so ranks would agree anyway;
under FSDP2 (``fully_shard``) each rank checks only its own gradient shard, and an
inf/NaN in one shard must still skip the step everywhere, or the replicas drift apart
and their loss scales diverge. :func:`agree_on_overflow_` makes that so with one
all-reduce (MAX) of the 0-dim ``found_inf`` tensor, on PyTorch's own communication
(gloo on CPU, NCCL on GPU: a device-side collective, no host sync). Every rank must
unscale the same optimizers in the same order, as SPMD training does.

Outside an initialised process group (or with a single rank) it does nothing, so the
same training script runs unchanged on one process.

Example:
    >>> import torch
    >>> from ampkit.scaling.distributed import agree_on_overflow_
    >>> found_inf = torch.tensor(1.0)
    >>> agree_on_overflow_(found_inf) is found_inf  # single process: unchanged
    True
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["agree_on_overflow_", "is_distributed"]


def is_distributed(process_group: Any = None) -> bool:
    """True when ``torch.distributed`` is initialised and the group (default: the
    world) has more than one rank.

    Example:
        >>> from ampkit.scaling.distributed import is_distributed
        >>> is_distributed()
        False
    """
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return False
    return torch.distributed.get_world_size(process_group) > 1


def agree_on_overflow_(found_inf: torch.Tensor, process_group: Any = None) -> torch.Tensor:
    """All-reduce ``found_inf`` with MAX across ``process_group`` (default: the world)
    in place, so that every rank sees an overflow found on any rank; returns it.

    Example:
        >>> import torch
        >>> from ampkit.scaling.distributed import agree_on_overflow_
        >>> agree_on_overflow_(torch.tensor(0.0)).item()
        0.0
    """
    if is_distributed(process_group):
        torch.distributed.all_reduce(found_inf, op=torch.distributed.ReduceOp.MAX,
                                     group=process_group)
    return found_inf
