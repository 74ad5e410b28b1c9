"""The autocast engine: regions that apply a policy to the ops run inside them, eager
and compiled. Imports ``ampkit.policies`` and ``ampkit.common``.

- ``regions``: ``ampkit.autocast``, the per-thread region stack, checkpoint carry,
  regions entered in compiled code;
- ``rules``: a policy's rules compiled per device, and the Python mode for composites;
- ``kernels``: ampkit's kernels on the dispatcher's Autocast keys for listed ops;
- ``casting``: ``amp_cast``, ``amp_multicast``, nested casts, the weight-cast cache;
- ``function_patching``: user functions with a fixed cast rule.

Example:
    >>> import torch
    >>> from ampkit.engine.regions import autocast
    >>> with autocast("cpu", torch.bfloat16):
    ...     (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
    torch.bfloat16
"""
