"""What ops a model runs, watched as it runs: operator statistics
(:mod:`~ampkit.tools.ops.op_stats`), the bytes cast below autograd
(:mod:`~ampkit.tools.ops.cast_traffic`), which list entries matched no call
(:mod:`~ampkit.tools.ops.list_usage`), the NaN/Inf checker with provenance
(:mod:`~ampkit.tools.ops.numerics_checker`), and the dispatch and module tracing they
share, which :func:`ampkit.compare` watches with too (:mod:`~ampkit.tools.ops.tracing`)."""
