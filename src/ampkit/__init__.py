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

from ampkit.common.lazy import lazy_exports
from ampkit.engine.casting import amp_cast, amp_multicast, cast_tree
from ampkit.engine.regions import autocast, current_policy, release_kernels
from ampkit.policies.policy import Policy
from ampkit.policies.presets import (
    available_policies,
    get_policy,
    register_policy,
    unregister_policy,
)
from ampkit.policies.registry import native_op_names, resolve_op, resolve_ops

__version__ = "0.1.0"

# Layers below the engine are imported on first use, so ``import ampkit`` stays light.
_LAZY = {
    # precision levels, model conversion, pure bf16, front door
    "Level": "ampkit.conversion.levels",
    "LevelProperties": "ampkit.conversion.levels",
    "level_properties": "ampkit.conversion.levels",
    "describe_levels": "ampkit.conversion.levels",
    "reuse_casts": "ampkit.conversion.parameter_casts",
    "device_supports_dtype": "ampkit.common.device_support",
    "clip_each_gradient": "ampkit.step_in_backward",
    "field_help": "ampkit.config",
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
# (``ampkit.tools.count_casts()``, ``ampkit.fsdp.prepare_optimizer()``), as the README
# and docs use them; each is imported on first use.
_SUBMODULES = (
    "tools", "config", "integrations", "dialects", "scaling", "conversion", "front_door",
    "pure", "common", "policies", "engine", "fsdp", "fp8", "step_in_backward",
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
    "clip_each_gradient",
    "convert_model",
    "describe_levels",
    "device_supports_dtype",
    "field_help",
    "initialize",
    "native_op_names",
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
    "release_kernels",
    "resolve_op",
    "resolve_ops",
    "reuse_casts",
    "unregister_policy",
]
