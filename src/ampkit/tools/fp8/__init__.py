"""Tools for fp8 layers (``initialize(fp8=...)``, through torchao): which layers run
fp8 and why (:mod:`~ampkit.tools.fp8.decisions`), each layer's error
(:mod:`~ampkit.tools.fp8.errors`), which to convert (:mod:`~ampkit.tools.fp8.tune`) and
the casts they make (:mod:`~ampkit.tools.fp8.casts`)."""
