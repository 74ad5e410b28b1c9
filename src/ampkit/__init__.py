"""ampkit: Automatic Mixed Precision for PyTorch.

One small model for everything the AMP systems of PyTorch, apex, PaddlePaddle,
MindSpore and MXNet do: op-level autocast with custom lists, whole-model levels
O0-O3 with fp32 master weights, loss scaling, and drop-in dialects
(``ampkit.apex``, ``ampkit.paddle``, ``ampkit.mindspore``, ``ampkit.mxnet``,
``ampkit.torch``).

Example:
    >>> import torch
    >>> import ampkit
    >>> with ampkit.autocast("cpu", torch.bfloat16, custom_white_list={"add"}):
    ...     (torch.ones(2) + torch.ones(2)).dtype
    torch.bfloat16
"""

from ampkit.autocast_mode import autocast, current_policy
from ampkit.casting import amp_cast, amp_multicast, cast_tree
from ampkit.policy import Policy
from ampkit.presets import available_policies, get_policy, register_policy
from ampkit.registry import resolve_op, resolve_ops

__version__ = "0.1.0"

__all__ = [
    "Policy",
    "__version__",
    "amp_cast",
    "amp_multicast",
    "autocast",
    "available_policies",
    "cast_tree",
    "current_policy",
    "get_policy",
    "register_policy",
    "resolve_op",
    "resolve_ops",
]
