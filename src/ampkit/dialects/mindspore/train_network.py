"""MindSpore's ``build_train_network``: a module whose every call runs one training
step (forward through the loss, scaled backward, a step skipped on overflow), at a
level's casts and with a loss-scale manager.

Example:
    >>> import torch
    >>> from ampkit.dialects.mindspore.train_network import build_train_network
    >>> net = torch.nn.Linear(2, 1)
    >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
    >>> step = build_train_network(net, opt, torch.nn.MSELoss(), level="O0")
    >>> step(torch.ones(3, 2), torch.zeros(3, 1)).dtype
    torch.float32
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ampkit.dialects.mindspore.managers import (
    DynamicLossScaleManager,
    FixedLossScaleManager,
    LossScaleManager,
)
from ampkit.dialects.mindspore.mixed_precision import auto_mixed_precision, check_network
from ampkit.pure.optimizer import needs_closure
from ampkit.scaling.grad_scaler import GradScaler
from ampkit.scaling.overflow import unscale_grads_

__all__ = ["build_train_network"]


# -- build_train_network ------------------------------------------------------------------

_TRAIN_LEVELS: dict[str, dict[str, Any]] = {
    "O0": {"keep_batchnorm_fp32": False, "cast_model_type": torch.float32},
    "O1": {"keep_batchnorm_fp32": False, "cast_model_type": torch.float32},
    "O2": {"keep_batchnorm_fp32": True, "cast_model_type": torch.float16},
    "O3": {"keep_batchnorm_fp32": False, "cast_model_type": torch.float16},
}
_TRAIN_KWARGS = ("cast_model_type", "keep_batchnorm_fp32", "loss_scale_manager")
_MODEL_TYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class _WithLossCell(nn.Module):
    """``loss_fn(network(data), label)``, the output and label cast to float32 first
    when the network computes in low precision (MindSpore's loss cell)."""

    def __init__(self, network: nn.Module, loss_fn: nn.Module, cast_to_fp32: bool) -> None:
        super().__init__()
        self.network = network
        self.loss_fn = loss_fn
        self.cast_to_fp32 = cast_to_fp32

    def forward(self, data: Any, label: Any) -> torch.Tensor:
        out = self.network(data)
        if self.cast_to_fp32:
            out = out.float() if out.is_floating_point() else out
            label = label.float() if label.is_floating_point() else label
        loss: torch.Tensor = self.loss_fn(out, label)
        return loss


def _sens_backward(loss: torch.Tensor) -> None:
    """MindSpore's backward from a (scaled) loss: the gradient it starts from ("sens")
    is one at every element of the loss, so a per-sample loss (reduction ``'none'``,
    MindSpore's default) back-propagates the gradient of its sum, a scalar loss that
    of itself."""
    loss.backward(torch.ones_like(loss))


class _TrainOneStep(nn.Module):
    """One training step per call: forward, (scaled) backward, (skipped) update.

    Returns the loss, or ``(loss, overflow, scale)`` when the loss-scale manager may
    skip steps (MindSpore's ``TrainOneStepWithLossScaleCell``). Any
    ``torch.optim.Optimizer`` steps: one whose ``step`` needs a closure
    (``LBFGS``) gets one that re-runs the forward and backward."""

    def __init__(self, network: nn.Module, optimizer: torch.optim.Optimizer,
                 manager: LossScaleManager | None) -> None:
        super().__init__()
        self.network = network
        self.optimizer = optimizer
        self.manager = manager
        self.scaler: GradScaler | None = None
        if isinstance(manager, DynamicLossScaleManager):
            self.scaler = GradScaler(None, init_scale=manager.get_loss_scale(),
                                     growth_factor=manager.scale_factor,
                                     backoff_factor=1.0 / manager.scale_factor,
                                     growth_interval=manager.scale_window, min_scale=1.0)
        elif isinstance(manager, FixedLossScaleManager) and manager.get_drop_overflow_update():
            self.scaler = GradScaler(None, init_scale=manager.get_loss_scale(), dynamic=False)
        if self.scaler is not None and needs_closure(optimizer):
            raise ValueError(
                f"optimizer: {type(optimizer).__name__}.step needs a closure, which a loss "
                f"scale that skips overflowing steps cannot give it; pass "
                f"loss_scale_manager=None or FixedLossScaleManager(drop_overflow_update="
                f"False), or an optimizer whose step takes no closure")

    def forward(self, *inputs: Any) -> Any:
        scaler = self.scaler
        if scaler is not None:
            self.optimizer.zero_grad(set_to_none=True)
            loss = self.network(*inputs)
            _sens_backward(scaler.scale(loss))
            scaler.step(self.optimizer)
            overflow = scaler.last_step_skipped
            scale = torch.tensor(scaler.get_scale())
            scaler.update()
            return loss.detach(), torch.tensor(overflow), scale
        fixed = (self.manager.get_loss_scale()
                 if isinstance(self.manager, FixedLossScaleManager) else None)

        losses: list[torch.Tensor] = []

        def closure() -> torch.Tensor:
            self.optimizer.zero_grad(set_to_none=True)
            with torch.enable_grad():
                loss: torch.Tensor = self.network(*inputs)
                if fixed is None:
                    _sens_backward(loss)
                else:
                    # A fixed scale that never drops a step: scale, unscale, apply
                    # regardless.
                    _sens_backward(loss * fixed)
                    params = [p for g in self.optimizer.param_groups for p in g["params"]]
                    unscale_grads_((p.grad for p in params), torch.tensor(1.0 / fixed),
                                   torch.zeros(()))
            losses.append(loss.detach())
            # LBFGS compares the closure's values: the summed loss, what was derived.
            return loss.detach().sum()

        if needs_closure(self.optimizer):
            self.optimizer.step(closure)  # type: ignore[arg-type]  # a 0-dim tensor
        else:
            closure()
            self.optimizer.step()
        # The loss at the parameters the step started from (LBFGS evaluates it more
        # than once).
        return losses[0]

def build_train_network(network: nn.Module, optimizer: torch.optim.Optimizer,
                        loss_fn: nn.Module | None = None, level: str = "O0",
                        boost_level: str = "O0", **kwargs: Any) -> nn.Module:
    """MindSpore's ``build_train_network``: a module whose every call runs one training
    step of ``network`` (with ``loss_fn`` when given: called as ``(data, label)``).

    Levels: O0 and O1 keep float32 parameters and no loss scaling (O1 casts the white
    list); O2 computes in float16 with BatchNorm and LayerNorm in float32 and a
    :class:`DynamicLossScaleManager`; O3 computes everything in float16 without loss
    scaling. At O2 and O3 every floating input is cast, float64 included.

    A per-sample loss (reduction ``'none'``, MindSpore's default) back-propagates the
    gradient of its sum, as MindSpore's backward starts from ones. Any
    ``torch.optim.Optimizer`` steps; one whose ``step`` needs a closure (``LBFGS``) is
    given one, except with a loss scale that skips overflowing steps (a ``ValueError``).

    Args:
        network: the network (fp32).
        optimizer: its optimizer.
        loss_fn: the loss.
        level: ``"O0"``, ``"O1"``, ``"O2"`` or ``"O3"``.
        boost_level: only ``"O0"`` (MindSpore's boost algorithms are not translated).
        **kwargs: ``cast_model_type`` (``torch.float16``, ``torch.bfloat16``,
            ``torch.float32``), ``keep_batchnorm_fp32`` (bool), ``loss_scale_manager``
            (a :class:`LossScaleManager` or ``None``).

    Returns:
        A module: ``step(*inputs)`` returns the loss, or ``(loss, overflow, scale)``
        when its loss-scale manager skips overflowing steps.

    Raises:
        TypeError: bad network, optimizer, loss function or keyword types.
        ValueError: a bad level, boost_level, keyword name or value; an optimizer
            that holds none of the network's parameters.

    Example:
        >>> import torch
        >>> import ampkit.mindspore as amp
        >>> net = torch.nn.Linear(4, 3)
        >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
        >>> step = amp.build_train_network(net, opt, torch.nn.CrossEntropyLoss(), "O2",
        ...                                cast_model_type=torch.bfloat16)
        >>> loss, overflow, scale = step(torch.rand(8, 4), torch.randint(0, 3, (8,)))
        >>> loss.dtype, bool(overflow), float(scale)
        (torch.float32, False, 16777216.0)
        >>> net = torch.nn.Linear(4, 3)
        >>> per_sample = torch.nn.CrossEntropyLoss(reduction="none")
        >>> step = amp.build_train_network(net, torch.optim.LBFGS(net.parameters()),
        ...                                per_sample)
        >>> step(torch.rand(8, 4), torch.randint(0, 3, (8,))).shape
        torch.Size([8])
    """
    check_network(network)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    own = list(network.parameters())
    if own and not any(id(p) in held for p in own):
        # Every step would leave the network as it is (a call that does nothing). A
        # network without parameters of its own may reach the optimizer's through its
        # forward, so it is not refused.
        raise ValueError(f"optimizer: the {type(optimizer).__name__} holds none of the "
                         f"network's {len(own)} parameters, so "
                         f"no step would change the network; build it from "
                         f"network.parameters()")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be None or callable, got {type(loss_fn).__name__}")
    if level not in _TRAIN_LEVELS:
        raise ValueError(f"level must be one of {list(_TRAIN_LEVELS)}, got {level!r}")
    if boost_level != "O0":
        raise ValueError(f"boost_level: only 'O0' is supported (MindSpore's boost "
                         f"algorithms have no ampkit counterpart), got {boost_level!r}")
    unknown = sorted(set(kwargs) - set(_TRAIN_KWARGS))
    if unknown:
        raise ValueError(f"unsupported keyword(s) {unknown}; accepted: {list(_TRAIN_KWARGS)}")
    config = {**_TRAIN_LEVELS[level], "loss_scale_manager":
              DynamicLossScaleManager() if level == "O2" else None, **kwargs}
    model_type = config["cast_model_type"]
    if isinstance(model_type, str):
        model_type = _MODEL_TYPES.get(model_type, model_type)
    if model_type not in _MODEL_TYPES.values():
        raise ValueError(f"cast_model_type must be torch.float16, torch.bfloat16 or "
                         f"torch.float32, got {config['cast_model_type']!r}")
    if not isinstance(config["keep_batchnorm_fp32"], bool):
        raise TypeError(f"keep_batchnorm_fp32 must be a bool, got "
                        f"{type(config['keep_batchnorm_fp32']).__name__}")
    manager = config["loss_scale_manager"]
    if manager is not None and not isinstance(manager, FixedLossScaleManager
                                              | DynamicLossScaleManager):
        raise TypeError(f"loss_scale_manager must be None, a FixedLossScaleManager or a "
                        f"DynamicLossScaleManager, got {type(manager).__name__}")
    low = model_type is not torch.float32
    if level == "O1":
        auto_mixed_precision(network, "O1", torch.float16)
    elif low:
        auto_mixed_precision(network, "O2" if config["keep_batchnorm_fp32"] else "O3",
                             model_type)
    if loss_fn is not None:
        network = _WithLossCell(network, loss_fn, cast_to_fp32=low)
    return _TrainOneStep(network, optimizer, manager)
