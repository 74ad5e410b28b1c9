"""Plan before you train: the memory of one training step per rank, for each precision
mode and parallel layout, computed by running the step on fake tensors
(:func:`plan`; the command ``ampkit plan``).

Example:
    >>> import torch
    >>> from ampkit.tools.plan import plan
    >>> report = plan(lambda: torch.nn.Linear(16, 16), lambda: torch.ones(4, 16),
    ...               modes=["O1"])
    >>> report.rows[0]["mode"], report.rows[0]["parameters"]
    ('O1', 1088)
"""

from ampkit.tools.plan.report import Plan
from ampkit.tools.plan.setup import LAYOUTS, MODES
from ampkit.tools.plan.simulate import largest_batch, plan

__all__ = ["LAYOUTS", "MODES", "Plan", "largest_batch", "plan"]
