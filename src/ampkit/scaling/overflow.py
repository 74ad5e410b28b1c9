"""Overflow detection: find inf/NaN in gradients and unscale them, in one pass.

:func:`unscale_grads_` is what :class:`~ampkit.scaling.grad_scaler.GradScaler` runs on an
optimizer's gradients. Gradients are grouped by device and dtype; each group goes through
torch's fused ``_amp_foreach_non_finite_check_and_unscale_`` kernel when that kernel
accepts the group's device and dtype (probed once per pair), and through a plain
tensor-op path otherwise (bfloat16 gradients on builds whose kernel refuses them:
https://github.com/pytorch/pytorch/issues/127176). Both paths check each value *before*
multiplying it, and neither reads a value back to the host.

Sharded gradients (``DTensor``, from FSDP2 ``fully_shard``) are checked and unscaled
through their local shard; agreeing across ranks is
:func:`ampkit.scaling.distributed.agree_on_overflow_`'s job.

:func:`all_finite` is the read-only check (MindSpore's ``all_finite``, jmp's
``all_finite``).

Example:
    >>> import torch
    >>> from ampkit.scaling.overflow import all_finite, unscale_grads_
    >>> grads = [torch.tensor([2.0, 4.0]), torch.tensor([8.0], dtype=torch.bfloat16)]
    >>> found_inf = torch.zeros(())
    >>> unscale_grads_(grads, torch.tensor(0.5), found_inf)
    >>> [g.tolist() for g in grads], found_inf.item()
    ([[1.0, 2.0], [4.0]], 0.0)
    >>> bool(all_finite([torch.tensor([1.0, float("inf")])]))
    False
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch

from ampkit import torch_internals
from ampkit.common.containers import iter_leaves

__all__ = ["all_finite", "local_tensor", "unscale_grads_"]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage holds this process's values: the local shard of a
    ``DTensor``, the tensor itself otherwise.

    Example:
        >>> import torch
        >>> from ampkit.scaling.overflow import local_tensor
        >>> t = torch.ones(2)
        >>> local_tensor(t) is t
        True
    """
    to_local = getattr(t, "to_local", None)  # DTensor, without importing torch.distributed
    if to_local is not None and hasattr(t, "placements"):
        local: torch.Tensor = to_local()
        return local
    return t


@functools.cache
def _kernel_accepts(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's fused check-and-unscale kernel runs for this device and dtype."""
    probe = [torch.ones(1, dtype=dtype, device=device)]
    found = torch.zeros((), dtype=torch.float32, device=device)
    try:
        torch_internals.amp_foreach_non_finite_check_and_unscale_(
            probe, found, torch.ones((), dtype=torch.float32, device=device))
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _check_and_unscale_by_ops(grads: list[torch.Tensor], found_inf: torch.Tensor,
                              inv_scale: torch.Tensor | None) -> None:
    # Check first, then unscale: a finite value must not be reported because unscaling
    # (by an inverse scale > 1) pushed it out of range.
    non_finite = torch.stack([~torch.isfinite(g).all() for g in grads]).any()
    found_inf.copy_(torch.maximum(found_inf, non_finite.to(found_inf.dtype)))
    if inv_scale is not None:
        for g in grads:
            # The float32 factor as it is: cast to float16, a small 1/scale would round
            # (2**-25 to zero); torch multiplies in float32 and rounds once.
            g.mul_(inv_scale)


def unscale_grads_(grads: Iterable[torch.Tensor | None], inv_scale: torch.Tensor | None,
                   found_inf: torch.Tensor) -> None:
    """Set ``found_inf`` nonzero if any gradient holds an inf or NaN, and multiply every
    gradient by ``inv_scale`` in place (``None``: check only, change nothing).

    ``found_inf`` is a 0-dim float32 tensor; it is only ever raised, never cleared, so
    several calls accumulate. ``None`` entries are ignored. Sparse gradients are checked
    and unscaled through their values; coalesce sparse float16 ones first (duplicate
    indices could overflow only once summed), as the GradScaler does.

    Example:
        >>> import torch
        >>> from ampkit.scaling.overflow import unscale_grads_
        >>> found_inf = torch.zeros(())
        >>> grads = [torch.tensor([1.0, float("nan")], dtype=torch.float16)]
        >>> unscale_grads_(grads, None, found_inf)
        >>> found_inf.item(), grads[0].tolist()[0]
        (1.0, 1.0)
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for grad in grads:
        if grad is None:
            continue
        g = local_tensor(grad)
        if g.is_sparse:
            g = torch_internals.sparse_values(g)
        groups.setdefault((g.device, g.dtype), []).append(g)
    if not groups:
        return
    home = found_inf.device
    with torch.no_grad():
        for (device, dtype), tensors in groups.items():
            local_found = (found_inf if device == home
                           else torch.zeros((), dtype=torch.float32, device=device))
            if _kernel_accepts(device, dtype):
                local_inv = (torch.ones((), dtype=torch.float32, device=device)
                             if inv_scale is None
                             else inv_scale.to(device, non_blocking=True))
                torch_internals.amp_foreach_non_finite_check_and_unscale_(tensors, local_found,
                                                                 local_inv)
            else:
                _check_and_unscale_by_ops(
                    tensors, local_found,
                    None if inv_scale is None else inv_scale.to(device, non_blocking=True))
            if local_found is not found_inf:
                found_inf.copy_(torch.maximum(found_inf,
                                              local_found.to(home, non_blocking=True)))


def all_finite(tensors: torch.Tensor | Iterable[Any]) -> torch.Tensor:
    """A 0-dim bool tensor: True when every element of every tensor is finite.

    Accepts a tensor or nested lists/tuples/dicts/dataclasses of tensors (``None`` and
    non-floating tensors are finite by definition). Nothing is read back to the host: use
    ``bool(...)`` only where a decision is needed on the host.

    Example:
        >>> import torch
        >>> from ampkit.scaling.overflow import all_finite
        >>> all_finite({"w": torch.ones(2), "b": [torch.zeros(1, dtype=torch.float16)]})
        tensor(True)
        >>> all_finite([torch.tensor([float("nan")])])
        tensor(False)
    """
    leaves = [t for t in _tensor_leaves(tensors) if t.is_floating_point() or t.is_complex()]
    if not leaves:
        return torch.tensor(True)
    home = leaves[0].device
    checks = [torch.isfinite(local_tensor(t)).all().to(home, non_blocking=True)
              for t in leaves]
    return torch.stack(checks).all()


def _tensor_leaves(tree: Any) -> list[torch.Tensor]:
    out = []
    for leaf in iter_leaves(tree):
        if isinstance(leaf, torch.Tensor):
            out.append(leaf)
        elif leaf is not None:
            raise TypeError(f"tensors must be a tensor or nested lists/tuples/dicts/"
                            f"dataclasses of tensors, found {type(leaf).__name__}")
    return out
