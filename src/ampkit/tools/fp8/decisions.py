"""Which linear layers of a model run in fp8, and why the others do not:
:func:`fp8_report`.

Example:
    >>> import torch
    >>> import ampkit
    >>> net = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(3)])
    >>> net = ampkit.initialize(net, level="O2", dtype=torch.bfloat16, fp8="tensorwise")
    >>> print(ampkit.tools.fp8_report(net))
    fp8 (tensorwise): 1 of 3 linear layers
    layer  type    shape    fp8  why not
    0      Linear  16 x 16  no   first linear layer of the model (fp8_first_last=True converts it)
    1      Linear  16 x 16  yes
    2      Linear  16 x 16  no   last linear layer of the model (fp8_first_last=True converts it)
"""

from __future__ import annotations

import torch.nn as nn

from ampkit.fp8.convert import get_fp8_plan

__all__ = ["fp8_report"]


def fp8_report(model: nn.Module) -> str:
    """A plain-text table of the fp8 decision ``initialize(fp8=...)`` made for every
    linear layer of ``model`` (``nn.Linear``, transformers ``Conv1D``): its type, its
    shape (in x out), whether it runs in fp8, and why not.
    (:func:`ampkit.fp8.select_fp8_layers` answers the same before converting.)

    Example:
        >>> import torch
        >>> from ampkit.tools import fp8_report
        >>> fp8_report(torch.nn.Linear(2, 2))
        'fp8: off (the model was not initialized with fp8=)'
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    plan = get_fp8_plan(model)
    if plan is None:
        return "fp8: off (the model was not initialized with fp8=)"
    return plan.table()
