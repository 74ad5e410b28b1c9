"""Where each parameter of a converted model sits, and the one check that an optimizer
steps parameters the model still holds.

FSDP2's ``fully_shard`` (torch's own, or :func:`ampkit.fsdp.fully_shard`, which calls
it) replaces every parameter of the modules it shards with a new, sharded ``DTensor``
parameter. An optimizer built over the parameters before that holds the old tensors:
they receive no gradient any more and nothing the model computes reads them, so its
steps would train nothing, with no error. So the conversion (``ampkit.initialize``,
``ampkit.convert_model``) records, for every parameter, the module that holds it and
its qualified name (:func:`record_owners`); :mod:`ampkit.fsdp` records again just
before it shards and notes what it replaced (:func:`note_replaced`); pure
low-precision models (:func:`ampkit.pure.mark_pure_models`) and O2's cast on use
(:class:`ampkit.conversion.parameter_casts.CastParametersOnUse`) record theirs too.
:func:`check_not_replaced` runs at every optimizer's first step
(:mod:`ampkit.common.step_hooks`) and in :func:`ampkit.fsdp.prepare_optimizer`: an
optimizer holding a replaced parameter is refused, naming the parameter, before
anything changes.

A parameter counts as replaced when :mod:`ampkit.fsdp` saw it replaced, or when its
module now holds a sharded ``DTensor`` parameter under its name while it is not one
itself. (A module may hold other tensors under a parameter's name for a while: O2's
low-precision copies and FSDP2's unsharded parameters during a forward; neither is a
sharded ``DTensor``.)

Example:
    >>> import torch
    >>> from ampkit.conversion.parameter_owners import record_owners, replaced_name
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    >>> record_owners(model)
    >>> replaced_name(model[0].weight) is None   # the model still holds it
    True
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

from ampkit import torch_internals
from ampkit.common.step_hooks import check_at_first_step

__all__ = ["MADE_FROM", "check_not_replaced", "note_replaced", "optimizer_class_name",
           "record_owners", "replaced_name"]

#: The class attribute of an optimizer class ampkit makes at run time around the user's
#: (``ampkit.pure``'s ``PureLowPrecisionAdamW``): the class it was made from, which
#: messages name, since that is the one the user builds.
MADE_FROM = "_ampkit_made_from"


class _Owner:
    """Where one parameter sat when it was recorded: its module (weakly), its name
    there, its qualified name in the model, and whether ``ampkit.fsdp.fully_shard``
    has since replaced it."""

    __slots__ = ("module", "name", "qualified", "replaced")

    def __init__(self, module: nn.Module, name: str, qualified: str) -> None:
        self.module = weakref.ref(module)
        self.name = name
        self.qualified = qualified
        self.replaced = False

    def holds_other_shard(self, p: torch.Tensor) -> bool:
        module = self.module()
        if module is None:
            return False
        now = torch_internals.module_parameters(module).get(self.name)
        return now is not None and now is not p and _is_dtensor(now) and not _is_dtensor(p)


# parameter -> its _Owner (weak, by identity): the one record the check reads
_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _is_dtensor(t: Any) -> bool:
    # duck-typed: importing torch.distributed.tensor here would cost every import ampkit
    return hasattr(t, "placements") and hasattr(t, "device_mesh")


def record_owners(model: nn.Module, *, keep_existing: bool = False,
                  recurse: bool = True) -> None:
    """Record where each parameter of ``model`` sits (its module, its name there, its
    qualified name in ``model``), so that an optimizer stepping one that FSDP2 has
    since replaced is refused at its first step (:func:`check_not_replaced`, which this
    registers). ``keep_existing=True`` leaves a parameter recorded already as it was
    (a module recorded on its own, inside a model recorded with fuller names);
    ``recurse=False`` records ``model``'s own parameters only.

    Example:
        >>> import torch
        >>> from ampkit.conversion.parameter_owners import record_owners
        >>> record_owners(torch.nn.Linear(2, 2))
    """
    seen: set[int] = set()  # a parameter held twice (tied) keeps its first name
    modules = model.named_modules() if recurse else iter((("", model),))
    for prefix, module in modules:
        for name, p in torch_internals.module_parameters(module).items():
            if p is None or id(p) in seen or (keep_existing and p in _OWNERS):
                continue
            seen.add(id(p))
            _OWNERS[p] = _Owner(module, name, f"{prefix}.{name}" if prefix else name)
    check_at_first_step(check_not_replaced)


def note_replaced(params: Iterable[torch.Tensor]) -> None:
    """After sharding: each of ``params`` (recorded before) whose module no longer
    holds it under its name was replaced; an optimizer holding it is refused, whatever
    replaced it with (``ampkit.fsdp.fully_shard`` calls this).

    Example:
        >>> import torch
        >>> from ampkit.conversion.parameter_owners import (note_replaced, record_owners,
        ...                                                 replaced_name)
        >>> lin = torch.nn.Linear(2, 2)
        >>> record_owners(lin)
        >>> old = lin.weight
        >>> lin.weight = torch.nn.Parameter(old.detach().clone())
        >>> note_replaced([old]); replaced_name(old)
        'weight'
    """
    for p in params:
        owner: _Owner | None = _OWNERS.get(p)
        module = None if owner is None else owner.module()
        if owner is not None and module is not None and \
                torch_internals.module_parameters(module).get(owner.name) is not p:
            owner.replaced = True


def replaced_name(p: torch.Tensor) -> str | None:
    """The qualified name of ``p`` where it has been replaced by sharding (see the
    module doc), else ``None``.

    Example:
        >>> import torch
        >>> from ampkit.conversion.parameter_owners import replaced_name
        >>> replaced_name(torch.nn.Parameter(torch.ones(1))) is None
        True
    """
    owner: _Owner | None = _OWNERS.get(p)
    if owner is None or not (owner.replaced or owner.holds_other_shard(p)):
        return None
    return owner.qualified


def optimizer_class_name(optimizer: torch.optim.Optimizer) -> str:
    """The name of the optimizer class ``optimizer`` was built as (a pure one's
    ``PureLowPrecisionAdamW`` is ``"AdamW"``), for messages that show its constructor.

    Example:
        >>> import torch
        >>> from ampkit.conversion.parameter_owners import optimizer_class_name
        >>> optimizer_class_name(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))]))
        'SGD'
    """
    cls: type = getattr(type(optimizer), MADE_FROM, type(optimizer))
    return cls.__name__


def check_not_replaced(optimizer: torch.optim.Optimizer) -> None:
    """Raise ``RuntimeError`` if ``optimizer`` holds a parameter that FSDP2's
    ``fully_shard`` has replaced since the optimizer was built (see the module doc):
    its steps would change nothing the model uses. Run at each optimizer's first step.

    Example:
        >>> import torch
        >>> from ampkit.conversion.parameter_owners import check_not_replaced
        >>> check_not_replaced(torch.optim.SGD(torch.nn.Linear(2, 2).parameters()))
    """
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = replaced_name(p)
            if name is not None:
                kind = optimizer_class_name(optimizer)
                raise RuntimeError(
                    f"this {kind} steps parameter {name!r} as it was before FSDP2's "
                    f"fully_shard replaced it with a sharded DTensor parameter (the "
                    f"optimizer was built first), so its steps would change nothing the "
                    f"model uses. Build the optimizer after sharding: optimizer = "
                    f"ampkit.fsdp.prepare_optimizer(model, torch.optim.{kind}("
                    f"model.parameters(), ...))")
