"""ampkit's tools: operator statistics, cast traffic, list usage (which list entries
matched no op call), the NaN/Inf checker with provenance, the fp32-vs-low-precision
comparison and policy tuning, the ``ampkit demo`` training report, the CLI, and for fp8
layers which run fp8 and why, their per-layer error, which to convert, and their casts.

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

from ampkit._lazy import lazy_exports

_LAZY = {
    "OpCallCounts": "ampkit.tools.op_stats",
    "OpStats": "ampkit.tools.op_stats",
    "Precision": "ampkit.tools.op_stats",
    "collect_op_stats": "ampkit.tools.op_stats",
    "CheckMode": "ampkit.tools.numerics_checker",
    "NonFiniteError": "ampkit.tools.numerics_checker",
    "NumericsChecker": "ampkit.tools.numerics_checker",
    "OpRecord": "ampkit.tools.numerics_checker",
    "DemoResult": "ampkit.tools.demo",
    "DemoSettings": "ampkit.tools.demo",
    "RunConfig": "ampkit.tools.demo",
    "RunResult": "ampkit.tools.demo",
    "demo_configurations": "ampkit.tools.demo",
    "run_demo": "ampkit.tools.demo",
    "training_code": "ampkit.tools.demo",
    "CastTraffic": "ampkit.tools.cast_traffic",
    "count_casts": "ampkit.tools.cast_traffic",
    "EntryUsage": "ampkit.tools.list_usage",
    "ListUsage": "ampkit.tools.list_usage",
    "list_usage": "ampkit.tools.list_usage",
    "ReportFiles": "ampkit.tools.report",
    "summary_table": "ampkit.tools.report",
    "write_report": "ampkit.tools.report",
    # ``compare`` and ``tune`` are this package's modules of those names; the functions
    # are ``ampkit.compare`` and ``ampkit.tune``.
    "Comparison": "ampkit.tools.compare",
    "write_comparison_report": "ampkit.tools.compare_report",
    "Trial": "ampkit.tools.tune",
    "TuneResult": "ampkit.tools.tune",
    "TuneWarning": "ampkit.tools.tune",
    "aggressive_policy": "ampkit.tools.tune",
    # fp8 (initialize(fp8=...), through torchao)
    "fp8_report": "ampkit.tools.fp8_decisions",
    "Fp8CastRecord": "ampkit.tools.fp8_casts",
    "Fp8CastWatch": "ampkit.tools.fp8_casts",
    "Fp8LayerError": "ampkit.tools.comparison",
    "fp8_layer_errors": "ampkit.tools.fp8_errors",
    "Fp8TuneResult": "ampkit.tools.fp8_tune",
    "tune_fp8": "ampkit.tools.fp8_tune",
}

__all__ = sorted(_LAZY)
__getattr__, __dir__ = lazy_exports("ampkit.tools", _LAZY, globals())
