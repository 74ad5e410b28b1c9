"""Live tensor bytes: what a step holds at each moment, counted storage by storage.

:class:`LiveBytes` is a dispatch mode that remembers (weakly) the storage of every
tensor an op returns and of every tensor it is shown (:meth:`LiveBytes.watch`). Its
:meth:`~LiveBytes.total` is the sum of the remembered storages' current sizes: a
storage counts once however many views share it, stops counting when its last tensor
dies, and counts its new size after ``resize_`` (FSDP2 frees and refills its unsharded
parameters that way). The high-water mark is taken after every op, while the op's
inputs and outputs are both alive.

The same accounting runs on fake tensors (the planner) and on real ones: it counts
tensor storages, not what the allocator rounds them up to or keeps cached.

Example:
    >>> import torch
    >>> from ampkit.tools.plan.memory import LiveBytes
    >>> with LiveBytes() as live:
    ...     a = torch.ones(256)           # 1,024 bytes
    ...     b = a * 2                     # 1,024 more
    ...     del a
    ...     c = b[:10]                    # a view: no new storage
    >>> live.peak, live.total()
    (2048, 1024)
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch

from ampkit.torch_internals import TorchDispatchMode, tree_leaves

__all__ = ["LiveBytes", "local_tensor", "storage_bytes"]


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage this rank holds: a DTensor's local shard, else the
    tensor itself.

    Example:
        >>> import torch
        >>> from ampkit.tools.plan.memory import local_tensor
        >>> t = torch.ones(2)
        >>> local_tensor(t) is t
        True
    """
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        with torch.no_grad():
            return tensor.to_local()
    return tensor


def storage_bytes(tensors: Iterable[Any], *, exclude: Iterable[Any] = ()) -> int:
    """The bytes of the distinct storages of ``tensors`` (non-tensors are ignored;
    DTensors count their local shard), less those that hold any of ``exclude``.

    Example:
        >>> import torch
        >>> from ampkit.tools.plan.memory import storage_bytes
        >>> t = torch.ones(4, 4)
        >>> storage_bytes([t, t[0], t.T, torch.ones(2, dtype=torch.bfloat16)])
        68
    """
    skip = {id(local_tensor(t).untyped_storage()) for t in exclude
            if isinstance(t, torch.Tensor)}
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            storage = local_tensor(t).untyped_storage()
            if id(storage) not in skip:
                seen[id(storage)] = storage.nbytes()
    return sum(seen.values())


class LiveBytes(TorchDispatchMode):
    """Count the bytes of live tensor storages: every op's outputs, and what
    :meth:`watch` is given; :attr:`peak` is the most counted after any op since
    :meth:`reset_peak`. With ``fake_scalar_reads`` (for fake tensors, which have no
    data) reading a tensor's value gives ``False`` for a boolean, else one.

    Example:
        >>> import torch
        >>> from ampkit.tools.plan.memory import LiveBytes
        >>> x = torch.ones(1000)
        >>> with LiveBytes() as live:
        ...     live.watch([x])
        ...     y = x.exp()
        >>> live.peak
        8000
    """

    def __init__(self, *, fake_scalar_reads: bool = False) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        # id(storage) -> (weak reference, size when last looked at)
        self._seen: dict[int, tuple[weakref.ref[Any], int]] = {}
        # the sum of those sizes: exact but for a storage resized in place (FSDP2 frees
        # and refills its unsharded parameters so) since it was last looked at
        self._counted = 0
        self.peak = 0
        # Fake tensors have no data for a branch to read: a NaN or overflow check reads
        # False (the path of a step without either), a number reads 1 (an optimizer's
        # step counter: 0 would divide its bias correction by zero).
        self._fake_reads = fake_scalar_reads

    def _gone(self, key: int, ref: weakref.ref[Any]) -> None:
        entry = self._seen.get(key)
        if entry is not None and entry[0] is ref:
            del self._seen[key]
            self._counted -= entry[1]

    def _add(self, tensor: torch.Tensor) -> None:
        storage = local_tensor(tensor).untyped_storage()
        key = id(storage)
        entry = self._seen.get(key)
        size = storage.nbytes()
        if entry is not None and entry[0]() is storage:
            self._counted += size - entry[1]
            self._seen[key] = (entry[0], size)
            return
        def gone(ref: weakref.ref[Any], key: int = key) -> None:
            self._gone(key, ref)

        ref = weakref.ref(storage, gone)
        self._seen[key] = (ref, size)
        self._counted += size

    def watch(self, tensors: Iterable[Any]) -> None:
        """Count the storages of ``tensors`` (made before the mode was entered) too."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._add(t)
        self.peak = max(self.peak, self.total())

    def total(self) -> int:
        """The bytes of the live storages counted, at their current sizes."""
        counted = 0
        for key, (ref, _) in list(self._seen.items()):
            storage = ref()
            if storage is not None:
                size = storage.nbytes()
                self._seen[key] = (ref, size)
                counted += size
        self._counted = counted
        return counted

    def reset_peak(self) -> None:
        """Start a new high-water mark from what is live now."""
        self.peak = self.total()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if self._fake_reads and func is torch.ops.aten._local_scalar_dense.default:
            dtype = args[0].dtype
            return False if dtype is torch.bool else 1.0 if dtype.is_floating_point else 1
        out = func(*args, **(kwargs or {}))
        # the op's own tensors are looked at again (one may have been resized); the
        # others only when the count says a new high-water mark may have been reached
        for leaf in (*tree_leaves(out), *tree_leaves((args, kwargs))):
            if isinstance(leaf, torch.Tensor):
                self._add(leaf)
        if self._counted > self.peak:
            self.peak = max(self.peak, self.total())
        return out
