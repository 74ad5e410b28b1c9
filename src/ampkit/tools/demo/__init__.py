"""``ampkit demo``: the runs (:mod:`~ampkit.tools.demo.run`: a small CNN on
scikit-learn's digits in fp32 and at the AMP levels), its data and model
(:mod:`~ampkit.tools.demo.digits`), the pure-bf16 curves
(:mod:`~ampkit.tools.demo.pure_curves`) and the demo's report folder
(:mod:`~ampkit.tools.demo.report`)."""
