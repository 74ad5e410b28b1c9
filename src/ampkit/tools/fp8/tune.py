"""Which Linears go to fp8 within a tolerance: :func:`tune_fp8`.

The reference is the model at the level *without* fp8 (bf16 O2 by default): fp8's
cost is measured against what the model would run otherwise. The search, each trial
on a fresh deep copy of the model prepared as ``ampkit.initialize`` prepares it
(:func:`ampkit.front_door.prepare_models`; no loss scaling is set up) with the trial's
layers in fp8, and the same RNG state:

1. every Linear that can run in fp8 (shape and type; the first and last included,
   since here they are measured) at once: within the tolerance, that is the answer;
2. otherwise each candidate alone, which ranks them by what fp8 costs in that layer
   (a layer alone already outside the tolerance is left out);
3. then, best first, each candidate is added to the set when the metric of the set
   with it stays within the tolerance.

At most ``1 + 2 * candidates`` evaluations plus the reference. The tolerance reads as in
:func:`ampkit.tune`: absolute in the metric's units, or relative with
``relative=True``; ``higher_is_better`` makes it one-sided.

Example:
    >>> import torch
    >>> import ampkit
    >>> _ = torch.manual_seed(0)
    >>> net = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(3)])
    >>> x = torch.randn(16, 32)
    >>> result = ampkit.tools.tune_fp8(net, lambda m: m(x).float().pow(2).mean(),
    ...                                "tensorwise", tolerance=0.5, relative=True)
    >>> result.layers, result.within_tolerance
    (('0', '1', '2'), True)
    >>> sorted(result.initialize_kwargs())
    ['fp8', 'fp8_first_last']
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from ampkit.common.arguments import non_negative_number
from ampkit.common.text import finite_or_none, text_table
from ampkit.fp8.recipe import float8_linear_config, parse_fp8, recipe_name
from ampkit.fp8.selection import select_fp8_layers
from ampkit.tools.accuracy.tune import evaluate_metric

__all__ = ["Fp8Trial", "Fp8TuneResult", "tune_fp8"]


@dataclasses.dataclass(frozen=True)
class Fp8Trial:
    """One evaluation with ``layers`` in fp8.

    Example:
        >>> from ampkit.tools.fp8.tune import Fp8Trial
        >>> Fp8Trial(0, ("1",), 0.5, 0.01, True).layers
        ('1',)
    """

    index: int
    layers: tuple[str, ...]
    metric: float
    difference: float  # metric - reference metric (the level without fp8)
    within_tolerance: bool


@dataclasses.dataclass(frozen=True)
class Fp8TuneResult:
    """What :func:`tune_fp8` found, and each trial on the way.

    Attributes:
        fp8: the recipe (as given to ``initialize``).
        layers: the Linears chosen to run in fp8 (module order).
        candidates: every Linear that could run in fp8.
        metric: the metric with ``layers`` in fp8 (the reference's when none).
        reference_metric: the metric at the level without fp8.
        tolerance: absolute, in the metric's units.
        within_tolerance: ``metric`` is within the tolerance (always, since the empty
            set is the reference; False only when the reference itself is NaN).
        trials: every evaluation, in order.

    Example:
        >>> from ampkit.tools.fp8.tune import Fp8TuneResult
        >>> r = Fp8TuneResult("rowwise", (), ("1",), 1.0, 1.0, 0.1, True, ())
        >>> r.initialize_kwargs()
        {}
    """

    fp8: Any
    layers: tuple[str, ...]
    candidates: tuple[str, ...]
    metric: float
    reference_metric: float
    tolerance: float
    within_tolerance: bool
    trials: tuple[Fp8Trial, ...]

    def initialize_kwargs(self) -> dict[str, Any]:
        """The ``ampkit.initialize`` keywords that put exactly :attr:`layers` in fp8
        (empty when none is chosen: leave fp8 off).

        Example:
            >>> from ampkit.tools.fp8.tune import Fp8TuneResult
            >>> r = Fp8TuneResult("rowwise", ("1",), ("0", "1"), 1.0, 1.0, 0.1, True, ())
            >>> r.initialize_kwargs()
            {'fp8': 'rowwise', 'fp8_first_last': True, 'fp8_exclude_modules': ['0']}
        """
        if not self.layers:
            return {}
        return _kwargs(self.fp8, self.layers, self.candidates)

    def table(self) -> str:
        """One line per trial, then the choice, as plain text.

        Example:
            >>> from ampkit.tools.fp8.tune import Fp8TuneResult
            >>> r = Fp8TuneResult("rowwise", (), ("1",), 1.0, 1.0, 0.1, True, ())
            >>> r.table().splitlines()[0]
            'reference (no fp8) metric 1, tolerance 0.1; fp8 (rowwise) in 0 of 1 candidates'
        """
        head = (f"reference (no fp8) metric {self.reference_metric:.6g}, tolerance "
                f"{self.tolerance:.6g}; fp8 ({recipe_name(self.fp8)}) in "
                f"{len(self.layers)} of {len(self.candidates)} candidates")
        rows = [(t.index, f"{t.metric:.6g}", f"{t.difference:.4g}",
                 "yes" if t.within_tolerance else "no", ", ".join(t.layers) or "-")
                for t in self.trials]
        return "\n".join([head, "", text_table(
            ("trial", "metric", "difference", "within", "fp8 layers"), rows,
            align="rrrll"), "", f"chosen: {', '.join(self.layers) or 'none'}"])

    def to_dict(self) -> dict[str, Any]:
        """Plain data (non-finite numbers as ``None``).

        Example:
            >>> from ampkit.tools.fp8.tune import Fp8TuneResult
            >>> Fp8TuneResult("rowwise", (), (), 1.0, 1.0, 0.1, True, ()).to_dict()["fp8"]
            'rowwise'
        """
        out: dict[str, Any] = finite_or_none({
            "fp8": recipe_name(self.fp8), "layers": list(self.layers),
            "candidates": list(self.candidates), "metric": self.metric,
            "reference_metric": self.reference_metric, "tolerance": self.tolerance,
            "within_tolerance": self.within_tolerance,
            "trials": [dataclasses.asdict(t) | {"layers": list(t.layers)}
                       for t in self.trials]})
        return out

    def to_json(self) -> str:
        """:meth:`to_dict` as JSON text.

        Example:
            >>> from ampkit.tools.fp8.tune import Fp8TuneResult
            >>> Fp8TuneResult("rowwise", (), (), 1.0, 1.0, 0.1, True, ()).to_json()[:1]
            '{'
        """
        return json.dumps(self.to_dict(), indent=2, allow_nan=False)


def _kwargs(fp8: Any, layers: tuple[str, ...], candidates: tuple[str, ...]
            ) -> dict[str, Any]:
    out: dict[str, Any] = {"fp8": fp8, "fp8_first_last": True}
    rest = [c for c in candidates if c not in layers]
    if rest:
        out["fp8_exclude_modules"] = rest
    return out


def tune_fp8(model: nn.Module, eval_fn: Callable[[nn.Module], Any], fp8: Any = "tensorwise",
             *, tolerance: float, relative: bool = False,
             higher_is_better: bool | None = None, level: str = "O2",
             dtype: torch.dtype | str = torch.bfloat16) -> Fp8TuneResult:
    """Choose the Linears of ``model`` that run in fp8 while ``eval_fn``'s metric stays
    within ``tolerance`` of the level without fp8; see the module doc for the search.

    Args:
        model: an fp32 model (not changed: every trial converts a deep copy).
        eval_fn: ``eval_fn(model) -> metric`` (a number or a one-element tensor).
        fp8: the recipe (as ``initialize``'s ``fp8=``).
        tolerance: how far the metric may move: absolute, or a fraction of
            ``|reference metric|`` with ``relative=True``.
        relative: as in :func:`ampkit.tune`.
        higher_is_better: as in :func:`ampkit.tune`.
        level: the level the trials and the reference run at.
        dtype: the low-precision dtype the trials and the reference run in.

    Returns:
        a :class:`Fp8TuneResult`; ``ampkit.initialize(model, opt, level=..., dtype=...,
        **result.initialize_kwargs())`` applies it.

    Raises:
        ImportError: torchao is missing (names ``ampkit[fp8]``).
        ValueError: a bad tolerance, recipe or ``higher_is_better``.
        TypeError: ``eval_fn`` not callable or not returning a number.

    Example:
        >>> import torch
        >>> from ampkit.tools import tune_fp8
        >>> tune_fp8(torch.nn.Linear(16, 16), lambda m: 0.0, "e5m2", tolerance=0)
        ... # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: fp8 must be None, a torchao Float8LinearConfig or one of [...], got 'e5m2'
    """
    from ampkit.front_door import prepare_models, resolve_settings

    fp8 = parse_fp8(fp8)
    float8_linear_config(fp8)  # ImportError naming the extra; None refused
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not callable(eval_fn):
        raise TypeError(f"eval_fn must be callable (model -> metric), got "
                        f"{type(eval_fn).__name__}")
    tol = non_negative_number(tolerance, "tolerance")
    if higher_is_better not in (None, True, False):
        raise ValueError(f"higher_is_better must be True, False or None, "
                         f"got {higher_is_better!r}")
    wrapped = nn.Sequential(model)  # so a bare Linear is a candidate too
    candidates = tuple(x.name[2:] for x in select_fp8_layers(wrapped, first_last=True)
                       if x.fp8 and x.name.startswith("0."))
    rng = torch.get_rng_state()

    device_type = next((p.device.type for p in model.parameters()), None)

    def evaluate(layers: tuple[str, ...]) -> float:
        # Each trial is prepared as initialize prepares a model (the one route), without
        # initialize's loss-scaling set-up: a trial configures nothing process-wide.
        trial = copy.deepcopy(model)
        kwargs = _kwargs(fp8, layers, candidates) if layers else {}
        settings = resolve_settings(None, level, dtype, kwargs, device_type)
        prepare_models([trial], settings, names=["model"], device_type=device_type)
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(rng)
            where = f"the trial with {list(layers)} in fp8" if layers else "the reference"
            return evaluate_metric(eval_fn, trial, where)

    reference = evaluate(())
    limit = tol * abs(reference) if relative else tol

    def cost(value: float) -> float:
        diff = value - reference
        return -diff if higher_is_better else diff if higher_is_better is False else abs(
            diff)

    trials: list[Fp8Trial] = []

    def trial(layers: tuple[str, ...]) -> Fp8Trial:
        value = evaluate(layers)
        t = Fp8Trial(len(trials), layers, value, value - reference, cost(value) <= limit)
        trials.append(t)
        return t

    chosen: tuple[str, ...] = ()
    metric = reference
    if candidates:
        everything = trial(candidates)
        if everything.within_tolerance:
            chosen, metric = candidates, everything.metric
        else:
            alone = {c: trial((c,)) for c in candidates}
            order = sorted((c for c in candidates if alone[c].within_tolerance),
                           key=lambda c: (cost(alone[c].metric), candidates.index(c)))
            for c in order:
                layers = tuple(x for x in candidates if x in chosen or x == c)
                t = alone[c] if not chosen else trial(layers)
                if t.within_tolerance:
                    chosen, metric = layers, t.metric
    return Fp8TuneResult(fp8, chosen, candidates, metric, reference, limit,
                         cost(metric) <= limit, tuple(trials))
