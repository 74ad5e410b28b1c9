"""Cast traffic: how many dtype-changing copies a region makes, and how many bytes.

Mixed precision pays for itself only if the casts it inserts cost less than the
low-precision arithmetic saves. :func:`count_casts` counts every copy that changes a
tensor's dtype inside its region (forward, backward and optimizer step alike), so two
ways of training the same model (``torch.autocast`` against ``ampkit.initialize`` at O2,
say) can be compared by the casts they really make.

Counting happens in a ``TorchDispatchMode``, below autocast and autograd, so what is
counted is what ran: the casts autocast inserts, the ones a module boundary makes, the
``ToCopyBackward`` of each in the backward pass, and the optimizer's copies. A call is a
cast when it is one of

* ``_to_copy`` (what ``Tensor.to``, ``.float()``, ``.type_as`` and autocast's casts
  become) whose result has another dtype than its input;
* ``copy_`` (and its out-of-place ``copy``) from a source of another dtype;
* ``_foreach_copy_``: each pair of its lists whose dtypes differ counts as one cast.

Its bytes are the bytes read plus the bytes written: ``numel * (source itemsize +
destination itemsize)``. Integer and boolean casts count too (they are casts), but a
copy between tensors of the same dtype is never a cast. The counts are of the thread
that entered the region (and of the backward passes it runs).

Example:
    >>> import torch
    >>> from ampkit.tools.ops.cast_traffic import count_casts
    >>> x = torch.ones(4, 4)
    >>> with count_casts() as traffic:
    ...     y = x.to(torch.bfloat16) * 2       # 16 elements read as fp32, written as bf16
    ...     _ = y.float()
    >>> traffic.casts, traffic.bytes
    (2, 192)
    >>> traffic.by_dtypes()[(torch.float32, torch.bfloat16)]
    (1, 96)
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

import torch

from ampkit.tools.ops.tracing import DispatchRegion

__all__ = ["CastTraffic", "count_casts"]


@dataclasses.dataclass(frozen=True)
class _Cast:
    op: str
    source: torch.dtype
    destination: torch.dtype


def _pairs(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any
           ) -> Iterator[tuple[str, torch.Tensor, torch.dtype]]:
    """``(op, source tensor, destination dtype)`` of each copy a call made."""
    packet = func.overloadpacket
    if packet is torch.ops.aten._to_copy and isinstance(out, torch.Tensor):
        yield "_to_copy", args[0], out.dtype
    elif packet in (torch.ops.aten.copy_, torch.ops.aten.copy):
        source = args[1] if len(args) > 1 else kwargs["src"]
        yield packet.__name__, source, args[0].dtype
    elif packet is torch.ops.aten._foreach_copy_:
        sources = args[1] if len(args) > 1 else kwargs["src"]
        for dst, src in zip(args[0], sources):
            yield "_foreach_copy_", src, dst.dtype


class CastTraffic(DispatchRegion):
    """The dtype-changing copies of one region; made by :func:`count_casts`.

    A region is entered once; the counts can be read during and after it.

    Example:
        >>> import torch
        >>> from ampkit.tools.ops.cast_traffic import count_casts
        >>> w = torch.ones(8, requires_grad=True)
        >>> with count_casts() as traffic:
        ...     w.half().float().sum().backward()   # 4 casts of 8 x (4 + 2) bytes
        >>> traffic.casts, dict(traffic.by_op())
        (4, {'_to_copy': (4, 192)})
    """

    def __init__(self) -> None:
        super().__init__("a CastTraffic region can be entered only once; call "
                         "count_casts() again for a new count")
        self._tally: Counter[_Cast] = Counter()
        self._bytes: Counter[_Cast] = Counter()
        self._scalar_bytes: Counter[_Cast] = Counter()

    def _on_call(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                 out: Any) -> None:
        for op, source, dtype in _pairs(func, args, kwargs, out):
            if not isinstance(source, torch.Tensor) or source.dtype == dtype:
                continue
            key = _Cast(op, source.dtype, dtype)
            self._tally[key] += 1
            itemsize = torch.empty((), dtype=dtype).element_size()
            moved = source.numel() * (source.element_size() + itemsize)
            self._bytes[key] += moved
            if source.numel() <= 1:
                self._scalar_bytes[key] += moved

    @property
    def casts(self) -> int:
        """How many dtype-changing copies ran."""
        return sum(self._tally.values())

    @property
    def bytes(self) -> int:
        """Bytes the casts read and wrote, summed."""
        return sum(self._bytes.values())

    @property
    def scalar_bytes(self) -> int:
        """Of :attr:`bytes`, those of one-element tensors: bookkeeping such as a loss
        scale or a step counter, not activations or parameters."""
        return sum(self._scalar_bytes.values())

    def _grouped(self, key: Any) -> Mapping[Any, tuple[int, int]]:
        out: dict[Any, list[int]] = {}
        for cast, calls in self._tally.items():
            entry = out.setdefault(key(cast), [0, 0])
            entry[0] += calls
            entry[1] += self._bytes[cast]
        return MappingProxyType({k: (v[0], v[1]) for k, v in sorted(
            out.items(), key=lambda item: -item[1][1])})

    def by_op(self) -> Mapping[str, tuple[int, int]]:
        """``op name -> (casts, bytes)``, the most bytes first."""
        return self._grouped(lambda cast: cast.op)

    def by_dtypes(self) -> Mapping[tuple[torch.dtype, torch.dtype], tuple[int, int]]:
        """``(source dtype, destination dtype) -> (casts, bytes)``, the most bytes first.

        Example:
            >>> import torch
            >>> from ampkit.tools.ops.cast_traffic import count_casts
            >>> with count_casts() as traffic:
            ...     _ = torch.zeros(2, dtype=torch.float16).double()
            >>> list(traffic.by_dtypes())
            [(torch.float16, torch.float64)]
        """
        return self._grouped(lambda cast: (cast.source, cast.destination))

    def __repr__(self) -> str:
        return (f"CastTraffic(casts={self.casts}, bytes={self.bytes}, "
                f"state={self._state!r})")


def count_casts() -> CastTraffic:
    """Count the dtype-changing copies of a region, and their bytes.

    Use the result as a context manager; see the module docstring for what counts.

    Example:
        >>> import torch
        >>> from ampkit.tools.ops.cast_traffic import count_casts
        >>> lin = torch.nn.Linear(4, 4)
        >>> with count_casts() as traffic, torch.autocast("cpu", torch.bfloat16):
        ...     _ = lin(torch.rand(2, 4))      # autocast casts the input, weight and bias
        >>> traffic.casts
        3
    """
    return CastTraffic()
