"""What an op list is: the op registry, its name tables, the immutable ``Policy`` and
the named presets. Imports ``ampkit.common`` only.

- ``registry``: canonical op names, entry points, resolving list entries, what each op
  is (compute, view, covered by native autocast) and its dispatcher schemas;
- ``op_names``: the registry's name tables as data (dunders, synonyms, module classes,
  framework aliases);
- ``policy``: ``Policy``, a frozen value of lists and dtypes;
- ``presets``: named policies (``"torch"``, ``"apex-o1"``, ...) and policy files.

Example:
    >>> from ampkit.policies.policy import Policy
    >>> Policy("mine", fp32_ops={"exp"}).fp32_ops
    frozenset({'exp'})
"""
