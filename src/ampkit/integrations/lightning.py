"""Lightning: ``Trainer(plugins=[AmpkitPrecision(level="O2", dtype=torch.bfloat16)])``.

:class:`AmpkitPrecision` is a Lightning ``Precision`` plugin that hands each of
Lightning's precision hooks to the front door:

===============================  ==========================================================
Lightning hook                   ampkit call
===============================  ==========================================================
``convert_module``               move to the strategy's device, ``ampkit.initialize(module)``
``connect`` (optimizers made)    ``ampkit.initialize(module, optimizers)``: fp32 masters
``forward_context`` (each step)  ``ampkit.autocast`` with the level's policy and lists
``pre_backward``                 ``GradScaler.scale(loss)`` (fp16 levels that scale)
``optimizer_step``               ``unscale_``, clipping hooks, ``step`` (skipped on
                                 inf/NaN), ``update``
``clip_grad_by_norm``            ``ampkit.clip_master_grad_norm_`` (on the fp32 masters)
``state_dict`` (checkpoints)     the scaler's ``state_dict``
===============================  ==========================================================

The checkpoint's ``state_dict`` holds the exact fp32 values at O2 (the masters) and the
optimizer state is the masters' (fp32), so ``trainer.fit(model, ckpt_path=...)``
continues a run exactly: the model is restored in fp32 before it is converted again.

Requires the ``lightning`` package (``pip install 'ampkit[lightning]'``); the older
``pytorch_lightning`` namespace is not supported.

Example:
    >>> import torch
    >>> from ampkit.integrations.lightning import AmpkitPrecision
    >>> plugin = AmpkitPrecision("O2", torch.float16, custom_black_list={"softmax"})
    >>> plugin.precision, plugin
    ('16-mixed', AmpkitPrecision(level='O2', dtype=torch.float16, custom_black_list={'softmax'}))
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ampkit.integrations._settings import AmpkitSettings, missing_framework

try:
    import lightning.pytorch as pl
    from lightning.pytorch.core.optimizer import _MockOptimizer
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
except ImportError as error:  # pragma: no cover - exercised without the extra
    raise ImportError(missing_framework("lightning", "lightning")) from error

__all__ = ["AmpkitPrecision"]

# Lightning's own words for what each level does, so that Lightning code reading
# ``trainer.precision`` (model summary, throughput monitor) sees the right dtype.
_LIGHTNING_NAMES = {("O0", torch.float16): "32-true", ("O0", torch.bfloat16): "32-true",
                    ("O1", torch.float16): "16-mixed", ("O1", torch.bfloat16): "bf16-mixed",
                    ("O2", torch.float16): "16-mixed", ("O2", torch.bfloat16): "bf16-mixed",
                    ("O3", torch.float16): "16-true", ("O3", torch.bfloat16): "bf16-true"}
_STRATEGIES = (SingleDeviceStrategy, DDPStrategy)


class AmpkitPrecision(Precision):
    """A Lightning ``Precision`` plugin that trains at an ampkit level.

    Args:
        level: ``"O0"``-``"O3"`` (see ``ampkit.levels``); ``"O2"`` by default.
        dtype: ``torch.float16`` or ``torch.bfloat16``; ``None`` is the device's
            autocast default (bfloat16 on CPU, float16 on CUDA).
        **options: ``ampkit.initialize`` overrides (``custom_white_list``,
            ``custom_black_list``, ``policy``, ``keep_fp32_modules``, ``loss_scale``,
            ``master_weights``, ...) and ``ampkit.GradScaler`` options for levels that
            scale the loss (``init_scale``, ``growth_factor``, ``backoff_factor``,
            ``growth_interval``, ``hysteresis``, ``min_scale``, ``max_scale``).

    Don't pass ``precision=`` to the ``Trainer`` as well: Lightning refuses both at once.
    Strategies: single device and DDP. At O3 (no autocast region) call ``self(x)`` in
    ``training_step`` so the module's forward casts the inputs.

    Raises:
        TypeError: an unknown option, listing the accepted ones.
        ValueError: a bad level, dtype or option value (checked here, before training).

    Example:
        >>> import torch
        >>> from ampkit.integrations.lightning import AmpkitPrecision
        >>> AmpkitPrecision("O3", torch.bfloat16).precision
        'bf16-true'
        >>> AmpkitPrecision("O2", torch.bfloat16, init_scale=1024.0)
        Traceback (most recent call last):
        ...
        ValueError: AmpkitPrecision: ['init_scale'] set up loss scaling, but level O2 ...
    """

    def __init__(self, level: str = "O2", dtype: torch.dtype | str | None = None,
                 **options: Any) -> None:
        self._settings = AmpkitSettings.build(level, dtype, options, owner="AmpkitPrecision")
        props = self._settings.properties(None)
        self.precision = _LIGHTNING_NAMES[(props.level.value, props.dtype)]  # type: ignore[assignment]
        self.scaler: Any = None
        self._module: torch.nn.Module | None = None
        self._device_type: str | None = None

    def __repr__(self) -> str:
        return f"AmpkitPrecision({self._settings.describe()})"

    # -- set-up -----------------------------------------------------------------------

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Move ``module`` to the strategy's device (so the fp32 masters are made
        there) and convert it with ``ampkit.initialize``.

        Raises:
            RuntimeError: a strategy other than single-device or DDP.

        Example:
            >>> import torch
            >>> from ampkit.integrations.lightning import AmpkitPrecision
            >>> net = AmpkitPrecision("O2", torch.float16).convert_module(
            ...     torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2)))
            >>> net[0].weight.dtype, net[1].weight.dtype
            (torch.float32, torch.float32)
        """
        trainer = getattr(module, "_trainer", None)
        if trainer is not None:
            strategy = trainer.strategy
            if not isinstance(strategy, _STRATEGIES):
                raise RuntimeError(f"AmpkitPrecision supports the single-device and DDP "
                                   f"strategies, got {type(strategy).__name__}; FSDP and "
                                   f"DeepSpeed bring their own precision plugins")
            module.to(strategy.root_device)
        self._device_type = next((p.device.type for p in module.parameters()), "cpu")
        self._module = self._settings.initialize(module)
        if self.scaler is None:  # a second fit() keeps the scale it reached
            self.scaler = self._settings.make_scaler(self._device_type)
        return self._module

    def connect(self, model: torch.nn.Module, optimizers: list[Any],
                lr_schedulers: list[Any]) -> tuple[torch.nn.Module, list[Any], list[Any]]:
        """Make the optimizers keep fp32 masters (in place, so schedulers keep working)."""
        real = [opt for opt in optimizers if not isinstance(opt, _MockOptimizer)]
        if real and self._module is not None:
            self._settings.initialize(self._module, real)
        return model, optimizers, lr_schedulers

    # -- each step --------------------------------------------------------------------

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        """The level's autocast region around training, validation, test and predict
        steps (none at O0/O3), so losses computed in the step follow the policy too.

        Example:
            >>> import torch
            >>> from ampkit.integrations.lightning import AmpkitPrecision
            >>> plugin = AmpkitPrecision("O1", torch.bfloat16, custom_white_list={"add"})
            >>> with plugin.forward_context():
            ...     (torch.ones(2) + torch.ones(2)).dtype
            torch.bfloat16
        """
        with self._settings.autocast(self._device_type or "cpu"):
            yield

    def pre_backward(self, tensor: torch.Tensor, module: pl.LightningModule) -> torch.Tensor:  # type: ignore[override]
        """Scale the loss when the level scales it."""
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        return super().pre_backward(tensor, module)

    def optimizer_step(self, optimizer: Any, model: pl.LightningModule,  # type: ignore[override]
                       closure: Callable[[], Any], **kwargs: Any) -> Any:
        """Run the closure, unscale, let Lightning clip, then step unless a gradient
        overflowed, and update the scale."""
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        if isinstance(optimizer, torch.optim.LBFGS):
            raise RuntimeError("AmpkitPrecision with loss scaling cannot step LBFGS (its "
                               "closure re-runs backward inside step); use bfloat16 or "
                               "loss_scale=None")
        closure_result = closure()
        # automatic optimization with a training_step that returned None: no backward ran
        skipped = closure_result is None and model.automatic_optimization
        if not skipped:
            self.scaler.unscale_(optimizer)
        self._after_closure(model, optimizer)  # on_before_optimizer_step hooks and clipping
        if skipped:
            return closure_result
        out = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        return out

    def clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        """Clip the gradients the step uses (the fp32 masters' at O2)."""
        torch.nn.utils.clip_grad_norm_(
            [p for g in optimizer.param_groups for p in g["params"]], clip_val)

    # -- checkpoints ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state (``{}`` without loss scaling).

        Example:
            >>> import torch
            >>> from ampkit.integrations.lightning import AmpkitPrecision
            >>> AmpkitPrecision("O2", torch.bfloat16).state_dict()
            {}
            >>> plugin = AmpkitPrecision("O2", torch.float16, init_scale=8.0)
            >>> _ = plugin.convert_module(torch.nn.Linear(2, 2))  # makes the scaler
            >>> plugin.state_dict()["scale"]
            8.0
        """
        return {} if self.scaler is None else self.scaler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the scaler's state from a checkpoint.

        Raises:
            ValueError: the checkpoint holds a scaler's state but this plugin's level
                scales no loss.
        """
        if not state_dict:
            return
        if self.scaler is None:
            raise ValueError(f"the checkpoint holds a loss scaler's state, but {self!r} "
                             f"does not scale the loss; resume with the settings it was "
                             f"saved with")
        self.scaler.load_state_dict(state_dict)
