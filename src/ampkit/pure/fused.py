"""Which of torch's implementations steps the fp32 working copies of an eager pure step
on the CPU, and the padding that makes torch's fused kernel give every element the same
bits however a parameter is cut.

Where an ``Adam``/``AdamW`` group leaves the implementation to torch (``foreach`` and
``fused`` both ``None``), torch's own choice on the CPU is its per-parameter loop, the
slowest of its three implementations of the same update. The eager pure step runs
torch's fused kernel there instead, for the bf16 parameters (:func:`left_to_torch`,
:func:`takes_fused`): the same update, which may differ from the loop in the last fp32
bit before the rounding to bf16, and 8-15% faster a step at 10M parameters (measured in
one process on a quiet AVX2 CPU).

The fused CPU kernel splits a tensor between the intra-op threads and runs each part
through vector lanes, then the last few elements of the part through a scalar loop that
computes in double precision: an element's fp32 result can depend on where the tensor
ends. A parameter stepped whole, in slices, or as an FSDP2 shard would then differ in a
last bit now and then. So every working copy the fused kernel steps is padded with
zeros to a multiple of :func:`lanes` elements: every part is whole vectors, every
element takes a lane, and lanes are independent, so each element's bits depend on its
own weight, gradient and state alone. The padding steps as zeros (a zero gradient and
zero moments give a zero update, without NaNs) and is never read back.

Example:
    >>> from ampkit.pure.fused import padded_length
    >>> padded_length(100, 64), padded_length(128, 64)
    (128, 128)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ampkit.pure.rounding import is_dtensor

__all__ = ["FUSED_ON_CPU", "MIN_ELEMENTS", "lanes", "left_to_torch", "padded_length",
           "stepping_fused", "takes_fused"]

#: torch optimizer classes whose fused implementation the eager pure step picks on the
#: CPU where the group leaves the implementation to torch (see :func:`left_to_torch`)
FUSED_ON_CPU: tuple[type, ...] = (torch.optim.Adam, torch.optim.AdamW)

#: The fewest elements of a parameter the fused kernel steps. The kernel splits every
#: tensor between the intra-op threads, however small (torch's element-wise ops split
#: from 32,768 elements): with 2 threads, a step of 1,000 one-element parameters took
#: 1.4x the loop's time on a quiet AVX2 CPU, of 300-element ones the same, so the
#: smallest parameters (a classifier's bias, a scale) keep the loop.
MIN_ELEMENTS = 512

# Elements of one vector of the widest float vectors torch's CPU kernels use (16 with
# AVX-512), times four for room: a part of a multiple of it is whole vectors.
_VECTOR = 64


def lanes() -> int:
    """The multiple of elements a working copy stepped by the fused kernel is padded to:
    whole vectors for each of the intra-op threads the kernel splits a tensor between
    (``torch.get_num_threads()``), so that no element falls in a part's scalar tail.

    Example:
        >>> import torch
        >>> from ampkit.pure.fused import lanes
        >>> lanes() == 64 * torch.get_num_threads()
        True
    """
    return _VECTOR * max(1, torch.get_num_threads())


def padded_length(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple`` (at least one ``multiple``).

    Example:
        >>> from ampkit.pure.fused import padded_length
        >>> padded_length(0, 64), padded_length(65, 64)
        (64, 128)
    """
    return max(1, -(-n // multiple)) * multiple


def left_to_torch(optimizer: Any, group: dict[str, Any]) -> bool:
    """Whether the eager pure step runs torch's fused kernel for ``group``'s bf16 CPU
    parameters (see :func:`takes_fused`): the user left the implementation to torch
    (``foreach`` and ``fused`` both ``None``) of an ``Adam`` or ``AdamW`` optimizer
    itself (not a subclass, which may read the flags its own way), the group neither
    ``differentiable`` nor ``capturable``, no ``grad_scale``/``found_inf`` on the
    optimizer. A group that names its implementation (``foreach=False`` for the loop)
    keeps it.

    Example:
        >>> import torch
        >>> from ampkit.pure.fused import left_to_torch
        >>> w = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
        >>> left_to_torch(torch.optim.AdamW([w]), {"foreach": None, "fused": None})
        True
        >>> left_to_torch(torch.optim.AdamW([w]), {"foreach": False, "fused": None})
        False
    """
    cls = type(optimizer)
    # a pure optimizer's class is made with the user's class as its second base
    base = cls.__bases__[1] if len(cls.__bases__) > 1 else cls
    return (base in FUSED_ON_CPU and getattr(optimizer, "grad_scale", None) is None
            and getattr(optimizer, "found_inf", None) is None
            and group.get("fused", False) is None and group.get("foreach", False) is None
            and not group.get("differentiable") and not group.get("capturable"))


def takes_fused(p: torch.Tensor) -> bool:
    """Whether a parameter of a group :func:`left_to_torch` is stepped by the fused
    kernel, on a padded working copy: a bf16 CPU parameter of at least
    :data:`MIN_ELEMENTS` elements (the whole parameter's, whatever a shard of it
    holds) with a dense gradient, a DTensor's gradient a DTensor too. Any other (an fp32
    one, one on a GPU, a small one, one with a sparse gradient, which torch refuses
    with its own message) is stepped as torch would step it, in runs of its own, so
    that how a parameter is stepped depends on nothing but itself: not on the other
    parameters, the chunking, the sharding or the thread count (a step in backward
    steps one parameter at a time).

    Example:
        >>> import torch
        >>> from ampkit.pure.fused import takes_fused
        >>> big, small = (torch.nn.Parameter(torch.ones(n, dtype=torch.bfloat16))
        ...               for n in (512, 8))
        >>> big.grad, small.grad = torch.ones_like(big), torch.ones_like(small)
        >>> takes_fused(big), takes_fused(small), takes_fused(big.detach().float())
        (True, False, False)
    """
    grad = p.grad
    return (p.dtype is torch.bfloat16 and p.device.type == "cpu"
            and p.numel() >= MIN_ELEMENTS and grad is not None
            and grad.layout is torch.strided and is_dtensor(grad) == is_dtensor(p))


@contextlib.contextmanager
def stepping_fused(group: dict[str, Any], on: bool) -> Iterator[None]:
    """``group["fused"]`` set to ``True`` while the inner optimizer steps when ``on``
    (then back to ``None``, as the user left it: hooks after the step, ``state_dict``
    and the user never see it); nothing changed otherwise.

    Example:
        >>> from ampkit.pure.fused import stepping_fused
        >>> group = {"fused": None}
        >>> with stepping_fused(group, True):
        ...     group["fused"]
        True
        >>> group["fused"] is None
        True
    """
    if not on:
        yield
        return
    group["fused"] = True
    try:
        yield
    finally:
        group["fused"] = None
