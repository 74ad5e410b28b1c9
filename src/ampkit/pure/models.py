"""The models ``ampkit.initialize`` set up for pure low-precision training: the record of
their rounding and seed (:func:`mark_pure_models`, :func:`pure_settings`), the check at
an optimizer's first step that it is pure when it steps their parameters, and
:func:`pure_low_precision`, what ``initialize`` calls.

Example:
    >>> import torch
    >>> from ampkit.pure import mark_pure_models, pure_settings
    >>> model = torch.nn.Linear(2, 2).to(torch.bfloat16)
    >>> mark_pure_models([model], "stochastic", None); pure_settings(model)
    (<Rounding.STOCHASTIC: 'stochastic'>, 0)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

from ampkit import torch_internals
from ampkit.common.step_hooks import check_at_first_step
from ampkit.conversion.levels import Rounding
from ampkit.conversion.parameter_owners import record_owners
from ampkit.pure.optimizer import (
    PureLowPrecisionOptimizer,
    check_rounding,
    check_seed,
    optimizer_class_name,
)
from ampkit.pure.rounding import is_dtensor

__all__ = ["mark_pure_models", "pure_low_precision", "pure_settings"]


class _PureRecord:
    """What ``initialize`` recorded about a parameter it made pure: the rounding and the
    seed an optimizer stepping it must use. (Where it sits, for the check that FSDP2
    has not replaced it since, is :mod:`ampkit.conversion.parameter_owners`'s record.)"""

    __slots__ = ("rounding", "seed")

    def __init__(self, rounding: Rounding, seed: int) -> None:
        self.rounding = rounding
        self.seed = seed


# parameters of models initialize() made pure -> their _PureRecord: an optimizer built
# over them later must be pure too (see _check_pure_at_first_step); models themselves
# -> (rounding, seed)
_PURE_PARAMS: WeakIdKeyDictionary = WeakIdKeyDictionary()
_PURE_MODELS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _check_pure_at_first_step(optimizer: torch.optim.Optimizer) -> None:
    # Checked at each optimizer's first step (ampkit.common.step_hooks), before anything
    # changed: a plain optimizer over parameters of a model trained purely rounds every
    # update to nearest (small updates stall), with no error. (An optimizer built before
    # fully_shard replaced them is refused by the check mark_pure_models registers
    # first: ampkit.conversion.parameter_owners.)
    if "_ampkit_pure" not in optimizer.__dict__:
        _check_not_plain(optimizer, optimizer_class_name(optimizer))


def _check_not_plain(optimizer: torch.optim.Optimizer, name: str) -> None:
    # What pure models hold now, beside what initialize recorded: sharding (torch's
    # fully_shard too) replaces their parameters with new ones.
    held = {id(p): settings for model, settings in list(_PURE_MODELS.items())
            for p in model.parameters() if p.dtype is torch.bfloat16}
    for group in optimizer.param_groups:
        for p in group["params"]:
            found = _PURE_PARAMS.get(p)
            settings = (found.rounding, found.seed) if found is not None else held.get(id(p))
            if settings is None:
                continue
            rounding, seed = settings
            if is_dtensor(p):
                fix = (f"Under FSDP2 build it with the one call that reads the rounding "
                       f"and seed from the model: optimizer = ampkit.fsdp."
                       f"prepare_optimizer(model, torch.optim.{name}(model.parameters(), "
                       f"...))")
            else:
                fix = (f"Make it pure before its first step: pass it to "
                       f"ampkit.initialize(model, optimizer, ...) with the same settings, "
                       f"or optimizer = ampkit.pure."
                       f"PureLowPrecisionOptimizer(optimizer, {rounding.value!r}, seed={seed})")
            raise RuntimeError(
                f"this {name} steps bf16 parameters of a model that ampkit.initialize "
                f"set up with master_weights={rounding.value!r}, but it is a plain "
                f"optimizer: its steps would round every update to nearest, and small "
                f"updates would be lost. {fix}")



def mark_pure_models(models: list[nn.Module], rounding: Rounding | str,
                     seed: int | None) -> None:
    """Record that ``models`` train purely with ``rounding`` and ``seed``: an optimizer
    built over their parameters later, and never made pure, raises ``RuntimeError``
    at its first step instead of training with updates rounded to nearest; so does an
    optimizer over parameters that FSDP2's ``fully_shard`` has since replaced.
    :func:`pure_settings` reads the record back (``ampkit.fsdp`` does).

    Example:
        >>> import torch
        >>> from ampkit.pure import mark_pure_models
        >>> model = torch.nn.Linear(2, 2).to(torch.bfloat16)
        >>> mark_pure_models([model], "kahan", 0)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> model(torch.ones(1, 2, dtype=torch.bfloat16)).sum().backward()
        >>> opt.step()
        Traceback (most recent call last):
        ...
        RuntimeError: this SGD steps bf16 parameters of a model that ...
    """
    if not isinstance(rounding, Rounding):  # initialize passes its mode's, checked
        rounding = check_rounding(rounding)
    check_seed(seed, "seed")
    seed = 0 if seed is None else seed
    for model in models:
        _PURE_MODELS[model] = (rounding, seed)
        for module in model.modules():
            for p in torch_internals.module_parameters(module).values():
                if p is not None and p.dtype is torch.bfloat16:
                    _PURE_PARAMS[p] = _PureRecord(rounding, seed)
        # registers the replaced-parameter check before this module's: an optimizer
        # built before sharding is named for that, whether it is pure or plain
        record_owners(model, keep_existing=True)
    check_at_first_step(_check_pure_at_first_step)


def pure_settings(model: nn.Module) -> tuple[Rounding, int] | None:
    """``(rounding, seed)`` of a model that ``ampkit.initialize`` set up for pure
    low-precision training (``master_weights="stochastic"`` or ``"kahan"``), else
    ``None``: what an optimizer built for it later must use.

    Example:
        >>> import torch
        >>> import ampkit
        >>> from ampkit.pure import pure_settings
        >>> model = ampkit.initialize(torch.nn.Linear(2, 2), level="O2", dtype="bfloat16",
        ...                           master_weights="kahan", rounding_seed=4)
        >>> pure_settings(model), pure_settings(torch.nn.Linear(2, 2))
        ((<Rounding.KAHAN: 'kahan'>, 4), None)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    settings: tuple[Rounding, int] | None = _PURE_MODELS.get(model)
    return settings


def pure_low_precision(optimizer: torch.optim.Optimizer, rounding: Rounding | str, *,
                       seed: int | None = None, compile_step: bool = False) -> Any:
    """Make ``optimizer`` pure (:class:`PureLowPrecisionOptimizer`); what
    ``ampkit.initialize(..., master_weights="stochastic" | "kahan")`` does
    (``compile_step``: :mod:`ampkit.pure.compiled_step`). The models
    need nothing: their ``state_dict`` holds their bf16 parameters, and the Kahan
    compensation is optimizer state. Calling it again on the same optimizer changes
    nothing.

    Raises:
        TypeError: ``optimizer`` is not an optimizer (and the other errors of
            :class:`PureLowPrecisionOptimizer`).

    Example:
        >>> import torch
        >>> import ampkit
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        >>> model, opt = ampkit.initialize(model, opt, level="O2", dtype=torch.bfloat16,
        ...                                master_weights="stochastic", rounding_seed=0)
        >>> model[0].weight.dtype, type(opt).__name__
        (torch.bfloat16, 'PureLowPrecisionAdamW')
        >>> model(torch.rand(2, 4)).sum().backward(); opt.step()
        >>> opt.state[model[0].weight]["exp_avg"].dtype
        torch.bfloat16
    """
    # The class checks everything and leaves an optimizer already pure with this
    # rounding as it is.
    return PureLowPrecisionOptimizer(optimizer, rounding, seed=seed, compile_step=compile_step)
