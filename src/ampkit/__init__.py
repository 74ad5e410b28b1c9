"""ampkit: Automatic Mixed Precision for PyTorch.

One small model for everything the AMP systems of PyTorch, apex, PaddlePaddle,
MindSpore and MXNet do: op-level autocast with custom lists, whole-model levels
O0-O3 (the fp32 parameters stay the truth), loss scaling, and drop-in dialects
(``ampkit.apex``, ``ampkit.paddle``, ``ampkit.mindspore``, ``ampkit.mxnet``,
``ampkit.torch``).

Example:
    >>> import torch
    >>> import ampkit
    >>> with ampkit.autocast("cpu", torch.bfloat16, custom_white_list={"add"}):
    ...     (torch.ones(2) + torch.ones(2)).dtype
    torch.bfloat16
"""

from ampkit._lazy import lazy_exports
from ampkit.autocast_mode import autocast, current_policy
from ampkit.casting import amp_cast, amp_multicast, cast_tree
from ampkit.policy import Policy
from ampkit.presets import available_policies, get_policy, register_policy, unregister_policy
from ampkit.registry import resolve_op, resolve_ops

__version__ = "0.1.0"

# Layers below the engine are imported on first use, so ``import ampkit`` stays light.
_LAZY = {
    # precision levels, model conversion, pure bf16, front door
    "Level": "ampkit.levels",
    "LevelProperties": "ampkit.levels",
    "level_properties": "ampkit.levels",
    "convert_model": "ampkit.front_door",
    "PureLowPrecisionOptimizer": "ampkit.pure",
    "initialize": "ampkit.front_door",
    "AmpConfig": "ampkit.config",
    # loss scaling
    "GradScaler": "ampkit.scaling.grad_scaler",
    "StaticLossScale": "ampkit.scaling.loss_scale",
    "DynamicLossScale": "ampkit.scaling.loss_scale",
    "scale_loss": "ampkit.scaling.loss_scaling",
    "configure_loss_scaling": "ampkit.scaling.loss_scaling",
    # tools
    "collect_op_stats": "ampkit.tools.ops.op_stats",
    "NumericsChecker": "ampkit.tools.ops.numerics_checker",
    "CheckMode": "ampkit.tools.ops.numerics_checker",
    "compare": "ampkit.tools.accuracy.compare",
    "tune": "ampkit.tools.accuracy.tune",
    "plan": "ampkit.tools.plan.simulate",
}


# Modules and subpackages reachable as attributes after a plain ``import ampkit``
# (``ampkit.tools.count_casts()``, ``ampkit.levels.describe_levels()``), as the README
# and docs use them; each is imported on first use.
_SUBMODULES = (
    "tools", "config", "levels", "integrations", "dialects", "scaling", "conversion", "front_door",
    "pure", "master_weights_pure", "policy", "presets", "registry", "casting",
    "autocast_mode", "function_patching", "fsdp", "parameter_casts", "parameter_truth",
    "fp8", "device_support", "step_in_backward",
    # the dialects' import names
    "apex", "paddle", "mindspore", "mxnet", "torch",
)

__getattr__, __dir__ = lazy_exports("ampkit", _LAZY, globals(), _SUBMODULES)

__all__ = [
    "AmpConfig",
    "CheckMode",
    "DynamicLossScale",
    "GradScaler",
    "Level",
    "LevelProperties",
    "NumericsChecker",
    "Policy",
    "PureLowPrecisionOptimizer",
    "StaticLossScale",
    "collect_op_stats",
    "compare",
    "configure_loss_scaling",
    "convert_model",
    "initialize",
    "level_properties",
    "plan",
    "scale_loss",
    "tune",
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
    "unregister_policy",
]
