"""Lightning: ``Trainer(plugins=[AmpkitPrecision(level="O2", dtype=torch.bfloat16)])``.

:class:`AmpkitPrecision` is a Lightning ``Precision`` plugin that hands each of
Lightning's precision hooks to the front door:

===============================  ==========================================================
Lightning hook                   ampkit call
===============================  ==========================================================
``convert_module``               move to the strategy's device, ``ampkit.initialize(module)``
``connect`` (optimizers made)    ``ampkit.initialize(module, optimizers)``
``forward_context`` (each step)  ``ampkit.autocast`` with the level's policy and lists
``pre_backward``                 ``GradScaler.scale(loss)`` (fp16 levels that scale)
``optimizer_step``               ``unscale_``, clipping hooks, ``step`` (skipped on
                                 inf/NaN), ``update``
``clip_grad_by_norm``            ``torch.nn.utils.clip_grad_norm_`` (fp32 gradients)
``state_dict`` (checkpoints)     the config (``ampkit_config``) and the scaler's state
===============================  ==========================================================

Configure it with an :class:`ampkit.AmpConfig` (``config=`` takes one or the path of a
config file) or with the same fields as typed parameters, which LightningCLI reads from
YAML and flags (``--trainer.plugins+=ampkit.integrations.lightning.AmpkitPrecision
--trainer.plugins.custom_black_list='[softmax]'``). The config is logged as
hyperparameters (``ampkit/<field>``) and saved in every checkpoint. With loss
scaling, ``amp/loss_scale`` and ``amp/skipped_steps`` are logged each step through
``LightningModule.log`` (so at the Trainer's ``log_every_n_steps``), and a
step-interval LR scheduler is not stepped on a skipped step (nor warned about)
unless ``step_scheduler_on_skip=True``. ``Trainer(precision=...)`` beside the plugin
is refused by Lightning itself ("Received both precision=... and plugins=...").

The checkpoint's ``state_dict`` holds the exact fp32 values at O2 (the parameters) and the
optimizer state is fp32, so ``trainer.fit(model, ckpt_path=...)``
continues a run exactly: the model is restored in fp32 before it is converted again.

Requires the ``lightning`` package (``pip install 'ampkit[lightning]'``); the older
``pytorch_lightning`` namespace is not supported.

Example:
    >>> import torch
    >>> from ampkit.integrations.lightning import AmpkitPrecision
    >>> plugin = AmpkitPrecision("O2", torch.float16, custom_black_list={"softmax"})
    >>> plugin.precision, plugin
    ('16-mixed', AmpkitPrecision(level='O2', dtype=torch.float16, custom_black_list=('softmax',)))
"""

from __future__ import annotations

import contextlib
import inspect
import typing
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ampkit import config as schema
from ampkit.common.arguments import default_device_type
from ampkit.config import AmpConfig, text_kind
from ampkit.integrations._settings import AmpkitSettings, missing_framework
from ampkit.integrations._versions import require_hooks
from ampkit.scaling.grad_scaler import scheduler_warning_suppressed

try:
    import lightning.pytorch as pl
    from lightning.pytorch.core.optimizer import _MockOptimizer
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
except ImportError as error:  # pragma: no cover - exercised without the extra
    raise ImportError(missing_framework("lightning", "lightning")) from error

require_hooks("lightning", "lightning", Precision, ("_after_closure",))

__all__ = ["AmpkitPrecision", "precision_signature"]


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
        level: ``"O0"``-``"O3"`` (see ``ampkit.conversion.levels``); ``None``: the config's, else
            ``"O2"``.
        dtype: ``torch.float16`` or ``torch.bfloat16`` (or their names); ``None`` is
            the config's, else the device's autocast default (bfloat16 on CPU,
            float16 on CUDA).
        config: an :class:`ampkit.AmpConfig`, the path of a config file (JSON/YAML),
            or a mapping of its fields (a YAML block under ``config:``); a parameter
            given as well must agree with it.
        step_scheduler_on_skip: step step-interval LR schedulers on steps skipped for
            an overflow too (default: they wait for a real optimizer step).
        **options: every other :class:`ampkit.AmpConfig` field (``policy``,
            ``custom_black_list``, ``hysteresis``, ...; ``None``: not given), each a
            typed parameter of the signature LightningCLI reads
            (:func:`precision_signature`, made from the fields), and the apex overrides
            ``ampkit.initialize`` takes (``cast_model_type``, ``patch_ops``).

    Don't pass ``precision=`` to the ``Trainer`` as well: Lightning refuses both at once.
    Strategies: single device and DDP. At O3 (no autocast region) call ``self(x)`` in
    ``training_step`` so the module's forward casts the inputs.

    Raises:
        TypeError: an unknown option, listing the accepted ones.
        ValueError: a bad level, dtype or option value, or a parameter that
            contradicts ``config`` (checked here, before training).

    Example:
        >>> import torch
        >>> from ampkit import AmpConfig
        >>> from ampkit.integrations.lightning import AmpkitPrecision
        >>> AmpkitPrecision("O3", torch.bfloat16).precision
        'bf16-true'
        >>> AmpkitPrecision(config=AmpConfig("O2", "float16", hysteresis=2))
        AmpkitPrecision(level='O2', dtype=torch.float16, hysteresis=2)
        >>> AmpkitPrecision("O2", torch.bfloat16, init_scale=1024.0)
        Traceback (most recent call last):
        ...
        ValueError: AmpkitPrecision: ['init_scale'] set up loss scaling, but level O2 ...
    """

    def __init__(self, level: str | None = None, dtype: torch.dtype | str | None = None,
                 *, config: Any = None, step_scheduler_on_skip: bool = False,
                 **options: Any) -> None:
        # The AmpConfig fields arrive in ``options``; the signature LightningCLI reads
        # (jsonargparse) lists each as a typed parameter: see _signature below.
        self._settings = AmpkitSettings.build(level, dtype, options,
                                              owner="AmpkitPrecision", config=config)
        props = self._settings.properties(None)
        self.precision = _LIGHTNING_NAMES[(props.level.value, props.dtype)]  # type: ignore[assignment]
        self.step_scheduler_on_skip = bool(step_scheduler_on_skip)
        self.scaler: Any = None
        self._module: torch.nn.Module | None = None
        self._device_type: str | None = None

    @property
    def config(self) -> AmpConfig:
        """The :class:`ampkit.AmpConfig` this plugin trains with.

        Example:
            >>> from ampkit.integrations.lightning import AmpkitPrecision
            >>> AmpkitPrecision("O3", "bfloat16").config.level
            'O3'
        """
        return self._settings.config

    @property
    def device(self) -> str:
        """The device type the autocast regions run on, as on Lightning's own
        ``MixedPrecision``: the converted module's (``"cpu"``, ``"cuda"``, ...); before
        the Trainer converts one, the default device (``"cuda"`` when available, else
        ``"cpu"``).

        Example:
            >>> import torch
            >>> from ampkit.integrations.lightning import AmpkitPrecision
            >>> plugin = AmpkitPrecision("O1", torch.bfloat16)
            >>> _ = plugin.convert_module(torch.nn.Linear(2, 2))
            >>> plugin.device
            'cpu'
        """
        return self._device_type or default_device_type()

    def __repr__(self) -> str:
        return f"AmpkitPrecision({self._settings.describe()})"

    # -- set-up -----------------------------------------------------------------------

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Move ``module`` to the strategy's device (so the fp32 parameters are
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
            for logger in trainer.loggers:  # merged with the module's own hparams
                logger.log_hyperparams(self.config.hyperparameters())
        self._device_type = next((p.device.type for p in module.parameters()), "cpu")
        self._module = self._settings.initialize(module)
        if self.scaler is None:  # a second fit() keeps the scale it reached
            self.scaler = self._settings.make_scaler(self._device_type)
        return self._module

    def connect(self, model: torch.nn.Module, optimizers: list[Any],
                lr_schedulers: list[Any]) -> tuple[torch.nn.Module, list[Any], list[Any]]:
        """Hand the optimizers to ``ampkit.initialize`` (in place, so schedulers keep working)."""
        real = [opt for opt in optimizers if not isinstance(opt, _MockOptimizer)]
        if real and self._module is not None:
            self._settings.initialize(self._module, real)
            self._guard_schedulers(self._module)
        return model, optimizers, lr_schedulers

    def _guard_schedulers(self, module: torch.nn.Module) -> None:
        """Route the module's ``lr_scheduler_step`` hook through the scaler: a
        step-interval scheduler waits out a skipped step (torch's scheduler would
        otherwise warn that it stepped before the optimizer, and move on)."""
        hook: Any = getattr(module, "lr_scheduler_step")  # noqa: B009 - typed Any on purpose
        if getattr(hook, "_ampkit_guard", False):
            return

        def lr_scheduler_step(scheduler: Any, metric: Any = None) -> None:
            trainer = getattr(module, "_trainer", None)
            configs = trainer.lr_scheduler_configs if trainer is not None else []
            per_step = any(c.scheduler is scheduler and c.interval == "step"
                           for c in configs)
            if (per_step and self.scaler is not None and not self.step_scheduler_on_skip
                    and self.scaler.last_step_skipped):
                return
            with scheduler_warning_suppressed():
                hook(scheduler, metric)

        lr_scheduler_step._ampkit_guard = True  # type: ignore[attr-defined]
        # an instance attribute: not in the module's state_dict, gone with the module
        setattr(module, "lr_scheduler_step", lr_scheduler_step)  # noqa: B010

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
        with self._settings.autocast(self.device):
            yield

    def autocast_context_manager(self) -> contextlib.AbstractContextManager[None]:
        """The level's autocast region as one context manager (what Lightning's own
        ``MixedPrecision.autocast_context_manager`` gives): the region
        :meth:`forward_context` opens.

        Example:
            >>> import torch
            >>> from ampkit.integrations.lightning import AmpkitPrecision
            >>> with AmpkitPrecision("O1", torch.bfloat16).autocast_context_manager():
            ...     (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
            torch.bfloat16
        """
        return self._settings.autocast(self.device)

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
        for name, value in self.scaler.metrics().items():  # tensors: read when written
            model.log(f"amp/{name}", value, on_step=True, on_epoch=False)
        return out

    def clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        """Clip the gradients the step uses (the fp32 parameters' at O2)."""
        torch.nn.utils.clip_grad_norm_(
            [p for g in optimizer.param_groups for p in g["params"]], clip_val)

    # -- checkpoints ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The config (``ampkit_config``, as :meth:`ampkit.AmpConfig.to_dict`) and the
        scaler's state, if any.

        Example:
            >>> import torch
            >>> from ampkit.integrations.lightning import AmpkitPrecision
            >>> AmpkitPrecision("O2", torch.bfloat16).state_dict()["ampkit_config"]["level"]
            'O2'
            >>> plugin = AmpkitPrecision("O2", torch.float16, init_scale=8.0)
            >>> _ = plugin.convert_module(torch.nn.Linear(2, 2))  # makes the scaler
            >>> plugin.state_dict()["scale"]
            8.0
        """
        state = {"ampkit_config": self.config.to_dict()}
        if self.scaler is not None:
            state.update(self.scaler.state_dict())
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the scaler's state from a checkpoint.

        Raises:
            ValueError: the checkpoint holds a scaler's state but this plugin's level
                scales no loss.
        """
        # the saved config is a record of the run; the plugin's own settings rule
        state_dict = {k: v for k, v in state_dict.items() if k != "ampkit_config"}
        if not state_dict:
            return
        if self.scaler is None:
            raise ValueError(f"the checkpoint holds a loss scaler's state, but {self!r} "
                             f"does not scale the loss; resume with the settings it was "
                             f"saved with")
        self.scaler.load_state_dict(state_dict)


def precision_signature() -> inspect.Signature:
    """:class:`AmpkitPrecision`'s signature as LightningCLI (jsonargparse) reads it: a
    typed keyword parameter for each of :class:`ampkit.AmpConfig`'s fields, read when
    called (``level`` and ``dtype`` first, positional too), its type the field's with
    the text a YAML file or a flag gives (:func:`ampkit.config.text_kind`), ``None``
    when not given; then ``config``, ``step_scheduler_on_skip`` and the apex overrides
    (``**options``).

    Example:
        >>> from ampkit.integrations.lightning import precision_signature
        >>> precision_signature().parameters["hysteresis"]
        <Parameter "hysteresis: int | None = None">
    """
    param = inspect.Parameter
    hints = typing.get_type_hints(schema.AmpConfig)
    positional = [param("self", param.POSITIONAL_OR_KEYWORD)]
    # config: Any, not AmpConfig | str: shown the dataclass, LightningCLI (jsonargparse)
    # would read a file path itself into an AmpConfig it cannot build; the accepted
    # types are checked when the plugin is made.
    keywords = [param("config", param.KEYWORD_ONLY, default=None, annotation=Any)]
    for f in schema.config_fields():
        kind = text_kind(f.name)
        if kind is list:
            annotation: Any = list[str] | None
        elif kind is str:
            annotation = hints[f.name] | str | None
        else:
            annotation = hints[f.name] if f.default is False else hints[f.name] | None
        default = False if f.default is False else None
        if f.name in ("level", "dtype"):
            positional.append(param(f.name, param.POSITIONAL_OR_KEYWORD, default=default,
                                    annotation=annotation))
        else:
            keywords.append(param(f.name, param.KEYWORD_ONLY, default=default,
                                  annotation=annotation))
    keywords.append(param("step_scheduler_on_skip", param.KEYWORD_ONLY, default=False,
                          annotation=bool))
    return inspect.Signature([*positional, *keywords,
                              param("options", param.VAR_KEYWORD, annotation=Any)])


# what LightningCLI reads: the parameters made from AmpConfig's fields
AmpkitPrecision.__init__.__signature__ = precision_signature()  # type: ignore[attr-defined]
