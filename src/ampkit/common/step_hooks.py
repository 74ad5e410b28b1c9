"""ampkit's one global optimizer step hook: how ampkit hears of an optimizer's step.

Some wrong orders only show at an optimizer's first step: an optimizer built before
FSDP2's ``fully_shard`` replaced the parameters it holds (it would step tensors the
model no longer uses: :mod:`ampkit.conversion.parameter_owners`), and a plain
optimizer over the parameters of a model ``initialize`` set up for pure low-precision
training (it would round every update to nearest: :mod:`ampkit.pure`). Each feature
registers its check here with :func:`check_at_first_step`; this module registers one
``torch.optim.Optimizer`` global step pre-hook, on the first check, and runs every
check, in the order they were registered, before an optimizer's step until that
optimizer has passed it (then never again for that optimizer). A check raises to
refuse the step; a refused step changes nothing, and the next one checks again.

Example:
    >>> import torch
    >>> from ampkit.common.step_hooks import check_at_first_step
    >>> seen = []
    >>> handle = check_at_first_step(lambda optimizer: seen.append(type(optimizer).__name__))
    >>> w = torch.nn.Parameter(torch.ones(1))
    >>> opt = torch.optim.SGD([w], lr=0.1)
    >>> w.grad = torch.ones(1); opt.step(); opt.step()
    >>> handle.remove()
    >>> seen  # once per optimizer
    ['SGD']
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["CheckHandle", "check_at_first_step"]

Check = Callable[[torch.optim.Optimizer], None]

# (check, the optimizers that have passed it), in the order the checks were registered
_checks: list[tuple[Check, weakref.WeakSet[torch.optim.Optimizer]]] = []
_handle: Any = None
_lock = threading.Lock()


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    # The global step pre-hook: torch calls it before every optimizer's step.
    for check, passed in tuple(_checks):  # a snapshot: registering may go on meanwhile
        if optimizer not in passed:
            check(optimizer)
            passed.add(optimizer)


class CheckHandle:
    """What :func:`check_at_first_step` returns: ``remove()`` stops the check."""

    __slots__ = ("check",)

    def __init__(self, check: Check) -> None:
        self.check = check

    def remove(self) -> None:
        """Stop running the check (the one global hook stays registered).

        Example:
            >>> from ampkit.common.step_hooks import check_at_first_step
            >>> check_at_first_step(print).remove()
        """
        with _lock:
            _checks[:] = [entry for entry in _checks if entry[0] is not self.check]


def check_at_first_step(check: Check) -> CheckHandle:
    """Run ``check(optimizer)`` before each optimizer's step until it has passed for
    that optimizer (see the module doc); registering the same check again adds
    nothing. Returns a :class:`CheckHandle`.

    Example:
        >>> import torch
        >>> from ampkit.common.step_hooks import check_at_first_step
        >>> def refuse(optimizer):
        ...     raise RuntimeError("not yet")
        >>> handle = check_at_first_step(refuse)
        >>> w = torch.nn.Parameter(torch.ones(1))
        >>> opt = torch.optim.SGD([w], lr=0.1)
        >>> try:
        ...     opt.step()
        ... except RuntimeError as error:
        ...     print(error)
        not yet
        >>> handle.remove(); opt.step()  # the check is gone: the step runs
    """
    global _handle
    with _lock:
        if not any(c is check for c, _ in _checks):
            _checks.append((check, weakref.WeakSet()))
        if _handle is None:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            _handle = register_optimizer_step_pre_hook(_before_step)
    return CheckHandle(check)
