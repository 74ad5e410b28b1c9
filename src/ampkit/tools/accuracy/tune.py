"""Accuracy-driven policy tuning: :func:`tune`.

:func:`tune` looks for the policy that runs the most ops in low precision while the
model's metric stays within a tolerance of its float32 value:

1. it evaluates the model once in float32 (the reference), recording every op call;
2. it evaluates the model under an aggressive policy, every compute op in low precision
   (``unlisted="lower"``), comparing each op call with the float32 run as
   :func:`ampkit.compare` does;
3. while the metric is outside the tolerance, it moves the op that added the most error
   (:meth:`~ampkit.tools.accuracy.compare.Comparison.ranked_ops`) into the float32 list and
   evaluates again, one op per trial, until the metric is within the tolerance, the
   budget of trials is spent, or no op that added error is left to move.

The search measures the model's forward: each trial's policy applies inside it, and
``eval_fn``'s own code around it (a loss, a metric) runs in float32. So the returned
policy decides only the ops it measured: its rule for unlisted ops is written out as a
list of the ops the forward ran, and every other op runs as native autocast runs it
(``unlisted="native"``). Put around forward *and* loss in training, it runs the loss
(``F.cross_entropy``, ...) exactly as ``torch.autocast`` would, not by the aggressive
rule nobody measured. (A ``start`` policy whose unlisted rule is ``"keep"`` or
``"native"`` has no list for that rule and is returned as it is.) Each trial starts from
a fresh deep copy of the model and the same RNG state, converted by the function
``ampkit.initialize`` converts models with, as ``initialize(model, level="O1",
policy=trial_policy)`` would (:func:`~ampkit.tools.accuracy.compare.converted_setup`):
the search measures what training with the policy runs, and, as there, the model's
floating outputs come back in float32, so ``eval_fn``'s own code computes in float32.

The tolerance is **absolute** by default: the metric may move by at most ``tolerance``
from its float32 value (in the metric's own units, e.g. ``0.01`` = one point of
accuracy on a 0-1 scale). With ``relative=True`` it is a fraction of the float32 value:
at most ``tolerance * |fp32 metric|``. ``higher_is_better`` makes it one-sided (``True``
for accuracy: only a drop counts; ``False`` for a loss: only a rise counts); ``None``
(default) counts a move either way.

When the budget runs out (or nothing is left to move) before the metric is within the
tolerance, the result says so: :attr:`TuneResult.within_tolerance` is ``False``, its
``stop_reason`` says why, its policy is the trial that came closest, and a
:class:`TuneWarning` is issued. Nothing is silent.

Example:
    >>> import torch
    >>> import ampkit
    >>> _ = torch.manual_seed(0)
    >>> net = torch.nn.Sequential(torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))
    >>> x = 100 + torch.randn(16, 32)  # raw features with a large offset
    >>> def eval_fn(model):
    ...     return model(x).float().pow(2).mean()
    >>> result = ampkit.tune(net, eval_fn, torch.bfloat16, tolerance=0.02, relative=True)
    >>> sorted(result.policy.fp32_ops), result.policy.unlisted, result.within_tolerance
    (['layer_norm'], 'native', True)
    >>> sorted(result.policy.lower_precision_ops)  # what the forward ran, measured
    ['linear']
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json
import math
import numbers
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from ampkit.common.arguments import non_negative_number
from ampkit.common.text import finite_or_none, text_table
from ampkit.policies.policy import Policy, as_dtype
from ampkit.tools.accuracy.compare import (
    check_model,
    compare_runs,
    converted_setup,
    model_device_type,
    resolve_threshold,
    run_once,
)
from ampkit.tools.accuracy.comparison import Comparison

__all__ = ["MetricError", "Trial", "TuneResult", "TuneWarning", "aggressive_policy",
           "evaluate_metric", "metric_value", "tune"]

#: Why a search stopped.
WITHIN_TOLERANCE = "within tolerance"
BUDGET_EXHAUSTED = "budget exhausted"
NOTHING_TO_MOVE = "no op that added error is left to move to float32"


class TuneWarning(UserWarning):
    """Issued when :func:`tune` stops without reaching the tolerance."""


class MetricError(ValueError):
    """``eval_fn``'s float32 metric is not a finite number: there is nothing to
    measure the trials against.

    Example:
        >>> from ampkit.tools.accuracy.tune import MetricError
        >>> issubclass(MetricError, ValueError)
        True
    """


def aggressive_policy(dtype: torch.dtype | str) -> Policy:
    """Every compute op in ``dtype``: where :func:`tune` starts.

    Example:
        >>> from ampkit.tools.accuracy.tune import aggressive_policy
        >>> p = aggressive_policy("bfloat16")
        >>> p.rule_for("softmax"), p.rule_for("linear")
        ('lower', 'lower')
    """
    return Policy(name="tuned", dtype=as_dtype(dtype, allow_none=False), unlisted="lower",
                  description="every compute op in low precision")


@dataclasses.dataclass(frozen=True)
class Trial:
    """One evaluation under one policy.

    Example:
        >>> from ampkit.tools.accuracy.tune import Trial, aggressive_policy
        >>> t = Trial(0, aggressive_policy("bfloat16"), 0.5, 0.01, True, 1.0, None, ())
        >>> t.fp32_ops
        ()
    """

    index: int
    policy: Policy
    metric: float
    difference: float  # metric - float32 metric
    within_tolerance: bool
    low_precision_share: float  # share of the model's watched op calls in low precision
    moved: str | None  # the op this trial's comparison moved to float32 for the next one
    worst_ops: tuple[tuple[str, float], ...]  # (op, error added), worst first

    @property
    def fp32_ops(self) -> tuple[str, ...]:
        """The ops this trial ran in float32 (sorted)."""
        return tuple(sorted(self.policy.fp32_ops))


@dataclasses.dataclass(frozen=True)
class TuneResult:
    """What :func:`tune` found, and each trial on the way.

    Example:
        >>> import torch
        >>> import ampkit
        >>> net = torch.nn.Linear(4, 2)
        >>> x = torch.rand(8, 4)
        >>> r = ampkit.tune(net, lambda m: m(x).float().mean(), "bfloat16", tolerance=0.1)
        >>> r.within_tolerance, len(r.trials), r.stop_reason
        (True, 1, 'within tolerance')
    """

    policy: Policy
    within_tolerance: bool
    stop_reason: str
    reference_metric: float
    tolerance: float  # absolute, in the metric's units
    trials: tuple[Trial, ...]

    def save(self, path: str | os.PathLike[str]) -> None:
        """Save :attr:`policy` as JSON (``Policy.load`` and ``ampkit.autocast(policy=
        Policy.load(path))`` read it back)."""
        self.policy.save(path)

    def table(self) -> str:
        """One line per trial and the lists found, as plain text.

        Example:
            >>> import torch
            >>> import ampkit
            >>> x = torch.rand(8, 4)
            >>> r = ampkit.tune(torch.nn.Linear(4, 2), lambda m: m(x).float().mean(),
            ...                 "bfloat16", tolerance=0.1)
            >>> r.table().splitlines()[2].split()[:2]
            ['trial', 'metric']
        """
        rows = [(t.index, f"{t.metric:.6g}", f"{t.difference:.4g}",
                 "yes" if t.within_tolerance else "no", f"{t.low_precision_share:.0%}",
                 (", ".join(t.fp32_ops) or "-") + (f" -> move {t.moved}" if t.moved else ""))
                for t in self.trials]
        lines = [f"float32 metric {self.reference_metric:.6g}, tolerance "
                 f"{self.tolerance:.6g}; stopped: {self.stop_reason}", "",
                 text_table(("trial", "metric", "difference", "within", "low-prec ops",
                             "float32 ops / moved next"), rows, align="rrrrrl")]
        lines += ["", self.policy.describe()]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (non-finite numbers as ``None``)."""
        out: dict[str, Any] = finite_or_none({
            "policy": self.policy.to_dict(),
            "within_tolerance": self.within_tolerance,
            "stop_reason": self.stop_reason,
            "reference_metric": self.reference_metric,
            "tolerance": self.tolerance,
            "trials": [{"index": t.index, "metric": t.metric, "difference": t.difference,
                        "within_tolerance": t.within_tolerance,
                        "low_precision_share": t.low_precision_share,
                        "fp32_ops": list(t.fp32_ops), "moved": t.moved,
                        "worst_ops": [list(w) for w in t.worst_ops]} for t in self.trials],
        })
        return out

    def to_json(self) -> str:
        """:meth:`to_dict` as JSON text."""
        return json.dumps(self.to_dict(), indent=2, allow_nan=False)


def metric_value(value: Any, where: str) -> float:
    """What ``eval_fn`` returned, as a float (a number or a one-element tensor);
    ``where`` names the run in the error.

    Example:
        >>> import torch
        >>> from ampkit.tools.accuracy.tune import metric_value
        >>> metric_value(torch.tensor([0.5]), "the fp32 run")
        0.5
    """
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.detach())
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    raise TypeError(f"eval_fn must return a number or a one-element tensor, got "
                    f"{type(value).__name__} in {where}")


def evaluate_metric(eval_fn: Callable[[nn.Module], Any], model: nn.Module,
                    where: str) -> float:
    """``eval_fn(model)`` as a float (:func:`metric_value`); ``where`` names the run in
    the errors.

    Raises:
        RuntimeError: ``eval_fn`` raised; the message names ``where``, and the original
            error is its ``__cause__``.
        TypeError: as :func:`metric_value`.

    Example:
        >>> import torch
        >>> from ampkit.tools.accuracy.tune import evaluate_metric
        >>> evaluate_metric(lambda m: m.weight.sum(), torch.nn.PReLU(init=0.5), "trial 0")
        0.5
    """
    try:
        value = eval_fn(model)
    except Exception as error:
        raise RuntimeError(f"eval_fn raised in {where}: "
                           f"{type(error).__name__}: {error}") from error
    return metric_value(value, where)


def _start_policy(start: Policy | str | None, dtype: torch.dtype) -> Policy:
    from ampkit.policies.presets import get_policy

    if start is None:
        return aggressive_policy(dtype)
    return dataclasses.replace(get_policy(start).with_dtype(dtype), name="tuned")


def tune(model: nn.Module, eval_fn: Callable[[nn.Module], Any], dtype: torch.dtype | str,
         *, tolerance: float, relative: bool = False, higher_is_better: bool | None = None,
         budget: int = 10, start: Policy | str | None = None,
         on_trial: Callable[[Trial], None] | None = None) -> TuneResult:
    """Find the policy with the most ops in ``dtype`` whose metric stays within
    ``tolerance`` of float32's; see the module docstring for the search.

    Args:
        model: an fp32 ``nn.Module`` with floating-point parameters (not changed).
        eval_fn: ``eval_fn(model) -> metric`` (a number or one-element tensor: an
            accuracy, a loss); it calls ``model(...)`` on a batch or a few.
        dtype: ``torch.float16`` or ``torch.bfloat16`` (or their names).
        tolerance: how far the metric may move from float32's: absolute (metric units),
            or a fraction of ``|fp32 metric|`` with ``relative=True``.
        relative: read ``tolerance`` as relative to the float32 metric.
        higher_is_better: ``True``: only a drop counts; ``False``: only a rise counts;
            ``None``: either.
        budget: the most trials (evaluations under a candidate policy); the float32
            reference is one evaluation more.
        start: the first policy tried (default: :func:`aggressive_policy`).
        on_trial: called with each :class:`Trial` as soon as it is done (progress).

    Returns:
        a :class:`TuneResult`; its ``policy`` saves with ``.save(path)``.

    Raises:
        ValueError: ``tolerance`` < 0 (or not finite), ``budget`` < 1, a model without
            floating-point parameters, an unknown ``dtype``.
        MetricError: (a ``ValueError``) the float32 metric is NaN or infinite.
        TypeError: ``model`` is not an ``nn.Module``, ``eval_fn`` is not callable or
            returns something that is not a number.
        RuntimeError: ``eval_fn`` raised; the message names the trial (or the float32
            reference) and the policy, and the original error is its ``__cause__``.

    Example:
        >>> import torch
        >>> import ampkit
        >>> x = torch.rand(4, 3)
        >>> ampkit.tune(torch.nn.Linear(3, 1), lambda m: m(x).sum(), "bfloat16",
        ...             tolerance=-1)
        Traceback (most recent call last):
        ...
        ValueError: tolerance must be a finite number >= 0, got -1
    """

    check_model(model)
    if not callable(eval_fn):
        raise TypeError(f"eval_fn must be callable (model -> metric), got "
                        f"{type(eval_fn).__name__}")
    low = as_dtype(dtype, allow_none=False)
    assert low is not None
    tol = non_negative_number(tolerance, "tolerance")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"budget must be an int >= 1 (trials), got {budget!r}")
    if on_trial is not None and not callable(on_trial):
        raise TypeError(f"on_trial must be callable or None, got {type(on_trial).__name__}")
    if higher_is_better not in (None, True, False):
        raise ValueError(f"higher_is_better must be True, False or None, "
                         f"got {higher_is_better!r}")
    device_type = model_device_type(model)
    threshold = resolve_threshold(None, low)

    def evaluate(where: str) -> Callable[[nn.Module], float]:
        return functools.partial(evaluate_metric, eval_fn, where=where)

    ref_run, reference = run_once(copy.deepcopy(model).float(),
                                  evaluate("the float32 reference run"),
                                  contextlib.nullcontext, None, device_type, recompute=False)
    if not math.isfinite(reference):
        # every trial is measured against it: NaN would make each one "outside the
        # tolerance" and blame the ops for what the float32 model already did
        raise MetricError(f"eval_fn returned {reference} on the float32 model (the "
                          f"reference every trial is measured against); it must be a "
                          f"finite number: check eval_fn and the model in float32")
    limit = tol * abs(reference) if relative else tol

    def within(value: float) -> bool:
        diff = value - reference
        if math.isnan(diff):
            return False
        if higher_is_better is True:
            return bool(diff >= -limit)
        if higher_is_better is False:
            return bool(diff <= limit)
        return bool(abs(diff) <= limit)

    policy = _start_policy(start, low)
    trials: list[Trial] = []
    measured: set[str] = set()  # the ops the forward ran, by name
    reason = BUDGET_EXHAUSTED
    for index in range(budget):
        current = policy
        where = f"trial {index} (float32 ops: {sorted(current.fp32_ops) or 'none'})"
        # The trial's copy converted as initialize(level="O1", policy=current) would
        # convert it: the search measures what training with the policy runs.
        setup = converted_setup(None, "O1", low, {"policy": current}, device_type)
        run, metric = run_once(setup.prepare(copy.deepcopy(model)), evaluate(where),
                               setup.region, None, device_type, recompute=True,
                               against=ref_run)
        comparison = compare_runs(ref_run, run, f"policy {current.name!r}", low, threshold)
        measured.update(r.op for r in comparison.ops)
        ok = within(metric)
        ranked = comparison.ranked_ops()
        moved = None
        if not ok:
            moved = next((r.op for r in ranked if r.op not in current.fp32_ops
                          and r.added > 0), None)  # NaN compares False: never moved
        trials.append(Trial(index, current, metric, metric - reference, ok,
                            _low_share(comparison, low), moved,
                            tuple((r.op, r.added) for r in ranked[:3])))
        if on_trial is not None:
            on_trial(trials[-1])
        if ok:
            reason = WITHIN_TOLERANCE
            break
        if moved is None:
            reason = NOTHING_TO_MOVE
            break
        policy = current.with_lists(custom_black_list={moved}, name="tuned")
    found = [t for t in trials if t.within_tolerance]
    if found:
        best = found[0]
    else:
        best = min(trials, key=lambda t: (math.isnan(t.difference), abs(t.difference)))
        warnings.warn(f"ampkit.tune stopped without reaching the tolerance ({reason}, "
                      f"{len(trials)} trial(s)); the closest trial ({best.index}) is returned "
                      f"with within_tolerance=False", TuneWarning, stacklevel=2)
    final = dataclasses.replace(
        _measured_only(best.policy, frozenset(measured)),
        description=(f"found by ampkit.tune: {len(best.policy.fp32_ops)} op(s) in float32, "
                     f"metric {best.metric:.6g} vs float32 {reference:.6g} ({reason}); "
                     f"ops the search did not measure run as native autocast runs them"))
    return TuneResult(final, bool(found), reason, reference, limit, tuple(trials))


_LIST_OF_RULE = {"lower": "lower_precision_ops", "fp32": "fp32_ops",
                 "promote": "promote_ops"}


def _measured_only(policy: Policy, measured: frozenset[str]) -> Policy:
    """``policy`` deciding only the ``measured`` ops: its unlisted rule becomes a list of
    them, and everything else is left to native autocast (see the module docstring)."""
    field = _LIST_OF_RULE.get(policy.unlisted)
    if field is None:  # "keep" / "native": no list to write the rule into
        return policy
    listed = policy.lower_precision_ops | policy.fp32_ops | policy.promote_ops
    return dataclasses.replace(policy, unlisted="native",
                               **{field: getattr(policy, field) | (measured - listed)})


def _low_share(comparison: Comparison, dtype: torch.dtype) -> float:
    calls = comparison.ops
    if not calls:
        return 0.0
    return sum(r.dtype == str(dtype) for r in calls) / len(calls)
