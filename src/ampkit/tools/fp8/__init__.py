"""Tools for fp8 layers (``initialize(fp8=...)``, through torchao): which layers run
fp8 and why (:mod:`~ampkit.tools.fp8.decisions`) and which to convert
(:mod:`~ampkit.tools.fp8.tune`). They build on the rooms below them: each layer's error
is measured with the accuracy tools (:mod:`~ampkit.tools.accuracy.fp8_errors`), and the
casts the layers make are watched with the op tools
(:mod:`~ampkit.tools.ops.fp8_casts`)."""
