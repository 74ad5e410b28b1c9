"""fp32 against low precision, op by op: :func:`compare`.

:func:`compare` runs one model on the same inputs twice, from identical weights (two
deep copies) and the same RNG state (forked, so dropout draws the same masks): once in
float32, once under a precision (a level ``"O1"``-``"O3"``, a policy or preset name, a
:class:`~ampkit.policies.policy.Policy`, with optional custom lists). It records, in the order
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
float32 outside it. The float32 run keeps one copy of each distinct floating tensor
its watched calls take or give (about what a float32 training forward holds); the
low-precision run is measured against it call by call and keeps only the numbers.

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
import functools
import math
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.nn as nn

from ampkit import torch_internals
from ampkit.engine.casting import map_floating
from ampkit.fp8.recipe import check_fp8_device, float8_linear_config
from ampkit.policies.policy import Policy, as_dtype
from ampkit.policies.registry import OpEntry, is_compute
from ampkit.tools.accuracy.comparison import (
    JSON_SCHEMA_VERSION,
    Comparison,
    ErrorStats,
    GradError,
    ModuleError,
    OpError,
    OpRank,
)
from ampkit.tools.accuracy.fp8_errors import fp8_layer_errors
from ampkit.tools.ops.tracing import ModuleScope, OpWatch
from ampkit.torch_internals import tree_leaves

# The results are defined in ampkit.tools.accuracy.comparison and re-exported here (their home
# before the split); the rest are the runs that produce them, which tune reuses.
__all__ = ["JSON_SCHEMA_VERSION", "Comparison", "ErrorStats", "GradError",
           "LowPrecisionSetup", "ModuleError", "NothingToCompareError", "OpError", "OpRank",
           "Run", "check_model", "check_settings", "compare", "compare_runs",
           "converted_setup", "model_device_type",
           "resolve_threshold", "run_once"]

_THRESHOLD_EPS = 8  # default threshold: this many machine epsilons of the low dtype


class NothingToCompareError(ValueError):
    """The float32 run gave nothing to measure the low-precision run against: the
    forward's output holds no floating-point tensor (a generator, an int), or the
    float32 output has NaN (where both runs are NaN they would count as agreeing, and
    the report would say "no error" having compared nothing).

    Example:
        >>> import torch
        >>> import ampkit
        >>> ampkit.compare(torch.nn.Linear(2, 2), torch.full((1, 2), float("nan")))
        Traceback (most recent call last):
        ...
        ampkit.tools.accuracy.compare.NothingToCompareError: the float32 run's output has \
2 NaN (of 2 values): compare measures low precision against a float32 reference that is \
a number; the inputs have 2 NaN: check them and the model in float32
    """


# -- recording ------------------------------------------------------------------------------

def _floats(value: Any) -> list[torch.Tensor]:
    """Detached clones of the floating tensors in ``value`` (nested)."""
    with torch_internals.DisableTorchFunction():  # our own clones are not ops of the model
        return [t.detach().clone() for t in tree_leaves(value)
                if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _live_floats(value: Any) -> list[torch.Tensor]:
    """The floating tensors in ``value`` (nested), detached, not copied: measured at
    once and let go."""
    with torch_internals.DisableTorchFunction():
        return [t.detach() for t in tree_leaves(value)
                if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _dtype_name(tensors: list[torch.Tensor]) -> str:
    return str(tensors[0].dtype) if tensors else "none"


@contextlib.contextmanager
def _plain(device_type: str) -> Iterator[None]:
    """No torch-function modes (the engine's, ours) and no autocast: plain float math."""
    with torch_internals.DisableTorchFunction(), torch.autocast(device_type, enabled=False), \
            torch.no_grad():
        yield


def _to_fp32_copy(value: Any) -> Any:
    # A copy: in-place ops stay local.
    return map_floating(value, lambda t: t.detach().to(torch.float32, copy=True))


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


class _Kept:
    """The reference run's tensors, each distinct one copied once.

    An op's output is usually the next op's input and a module's output the next
    module's input: a tensor seen again unchanged (the same object, its version counter
    not moved by an in-place op since) shares the first copy. A tensor without a version
    counter (made under ``torch.inference_mode``) is copied each time it is seen.
    """

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[weakref.ref[torch.Tensor], int, torch.Tensor]] = {}

    def floats(self, value: Any) -> list[torch.Tensor]:
        with torch_internals.DisableTorchFunction():  # our own clones are not the model's
            return [self._one(t) for t in tree_leaves(value)
                    if isinstance(t, torch.Tensor) and t.is_floating_point()]

    def _one(self, t: torch.Tensor) -> torch.Tensor:
        try:
            version = torch_internals.tensor_version(t)
        except RuntimeError:  # an inference tensor: no version counter to trust
            return t.detach().clone()
        hit = self._by_id.get(id(t))
        if hit is not None and hit[0]() is t and hit[1] == version:
            return hit[2]
        kept = t.detach().clone()
        self._by_id[id(t)] = (weakref.ref(t), version, kept)
        return kept


@dataclasses.dataclass(frozen=True)
class _MeasuredOp:
    """An op call of a run measured as it ran against its reference (nothing kept)."""

    dtype: str
    shape: tuple[int, ...]
    error: ErrorStats | None  # None: the reference has no call of this key
    input_rel: float
    local: ErrorStats | None


@dataclasses.dataclass
class _MeasuredModule:
    kind: str
    started: int
    input_rel: float | None  # None: the reference has no call of this key
    error: ErrorStats | None = None
    dtype: str = "none"


class _Recorder:
    """Captures one run: op calls and module calls of ``model``, by key.

    Without ``against`` (the float32 reference) it keeps a copy of each distinct
    floating tensor the watched calls take and give (:class:`_Kept`). With ``against``
    (a low-precision run) it measures each call against the reference's record of the
    same key as the call happens and keeps only the numbers: nothing of this run's
    activations outlives the call.
    """

    def __init__(self, model: nn.Module, *, recompute: bool,
                 against: _Recorder | None = None,
                 progress: Callable[[int], None] | None = None) -> None:
        self._is_compute = is_compute
        self.recompute = recompute
        self.against = against
        self.device_type = model_device_type(model)
        self.ops: dict[tuple[str, str, int], Any] = {}
        self.modules: dict[tuple[str, int], Any] = {}
        self.finished: list[tuple[str, int]] = []
        self._kept = _Kept()
        self._progress = progress
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
        outputs = _live_floats(out)
        if not outputs:
            return
        n = self._op_calls[module, name]
        self._op_calls[module, name] += 1
        local = _local_error(func, args, kwargs, outputs) if self.recompute else None
        key = (module, name, n)
        if self.against is None:
            # the model's own tensors (not detached views) are the keys of what is kept
            self.ops[key] = (self._kept.floats((args, kwargs)), self._kept.floats(out), local)
        else:
            match = self.against.ops.get(key)
            error, input_rel = None, math.nan
            if match is not None:
                with _plain(self.device_type):
                    error = ErrorStats.between(outputs, match[1])
                    input_rel = _input_rel(_live_floats((args, kwargs)), match[0])
            self.ops[key] = _MeasuredOp(_dtype_name(outputs), tuple(outputs[0].shape), error,
                                        input_rel, local)
        if self._progress is not None:
            self._progress(len(self.ops))

    def _enter(self, name: str, module: nn.Module, args: Any) -> None:
        n = self._module_calls[name]
        self._module_calls[name] += 1
        key = (name, n)
        self._open.setdefault(name, []).append(key)
        if self.against is None:
            self.modules[key] = [type(module).__name__, self._kept.floats(args), [],
                                 len(self.modules)]
            return
        match = self.against.modules.get(key)
        input_rel = None
        if match is not None:
            with _plain(self.device_type):
                input_rel = _input_rel(_live_floats(args), match[1])
        self.modules[key] = _MeasuredModule(type(module).__name__, len(self.modules),
                                            input_rel)

    def _exit(self, name: str, module: nn.Module, args: Any, output: Any) -> None:
        key = self._open[name].pop()
        self.finished.append(key)
        if self.against is None:
            self.modules[key][2] = self._kept.floats(output)
            return
        record = self.modules[key]
        outputs = _live_floats(output)
        record.dtype = _dtype_name(outputs)
        if record.input_rel is not None:
            with _plain(self.device_type):
                record.error = ErrorStats.between(outputs, self.against.modules[key][2])


# -- running --------------------------------------------------------------------------------

def model_device_type(model: nn.Module) -> str:
    """The device type of ``model``'s first parameter (or buffer); ``"cpu"`` if none.

    Example:
        >>> import torch
        >>> from ampkit.tools.accuracy.compare import model_device_type
        >>> model_device_type(torch.nn.Linear(1, 1))
        'cpu'
    """
    for p in model.parameters():
        return p.device.type
    for b in model.buffers():
        return b.device.type
    return "cpu"


@contextlib.contextmanager
def _forked_rng(device_type: str) -> Iterator[None]:
    devices: list[int] = []
    if device_type == "cuda" and torch.cuda.is_available():
        devices = list(range(torch.cuda.device_count()))
    with torch.random.fork_rng(devices=devices, device_type=device_type):
        yield


@dataclasses.dataclass(frozen=True)
class LowPrecisionSetup:
    """How a low-precision copy is made and run (:func:`converted_setup`)."""

    description: str
    dtype: torch.dtype
    prepare: Callable[[nn.Module], nn.Module]  # converts the copy (levels) or not
    region: Callable[[], Any]  # the context the copy's forward runs in


def _is_level(precision: Any) -> bool:
    from ampkit.conversion.levels import Level

    if isinstance(precision, Level):
        return True
    return isinstance(precision, str) and precision.strip().upper() in Level.__members__


def _setup(precision: Any, dtype: Any, device_type: str, white: Iterable[OpEntry] | None,
           black: Iterable[OpEntry] | None) -> LowPrecisionSetup:
    import ampkit
    from ampkit.config import AmpConfig
    from ampkit.policies.presets import get_policy

    chosen = as_dtype(dtype)
    if _is_level(precision) or isinstance(precision, AmpConfig):
        config, level = (precision, None) if isinstance(precision, AmpConfig) else (
            None, precision)
        return converted_setup(config, level, chosen, {"custom_white_list": white,
                                                       "custom_black_list": black},
                               device_type)
    if not isinstance(precision, (str, Policy)):
        raise TypeError(f"precision must be a level ('O0'-'O3'), a policy name or a Policy, "
                        f"got {type(precision).__name__}")
    policy = get_policy(precision).with_lists(white, black)
    low = chosen or policy.dtype or torch.get_autocast_dtype(device_type)
    return LowPrecisionSetup(f"policy {policy.name!r}", low, lambda m: m,
                             lambda: ampkit.autocast(device_type, low, policy=policy))


def converted_setup(config: Any, level: Any, dtype: torch.dtype | None,
                    overrides: Mapping[str, Any], device_type: str) -> LowPrecisionSetup:
    """How a low-precision copy is made and run as ``initialize`` would convert it: the
    settings merged by :func:`ampkit.front_door.resolve_settings` (a keyword given with
    ``config`` must agree with it), the copy prepared by
    :func:`ampkit.front_door.prepare_models` (fp8 included), and its forward run in the
    conversion's region. :func:`compare` (a level or a config) and
    :func:`ampkit.tune` (each trial's policy, at level O1) measure what training runs.

    Example:
        >>> import torch
        >>> from ampkit.tools.accuracy.compare import converted_setup
        >>> setup = converted_setup(None, "O3", torch.bfloat16, {}, "cpu")
        >>> net = setup.prepare(torch.nn.Linear(2, 2))
        >>> with setup.region():
        ...     out = net(torch.ones(1, 2, dtype=torch.bfloat16))
        >>> setup.description, setup.dtype, net.weight.dtype, out.dtype
        ('O3', torch.bfloat16, torch.bfloat16, torch.float32)
    """
    import ampkit
    from ampkit.front_door import prepare_models, resolve_settings

    settings = resolve_settings(config, level, dtype, overrides, device_type)
    props, conversion = settings.level_conversion(device_type)
    low = conversion.compute_dtype or torch.get_autocast_dtype(device_type)
    policy = conversion.policy
    # Entering the conversion's own region before the op watch keeps the engine under
    # the watch, so the watch sees each op's inputs before they are cast.
    region: Callable[[], Any] = (
        functools.partial(ampkit.autocast, device_type, low, policy=policy)
        if policy is not None else contextlib.nullcontext)

    def prepare(model: nn.Module) -> nn.Module:
        prepare_models([model], settings, names=["model"], device_type=device_type)
        return model

    return LowPrecisionSetup(f"{props.level.value}", low, prepare, region)


@dataclasses.dataclass
class Run:
    """One recorded run of a model (:func:`run_once`): its op and module records, its
    floating outputs, loss and gradients.

    Example:
        >>> import contextlib, torch
        >>> from ampkit.tools.accuracy.compare import run_once
        >>> run, out = run_once(torch.nn.Linear(2, 1), lambda m: m(torch.ones(1, 2)),
        ...                     contextlib.nullcontext, None, "cpu", recompute=False)
        >>> len(run.output), run.loss
        (1, None)
    """

    recorder: _Recorder
    output: list[torch.Tensor]
    loss: float | None
    grads: dict[str, torch.Tensor | None]


def run_once(model: nn.Module, run_fn: Callable[[nn.Module], Any], region: Callable[[], Any],
             loss_fn: Callable[[Any], torch.Tensor] | None, device_type: str, *,
             recompute: bool, against: Run | None = None,
             progress: Callable[[int], None] | None = None) -> tuple[Run, Any]:
    """Run ``run_fn(model)`` with the model's forward inside ``region()``, recording
    every op and module call (``recompute``: also each op's own float32 error), then
    ``loss_fn(output).backward()`` if given; the RNG is forked so runs draw alike.
    Returns the :class:`Run` and ``run_fn``'s result. See :class:`Run` for an example.

    Without ``against`` the run keeps one copy of each distinct floating tensor its
    watched op and module calls take or give (what a later run is measured against).
    With ``against`` (the float32 :class:`Run`) each call is measured against that
    run's call of the same key as it happens, and only the numbers are kept;
    :func:`compare_runs` then takes ``against`` as its ``ref``. ``progress`` is called
    with the number of watched op calls so far after each one.
    """
    recorder = _Recorder(model, recompute=recompute,
                         against=None if against is None else against.recorder,
                         progress=progress)
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
    return Run(recorder, _floats(out), loss_value, grads), out


def _input_rel(low: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    return ErrorStats.between(low, ref).max_rel if low else 0.0


def compare_runs(ref: Run, low: Run, description: str, dtype: torch.dtype,
                 threshold: float) -> Comparison:
    """The :class:`Comparison` of a low-precision run against its float32 reference.

    Example:
        >>> import contextlib, torch
        >>> from ampkit.tools.accuracy.compare import compare_runs, run_once
        >>> def run(m):
        ...     return run_once(m, lambda m: m(torch.ones(1, 2)), contextlib.nullcontext,
        ...                     None, "cpu", recompute=True)[0]
        >>> net = torch.nn.Linear(2, 1)
        >>> compare_runs(run(net), run(net), "same", torch.float32, 0.1).output.max_abs
        0.0
    """
    if low.recorder.against is not None and low.recorder.against is not ref.recorder:
        raise ValueError("the low-precision run was measured against another float32 "
                         "run than ref: pass the Run it was recorded against")
    ops, unmatched = [], 0
    for index, (key, record) in enumerate(low.recorder.ops.items()):
        module, name, call = key
        if isinstance(record, _MeasuredOp):
            if record.error is None:
                unmatched += 1
                continue
            local_rel = math.nan if record.local is None else record.local.max_rel
            ops.append(OpError(index, name, module, call, record.dtype, record.shape,
                               record.error, record.input_rel, local_rel))
            continue
        inputs, outputs, local = record
        match = ref.recorder.ops.get(key)
        if match is None:
            unmatched += 1
            continue
        ops.append(OpError(index, name, module, call, _dtype_name(outputs),
                           tuple(outputs[0].shape), ErrorStats.between(outputs, match[1]),
                           _input_rel(inputs, match[0]), local.max_rel))
    finished = {done: i for i, done in enumerate(low.recorder.finished)}
    modules = []
    for mkey, mrecord in low.recorder.modules.items():
        if mkey not in finished:
            continue
        if isinstance(mrecord, _MeasuredModule):
            if mrecord.input_rel is None or mrecord.error is None:
                continue
            modules.append(ModuleError(mkey[0], mrecord.kind, mkey[1], mrecord.started,
                                       finished[mkey], mrecord.dtype, mrecord.error,
                                       mrecord.input_rel))
            continue
        kind, inputs, outputs, started = mrecord
        mmatch = ref.recorder.modules.get(mkey)
        if mmatch is None:
            continue
        modules.append(ModuleError(mkey[0], kind, mkey[1], started, finished[mkey],
                                   _dtype_name(outputs), ErrorStats.between(outputs, mmatch[2]),
                                   _input_rel(inputs, mmatch[1])))
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


def _nan_count(tensors: Iterable[torch.Tensor]) -> int:
    return sum(int(torch.isnan(t).sum()) for t in tensors)


def _check_reference(output: list[torch.Tensor], inputs: tuple[Any, ...]) -> None:
    """Refuse a float32 output with NaN (:class:`NothingToCompareError`), naming the NaN
    in the inputs, their most likely source."""
    bad = _nan_count(output)
    if bad:
        given = _nan_count(t for t in tree_leaves(inputs)
                           if isinstance(t, torch.Tensor) and t.is_floating_point())
        raise NothingToCompareError(
            f"the float32 run's output has {bad} NaN (of {sum(t.numel() for t in output)} "
            f"values): compare measures low precision against a float32 reference that "
            f"is a number; the inputs have {given} NaN: check them and the model in "
            f"float32")


def check_model(model: Any) -> None:
    """Refuse what :func:`compare` cannot run: not an ``nn.Module``, or one without
    floating-point parameters.

    Example:
        >>> from ampkit.tools.accuracy.compare import check_model
        >>> check_model("net")
        Traceback (most recent call last):
        ...
        TypeError: model must be an nn.Module, got str
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not any(p.is_floating_point() for p in model.parameters()):
        raise ValueError("model has no floating-point parameters: there is nothing to run "
                         "in low precision")


def resolve_threshold(threshold: float | None, dtype: torch.dtype) -> float:
    """The relative error that counts as diverged: ``threshold`` checked, or by default
    8 machine epsilons of ``dtype``.

    Example:
        >>> import torch
        >>> from ampkit.tools.accuracy.compare import resolve_threshold
        >>> resolve_threshold(None, torch.bfloat16)
        0.0625
    """
    if threshold is None:
        return _THRESHOLD_EPS * torch.finfo(dtype).eps
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not (
            threshold >= 0):
        raise ValueError(f"threshold must be a number >= 0 (a relative error), "
                         f"got {threshold!r}")
    return float(threshold)


def _prepare(model: nn.Module, precision: Any, dtype: Any, white: Iterable[OpEntry] | None,
             black: Iterable[OpEntry] | None, threshold: float | None, fp8: Any
             ) -> tuple[LowPrecisionSetup, float, Any, str]:
    """Every check :func:`compare` makes before it runs the model, and what they give:
    the low-precision setup, the threshold, the fp8 recipe and the device type."""
    from ampkit.config import AmpConfig, contradiction

    check_model(model)
    device_type = model_device_type(model)
    setup = _setup(precision, dtype, device_type, white, black)
    if isinstance(precision, AmpConfig) and precision.fp8 is not None:
        if fp8 is not None and fp8 != precision.fp8:
            raise ValueError(contradiction(f"fp8={fp8!r}", "fp8", precision.fp8))
        fp8 = precision.fp8
    limit = resolve_threshold(threshold, setup.dtype)
    if fp8 is not None:  # a bad recipe, a missing torchao or this CPU's kernel: refused
        float8_linear_config(fp8)  # before any run
        check_fp8_device(fp8, device_type)
    return setup, limit, fp8, device_type


def check_settings(model: nn.Module, *, precision: Any = "torch",
                   dtype: torch.dtype | str | None = None,
                   custom_white_list: Iterable[OpEntry] | None = None,
                   custom_black_list: Iterable[OpEntry] | None = None,
                   threshold: float | None = None, fp8: Any = None) -> None:
    """Check :func:`compare`'s settings for ``model`` without running it: what
    ``compare`` would refuse before its first run, it refuses here (the command line
    reports it as bad input, apart from errors raised while the model runs).

    Raises:
        ValueError, TypeError: a setting ``compare`` refuses (a combination that means
            nothing, an unknown preset or dtype, a model without floating parameters).
        RuntimeError: this machine cannot run the ``fp8`` recipe.

    Example:
        >>> import torch
        >>> from ampkit.tools.accuracy.compare import check_settings
        >>> check_settings(torch.nn.Linear(2, 2), precision="O3",
        ...                custom_black_list=["softmax"])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: policy, custom_white_list and custom_black_list choose how ops are ...
    """
    _prepare(model, precision, dtype, custom_white_list, custom_black_list, threshold, fp8)


def compare(model: nn.Module, *inputs: Any, precision: Any = "torch",
            dtype: torch.dtype | str | None = None,
            custom_white_list: Iterable[OpEntry] | None = None,
            custom_black_list: Iterable[OpEntry] | None = None,
            loss_fn: Callable[[Any], torch.Tensor] | None = None,
            threshold: float | None = None, fp8: Any = None,
            progress: Callable[[str, int, int | None], None] | None = None) -> Comparison:
    """Run ``model(*inputs)`` in float32 and under ``precision``; compare op by op.

    Args:
        model: an fp32 ``nn.Module`` (not changed: both runs use deep copies).
        inputs: the forward's positional arguments.
        precision: a level (``"O1"``, ``"O2"``, ``"O3"``), a preset name or a
            :class:`~ampkit.policies.policy.Policy` (run with ``ampkit.autocast`` inside the
            model's forward), or an :class:`ampkit.AmpConfig`. A level or a config
            prepares the low-precision copy by the function ``initialize`` prepares
            models with (:func:`ampkit.front_door.prepare_models`, its settings merged
            as ``initialize`` merges them): its level, policy, lists, kept modules,
            master weights and fp8 layers (a config's ``fp8`` is measured per layer
            too, as with ``fp8=``); loss-scale options change nothing here.
        dtype: ``torch.float16`` or ``torch.bfloat16``; ``None``: the policy's, else the
            device's autocast default.
        custom_white_list: ops added to the policy's low-precision list (as in
            ``ampkit.autocast`` and ``initialize``); with a config, it must agree with
            the config's (a contradiction is a ``ValueError``), as must ``dtype``.
        custom_black_list: ops added to the policy's float32 list; with a config, as
            ``custom_white_list``.
        loss_fn: ``loss_fn(output) -> scalar tensor``; given, both runs call
            ``.backward()`` on it and gradients are compared per parameter.
        threshold: the relative error that counts as diverged (default: 8 machine
            epsilons of ``dtype``: 0.0625 for bfloat16, 0.0078 for float16).
        fp8: an fp8 recipe (as ``initialize``'s ``fp8=``); given, every Linear that can
            run in fp8 is also measured alone in fp8 and in ``dtype`` against fp32
            (:attr:`Comparison.fp8_layers`, see :mod:`ampkit.tools.accuracy.fp8_errors`).
        progress: called after each watched op call of each run as ``progress(run,
            done, total)``: ``run`` is ``"float32"`` or the low dtype's name, ``done`` the
            op calls of that run so far, ``total`` the float32 run's count (``None``
            during the float32 run, which sets it). ``ampkit compare`` draws its
            progress bars with it.

    Memory: the float32 run keeps one float32 copy of each distinct floating tensor
    its watched op and module calls take or give (an op's output that is the next
    op's input is kept once), about the activations one float32 training forward
    holds; the low-precision run is measured call by call against it and keeps only
    the numbers. See ``docs/tools.md`` for measured costs.

    Returns:
        a :class:`Comparison`.

    Raises:
        NothingToCompareError: the forward's output holds no floating-point tensor, or
            its float32 output has NaN.

    Example:
        >>> import torch
        >>> import ampkit
        >>> net = torch.nn.Linear(3, 2)
        >>> c = ampkit.compare(net, torch.ones(4, 3), precision="O3", dtype="float16",
        ...                    loss_fn=lambda out: out.float().sum())
        >>> [g.parameter for g in c.grads], c.divergence is None
        (['weight', 'bias'], True)
    """
    setup, limit, fp8, device_type = _prepare(model, precision, dtype, custom_white_list,
                                              custom_black_list, threshold, fp8)

    def run_fn(m: nn.Module) -> Any:
        out = m(*inputs)
        if not any(isinstance(t, torch.Tensor) and t.is_floating_point()
                   for t in tree_leaves(out)):  # (a generator's body has not even run)
            raise NothingToCompareError(
                f"the model's forward returned {type(out).__name__!r}, which holds no "
                f"floating-point tensor (tensors are read from tuples, lists, dicts and "
                f"the types torch's pytree knows): there is nothing to compare; return "
                f"the output tensors")
        return out

    if progress is not None and not callable(progress):
        raise TypeError(f"progress must be callable or None, got {type(progress).__name__}")

    def counted(run: str, total: int | None) -> Callable[[int], None] | None:
        if progress is None:
            return None
        return lambda done: progress(run, done, total)

    reference = copy.deepcopy(model).float()
    ref, _ = run_once(reference, run_fn, contextlib.nullcontext, loss_fn, device_type,
                      recompute=False, progress=counted("float32", None))
    del reference  # what the comparison needs of it is in ref
    _check_reference(ref.output, inputs)
    low_model = setup.prepare(copy.deepcopy(model))
    low_name = str(setup.dtype).removeprefix("torch.")
    low, _ = run_once(low_model, run_fn, setup.region, loss_fn, device_type, recompute=True,
                      against=ref, progress=counted(low_name, len(ref.recorder.ops)))
    del low_model
    result = compare_runs(ref, low, setup.description, setup.dtype, limit)
    if fp8 is None:
        return result
    return dataclasses.replace(result, fp8_layers=fp8_layer_errors(
        model, *inputs, fp8=fp8, dtype=setup.dtype))
