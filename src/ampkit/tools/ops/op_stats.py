"""Operator statistics: how many aten op calls ran in which precision.

:func:`collect_op_stats` counts every aten op call made inside its region (forward,
backward and optimizer alike) and files it under the dtype it produced, in the shape of
Paddle's ``paddle.amp.debugging`` operator table: ``Op Name | FP16 Calls | BF16 Calls |
FP32 Calls | Other Calls``.

Counting happens in a ``TorchDispatchMode``, which sits below autocast and autograd in
the dispatcher, so what is counted is what really ran: the ``addmm`` that autocast sent
to bfloat16, the casts it inserted, and the backward kernels autograd called.

How a call is classified:

* by the dtype of the first floating-point tensor among its outputs;
* an op that returns no tensor (``_foreach_add_``, ``_amp_update_scale_``, ...) by the
  first floating-point tensor it writes to, as its schema declares;
* anything else (integer or bool results, ``float64``, scalars, no output) is "other".

Calls in the ``profiler`` namespace (the markers ``record_function`` leaves while a
profiler runs) are instrumentation, not computation, and are not counted. The counts
are of the thread that entered the region (and of the backward passes it runs).

Example:
    >>> import torch
    >>> from ampkit.tools.ops.op_stats import collect_op_stats
    >>> lin = torch.nn.Linear(4, 3)
    >>> x, target = torch.rand(2, 4), torch.tensor([0, 2])
    >>> with collect_op_stats() as stats, torch.autocast("cpu", torch.bfloat16):
    ...     loss = torch.nn.functional.cross_entropy(lin(x), target)
    >>> stats.counts["addmm"].bfloat16, stats.counts["nll_loss_forward"].float32
    (1, 1)
    >>> 0.0 < stats.low_precision_share < 1.0
    True
"""

from __future__ import annotations

import dataclasses
import enum
from collections import Counter
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch

from ampkit import torch_internals
from ampkit.tools.ops.tracing import DispatchRegion
from ampkit.torch_internals import tree_leaves

__all__ = ["OpCallCounts", "OpStats", "Precision", "collect_op_stats"]


class Precision(enum.Enum):
    """The column an op call is counted in.

    Example:
        >>> from ampkit.tools.ops.op_stats import Precision
        >>> Precision("bfloat16").name
        'BFLOAT16'
    """

    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    FLOAT32 = "float32"
    OTHER = "other"


_PRECISION_OF_DTYPE = {
    torch.float16: Precision.FLOAT16,
    torch.bfloat16: Precision.BFLOAT16,
    torch.float32: Precision.FLOAT32,
}


@dataclasses.dataclass(frozen=True)
class OpCallCounts:
    """Calls of one op (or of all ops), by the precision they ran in.

    Example:
        >>> from ampkit.tools.ops.op_stats import OpCallCounts
        >>> c = OpCallCounts(float16=1, bfloat16=2, float32=3, other=4)
        >>> c.total, c.floating, c.low_precision
        (10, 6, 3)
    """

    float16: int = 0
    bfloat16: int = 0
    float32: int = 0
    other: int = 0

    @property
    def total(self) -> int:
        """All calls."""
        return self.float16 + self.bfloat16 + self.float32 + self.other

    @property
    def floating(self) -> int:
        """Calls that produced float16, bfloat16 or float32."""
        return self.float16 + self.bfloat16 + self.float32

    @property
    def low_precision(self) -> int:
        """Calls that produced float16 or bfloat16."""
        return self.float16 + self.bfloat16


def _op_name(func: Any) -> str:
    # Overloads (add.Tensor, add.Scalar) are one op to a reader; the aten namespace is
    # implied, other namespaces are kept so custom ops stay recognisable.
    namespace = func.namespace
    name = torch_internals.op_schema(func).name.split("::", 1)[-1]
    return name if namespace == "aten" else f"{namespace}::{name}"


def _first_floating_dtype(values: Any) -> torch.dtype | None:
    for leaf in tree_leaves(values):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            return leaf.dtype
    return None


def _precision_of_call(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                       out: Any) -> Precision:
    if any(isinstance(leaf, torch.Tensor) for leaf in tree_leaves(out)):
        dtype = _first_floating_dtype(out)
    else:
        written = []
        for position, argument in enumerate(torch_internals.op_schema(func).arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            if argument.name in kwargs:
                written.append(kwargs[argument.name])
            elif position < len(args) and not argument.kwarg_only:
                written.append(args[position])
        dtype = _first_floating_dtype(written)
    if dtype is None:
        return Precision.OTHER
    return _PRECISION_OF_DTYPE.get(dtype, Precision.OTHER)


class OpStats(DispatchRegion):
    """Op-call counts of one region; made by :func:`collect_op_stats`.

    A region is entered once; the counts can be read during and after it.

    Example:
        >>> import torch
        >>> from ampkit.tools.ops.op_stats import collect_op_stats
        >>> with collect_op_stats() as stats:
        ...     _ = torch.ones(3, dtype=torch.float16) * 2
        >>> print(stats.table())
        Op Name | FP16 Calls | BF16 Calls | FP32 Calls | Other Calls
        --------+------------+------------+------------+------------
        mul     |          1 |          0 |          0 |           0
        ones    |          1 |          0 |          0 |           0
        --------+------------+------------+------------+------------
        Total   |          2 |          0 |          0 |           0
    """

    def __init__(self) -> None:
        super().__init__("an OpStats region can be entered only once; call "
                         "collect_op_stats() again for a new count", active="collecting")
        self._tally: Counter[tuple[str, Precision]] = Counter()

    def _on_call(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                 out: Any) -> None:
        if func.namespace != "profiler":
            self._tally[_op_name(func), _precision_of_call(func, args, kwargs, out)] += 1

    @property
    def counts(self) -> Mapping[str, OpCallCounts]:
        """``op name -> OpCallCounts``, sorted by op name (a read-only snapshot)."""
        per_op: dict[str, dict[str, int]] = {}
        for (name, precision), calls in self._tally.items():
            per_op.setdefault(name, {})[precision.value] = calls
        return MappingProxyType({name: OpCallCounts(**per_op[name]) for name in sorted(per_op)})

    @property
    def total(self) -> OpCallCounts:
        """The counts summed over all ops."""
        summed: Counter[str] = Counter()
        for (_, precision), calls in self._tally.items():
            summed[precision.value] += calls
        return OpCallCounts(**summed)

    @property
    def low_precision_share(self) -> float:
        """``(float16 + bfloat16 calls) / (float16 + bfloat16 + float32 calls)``: the
        share of floating-point op calls that ran in low precision; 0.0 when no call
        produced a floating-point result."""
        total = self.total
        return total.low_precision / total.floating if total.floating else 0.0

    def table(self) -> str:
        """The counts as a text table, one row per op (sorted by name) and a total row.

        Example:
            >>> import torch
            >>> from ampkit.tools.ops.op_stats import collect_op_stats
            >>> with collect_op_stats() as stats:
            ...     _ = torch.ones(2, dtype=torch.float16) * 2
            >>> print(stats.table().splitlines()[0])
            Op Name | FP16 Calls | BF16 Calls | FP32 Calls | Other Calls
        """
        from ampkit.common.text import text_table

        rows = [(name, c.float16, c.bfloat16, c.float32, c.other)
                for name, c in self.counts.items()]
        total = self.total
        return text_table(
            ("Op Name", "FP16 Calls", "BF16 Calls", "FP32 Calls", "Other Calls"), rows,
            footer=("Total", total.float16, total.bfloat16, total.float32, total.other),
            separator=" | ", rules=True)

    def __repr__(self) -> str:
        t = self.total
        return (f"OpStats(float16={t.float16}, bfloat16={t.bfloat16}, float32={t.float32}, "
                f"other={t.other}, state={self._state!r})")


def collect_op_stats() -> OpStats:
    """Count the aten op calls of a region by the precision they ran in.

    Use the result as a context manager; forward, backward and optimizer ops inside the
    region are all counted. See the module docstring for how calls are classified.

    Example:
        >>> import torch
        >>> from ampkit.tools.ops.op_stats import collect_op_stats
        >>> w = torch.rand(3, 3, requires_grad=True)
        >>> with collect_op_stats() as stats:
        ...     (w.half() @ w.half()).sum().backward()
        >>> stats.counts["mm"].float16 >= 3   # one forward and two backward matmuls
        True
    """
    return OpStats()
