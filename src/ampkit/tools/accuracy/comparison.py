"""The results of :func:`ampkit.compare` (and of :func:`ampkit.tune`'s trials): the
error measures (:class:`ErrorStats`), per op call, module and gradient, and the
:class:`Comparison` that holds them, ranks them and writes them out (text table, JSON,
HTML report). The runs that produce them are in :mod:`ampkit.tools.accuracy.compare`; the
definitions of the measures are in its docstring.

Example:
    >>> import torch
    >>> from ampkit.tools.accuracy.comparison import ErrorStats
    >>> ErrorStats.between([torch.ones(2)], [torch.ones(2)]).max_abs
    0.0
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from ampkit.common.text import TextTable, finite_or_none

__all__ = ["JSON_SCHEMA_VERSION", "Comparison", "ErrorStats", "Fp8LayerError", "GradError",
           "ModuleError", "OpError", "OpRank", "fp8_layers_table"]

JSON_SCHEMA_VERSION = 1


# -- error measures -------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ErrorStats:
    """How far a low-precision value is from its float32 reference.

    Example:
        >>> import torch
        >>> from ampkit.tools.accuracy.compare import ErrorStats
        >>> e = ErrorStats.between([torch.tensor([1.0, 2.5])], [torch.tensor([1.0, 2.0])])
        >>> e.max_abs, e.max_rel, e.num_nan
        (0.5, 0.25, 0)
    """

    max_abs: float  # Inf where one run is finite and the other is not
    max_rel: float  # max_abs / largest finite |reference|
    cosine: float  # over positions finite in both runs; 1.0 when both are all zero
    num_nan: int  # in the low-precision value
    num_inf: int

    @classmethod
    def between(cls, low: list[torch.Tensor], ref: list[torch.Tensor]) -> ErrorStats:
        """Error of the tensors ``low`` against ``ref`` (same count and shapes; a
        mismatch gives NaN errors)."""
        if len(low) != len(ref) or any(a.shape != b.shape for a, b in zip(low, ref)):
            nan = float("nan")
            return cls(nan, nan, nan, 0, 0)
        max_abs = scale = dot = norm_low = norm_ref = 0.0
        num_nan = num_inf = 0
        with torch.no_grad():
            for a, b in zip(low, ref):
                y, r = a.detach().double(), b.detach().double()
                if y.numel() == 0:
                    continue
                if bool(torch.isfinite(y).all()) and bool(torch.isfinite(r).all()):
                    # the usual case, the same numbers in a few passes: no position to
                    # mask (the masked path's selections cost most of compare's time)
                    y, r = y.reshape(-1), r.reshape(-1)
                    max_abs = max(max_abs, float((y - r).abs().max()))
                    scale = max(scale, float(r.abs().max()))
                    dot += float((y * r).sum())
                    norm_low += float((y * y).sum())
                    norm_ref += float((r * r).sum())
                    continue
                num_nan += int(torch.isnan(y).sum())
                num_inf += int(torch.isinf(y).sum())
                # equal infinities agree, and so do NaNs in both runs at one position
                same = (y == r) | (torch.isnan(y) & torch.isnan(r))
                diff = torch.where(same, 0.0, (y - r).abs())
                worst = torch.nan_to_num(diff, nan=math.inf, posinf=math.inf).max()
                max_abs = max(max_abs, float(worst))
                finite_ref = r[torch.isfinite(r)]
                if finite_ref.numel():
                    scale = max(scale, float(finite_ref.abs().max()))
                both = torch.isfinite(y) & torch.isfinite(r)
                yf, rf = y[both], r[both]
                dot += float((yf * rf).sum())
                norm_low += float((yf * yf).sum())
                norm_ref += float((rf * rf).sum())
        # relative to the largest reference magnitude; an all-zero reference has none
        max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
        if norm_low == 0 and norm_ref == 0:
            cosine = 1.0
        elif norm_low == 0 or norm_ref == 0:
            cosine = 0.0
        else:
            cosine = dot / math.sqrt(norm_low * norm_ref)
        return cls(max_abs, max_rel, cosine, num_nan, num_inf)


def _added(out_rel: float, in_rel: float) -> float:
    if math.isnan(out_rel):
        return math.nan
    if math.isinf(out_rel):
        return 0.0 if math.isinf(in_rel) else math.inf  # an Inf passed along adds nothing
    return max(0.0, out_rel - in_rel)


@dataclasses.dataclass(frozen=True)
class OpError:
    """One op call: its output's error against the float32 run, and the error the op
    itself added (against the same op run in float32 on the same inputs).

    Example:
        >>> from ampkit.tools.accuracy.compare import ErrorStats, OpError
        >>> r = OpError(0, "exp", "", 0, "torch.bfloat16", (2,),
        ...             ErrorStats(0.1, 0.05, 1.0, 0, 0), input_rel=0.01, local_rel=0.04)
        >>> r.added
        0.04
    """

    index: int  # position among the watched op calls of the low-precision run
    op: str  # canonical op name (what a policy's lists hold)
    module: str  # innermost module running it (qualified name, "" = the model)
    call: int  # n-th call of this op in this module, 0-based
    dtype: str  # output dtype in the low-precision run
    shape: tuple[int, ...]
    error: ErrorStats
    input_rel: float  # largest relative error among its floating inputs
    local_rel: float  # relative error against the op re-run in float32 on these inputs

    @property
    def added(self) -> float:
        """The error this call made itself: :attr:`local_rel` (an error it only passed
        on or amplified from its inputs is not counted)."""
        return self.local_rel


@dataclasses.dataclass(frozen=True)
class ModuleError:
    """One module call: its inputs' and output's error.

    Example:
        >>> from ampkit.tools.accuracy.compare import ErrorStats, ModuleError
        >>> m = ModuleError("fc", "Linear", 0, 0, 0, "torch.bfloat16",
        ...                 ErrorStats(0.0, 0.5, 0.9, 0, 0), input_rel=0.0)
        >>> m.added
        0.5
    """

    module: str  # qualified name, "" = the model itself
    kind: str  # class name
    call: int  # n-th call of this module, 0-based
    started: int  # order in which module calls started
    finished: int  # order in which they finished (innermost first)
    dtype: str  # output dtype in the low-precision run
    error: ErrorStats
    input_rel: float

    @property
    def added(self) -> float:
        """``max(0, output relative error - input relative error)`` (a container's
        includes its children's)."""
        return _added(self.error.max_rel, self.input_rel)


@dataclasses.dataclass(frozen=True)
class GradError:
    """One parameter's gradient (``dtype`` ``"none"`` when a run left it unset)."""

    parameter: str
    dtype: str
    error: ErrorStats


@dataclasses.dataclass(frozen=True)
class OpRank:
    """An op (or module) with the most error one of its calls added, and its calls."""

    name: str
    added: float
    calls: int
    worst_module: str  # where the worst call ran (for ops) / "" (for modules)

    @property
    def op(self) -> str:
        """Alias of ``name`` for op rankings."""
        return self.name


# -- the result -----------------------------------------------------------------------------

def _fmt(value: float) -> str:
    return f"{value:.3g}" if math.isfinite(value) else str(value)


@dataclasses.dataclass(frozen=True)
class Fp8LayerError:
    """One Linear's local error in fp8 and in the low dtype, against fp32.

    Attributes:
        layer: qualified name.
        recipe: the fp8 recipe name (``"custom"`` for a config object).
        low_dtype: the dtype of the low run (``"torch.bfloat16"``).
        output_fp8: the fp8 forward output's error against fp32.
        output_low: the low run's forward output's error against fp32.
        output_fp8_vs_low: fp8's output against the low run's.
        grad_input_fp8: the fp8 input gradient's error against fp32.
        grad_input_low: the low run's input gradient's error against fp32.
        grad_weight_fp8: the fp8 weight gradient's error against fp32.
        grad_weight_low: the low run's weight gradient's error against fp32.

    Example:
        >>> from ampkit.tools.accuracy.comparison import ErrorStats
        >>> from ampkit.tools.accuracy.comparison import Fp8LayerError
        >>> e = ErrorStats(0.1, 0.02, 0.999, 0, 0)
        >>> Fp8LayerError("1", "rowwise", "torch.bfloat16", *[e] * 7).worst_fp8
        0.02
    """

    layer: str
    recipe: str
    low_dtype: str
    output_fp8: ErrorStats
    output_low: ErrorStats
    output_fp8_vs_low: ErrorStats
    grad_input_fp8: ErrorStats
    grad_input_low: ErrorStats
    grad_weight_fp8: ErrorStats
    grad_weight_low: ErrorStats

    @property
    def worst_fp8(self) -> float:
        """The largest fp8 relative error of the three (output, input gradient,
        weight gradient).

        Example:
            >>> from ampkit.tools.accuracy.comparison import ErrorStats
            >>> from ampkit.tools.accuracy.comparison import Fp8LayerError
            >>> e, f = ErrorStats(0, 0.0, 1, 0, 0), ErrorStats(1, 0.5, 0.9, 0, 0)
            >>> Fp8LayerError("1", "rowwise", "torch.bfloat16", e, e, e, f, e, e, e).worst_fp8
            0.5
        """
        return max(self.output_fp8.max_rel, self.grad_input_fp8.max_rel,
                   self.grad_weight_fp8.max_rel)


@dataclasses.dataclass(frozen=True)
class Comparison:
    """What :func:`compare` measured; see the module docstring for the definitions.

    Example:
        >>> import torch
        >>> import ampkit
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
        >>> c = ampkit.compare(net, torch.ones(2, 4), precision="O3", dtype="bfloat16")
        >>> [r.op for r in c.ops], c.ops[0].dtype
        (['linear', 'relu'], 'torch.bfloat16')
    """

    precision: str  # what ran against float32, in words
    dtype: str
    threshold: float
    ops: tuple[OpError, ...]
    modules: tuple[ModuleError, ...]  # in the order they started
    grads: tuple[GradError, ...]
    output: ErrorStats
    loss: tuple[float, float] | None  # (float32, low precision) with loss_fn
    unmatched_ops: int  # low-precision op calls with no float32 counterpart
    # with fp8=: each fp8-capable Linear's local error in fp8 and in dtype, against fp32
    # (ampkit.tools.accuracy.fp8_errors.fp8_layer_errors)
    fp8_layers: tuple[Fp8LayerError, ...] = ()

    @property
    def divergence(self) -> ModuleError | None:
        """The first module to finish whose inputs were within :attr:`threshold` and
        whose output was not: where divergence starts (``None``: nowhere)."""
        for m in sorted(self.modules, key=lambda m: m.finished):
            if m.input_rel <= self.threshold < m.error.max_rel:
                return m
        return None

    @property
    def first_divergent_op(self) -> OpError | None:
        """The first op call whose inputs were within :attr:`threshold` and whose
        output was not."""
        return next((r for r in self.ops if r.input_rel <= self.threshold < r.error.max_rel),
                    None)

    def ranked_ops(self) -> list[OpRank]:
        """Op names by the most error one of their calls added, largest first (ties:
        the earlier op first).

        Example:
            >>> import torch
            >>> import ampkit
            >>> net = torch.nn.Linear(3, 3)
            >>> c = ampkit.compare(net, torch.ones(1, 3), precision="O3", dtype="float16")
            >>> [r.op for r in c.ranked_ops()]
            ['linear']
        """
        return self._rank((r.op, r.added, r.module, r.index) for r in self.ops)

    def ranked_modules(self) -> list[OpRank]:
        """Modules by the most error an op directly inside them added, largest first.

        Example:
            >>> import torch
            >>> import ampkit
            >>> net = torch.nn.Sequential(torch.nn.Linear(3, 3))
            >>> c = ampkit.compare(net, torch.ones(1, 3), precision="O3", dtype="float16")
            >>> [r.name for r in c.ranked_modules()]
            ['0']
        """
        return self._rank((r.module, r.added, "", r.index) for r in self.ops)

    @staticmethod
    def _rank(items: Iterable[tuple[str, float, str, int]]) -> list[OpRank]:
        best: dict[str, tuple[float, str, int]] = {}
        calls: Counter[str] = Counter()
        for name, added, where, index in items:
            calls[name] += 1
            value = -1.0 if math.isnan(added) else added
            if name not in best or value > best[name][0]:
                best[name] = (value, where, best.get(name, (0, "", index))[2])
        ranked = sorted(best.items(), key=lambda kv: (-kv[1][0], kv[1][2]))
        return [OpRank(name, value if value >= 0 else math.nan, calls[name], where)
                for name, (value, where, _) in ranked]

    # -- output ----------------------------------------------------------------------------
    def table(self, limit: int = 20) -> str:
        """A plain-text summary: where divergence starts, the ``limit`` ops and
        modules that added the most error, and the gradients (:meth:`summary`'s
        parts, its tables as aligned text).

        Example:
            >>> import torch
            >>> import ampkit
            >>> c = ampkit.compare(torch.nn.Linear(2, 2), torch.ones(1, 2), precision="O3",
            ...                    dtype="bfloat16")
            >>> c.table().splitlines()[0]
            'ampkit.compare: O3 (torch.bfloat16) against float32'
        """
        return "\n".join(part if isinstance(part, str) else part.text()
                         for part in self.summary(limit))

    def summary(self, limit: int = 20) -> list[str | TextTable]:
        """What :meth:`table` shows, in order: lines of text and tables
        (:class:`~ampkit.common.text.TextTable`), for a front end that draws tables
        itself (``ampkit compare`` draws them with rich).

        Example:
            >>> import torch
            >>> import ampkit
            >>> c = ampkit.compare(torch.nn.Linear(2, 2), torch.ones(1, 2), precision="O3",
            ...                    dtype="bfloat16")
            >>> [p.columns[0] for p in c.summary() if not isinstance(p, str)]
            ['op', 'module']
        """
        parts: list[str | TextTable] = [
            f"ampkit.compare: {self.precision} ({self.dtype}) against float32"]
        div = self.divergence
        parts.append(
            f"divergence starts: module {div.module!r} ({div.kind}), input error "
            f"{_fmt(div.input_rel)} -> output error {_fmt(div.error.max_rel)}"
            if div else f"divergence starts: nowhere (every module within "
                        f"{_fmt(self.threshold)} relative error)")
        parts.append(f"model output: max rel error {_fmt(self.output.max_rel)}, cosine "
                     f"{self.output.cosine:.6f}, NaN {self.output.num_nan}, "
                     f"Inf {self.output.num_inf}")
        if self.loss is not None:
            parts.append(f"loss: float32 {self.loss[0]:.6g}, low precision {self.loss[1]:.6g}")
        parts += ["", "ops ranked by error added", TextTable.of(
            ("op", "added rel error", "calls", "worst in module"),
            [(r.name, _fmt(r.added), r.calls, repr(r.worst_module))
             for r in self.ranked_ops()[:limit]], align="lrrl")]
        parts += ["", "module calls in the order they ran", TextTable.of(
            ("module", "kind", "dtype", "in rel", "out rel", "max abs", "cosine", "nan", "inf"),
            [((m.module or "(model)") + (f"#{m.call}" if m.call else ""), m.kind, m.dtype,
              _fmt(m.input_rel), _fmt(m.error.max_rel), _fmt(m.error.max_abs),
              f"{m.error.cosine:.6f}", m.error.num_nan, m.error.num_inf)
             for m in self.modules[:limit]], align="lllrrrrrr")]
        if len(self.modules) > limit:
            parts.append(f"... {len(self.modules) - limit} more")
        if self.grads:
            parts += ["", TextTable.of(
                ("gradient", "dtype", "max rel", "cosine"),
                [(g.parameter, g.dtype, _fmt(g.error.max_rel), f"{g.error.cosine:.6f}")
                 for g in self.grads[:limit]], align="llrr")]
        if self.fp8_layers:
            parts += ["", *_fp8_layers_parts(self.fp8_layers)]
        return parts

    def to_dict(self) -> dict[str, Any]:
        """Everything as plain data (non-finite numbers as ``None``)."""
        def err(e: ErrorStats) -> dict[str, Any]:
            return dataclasses.asdict(e)

        div, first = self.divergence, self.first_divergent_op
        data = {
            "schema_version": JSON_SCHEMA_VERSION,
            "precision": self.precision, "dtype": self.dtype, "threshold": self.threshold,
            "divergence": None if div is None else {"module": div.module, "call": div.call},
            "first_divergent_op": None if first is None else {
                "op": first.op, "module": first.module, "call": first.call},
            "output": err(self.output),
            "loss": None if self.loss is None else list(self.loss),
            "unmatched_ops": self.unmatched_ops,
            "ranked_ops": [dataclasses.asdict(r) for r in self.ranked_ops()],
            "ranked_modules": [dataclasses.asdict(r) for r in self.ranked_modules()],
            "ops": [{**{k: v for k, v in dataclasses.asdict(r).items() if k != "error"},
                     "shape": list(r.shape), "added": r.added, **err(r.error)}
                    for r in self.ops],
            "modules": [{**{k: v for k, v in dataclasses.asdict(m).items() if k != "error"},
                         "added": m.added, **err(m.error)} for m in self.modules],
            "grads": [{"parameter": g.parameter, "dtype": g.dtype, **err(g.error)}
                      for g in self.grads],
            "fp8_layers": [dataclasses.asdict(r) for r in self.fp8_layers],
        }
        out: dict[str, Any] = finite_or_none(data)
        return out

    def to_json(self) -> str:
        """:meth:`to_dict` as JSON text.

        Example:
            >>> import json, torch
            >>> import ampkit
            >>> c = ampkit.compare(torch.nn.Linear(2, 2), torch.ones(1, 2), precision="O3",
            ...                    dtype="bfloat16")
            >>> json.loads(c.to_json())["ops"][0]["op"]
            'linear'
        """
        return json.dumps(self.to_dict(), indent=2, allow_nan=False)

    def write_report(self, out_dir: str | os.PathLike[str]) -> Path:
        """Write ``compare.html`` (plots embedded), the two plots as PNG and
        ``compare.json`` into ``out_dir``; return the HTML file's path.

        Example:
            >>> import tempfile, torch
            >>> import ampkit
            >>> c = ampkit.compare(torch.nn.Linear(2, 2), torch.ones(1, 2), precision="O3",
            ...                    dtype="bfloat16")
            >>> with tempfile.TemporaryDirectory() as out:
            ...     c.write_report(out).name
            'compare.html'
        """
        from ampkit.tools.accuracy.compare_report import write_comparison_report

        return write_comparison_report(self, out_dir)


def fp8_layers_table(rows: tuple[Fp8LayerError, ...]) -> str:
    """Rows of :func:`ampkit.tools.accuracy.fp8_errors.fp8_layer_errors` as a plain-text table
    (relative errors).

    Example:
        >>> from ampkit.tools.accuracy.comparison import fp8_layers_table
        >>> fp8_layers_table(())
        'fp8 per layer: no Linear can run in fp8'
    """
    return "\n".join(part if isinstance(part, str) else part.text()
                     for part in _fp8_layers_parts(rows))


def _fp8_layers_parts(rows: tuple[Fp8LayerError, ...]) -> list[str | TextTable]:
    if not rows:
        return ["fp8 per layer: no Linear can run in fp8"]

    def f(e: ErrorStats) -> str:
        return f"{e.max_rel:.3g}"

    low = rows[0].low_dtype.removeprefix("torch.")
    return [f"fp8 per layer ({rows[0].recipe}; relative error against fp32, local to "
            f"each layer)", TextTable.of(
        ("layer", "out fp8", f"out {low}", f"fp8 vs {low}", "dx fp8", f"dx {low}",
         "dw fp8", f"dw {low}"),
        [(r.layer, f(r.output_fp8), f(r.output_low), f(r.output_fp8_vs_low),
          f(r.grad_input_fp8), f(r.grad_input_low), f(r.grad_weight_fp8),
          f(r.grad_weight_low)) for r in rows], align="lrrrrrrr")]
