"""How far low precision moves a model from float32, and what to do about it: the
results (:mod:`~ampkit.tools.accuracy.comparison`), the fp32-vs-low-precision runs
behind ``ampkit.compare`` (:mod:`~ampkit.tools.accuracy.compare`), their HTML report
(:mod:`~ampkit.tools.accuracy.compare_report`) and the policy search behind
``ampkit.tune`` (:mod:`~ampkit.tools.accuracy.tune`)."""
