"""Distributed agreement: an overflow skips the step on exactly the ranks that share the
parameters.

Ranks that share parameters must take the same decision, or their replicas drift apart
and their loss scales diverge. Which ranks those are, the gradients say:

* **Sharded gradients** (``DTensor``: FSDP2 ``fully_shard``, tensor parallelism): each
  rank checks only its own shard, so ``found_inf`` is all-reduced (MAX) over each mesh
  dimension the gradients are sharded (or partial) on, once per distinct group. This
  is the reduction ``torch.amp.GradScaler`` gets from DTensor's own ``found_inf``
  handler; ampkit checks the local shards and makes it once, never twice. Replicated
  dimensions (HSDP's replicas) hold equal gradients and need none.
* **Plain gradients**: no communication. Under DDP every rank holds the same
  all-reduced gradients (an inf or NaN on any rank is in every rank's sum), so each rank
  reaches the same verdict on its own; a model that lives on one rank only (a side
  model, an EMA teacher) has no one to agree with, and must not wait in a world-wide
  collective that the other ranks never join.
* **An explicit** ``process_group``: one all-reduce over that group, whatever the
  gradients are. For gradients that plain tensors do not show as shared: model
  parallelism written by hand, or gradients edited per rank after DDP reduced them.
  Every rank of the group must then check the same optimizers in the same order.

Outside an initialised process group (or with a single rank) nothing is communicated,
so the same training script runs unchanged on one process. The collective is
PyTorch's own (gloo on CPU, NCCL on GPU: a device-side all-reduce, no host sync).

Example:
    >>> import torch
    >>> from ampkit.scaling.distributed import agree_on_overflow_
    >>> found_inf = torch.tensor(1.0)
    >>> agree_on_overflow_(found_inf, grads=[torch.ones(2)]) is found_inf  # unchanged
    True
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["agree_on_overflow_", "check_process_group", "is_distributed", "overflow_groups"]


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


def check_process_group(value: Any, argument: str = "process_group") -> Any:
    """``value`` when it is ``None`` or a ``torch.distributed.ProcessGroup``; a
    ``TypeError`` naming ``argument`` otherwise.

    Example:
        >>> from ampkit.scaling.distributed import check_process_group
        >>> check_process_group(None) is None
        True
        >>> check_process_group("world")
        Traceback (most recent call last):
        ...
        TypeError: process_group must be None (the ranks that share the parameters) or a ...
    """
    if value is None or (torch.distributed.is_available()
                         and isinstance(value, torch.distributed.ProcessGroup)):
        return value
    raise TypeError(f"{argument} must be None (the ranks that share the parameters) or a "
                    f"torch.distributed.ProcessGroup, got {type(value).__name__}")


def overflow_groups(grads: Iterable[torch.Tensor | None]) -> list[Any]:
    """The process groups over which ranks holding other parts of these gradients'
    parameters must agree: for each ``DTensor`` gradient, the groups of the mesh
    dimensions it is sharded or partial on (each group once, in first-seen order);
    none for plain tensors.

    Example:
        >>> import torch
        >>> from ampkit.scaling.distributed import overflow_groups
        >>> overflow_groups([torch.ones(2), None])
        []
    """
    groups: dict[int, Any] = {}
    for grad in grads:
        placements = getattr(grad, "placements", None)  # DTensor, without importing it
        mesh = getattr(grad, "device_mesh", None)
        if placements is None or mesh is None:
            continue
        for dim, placement in enumerate(placements):
            if not placement.is_replicate():
                group = mesh.get_group(dim)
                groups.setdefault(id(group), group)
    return list(groups.values())


def agree_on_overflow_(found_inf: torch.Tensor, process_group: Any = None,
                       grads: Iterable[torch.Tensor | None] = ()) -> torch.Tensor:
    """Make ``found_inf`` (a 0-dim tensor, nonzero on overflow) the same on every rank
    that shares the parameters of ``grads``, in place, and return it: an all-reduce
    (MAX) over ``process_group`` when one is given, else over
    :func:`overflow_groups` ``(grads)`` (none for plain tensors; see the module doc).

    Example:
        >>> import torch
        >>> from ampkit.scaling.distributed import agree_on_overflow_
        >>> agree_on_overflow_(torch.tensor(0.0)).item()
        0.0
    """
    groups = [process_group] if process_group is not None else overflow_groups(grads)
    for group in groups:
        if is_distributed(group):
            torch.distributed.all_reduce(found_inf, op=torch.distributed.ReduceOp.MAX,
                                         group=group)
    return found_inf
