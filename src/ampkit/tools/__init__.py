"""ampkit's tools: operator statistics, the ``ampkit demo`` training report, the CLI.

Names are imported on first use, so ``import ampkit.tools`` loads neither matplotlib
nor scikit-learn.

Example:
    >>> import torch
    >>> from ampkit import tools
    >>> with tools.collect_op_stats() as stats:
    ...     _ = torch.ones(2, dtype=torch.bfloat16) + 1
    >>> stats.low_precision_share
    1.0
"""

from __future__ import annotations

import importlib

_LAZY = {
    "OpCallCounts": "ampkit.tools.op_stats",
    "OpStats": "ampkit.tools.op_stats",
    "Precision": "ampkit.tools.op_stats",
    "collect_op_stats": "ampkit.tools.op_stats",
    "DemoResult": "ampkit.tools.demo",
    "DemoSettings": "ampkit.tools.demo",
    "RunConfig": "ampkit.tools.demo",
    "RunResult": "ampkit.tools.demo",
    "demo_configurations": "ampkit.tools.demo",
    "run_demo": "ampkit.tools.demo",
    "training_code": "ampkit.tools.demo",
    "ReportFiles": "ampkit.tools.report",
    "summary_table": "ampkit.tools.report",
    "write_report": "ampkit.tools.report",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ampkit.tools' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
