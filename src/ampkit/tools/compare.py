"""fp32 against low precision, op by op: :func:`compare`.

:func:`compare` runs one model on the same inputs twice, from identical weights (two
deep copies) and the same RNG state (forked, so dropout draws the same masks): once in
float32, once under a precision (a level ``"O1"``-``"O3"``, a policy or preset name, a
:class:`~ampkit.policy.Policy`, with optional custom lists). It records, in the order
they ran:

* every call of a registered op (the canonical names a policy lists) inside the model,
  keyed by ``(module, op, n-th call of that op in that module)``;
* every module call (qualified name), with its inputs' error and its output's error;
* with ``loss_fn``, every parameter's gradient after ``loss_fn(output).backward()``.

For each: the output dtype of the low-precision run, the largest absolute error
against float32, the largest *relative* error (the largest absolute error divided by
the largest magnitude of the float32 value, so a value near zero does not blow it up),
the cosine similarity (over positions finite in both runs), and NaN/Inf counts.

The error an op call *adds* is measured locally: its low-precision output against the
same op run again in float32 on float32 copies of the same inputs, so an error it only
passes on (or amplifies) from its inputs is not charged to it. Ops are ranked by the
most error one call added (:meth:`Comparison.ranked_ops`), modules by the most error an
op directly inside them added (:meth:`Comparison.ranked_modules`). Divergence *starts*
at the first module to finish (innermost first) whose inputs were within
``threshold`` and whose output is not (:attr:`Comparison.divergence`);
:attr:`Comparison.first_divergent_op` is the same at op level. Ops are watched at the
autocast engine's level, before its casts, so an op whose float32 inputs are rounded
to low precision is charged for that rounding.

The policy (or level) applies inside the model's forward only; ``loss_fn`` runs in
float32 outside it. Both runs keep every watched tensor (a clone) until the comparison
is made: use a small batch.

Example:
    >>> import torch
    >>> import ampkit
    >>> _ = torch.manual_seed(0)
    >>> net = torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    >>> x = 100 + torch.randn(8, 16)  # a large offset: LayerNorm cancels it in bf16
    >>> result = ampkit.compare(net, x, precision="torch", dtype=torch.bfloat16,
    ...                         custom_white_list={"layer_norm"})
    >>> result.ranked_ops()[0].op, result.divergence.module
    ('layer_norm', '0')
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import os
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from ampkit.policy import Policy, as_dtype
from ampkit.registry import OpEntry
from ampkit.tools._tracing import ModuleScope, OpWatch

__all__ = ["Comparison", "ErrorStats", "GradError", "ModuleError", "OpError", "OpRank",
           "compare"]

JSON_SCHEMA_VERSION = 1
_THRESHOLD_EPS = 8  # default threshold: this many machine epsilons of the low dtype


# -- error measures -------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ErrorStats:
    """How far a low-precision value is from its float32 reference.

    Example:
        >>> import torch
        >>> from ampkit.tools.compare import ErrorStats
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
                num_nan += int(torch.isnan(y).sum())
                num_inf += int(torch.isinf(y).sum())
                if y.numel() == 0:
                    continue
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
        >>> from ampkit.tools.compare import ErrorStats, OpError
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
        >>> from ampkit.tools.compare import ErrorStats, ModuleError
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


# -- recording ------------------------------------------------------------------------------

def _floats(value: Any) -> list[torch.Tensor]:
    """Detached clones of the floating tensors in ``value`` (nested)."""
    with torch._C.DisableTorchFunction():  # our own clones are not ops of the model
        return [t.detach().clone() for t in tree_leaves(value)
                if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _dtype_name(tensors: list[torch.Tensor]) -> str:
    return str(tensors[0].dtype) if tensors else "none"


@contextlib.contextmanager
def _plain(device_type: str) -> Iterator[None]:
    """No torch-function modes (the engine's, ours) and no autocast: plain float math."""
    with torch._C.DisableTorchFunction(), torch.autocast(device_type, enabled=False), \
            torch.no_grad():
        yield


def _to_fp32_copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.detach().to(torch.float32, copy=True)  # a copy: in-place ops stay local
    if isinstance(value, (list, tuple)):
        return type(value)(_to_fp32_copy(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_fp32_copy(v) for k, v in value.items()}
    return value


def _local_error(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                 outputs: list[torch.Tensor]) -> ErrorStats:
    """The error the op itself made: its output against the same op run in float32
    on float32 copies of the same inputs."""
    nan = math.nan
    with _plain(outputs[0].device.type):
        try:
            again = func(*_to_fp32_copy(args), **_to_fp32_copy(kwargs))
        except Exception:  # an op with no float32 kernel for these inputs: unknown
            return ErrorStats(nan, nan, nan, 0, 0)
        expected = [t for t in tree_leaves(again)
                    if isinstance(t, torch.Tensor) and t.is_floating_point()]
        return ErrorStats.between(outputs, expected)


class _Recorder:
    """Captures one run: op calls and module calls of ``model``, by key."""

    def __init__(self, model: nn.Module, *, recompute: bool) -> None:
        from ampkit.autocast_mode import _is_compute

        self._is_compute = _is_compute
        self.recompute = recompute
        self.ops: dict[tuple[str, str, int], tuple[Any, ...]] = {}
        self.modules: dict[tuple[str, int], list[Any]] = {}
        self.finished: list[tuple[str, int]] = []
        self._op_calls: Counter[tuple[str, str]] = Counter()
        self._module_calls: Counter[str] = Counter()
        self._open: dict[str, list[tuple[str, int]]] = {}
        self.scope = ModuleScope(model, on_enter=self._enter, on_exit=self._exit)

    def watch(self) -> OpWatch:
        return OpWatch(self._op, with_func=True)

    def _op(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any,
            func: Any) -> None:
        module = self.scope.current
        if module is None or not self._is_compute(name):
            return
        outputs = _floats(out)
        if not outputs:
            return
        n = self._op_calls[module, name]
        self._op_calls[module, name] += 1
        local = _local_error(func, args, kwargs, outputs) if self.recompute else None
        self.ops[module, name, n] = (_floats((args, kwargs)), outputs, local)

    def _enter(self, name: str, module: nn.Module, args: Any) -> None:
        n = self._module_calls[name]
        self._module_calls[name] += 1
        key = (name, n)
        self._open.setdefault(name, []).append(key)
        self.modules[key] = [type(module).__name__, _floats(args), [], len(self.modules)]

    def _exit(self, name: str, module: nn.Module, args: Any, output: Any) -> None:
        key = self._open[name].pop()
        self.modules[key][2] = _floats(output)
        self.finished.append(key)


# -- the result -----------------------------------------------------------------------------

def _finite_or_none(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_none(v) for v in value]
    return value


def _fmt(value: float) -> str:
    return f"{value:.3g}" if math.isfinite(value) else str(value)


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
    # (ampkit.tools.fp8_errors.Fp8LayerError)
    fp8_layers: tuple[Any, ...] = ()

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
        modules that added the most error, and the gradients.

        Example:
            >>> import torch
            >>> import ampkit
            >>> c = ampkit.compare(torch.nn.Linear(2, 2), torch.ones(1, 2), precision="O3",
            ...                    dtype="bfloat16")
            >>> c.table().splitlines()[0]
            'ampkit.compare: O3 (torch.bfloat16) against float32'
        """
        lines = [f"ampkit.compare: {self.precision} ({self.dtype}) against float32"]
        div = self.divergence
        lines.append(
            f"divergence starts: module {div.module!r} ({div.kind}), input error "
            f"{_fmt(div.input_rel)} -> output error {_fmt(div.error.max_rel)}"
            if div else f"divergence starts: nowhere (every module within "
                        f"{_fmt(self.threshold)} relative error)")
        lines.append(f"model output: max rel error {_fmt(self.output.max_rel)}, cosine "
                     f"{self.output.cosine:.6f}, NaN {self.output.num_nan}, "
                     f"Inf {self.output.num_inf}")
        if self.loss is not None:
            lines.append(f"loss: float32 {self.loss[0]:.6g}, low precision {self.loss[1]:.6g}")
        from ampkit.tools._text import text_table

        lines += ["", "ops ranked by error added", text_table(
            ("op", "added rel error", "calls", "worst in module"),
            [(r.name, _fmt(r.added), r.calls, repr(r.worst_module))
             for r in self.ranked_ops()[:limit]], align="lrrl")]
        lines += ["", "module calls in the order they ran", text_table(
            ("module", "kind", "dtype", "in rel", "out rel", "max abs", "cosine", "nan", "inf"),
            [((m.module or "(model)") + (f"#{m.call}" if m.call else ""), m.kind, m.dtype,
              _fmt(m.input_rel), _fmt(m.error.max_rel), _fmt(m.error.max_abs),
              f"{m.error.cosine:.6f}", m.error.num_nan, m.error.num_inf)
             for m in self.modules[:limit]], align="lllrrrrrr")]
        if len(self.modules) > limit:
            lines.append(f"... {len(self.modules) - limit} more")
        if self.grads:
            lines += ["", text_table(
                ("gradient", "dtype", "max rel", "cosine"),
                [(g.parameter, g.dtype, _fmt(g.error.max_rel), f"{g.error.cosine:.6f}")
                 for g in self.grads[:limit]], align="llrr")]
        if self.fp8_layers:
            from ampkit.tools.fp8_errors import fp8_layers_table

            lines += ["", fp8_layers_table(self.fp8_layers)]
        return "\n".join(lines)

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
        return _finite_or_none(data)

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
        from ampkit.tools.compare_report import write_comparison_report

        return write_comparison_report(self, out_dir)


# -- running --------------------------------------------------------------------------------

def _device_type(model: nn.Module) -> str:
    for t in model.parameters():
        return t.device.type
    for t in model.buffers():
        return t.device.type
    return "cpu"


@contextlib.contextmanager
def _forked_rng(device_type: str) -> Iterator[None]:
    devices: list[int] = []
    if device_type == "cuda" and torch.cuda.is_available():
        devices = list(range(torch.cuda.device_count()))
    with torch.random.fork_rng(devices=devices, device_type=device_type):
        yield


@dataclasses.dataclass(frozen=True)
class _Setup:
    """How the low-precision copy is made and run."""

    description: str
    dtype: torch.dtype
    prepare: Callable[[nn.Module], nn.Module]  # converts the copy (levels) or not
    region: Callable[[], Any]  # the context the copy's forward runs in


def _is_level(precision: Any) -> bool:
    from ampkit.levels import Level

    if isinstance(precision, Level):
        return True
    return isinstance(precision, str) and precision.strip().upper() in Level.__members__


def _setup(precision: Any, dtype: Any, device_type: str,
           white: Iterable[OpEntry] | None, black: Iterable[OpEntry] | None) -> _Setup:
    import ampkit
    from ampkit.presets import get_policy

    chosen = as_dtype(dtype)
    if _is_level(precision):
        from ampkit.conversion import ConversionConfig, convert_model
        from ampkit.levels import Level

        level = Level.parse(precision)
        config = ConversionConfig.for_level(level, chosen, device_type=device_type,
                                            custom_white_list=white, custom_black_list=black)
        low = config.compute_dtype or torch.get_autocast_dtype(device_type)
        policy = config.policy
        # Entering the conversion's own region before the op watch keeps the engine
        # under the watch, so the watch sees each op's inputs before they are cast.
        region = ((lambda: ampkit.autocast(device_type, low, policy=policy))
                  if policy is not None else contextlib.nullcontext)
        return _Setup(f"{level.value}", low, lambda m: convert_model(m, config), region)
    if not isinstance(precision, (str, Policy)):
        raise TypeError(f"precision must be a level ('O0'-'O3'), a policy name or a Policy, "
                        f"got {type(precision).__name__}")
    policy = get_policy(precision).with_lists(white, black)
    low = chosen or policy.dtype or torch.get_autocast_dtype(device_type)
    return _Setup(f"policy {policy.name!r}", low, lambda m: m,
                  lambda: ampkit.autocast(device_type, low, policy=policy))


@dataclasses.dataclass
class _Run:
    recorder: _Recorder
    output: list[torch.Tensor]
    loss: float | None
    grads: dict[str, torch.Tensor | None]


def _run_once(model: nn.Module, run_fn: Callable[[nn.Module], Any], region: Callable[[], Any],
              loss_fn: Callable[[Any], torch.Tensor] | None, device_type: str, *,
              recompute: bool) -> tuple[_Run, Any]:
    recorder = _Recorder(model, recompute=recompute)
    forward = model.forward

    def watched_forward(*args: Any, **kwargs: Any) -> Any:
        with region(), recorder.watch():
            return forward(*args, **kwargs)

    model.forward = watched_forward  # an instance attribute on a private copy
    with _forked_rng(device_type):
        with recorder.scope:
            out = run_fn(model)
        loss_value = None
        if loss_fn is not None:
            loss = loss_fn(out)
            if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
                raise TypeError(f"loss_fn must return a one-element tensor, got "
                                f"{type(loss).__name__}")
            loss.backward()
            loss_value = float(loss.detach())
    grads = {name: (None if p.grad is None else p.grad.detach())
             for name, p in model.named_parameters()}
    return _Run(recorder, _floats(out), loss_value, grads), out


def _input_rel(low: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    return ErrorStats.between(low, ref).max_rel if low else 0.0


def _compare_runs(ref: _Run, low: _Run, description: str, dtype: torch.dtype,
                  threshold: float) -> Comparison:
    ops, unmatched = [], 0
    for index, (key, (inputs, outputs, local)) in enumerate(low.recorder.ops.items()):
        match = ref.recorder.ops.get(key)
        if match is None:
            unmatched += 1
            continue
        module, name, call = key
        ops.append(OpError(index, name, module, call, _dtype_name(outputs),
                           tuple(outputs[0].shape), ErrorStats.between(outputs, match[1]),
                           _input_rel(inputs, match[0]), local.max_rel))
    finished = {key: i for i, key in enumerate(low.recorder.finished)}
    modules = []
    for key, (kind, inputs, outputs, started) in low.recorder.modules.items():
        match = ref.recorder.modules.get(key)
        if match is None or key not in finished:
            continue
        modules.append(ModuleError(key[0], kind, key[1], started, finished[key],
                                   _dtype_name(outputs), ErrorStats.between(outputs, match[2]),
                                   _input_rel(inputs, match[1])))
    grads = []
    for name, g_ref in ref.grads.items():
        g_low = low.grads.get(name)
        if g_ref is None and g_low is None:
            continue
        if g_ref is None or g_low is None:
            nan = math.nan
            grads.append(GradError(name, "none" if g_low is None else str(g_low.dtype),
                                   ErrorStats(nan, nan, nan, 0, 0)))
            continue
        grads.append(GradError(name, str(g_low.dtype), ErrorStats.between([g_low], [g_ref])))
    loss = None if ref.loss is None or low.loss is None else (ref.loss, low.loss)
    return Comparison(description, str(dtype), threshold, tuple(ops), tuple(modules),
                      tuple(grads), ErrorStats.between(low.output, ref.output), loss, unmatched)


def _check_model(model: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not any(p.is_floating_point() for p in model.parameters()):
        raise ValueError("model has no floating-point parameters: there is nothing to run "
                         "in low precision")


def _threshold(threshold: float | None, dtype: torch.dtype) -> float:
    if threshold is None:
        return _THRESHOLD_EPS * torch.finfo(dtype).eps
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not (
            threshold >= 0):
        raise ValueError(f"threshold must be a number >= 0 (a relative error), "
                         f"got {threshold!r}")
    return float(threshold)


def compare(model: nn.Module, *inputs: Any, precision: Any = "torch",
            dtype: torch.dtype | str | None = None,
            custom_white_list: Iterable[OpEntry] | None = None,
            custom_black_list: Iterable[OpEntry] | None = None,
            loss_fn: Callable[[Any], torch.Tensor] | None = None,
            threshold: float | None = None, fp8: Any = None) -> Comparison:
    """Run ``model(*inputs)`` in float32 and under ``precision``; compare op by op.

    Args:
        model: an fp32 ``nn.Module`` (not changed: both runs use deep copies).
        inputs: the forward's positional arguments.
        precision: a level (``"O1"``, ``"O2"``, ``"O3"``), a preset name or a
            :class:`~ampkit.policy.Policy` (run with ``ampkit.autocast`` inside the
            model's forward).
        dtype: ``torch.float16`` or ``torch.bfloat16``; ``None``: the policy's, else the
            device's autocast default.
        custom_white_list, custom_black_list: added to the policy (as in
            ``ampkit.autocast``).
        loss_fn: ``loss_fn(output) -> scalar tensor``; given, both runs call
            ``.backward()`` on it and gradients are compared per parameter.
        threshold: the relative error that counts as diverged (default: 8 machine
            epsilons of ``dtype``: 0.0625 for bfloat16, 0.0078 for float16).
        fp8: an fp8 recipe (as ``initialize``'s ``fp8=``); given, every Linear that can
            run in fp8 is also measured alone in fp8 and in ``dtype`` against fp32
            (:attr:`Comparison.fp8_layers`, see :mod:`ampkit.tools.fp8_errors`).

    Returns:
        a :class:`Comparison`.

    Example:
        >>> import torch
        >>> import ampkit
        >>> net = torch.nn.Linear(3, 2)
        >>> c = ampkit.compare(net, torch.ones(4, 3), precision="O3", dtype="float16",
        ...                    loss_fn=lambda out: out.float().sum())
        >>> [g.parameter for g in c.grads], c.divergence is None
        (['weight', 'bias'], True)
    """
    _check_model(model)
    device_type = _device_type(model)
    setup = _setup(precision, dtype, device_type, custom_white_list, custom_black_list)
    limit = _threshold(threshold, setup.dtype)
    if fp8 is not None:  # a bad recipe or a missing torchao: refused before any run
        from ampkit.fp8 import float8_linear_config

        float8_linear_config(fp8)

    def run_fn(m: nn.Module) -> Any:
        return m(*inputs)

    reference = copy.deepcopy(model).float()
    ref, _ = _run_once(reference, run_fn, contextlib.nullcontext, loss_fn, device_type,
                       recompute=False)
    low_model = setup.prepare(copy.deepcopy(model))
    low, _ = _run_once(low_model, run_fn, setup.region, loss_fn, device_type, recompute=True)
    result = _compare_runs(ref, low, setup.description, setup.dtype, limit)
    if fp8 is None:
        return result
    from ampkit.tools.fp8_errors import fp8_layer_errors

    return dataclasses.replace(result, fp8_layers=fp8_layer_errors(
        model, *inputs, fp8=fp8, dtype=setup.dtype))
