"""Find the op that overflowed first: a NaN/Inf checker with provenance.

When fp16 training goes NaN, the loss is the last place to look. :class:`NumericsChecker`
watches every aten op (forward and backward, below autograd) while it is active and
records, for each op whose floating output holds NaN or Inf, *which* op it was, in
*which* module (qualified name, from forward hooks) or which backward node, in which
dtype, and the output's statistics. :meth:`NumericsChecker.suggest_fp32_ops` turns the
findings into a ``custom_black_list`` for :func:`ampkit.autocast`.

Modes follow Paddle's tensor checker:

* ``CHECK_NAN_INF_AND_ABORT``: raise :class:`NonFiniteError` at the first NaN/Inf;
* ``CHECK_NAN_INF``: record every op with a NaN/Inf output, keep running;
* ``CHECK_ALL_FOR_OVERFLOW``: also record float32 outputs whose magnitude would overflow
  float16 (> 65504), i.e. the ops that must stay in float32 if you switch to fp16;
* ``CHECK_ALL``: record statistics of every op output.

Example:
    >>> import torch
    >>> from ampkit.tools.ops.numerics_checker import NumericsChecker, CheckMode
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Softmax(-1))
    >>> x = torch.tensor([[1.0, 3e38]])
    >>> with NumericsChecker(model, CheckMode.CHECK_NAN_INF) as checker:
    ...     out = model(x * 10)  # 3e39 overflows float32
    >>> checker.origin.op, checker.origin.module, checker.first_bad_in("0").op
    ('mul', '', 'addmm')
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

from ampkit import torch_internals
from ampkit.fp8.selection import is_float8
from ampkit.tools.ops.tracing import ModuleScope
from ampkit.torch_internals import TorchDispatchMode, disable_current_modes, tree_leaves

__all__ = ["CheckMode", "NonFiniteError", "NumericsChecker", "OpRecord"]

_FP16_MAX = float(torch.finfo(torch.float16).max)
_PLAIN_TENSORS = (torch.Tensor, nn.Parameter)
_FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2",
                                                "float8_e4m3fnuz", "float8_e5m2fnuz")
                    if hasattr(torch, n))


class CheckMode(enum.Enum):
    """What the checker records (Paddle's tensor-checker modes).

    Example:
        >>> from ampkit.tools.ops.numerics_checker import CheckMode
        >>> CheckMode("overflow") is CheckMode.CHECK_ALL_FOR_OVERFLOW
        True
    """

    CHECK_NAN_INF_AND_ABORT = "abort"
    CHECK_NAN_INF = "nan_inf"
    CHECK_ALL_FOR_OVERFLOW = "overflow"
    CHECK_ALL = "all"


@dataclasses.dataclass(frozen=True)
class OpRecord:
    """One op output the checker recorded.

    Example:
        >>> import torch
        >>> from ampkit.tools.ops.numerics_checker import NumericsChecker
        >>> with NumericsChecker(mode="all") as c:
        ...     _ = torch.tensor([1.0, 0.0]) * 2
        >>> r = c.records[-1]
        >>> r.op, r.numel, r.num_zero, r.max, r.finite
        ('mul', 2, 1, 2.0, True)
    """

    index: int  # position among all ops seen, 0-based
    op: str  # aten op name, e.g. "addmm"
    introduced: bool  # NaN/Inf in the output while every floating input was finite
    module: str  # qualified module name in forward; "" at top level or in backward
    phase: str  # "forward" or "backward"
    grad_fn: str  # autograd node running the op in backward ("" in forward)
    dtype: torch.dtype
    numel: int
    num_nan: int
    num_inf: int
    num_zero: int
    max: float
    min: float
    mean: float

    @property
    def finite(self) -> bool:
        """True when the output holds no NaN and no Inf (see :class:`OpRecord`)."""
        return self.num_nan == 0 and self.num_inf == 0

    @property
    def where(self) -> str:
        """Module (forward) or autograd node (backward), for messages."""
        if self.phase == "backward":
            return f"backward of {self.grad_fn or '?'}"
        return f"module {self.module!r}" if self.module else "top level"


class NonFiniteError(FloatingPointError):
    """Raised in ``CHECK_NAN_INF_AND_ABORT`` mode; ``.record`` says where.

    Example:
        >>> import torch
        >>> from ampkit.tools.ops.numerics_checker import NumericsChecker, NonFiniteError
        >>> try:
        ...     with NumericsChecker():
        ...         _ = torch.tensor([0.0]) / 0
        ... except NonFiniteError as e:
        ...     e.record.num_nan, e.record.phase
        (1, 'forward')
    """

    def __init__(self, record: OpRecord) -> None:
        super().__init__(
            f"op {record.op!r} ({record.phase}, {record.where}) produced "
            f"{record.num_nan} NaN and {record.num_inf} Inf values in a {record.dtype} "
            f"output of {record.numel} elements (op #{record.index})")
        self.record = record


def _stats(index: int, op: str, introduced: bool, module: str, phase: str, grad_fn: str,
           t: torch.Tensor) -> OpRecord:
    flat = t.detach().reshape(-1)
    if flat.dtype in _FP8_DTYPES:
        flat = flat.to(torch.float32)  # fp8 kernels lack isnan & co.; the upcast is exact
    nan = torch.isnan(flat)
    inf = torch.isinf(flat)
    finite = flat[~(nan | inf)].double()
    return OpRecord(
        index=index, op=op, introduced=introduced, module=module, phase=phase,
        grad_fn=grad_fn, dtype=t.dtype,
        numel=flat.numel(), num_nan=int(nan.sum()), num_inf=int(inf.sum()),
        num_zero=int((flat == 0).sum()),
        max=float(finite.max()) if finite.numel() else float("nan"),
        min=float(finite.min()) if finite.numel() else float("nan"),
        mean=float(finite.mean()) if finite.numel() else float("nan"),
    )


def _all_finite(t: torch.Tensor) -> bool:
    if type(t) not in _PLAIN_TENSORS:
        return True  # a wrapper subclass (fp8): its plain data is checked where made
    # fp8 kernels lack isfinite; the upcast is exact
    return bool(torch.isfinite(t.to(torch.float32) if t.dtype in _FP8_DTYPES else t).all())


class _Watch(TorchDispatchMode):
    def __init__(self, checker: NumericsChecker) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's base, unannotated
        self.checker = checker

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # The checker's own ops (isnan, isinf, sum, ...) are not the program's: an outer
        # checker, or any other mode below this one, must not see them.
        with disable_current_modes():
            self.checker._inspect(func.overloadpacket.__name__, (args, kwargs), out)
        return out


class NumericsChecker:
    """Context manager recording op outputs with NaN/Inf (or all, by ``mode``).

    A checker inside another records the same program ops as the outer one, and the
    outer records none of the inner checker's own. Meta tensors have no values to check:
    an op giving one raises ``ValueError``.

    Args:
        model: module whose submodules name the ops' locations (optional).
        mode: a :class:`CheckMode` (or its value string).
        max_records: stop recording after this many records (the count goes on).

    Example:
        >>> import torch
        >>> from ampkit.tools.ops.numerics_checker import NumericsChecker, NonFiniteError
        >>> try:
        ...     with NumericsChecker():
        ...         torch.log(torch.tensor([-1.0]))
        ... except NonFiniteError as e:
        ...     e.record.op
        'log'
    """

    def __init__(self, model: nn.Module | None = None,
                 mode: CheckMode | str = CheckMode.CHECK_NAN_INF_AND_ABORT, *,
                 max_records: int = 10_000) -> None:
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module or None, got {type(model).__name__}")
        try:
            self.mode = CheckMode(mode) if isinstance(mode, str) else mode
        except ValueError:
            raise ValueError(f"mode must be a CheckMode or one of "
                             f"{[m.value for m in CheckMode]}, got {mode!r}") from None
        if not isinstance(self.mode, CheckMode):
            raise TypeError(f"mode must be a CheckMode, got {type(mode).__name__}")
        if not isinstance(max_records, int) or max_records < 1:
            raise ValueError(f"max_records must be a positive int, got {max_records!r}")
        self.model = model
        self.max_records = max_records
        self.records: list[OpRecord] = []
        self.ops_seen = 0
        self._scope = ModuleScope(model)
        self._mode: _Watch | None = None
        # A model with fp8 layers: their casts to fp8 are watched too (fp8_casts).
        self._fp8 = None
        if model is not None and any(is_float8(m) for m in model.modules()):
            from ampkit.tools.ops.fp8_casts import Fp8CastWatch

            self._fp8 = Fp8CastWatch(model)

    # -- context manager ------------------------------------------------------------------
    def __enter__(self) -> NumericsChecker:
        self._scope.__enter__()
        if self._fp8 is not None:
            self._fp8.__enter__()
        self._mode = _Watch(self)
        self._mode.__enter__()  # type: ignore[no-untyped-call]  # torch's base, unannotated
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._mode is not None:
            self._mode.__exit__(*exc)  # type: ignore[no-untyped-call]  # torch's base, unannotated
            self._mode = None
        if self._fp8 is not None:
            self._fp8.__exit__(*exc)
        self._scope.__exit__(*exc)

    # -- inspection ------------------------------------------------------------------------
    def _inspect(self, op: str, inputs: Any, out: Any) -> None:
        index = self.ops_seen
        self.ops_seen += 1
        node = torch_internals.current_autograd_node()
        phase = "backward" if node is not None else "forward"
        grad_fn = node.name() if node is not None else ""
        module = (self._scope.current or "") if node is None else ""
        for t in tree_leaves(out):
            if not (isinstance(t, torch.Tensor) and t.is_floating_point()) or t.numel() == 0:
                continue
            if type(t) not in _PLAIN_TENSORS:
                continue  # a wrapper subclass (torchao's fp8 tensors): its data is seen
            if t.is_meta:
                raise ValueError(f"NumericsChecker: op {op!r} gave a meta tensor (no data): "
                                 f"there are no values to check; run the model on a device "
                                 f"with data")
            if self.mode is CheckMode.CHECK_ALL:
                introduced = not _all_finite(t) and all(
                    _all_finite(i) for i in tree_leaves(inputs)
                    if isinstance(i, torch.Tensor) and i.is_floating_point())
                self._record(_stats(index, op, introduced, module, phase, grad_fn, t))
                continue
            finite = _all_finite(t)
            overflow = (self.mode is CheckMode.CHECK_ALL_FOR_OVERFLOW and finite
                        and t.dtype in (torch.float32, torch.float64)
                        and bool((t.detach().abs() > _FP16_MAX).any()))
            if finite and not overflow:
                continue
            introduced = not finite and all(
                _all_finite(i) for i in tree_leaves(inputs)
                if isinstance(i, torch.Tensor) and i.is_floating_point())
            record = _stats(index, op, introduced, module, phase, grad_fn, t)
            if self.mode is CheckMode.CHECK_NAN_INF_AND_ABORT:
                self._record(record)
                raise NonFiniteError(record)
            self._record(record)

    def _record(self, record: OpRecord) -> None:
        if len(self.records) < self.max_records:
            self.records.append(record)

    # -- results ---------------------------------------------------------------------------
    @property
    def first_bad(self) -> OpRecord | None:
        """The first recorded op output holding NaN or Inf, or ``None``.

        Example:
            >>> import torch
            >>> from ampkit.tools.ops.numerics_checker import NumericsChecker
            >>> x = torch.tensor([float("inf")])
            >>> with NumericsChecker(mode="nan_inf") as c:
            ...     _ = (x * 2).exp()
            >>> c.first_bad.op, c.origin is None  # inf came in: no op introduced it
            ('mul', True)
        """
        return next((r for r in self.records if not r.finite), None)

    @property
    def origin(self) -> OpRecord | None:
        """The first op that *introduced* NaN/Inf (its floating inputs were all finite):
        the op that overflowed, as opposed to ops that merely passed NaN/Inf along.

        Example:
            >>> import torch
            >>> from ampkit.tools.ops.numerics_checker import NumericsChecker
            >>> with NumericsChecker(mode="nan_inf") as c:
            ...     _ = torch.tensor([100.0], dtype=torch.float16).exp() + 1
            >>> c.origin.op, [r.op for r in c.bad_records()]
            ('exp', ['exp', 'add'])
        """
        return next((r for r in self.records if r.introduced), None)

    def first_bad_in(self, module: str) -> OpRecord | None:
        """The first non-finite output recorded inside module ``module`` (qualified name).

        Example:
            >>> import torch
            >>> from ampkit.tools.ops.numerics_checker import NumericsChecker
            >>> net = torch.nn.Sequential(torch.nn.Identity(), torch.nn.Softmax(-1))
            >>> with NumericsChecker(net, mode="nan_inf") as c:
            ...     _ = net(torch.tensor([float("nan")]))
            >>> c.first_bad_in("1").op
            '_softmax'
        """
        return next((r for r in self.records if not r.finite and r.module == module), None)

    @property
    def fp8_casts(self) -> Any:
        """For a model with fp8 layers (``initialize(fp8=...)``), the
        :class:`~ampkit.tools.ops.fp8_casts.Fp8CastWatch` of their casts to fp8: its
        ``worst`` names the layer and tensor whose cast saturated or underflowed most;
        ``None`` for other models.

        Example:
            >>> import torch
            >>> from ampkit.tools.ops.numerics_checker import NumericsChecker
            >>> NumericsChecker(torch.nn.Linear(2, 2)).fp8_casts is None
            True
        """
        return self._fp8

    def bad_records(self) -> Iterator[OpRecord]:
        """Recorded outputs with NaN/Inf, in the order they happened (see :attr:`origin`)."""
        return (r for r in self.records if not r.finite)

    def suggest_fp32_ops(self) -> list[str]:
        """Canonical op names to put in a ``custom_black_list``: forward ops that
        introduced Inf/NaN, or whose float32 output exceeds the float16 range
        (``CHECK_ALL_FOR_OVERFLOW``), first offender first.

        Example:
            >>> import torch
            >>> from ampkit.tools.ops.numerics_checker import NumericsChecker
            >>> with NumericsChecker(mode="overflow") as c:
            ...     _ = torch.exp(torch.tensor([20.0]))
            >>> c.suggest_fp32_ops()
            ['exp']
        """
        from ampkit.policies.registry import all_op_names

        known = all_op_names()
        names: list[str] = []
        for r in self.records:
            overflowed = r.introduced or (r.finite and max(abs(r.max), abs(r.min)) > _FP16_MAX)
            if r.phase == "forward" and overflowed and r.op in known and r.op not in names:
                names.append(r.op)
        return names

    def table(self) -> str:
        """The records as a text table (Paddle-style columns).

        Example:
            >>> from ampkit.tools.ops.numerics_checker import NumericsChecker
            >>> NumericsChecker().table().split()[:3]
            ['#', 'op', 'where']
        """
        head = (f"{'#':>5} {'op':<24} {'where':<32} {'dtype':<9} {'numel':>8} {'nan':>6} "
                f"{'inf':>6} {'zero':>6} {'max':>11} {'min':>11} {'mean':>11}")
        lines = [head]
        for r in self.records:
            lines.append(f"{r.index:>5} {r.op:<24} {r.where[:32]:<32} "
                         f"{str(r.dtype).removeprefix('torch.'):<9} {r.numel:>8} "
                         f"{r.num_nan:>6} {r.num_inf:>6} {r.num_zero:>6} {r.max:>11.4g} "
                         f"{r.min:>11.4g} {r.mean:>11.4g}")
        return "\n".join(lines)
