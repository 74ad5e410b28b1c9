"""accelerate: ``AmpkitAccelerator(level="O2", dtype=torch.bfloat16)`` in place of
``Accelerator(mixed_precision=...)``.

ampkit replaces accelerate's ``mixed_precision="fp16"`` and ``"bf16"`` modes (its
``torch.autocast`` around the model's forward and its ``torch.amp.GradScaler``); the
accelerator itself runs with ``mixed_precision="no"``, and everything else (devices,
DDP, data loaders, gradient accumulation, ``save_state``/``load_state``) is
accelerate's own. :class:`AmpkitAccelerator` is an ``Accelerator`` whose hooks call the
front door:

===============================  ============================================================
accelerate call                  ampkit call
===============================  ============================================================
``prepare(model, ...)``          move to ``accelerator.device``, ``ampkit.initialize(model)``
``prepare(optimizer, ...)``      ``ampkit.initialize(models, optimizer)``
``backward(loss)``               ``GradScaler.scale(loss).backward()`` (levels that scale)
``clip_grad_norm_``              ``GradScaler.unscale_``, ``torch.nn.utils.clip_grad_norm_``
``optimizer.step()``             ``GradScaler.step`` (skipped on inf/NaN) and ``update``
``optimizer_step_was_skipped``   ``GradScaler.last_step_skipped`` (fused optimizers too)
``autocast()``                   ``ampkit.autocast`` with the level's policy and lists
``save_state`` / ``load_state``  the scaler's ``state_dict``; the model's holds fp32 values
===============================  ============================================================

Configure it with an :class:`ampkit.AmpConfig` (``config=``: one or the path of a
config file) or with ``level=``, ``dtype=`` and the config's fields as keywords. The
host's precision setting is mapped, never ignored: ``mixed_precision=`` or
``ACCELERATE_MIXED_PRECISION`` (which ``accelerate launch --mixed_precision`` and
``accelerate config`` set) gives the config its dtype when it has none, and is refused,
naming both settings, when it says otherwise (``"fp8"`` is refused: use the config's
``fp8``). ``init_trackers`` adds the config to the trackers' hyperparameters,
``save_state`` writes it beside the state (``ampkit_config.json``), and with loss
scaling ``log`` adds ``amp/loss_scale`` and ``amp/skipped_steps`` to what you log.

Without the subclass, bf16 needs nothing but order: ``Accelerator(mixed_precision="no")``,
``model.to(accelerator.device)``, ``ampkit.initialize(model, optimizer, level=...)``,
then ``accelerator.prepare``. fp16 needs the subclass (or a loop of your own) because
accelerate only unscales before clipping for its own fp16 mode.

``accelerator.mixed_precision`` says the precision ampkit trains in (``"bf16"``,
``"fp16"``, ``"no"`` at O0), so a tracker or callback that logs it records the truth;
accelerate's own mode, ``accelerator.state.mixed_precision``, stays ``"no"``.

Requires ``accelerate`` (``pip install 'ampkit[accelerate]'``). Distributed types:
none, multi-CPU and multi-GPU (DDP); FSDP, DeepSpeed, Megatron and XLA are refused.

Example:
    >>> import torch
    >>> from ampkit.integrations.accelerate import AmpkitAccelerator
    >>> accelerator = AmpkitAccelerator(level="O2", dtype=torch.bfloat16, cpu=True)
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    >>> model, opt = accelerator.prepare(model, opt)
    >>> model[0].weight.dtype, accelerator.mixed_precision, accelerator.scaler is None
    (torch.float32, 'bf16', True)
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import typing
from collections.abc import Iterator
from typing import Any

import torch

import ampkit
from ampkit.config import AmpConfig
from ampkit.conversion.levels import Level
from ampkit.integrations._settings import (
    AmpkitSettings,
    accepted_options,
    missing_framework,
)

try:
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.utils import (
        AutocastKwargs,
        DistributedDataParallelKwargs,
        DistributedType,
        GradScalerKwargs,
        InitProcessGroupKwargs,
        KwargsHandler,
        ProfileKwargs,
    )
except ImportError as error:  # pragma: no cover - exercised without the extra
    raise ImportError(missing_framework("accelerate", "accelerate")) from error

__all__ = ["AmpkitAccelerator"]

_SUPPORTED = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)
# kwargs handlers that set up no precision: accelerate uses them as it does without ampkit
_PASSED_THROUGH = (DistributedDataParallelKwargs, InitProcessGroupKwargs, ProfileKwargs)
# GradScalerKwargs fields -> the AmpConfig fields that take them ("enabled" is separate)
_SCALER_HANDLER_FIELDS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval")
# the low dtype -> accelerate's name for its mixed_precision mode
_ACCELERATE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


class AmpkitAccelerator(Accelerator):
    """An ``Accelerator`` that trains at an ampkit level instead of its own
    ``mixed_precision`` modes.

    Args:
        level: ``"O0"``-``"O3"``; ``None``: the config's, else ``"O2"``.
        dtype: ``torch.float16`` or ``torch.bfloat16``; ``None``: the config's, or what
            ``mixed_precision``/``ACCELERATE_MIXED_PRECISION`` say, else the device's
            autocast default (bfloat16 on CPU, float16 on CUDA).
        config: an :class:`ampkit.AmpConfig` or the path of a config file; keywords
            given as well must agree with it.
        kwargs_handlers: accelerate's handlers, each mapped or refused, never ignored:
            ``GradScalerKwargs`` gives the scaler its ``init_scale``,
            ``growth_factor``, ``backoff_factor`` and ``growth_interval`` (a value
            left at its default is not a choice), and ``enabled=False`` turns loss
            scaling off; ``AutocastKwargs`` gives ``cache_enabled`` to the
            :meth:`autocast` regions (``enabled=False`` only at level O0: the level
            decides what runs in low precision); ``DistributedDataParallelKwargs``,
            ``InitProcessGroupKwargs`` and ``ProfileKwargs`` pass through to
            accelerate; the fp8 recipe handlers and any other handler are refused.
        **kwargs: :class:`ampkit.AmpConfig` fields (``custom_white_list``,
            ``custom_black_list``, ``policy``, ``keep_fp32_modules``, ``loss_scale``,
            ``init_scale``, ``hysteresis``, ``min_scale``, ...) and the rarer
            ``initialize`` overrides; every other keyword goes to ``Accelerator``.

    Prepare each model before, or together with, its optimizers.

    Raises:
        ValueError: ``mixed_precision`` or ``ACCELERATE_MIXED_PRECISION`` contradicting
            the config's dtype (both named), a bad level, dtype or option value, a
            distributed type ampkit does not support, or a ``GradScalerKwargs`` or
            ``AutocastKwargs`` value that contradicts the config or the level (the
            handler and the field named).
        TypeError: an unknown ampkit option (the accepted ones are listed), or a
            kwargs handler ampkit refuses (named, with what to use instead).

    Example:
        >>> import torch
        >>> from ampkit import AmpConfig
        >>> from ampkit.integrations.accelerate import AmpkitAccelerator
        >>> AmpkitAccelerator(config=AmpConfig("O2", "bfloat16"), mixed_precision="fp16")
        Traceback (most recent call last):
        ...
        ValueError: AmpkitAccelerator: mixed_precision='fp16' asks for torch.float16, ...
        >>> from accelerate.utils import GradScalerKwargs
        >>> handler = GradScalerKwargs(init_scale=1024.0, growth_factor=4.0)
        >>> AmpkitAccelerator(level="O2", dtype="float16", cpu=True,
        ...                   kwargs_handlers=[handler]).scaler.get_scale()
        1024.0
    """

    _ampkit: AmpkitSettings
    _ampkit_models: list[torch.nn.Module]
    _ampkit_scaling: bool
    _ampkit_cache_enabled: bool | None

    def __init__(self, *, level: str | None = None, dtype: torch.dtype | str | None = None,
                 config: AmpConfig | str | os.PathLike[str] | None = None,
                 **kwargs: Any) -> None:
        accepted = accepted_options()
        options = {k: kwargs.pop(k) for k in list(kwargs) if k in accepted}
        settings = AmpkitSettings.build(level, dtype, options, owner="AmpkitAccelerator",
                                        config=config)
        mixed = kwargs.pop("mixed_precision", None)
        if mixed is not None:
            settings = settings.with_host_precision(f"mixed_precision={mixed!r}", mixed)
        elif os.environ.get("ACCELERATE_MIXED_PRECISION"):
            # set by `accelerate launch --mixed_precision` and `accelerate config`
            env = os.environ["ACCELERATE_MIXED_PRECISION"]
            settings = settings.with_host_precision(f"ACCELERATE_MIXED_PRECISION={env!r}",
                                                    env)
        handlers = list(kwargs.get("kwargs_handlers") or [])
        settings, scaling, cache_enabled = _map_handlers(settings, handlers)
        # ampkit replaces accelerate's autocast and GradScaler: its own mode stays off.
        # The handlers still go to accelerate (which keeps them as its *_handler
        # attributes; with its mode off it casts and scales nothing with them).
        super().__init__(mixed_precision="no", **kwargs)
        self._ampkit_attach(settings, scaling=scaling, cache_enabled=cache_enabled)

    @classmethod
    def adopt(cls, accelerator: Accelerator, level: str | None = None,
              dtype: torch.dtype | str | None = None, *,
              config: AmpConfig | str | os.PathLike[str] | None = None,
              **options: Any) -> AmpkitAccelerator:
        """Turn an existing ``Accelerator`` (made with ``mixed_precision="no"``) into an
        ``AmpkitAccelerator``, in place: for frameworks that build their own, such as
        Hugging Face ``Trainer``. Returns the same object.

        Raises:
            ValueError: the accelerator runs a ``mixed_precision`` mode of its own
                (named with the ampkit config it would run beside).

        Example:
            >>> from accelerate import Accelerator
            >>> from ampkit.integrations.accelerate import AmpkitAccelerator
            >>> plain = Accelerator(cpu=True)
            >>> AmpkitAccelerator.adopt(plain, "O1", "bfloat16") is plain, type(plain).__name__
            (True, 'AmpkitAccelerator')
        """
        settings = AmpkitSettings.build(level, dtype, options, owner=cls.__name__,
                                        config=config)
        if not isinstance(accelerator, Accelerator):
            raise TypeError(f"accelerator must be an accelerate.Accelerator, got "
                            f"{type(accelerator).__name__}")
        if isinstance(accelerator, cls):
            return accelerator
        accelerator.__class__ = cls
        try:
            accelerator._ampkit_attach(settings)
        except BaseException:
            accelerator.__class__ = Accelerator
            raise
        return typing.cast(AmpkitAccelerator, accelerator)

    def _ampkit_attach(self, settings: AmpkitSettings, *, scaling: bool = True,
                       cache_enabled: bool | None = None) -> None:
        if self.state.mixed_precision != "no":
            raise ValueError(f"{type(self).__name__}: the Accelerator runs its own "
                             f"mixed_precision={self.state.mixed_precision!r}, beside the "
                             f"ampkit config ({settings.describe()}); make the Accelerator with "
                             f"mixed_precision='no' and set the precision in the config")
        if self.distributed_type not in _SUPPORTED:
            raise ValueError(f"{type(self).__name__} supports distributed types "
                             f"{[d.value for d in _SUPPORTED]}, got {self.distributed_type}")
        self._ampkit = settings
        self._ampkit_models = []
        self._ampkit_scaling = scaling
        self._ampkit_cache_enabled = cache_enabled
        handler = self.scaler_handler if isinstance(self.scaler_handler,
                                                    GradScalerKwargs) else None
        try:
            scaler = settings.make_scaler(self.device.type)
        except ValueError as error:
            if handler is None:
                raise
            raise ValueError(f"{type(self).__name__}: kwargs_handlers {handler!r} sets up "
                             f"loss scaling, but the level scales no loss ({error})"
                             ) from None
        self.scaler = scaler if scaling else None

    def __repr__(self) -> str:
        return f"AmpkitAccelerator({self._ampkit.describe()}, device={self.device})"

    @property
    def mixed_precision(self) -> str:
        """accelerate's own field, which trackers, callbacks and logs read: the precision
        ampkit trains in, in accelerate's words (``"bf16"``, ``"fp16"``; ``"no"`` at
        level O0). accelerate's own mode stays off (``state.mixed_precision == "no"``:
        ampkit, not accelerate, casts and scales), so accelerate's code paths for its
        own autocast and scaler never run.

        Example:
            >>> from ampkit.integrations.accelerate import AmpkitAccelerator
            >>> accelerator = AmpkitAccelerator(level="O2", dtype="bfloat16", cpu=True)
            >>> accelerator.mixed_precision, accelerator.state.mixed_precision
            ('bf16', 'no')
        """
        properties = self._ampkit.properties(self.device.type)
        if properties.level is Level.O0:
            return "no"
        return _ACCELERATE_NAMES[properties.dtype]

    @property
    def ampkit_config(self) -> AmpConfig:
        """The :class:`ampkit.AmpConfig` this accelerator trains with (host setting
        mapped).

        Example:
            >>> from ampkit.integrations.accelerate import AmpkitAccelerator
            >>> AmpkitAccelerator(mixed_precision="bf16", cpu=True).ampkit_config.dtype
            torch.bfloat16
        """
        return self._ampkit.config

    # -- records and logs -------------------------------------------------------------

    def init_trackers(self, project_name: str, config: dict[str, Any] | None = None,
                      init_kwargs: dict[str, Any] | None = None) -> None:
        """``Accelerator.init_trackers`` with the ampkit config added to ``config`` (the
        trackers' hyperparameters) as ``ampkit/<field>`` entries."""
        merged = {**self._ampkit.config.hyperparameters(), **(config or {})}
        super().init_trackers(project_name, merged, init_kwargs or {})

    def log(self, values: dict[str, Any], step: int | None = None,
            log_kwargs: dict[str, Any] | None = None) -> None:
        """``Accelerator.log``, with ``amp/loss_scale`` and ``amp/skipped_steps`` added
        when the level scales the loss (at your logging cadence)."""
        if self.scaler is not None:
            values = {"amp/loss_scale": self.scaler.get_scale(),
                      "amp/skipped_steps": self.scaler.skipped_steps, **values}
        super().log(values, step=step, log_kwargs=log_kwargs or {})

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True,
                   **save_model_func_kwargs: Any) -> str:
        """``Accelerator.save_state``, plus the config as ``ampkit_config.json`` in the
        state's folder."""
        location: str = super().save_state(output_dir, safe_serialization,
                                           **save_model_func_kwargs)
        if self.is_main_process:
            self._ampkit.config.to_file(os.path.join(location, "ampkit_config.json"))
        return location

    # -- prepare ----------------------------------------------------------------------

    def convert_model(self, model: torch.nn.Module, device_placement: bool | None = None
                      ) -> None:
        """Convert ``model`` with ``ampkit.initialize`` (moved to the accelerator's device
        first, unless ``device_placement`` is ``False``), once; ``prepare`` does it too.

        Example:
            >>> import torch
            >>> from ampkit.integrations.accelerate import AmpkitAccelerator
            >>> accelerator = AmpkitAccelerator(level="O3", dtype=torch.bfloat16, cpu=True)
            >>> net = torch.nn.Linear(2, 2)
            >>> accelerator.convert_model(net)
            >>> net.weight.dtype
            torch.bfloat16
        """
        model = self.unwrap_model(model)
        if any(m is model for m in self._ampkit_models):
            return
        if self.device_placement if device_placement is None else device_placement:
            model.to(self.device)  # first, so the fp32 parameters are on the device
        self._ampkit.initialize(model)
        self._ampkit_models.append(model)

    def _ampkit_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        while isinstance(optimizer, AcceleratedOptimizer):
            optimizer = optimizer.optimizer
        if not self._ampkit_models:
            raise RuntimeError("AmpkitAccelerator: prepare the model before, or together "
                               "with, its optimizer (the optimizer's fp32 parameters are the "
                               "converted model's)")
        self._ampkit.initialize(list(self._ampkit_models), [optimizer])

    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """Convert the models and check the optimizers' parameters, then
        ``Accelerator.prepare`` (any order of arguments)."""
        places: list[bool | None] = ([None] * len(args) if not device_placement
                                     else list(device_placement))
        for obj, place in zip(args, places):
            if isinstance(obj, torch.nn.Module):
                self.convert_model(obj, place)
        for obj in args:
            if isinstance(obj, torch.optim.Optimizer):
                self._ampkit_optimizer(obj)
        return super().prepare(*args, device_placement=device_placement)

    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> Any:
        """Convert ``model`` (on the accelerator's device), then
        ``Accelerator.prepare_model``."""
        self.convert_model(model, device_placement)
        return super().prepare_model(model, device_placement=device_placement,
                                     evaluation_mode=evaluation_mode)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer,
                          device_placement: bool | None = None) -> Any:
        """Check ``optimizer`` against the converted models (``ampkit.initialize``), then
        ``Accelerator.prepare_optimizer``."""
        self._ampkit_optimizer(optimizer)
        return super().prepare_optimizer(optimizer, device_placement=device_placement)

    # -- each step --------------------------------------------------------------------

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """Unscale with the ampkit scaler (a no-op for levels that scale no loss);
        ``clip_grad_norm_`` and ``clip_grad_value_`` call it before clipping."""
        if self.scaler is None:
            return
        if optimizer is None:
            optimizers = list(self._optimizers)
        else:
            optimizers = list(optimizer) if isinstance(optimizer, list | tuple) else [optimizer]
        for opt in optimizers:
            while isinstance(opt, AcceleratedOptimizer):
                opt = opt.optimizer
            self.scaler.unscale_(opt)

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """Whether the last optimizer step was skipped for an overflow (so the LR
        scheduler should not move): the scaler's ``last_step_skipped``, which also
        covers fused optimizers, whose ``step`` runs and skips on the device."""
        return self.scaler is not None and bool(self.scaler.last_step_skipped)

    def _optimizer_over(self, params: list[torch.Tensor]) -> torch.optim.Optimizer | None:
        """The one prepared optimizer whose (model) parameters are ``params``."""
        wanted = {id(p) for p in params if p.requires_grad}
        for opt in self._optimizers:
            while isinstance(opt, AcceleratedOptimizer):
                opt = opt.optimizer
            if wanted == {id(p) for g in opt.param_groups for p in g["params"] if p.requires_grad}:
                found: torch.optim.Optimizer = opt
                return found
        return None

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        """Unscale, then clip. Given the parameters of a prepared optimizer (the usual
        ``model.parameters()``), the clipping is ``torch.nn.utils.clip_grad_norm_``: the
        norm is taken in fp32 over the gradients the step uses (the fp32 parameters' at O2)."""
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        optimizer = self._optimizer_over(params)
        if optimizer is None:
            return super().clip_grad_norm_(params, max_norm, norm_type)
        self.unscale_gradients()
        return torch.nn.utils.clip_grad_norm_(
            [p for g in optimizer.param_groups for p in g["params"]], max_norm, norm_type)

    @contextlib.contextmanager
    def autocast(self, autocast_handler: Any = None) -> Iterator[None]:
        """The level's ``ampkit.autocast`` region (none at O0/O3), for code outside the
        model's forward (which runs in it already).

        ``autocast_handler`` (an ``AutocastKwargs``, as in accelerate) overrides the
        accelerator's for this region: ``enabled=False`` runs the block in fp32 (autocast
        off, also inside an outer region), ``cache_enabled`` sets the weight-cast cache.

        Raises:
            TypeError: ``autocast_handler`` is not an ``AutocastKwargs``.

        Example:
            >>> import torch
            >>> from accelerate.utils import AutocastKwargs
            >>> from ampkit.integrations.accelerate import AmpkitAccelerator
            >>> accelerator = AmpkitAccelerator(level="O1", dtype="bfloat16", cpu=True)
            >>> a = torch.ones(2, 2)
            >>> with accelerator.autocast():
            ...     with accelerator.autocast(AutocastKwargs(enabled=False)):
            ...         (a @ a).dtype
            torch.float32
        """
        cache_enabled = self._ampkit_cache_enabled
        if autocast_handler is not None:
            if not isinstance(autocast_handler, AutocastKwargs):
                raise TypeError(f"AmpkitAccelerator.autocast: autocast_handler must be an "
                                f"accelerate AutocastKwargs, got "
                                f"{type(autocast_handler).__name__}")
            if not autocast_handler.enabled:
                with ampkit.autocast(self.device.type, enabled=False):
                    yield
                return
            if autocast_handler.cache_enabled is not None:
                cache_enabled = autocast_handler.cache_enabled
        with self._ampkit.autocast(self.device.type, cache_enabled=cache_enabled):
            yield


def _map_handlers(settings: AmpkitSettings, handlers: list[Any]
                  ) -> tuple[AmpkitSettings, bool, bool | None]:
    """Map accelerate's ``kwargs_handlers`` onto the settings: the settings with the
    scaler's options, whether loss scaling is on, and the autocast cache setting (``None``:
    torch's). A handler that is not mapped and not passed through is refused."""
    owner = settings.owner
    scaling, cache_enabled = True, None
    for handler in handlers:
        if isinstance(handler, GradScalerKwargs):
            settings, scaling = _map_scaler_handler(settings, handler)
        elif isinstance(handler, AutocastKwargs):
            if not handler.enabled and settings.config.level != Level.O0.value:
                raise ValueError(
                    f"{owner}: kwargs_handlers {handler!r} turns autocast off for the "
                    f"whole run, but level {settings.config.level} decides what runs in "
                    f"low precision; use level='O0' to train in fp32, or pass "
                    f"AutocastKwargs(enabled=False) to accelerator.autocast() for one block")
            cache_enabled = handler.cache_enabled
        elif isinstance(handler, _PASSED_THROUGH):
            continue
        elif isinstance(handler, KwargsHandler):
            name = type(handler).__name__
            if "Recipe" in name:  # accelerate's fp8 recipes: AO, TE, MS-AMP, FP8
                raise TypeError(f"{owner}: kwargs_handlers entry {name} sets up accelerate's "
                                f"fp8 training, which ampkit replaces; set the config's fp8 "
                                f"recipe (AmpConfig(fp8=...)) instead")
            raise TypeError(f"{owner}: kwargs_handlers entry {name} is not one ampkit "
                            f"knows to leave the precision alone; it maps GradScalerKwargs "
                            f"and AutocastKwargs and passes "
                            f"{[c.__name__ for c in _PASSED_THROUGH]} to accelerate")
    return settings, scaling, cache_enabled


def _map_scaler_handler(settings: AmpkitSettings, handler: Any
                        ) -> tuple[AmpkitSettings, bool]:
    """``GradScalerKwargs`` onto the config's scaler fields (a field left at the
    handler's default is not a choice); a value the config sets otherwise is refused."""
    owner, config = settings.owner, settings.config
    given = {k: v for k, v in handler.to_kwargs().items() if k in _SCALER_HANDLER_FIELDS}
    if not handler.enabled:
        if given or config.scaler_options():
            raise ValueError(f"{owner}: kwargs_handlers {handler!r} turns loss scaling off "
                             f"but sets scaler options too"
                             + (f" (the config sets {sorted(config.scaler_options())})"
                                if config.scaler_options() else ""))
        return settings, False
    clashes = [k for k, v in given.items()
               if getattr(config, k) is not None and getattr(config, k) != v]
    if clashes:
        raise ValueError(f"{owner}: kwargs_handlers {handler!r} contradicts the ampkit "
                         f"config on {clashes} (config: "
                         f"{ {k: getattr(config, k) for k in clashes} }); set them in one place")
    if not given:
        return settings, True
    try:
        config = config.replace(**given)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{owner}: kwargs_handlers {handler!r} does not fit the ampkit "
                         f"config: {error}") from None
    return dataclasses.replace(settings, config=config), True

