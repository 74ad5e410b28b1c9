"""What a converted forward sees of its parameters, and where its edits go (issue 46).

At O2 a module's forward computes with low-precision copies of its fp32 parameters
(:mod:`ampkit.parameter_casts`): while it runs, its ``_parameters`` hold the copies.
The fp32 parameters stay the truth, and these rules keep everything that is not the
forward's compute on the truth, as fp32 training would have it:

* **Forward pre-hooks run before the cast.** ampkit's cast is the last of a module's
  forward pre-hooks, whenever the user's were registered (before or after
  ``initialize``; :func:`keep_cast_last` moves it back to the end when another is
  registered). A user's pre-hook sees the fp32 parameter, and an edit it makes (a
  constraint: ``m.weight.data.clamp_(-c, c)``) is made to the truth, which the copy is
  then made from.
* **An embedding's** ``max_norm`` **renormalises the truth.** ``nn.Embedding`` and
  ``nn.EmbeddingBag`` with ``max_norm`` renormalise the rows they look up, in place, in
  their forward: the only modules of ``torch.nn`` that edit their own parameters there.
  ampkit makes that edit on the fp32 weight, with torch's kernel, just before the cast
  (:meth:`~ampkit.parameter_casts.CastParametersOnUse.before_renorming`).
* **Any other in-place edit of a copy is refused.** An edit made inside ``forward``
  (``with torch.no_grad(): self.weight.mul_(0.5)``) lands on the copy. When the
  module's forward ends, a copy whose version counter moved and whose values are no
  longer the cast of its parameter raises ``RuntimeError`` naming the module and the
  parameter (:func:`check_copies_unedited`). An edit through ``.data`` moves no
  version counter (``.data`` is a tensor with a counter of its own) and cannot be
  seen: make such edits in a forward pre-hook, where they reach the truth.
* **``parameters()`` and ``named_parameters()`` give the truth.** Called inside a
  converted forward (a regulariser over ``self.parameters()``), they give the fp32
  parameters, also those of modules whose forward is running (:func:`truths`); the
  gradient of what is computed from them reaches ``.grad`` directly. Reading an
  attribute (``self.weight``) inside the module's own forward gives the copy: that is
  the compute use the copy is for. Under ``torch.compile``, and in a module whose class
  the conversion does not replace (a parametrized module, a class with a ``__call__``
  of its own), ``parameters()`` gives what ``_parameters`` holds.

Example:
    >>> import torch
    >>> import ampkit
    >>> class Net(torch.nn.Linear):
    ...     def forward(self, x):
    ...         self.seen = {p.dtype for p in self.parameters()}
    ...         return super().forward(x)
    >>> net = ampkit.initialize(Net(2, 2), level="O2", dtype="bfloat16")
    >>> _ = net(torch.ones(1, 2))
    >>> net.seen
    {torch.float32}
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

from ampkit.parameter_casts import _CAST_HOOKS, _pass, _swaps

__all__ = ["check_copies_unedited", "keep_cast_last", "truth_of", "truths"]


def check_copies_unedited(module: nn.Module,
                          edited: list[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
    """Raise ``RuntimeError`` for the copies in ``edited`` (``(name, fp32 parameter,
    copy)`` whose version counter moved during ``module``'s forward) whose values are
    no longer the cast of the parameter. A version moved with the values unchanged
    (a kernel that rewrites a weight's storage as it was) is no edit.

    Example:
        >>> import torch
        >>> from ampkit.parameter_truth import check_copies_unedited
        >>> lin = torch.nn.Linear(2, 2)
        >>> copy = lin.weight.detach().to(torch.bfloat16)
        >>> check_copies_unedited(lin, [("weight", lin.weight, copy)])
        >>> _ = copy.mul_(2)
        >>> check_copies_unedited(lin, [("weight", lin.weight, copy)])
        Traceback (most recent call last):
        ...
        RuntimeError: module 'Linear' edited its parameter 'weight' in place ...
    """
    names = []
    with torch.no_grad():
        for name, param, low in edited:
            if not torch.equal(low, param.detach().to(low.dtype)):
                names.append(name)
    if not names:
        return
    from ampkit.conversion.classes import original_class
    from ampkit.conversion.config import record_of

    record = record_of(module)
    where = f"{record.name!r} " if record is not None and record.name else ""
    kind = original_class(type(module)).__name__
    raise RuntimeError(
        f"module {where}{kind!r} edited its parameter"
        f"{'s' if len(names) > 1 else ''} {', '.join(map(repr, names))} in place during "
        f"its forward, but there the module holds low-precision copies made for the "
        f"compute: the edit reached the copy, not the fp32 parameter the optimizer "
        f"steps and state_dict saves. Make the edit in a forward pre-hook "
        f"(module.register_forward_pre_hook), which runs before the cast and edits the "
        f"fp32 parameter, or between steps")


def truth_of(tensor: torch.Tensor) -> torch.Tensor:
    """The fp32 parameter whose low-precision copy ``tensor`` is in this thread's
    running forward, else ``tensor`` itself.

    Example:
        >>> import torch
        >>> from ampkit.parameter_truth import truth_of
        >>> w = torch.nn.Parameter(torch.ones(1))
        >>> truth_of(w) is w
        True
    """
    if isinstance(tensor, nn.Parameter):
        return tensor
    for module, swapped in reversed(_swaps.stack):
        params = module._parameters
        for name, param, _ in swapped:
            if params.get(name) is tensor:
                return param
    copies = _pass.copies
    if copies:
        for param, low in copies.values():
            if low is tensor:
                return param
    return tensor


def truths(named: Iterator[tuple[str, Any]], remove_duplicate: bool = True
           ) -> Iterator[tuple[str, Any]]:
    """``named`` (``named_parameters()``'s pairs) with every low-precision copy of the
    running forward replaced by its fp32 parameter (a parameter reached twice, through
    two copies, given once when ``remove_duplicate``).

    Example:
        >>> import torch
        >>> from ampkit.parameter_truth import truths
        >>> [n for n, _ in truths(torch.nn.Linear(1, 1).named_parameters())]
        ['weight', 'bias']
    """
    seen: set[int] = set()
    for name, tensor in named:
        param = truth_of(tensor)
        if remove_duplicate:
            if id(param) in seen:
                continue
            seen.add(id(param))
        yield name, param


def keep_cast_last(module: nn.Module) -> None:
    """Move ampkit's cast back to the end of ``module``'s forward pre-hooks (after a
    hook was registered), so that every user's pre-hook runs before it, on the fp32
    parameters. A converted module's ``register_forward_pre_hook`` calls it.

    Example:
        >>> import torch
        >>> import ampkit
        >>> lin = ampkit.initialize(torch.nn.Linear(2, 2), level="O2", dtype="bfloat16")
        >>> _ = lin.register_forward_pre_hook(lambda m, a: print(m.weight.dtype))
        >>> _ = lin(torch.ones(1, 2))
        torch.float32
    """
    own = module.__dict__.get(_CAST_HOOKS)
    hooks = module._forward_pre_hooks
    if own is not None and own[1] in hooks:
        hooks.move_to_end(own[1])  # type: ignore[attr-defined]
