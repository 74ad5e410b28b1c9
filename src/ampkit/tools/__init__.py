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

from ampkit.common.lazy import lazy_exports

_LAZY = {
    "OpCallCounts": "ampkit.tools.ops.op_stats",
    "OpStats": "ampkit.tools.ops.op_stats",
    "Precision": "ampkit.tools.ops.op_stats",
    "collect_op_stats": "ampkit.tools.ops.op_stats",
    "CheckMode": "ampkit.tools.ops.numerics_checker",
    "NonFiniteError": "ampkit.tools.ops.numerics_checker",
    "NumericsChecker": "ampkit.tools.ops.numerics_checker",
    "OpRecord": "ampkit.tools.ops.numerics_checker",
    "DemoResult": "ampkit.tools.demo.run",
    "DemoSettings": "ampkit.tools.demo.run",
    "RunConfig": "ampkit.tools.demo.run",
    "RunResult": "ampkit.tools.demo.run",
    "demo_configurations": "ampkit.tools.demo.run",
    "run_demo": "ampkit.tools.demo.run",
    "training_code": "ampkit.tools.demo.run",
    "CastTraffic": "ampkit.tools.ops.cast_traffic",
    "count_casts": "ampkit.tools.ops.cast_traffic",
    "EntryUsage": "ampkit.tools.ops.list_usage",
    "ListUsage": "ampkit.tools.ops.list_usage",
    "list_usage": "ampkit.tools.ops.list_usage",
    "ReportFiles": "ampkit.tools.demo.report",
    "summary_table": "ampkit.tools.demo.report",
    "write_report": "ampkit.tools.demo.report",
    # The functions ``compare`` and ``tune`` are ``ampkit.compare`` and ``ampkit.tune``,
    # not attributes here: their modules live in ``ampkit.tools.accuracy``.
    "Comparison": "ampkit.tools.accuracy.compare",
    "write_comparison_report": "ampkit.tools.accuracy.compare_report",
    "Trial": "ampkit.tools.accuracy.tune",
    "TuneResult": "ampkit.tools.accuracy.tune",
    "TuneWarning": "ampkit.tools.accuracy.tune",
    "aggressive_policy": "ampkit.tools.accuracy.tune",
    # fp8 (initialize(fp8=...), through torchao)
    "fp8_report": "ampkit.tools.fp8.decisions",
    "Fp8CastRecord": "ampkit.tools.ops.fp8_casts",
    "Fp8CastWatch": "ampkit.tools.ops.fp8_casts",
    "Fp8LayerError": "ampkit.tools.accuracy.comparison",
    "fp8_layer_errors": "ampkit.tools.accuracy.fp8_errors",
    "Fp8TuneResult": "ampkit.tools.fp8.tune",
    "tune_fp8": "ampkit.tools.fp8.tune",
}

__all__ = sorted(_LAZY)
__getattr__, __dir__ = lazy_exports("ampkit.tools", _LAZY, globals())
