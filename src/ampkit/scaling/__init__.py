"""Loss scaling: static and dynamic scalers, overflow detection, skip-on-overflow,
several losses, and agreement across ranks.

* :class:`GradScaler` (:mod:`~ampkit.scaling.grad_scaler`): ``torch.amp.GradScaler``,
  drop-in, plus hysteresis, min/max scale, static mode, bfloat16/float16/float32
  gradients and distributed agreement.
* :class:`DynamicLossScale` / :class:`StaticLossScale`
  (:mod:`~ampkit.scaling.loss_scale`): immutable scale values (jmp, MindSpore, MXNet).
* :func:`configure_loss_scaling` / :func:`scale_loss` / :func:`loss_scaler`
  (:mod:`~ampkit.scaling.loss_scaling`): apex-style contexts with one scaler per loss
  id.
* :class:`ScaleSchedule` (:mod:`~ampkit.scaling.schedule`): the one rule all of them
  follow; :func:`all_finite` (:mod:`~ampkit.scaling.overflow`).

Example:
    >>> import torch
    >>> from ampkit.scaling import DynamicLossScale, all_finite
    >>> ls = DynamicLossScale(4.0, growth_interval=1)
    >>> float(ls.adjust(all_finite([torch.ones(1)])).loss_scale)
    8.0
"""

from ampkit.scaling.distributed import agree_on_overflow_
from ampkit.scaling.grad_scaler import GradScaler, OptState
from ampkit.scaling.loss_scale import DynamicLossScale, StaticLossScale
from ampkit.scaling.loss_scaling import (
    build_loss_scaler,
    configure_loss_scaling,
    load_loss_scaling_state_dict,
    loss_scaler,
    loss_scaling_state_dict,
    scale_loss,
)
from ampkit.scaling.overflow import all_finite, unscale_grads_
from ampkit.scaling.schedule import ScaleSchedule, update_scale_

__all__ = [
    "DynamicLossScale",
    "GradScaler",
    "OptState",
    "ScaleSchedule",
    "StaticLossScale",
    "agree_on_overflow_",
    "all_finite",
    "build_loss_scaler",
    "configure_loss_scaling",
    "load_loss_scaling_state_dict",
    "loss_scaler",
    "loss_scaling_state_dict",
    "scale_loss",
    "unscale_grads_",
    "update_scale_",
]
