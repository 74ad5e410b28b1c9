"""The front door: ``ampkit.initialize(models, optimizers, level=..., dtype=...)``.

One call applies a precision level to one or several models and their optimizers:

1. the level's properties are looked up and the overrides applied (nonsensical ones
   refused, see :func:`ampkit.conversion.levels.build_level`);
2. every model is checked (an ``nn.Module``, fp32, not yet wrapped in DDP/FSDP) and
   every optimizer's parameters are checked to belong to the models, all before
   anything is changed;
3. the models are converted (:func:`convert_model`);
4. optimizers are returned as they are: at O1 and O2 the fp32 parameters are the truth
   and the user's optimizer steps them directly (O2's modules compute with
   low-precision copies made on use, :mod:`ampkit.conversion.parameter_casts`); only with
   ``master_weights="stochastic"``/``"kahan"`` is an optimizer made to train bf16
   weights and state purely
   (:class:`ampkit.pure.PureLowPrecisionOptimizer`, seeded by
   ``rounding_seed``);
5. loss scaling is configured for :func:`ampkit.scale_loss` when the level scales the
   loss (float16 at O1/O2 by default).

Models and optimizers come back in the shape they were given (one, or a list/tuple).
Call it once per model, before wrapping the model in DistributedDataParallel or FSDP2
(``fully_shard``); calling it again with the same settings changes nothing. An optimizer
may be made before or after the call.

Example:
    >>> import torch
    >>> import ampkit
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    >>> model, opt = ampkit.initialize(model, opt, level="O2", dtype=torch.bfloat16)
    >>> model[0].weight.dtype, model(torch.rand(2, 4)).dtype  # fp32 truth, cast on use
    (torch.float32, torch.float32)
    >>> {p.dtype for g in opt.param_groups for p in g["params"]}
    {torch.float32}
"""

from __future__ import annotations

import dataclasses
import os
import typing
import warnings
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch
import torch.nn as nn

from ampkit.common.arguments import DEPRECATED_NAMES, canonical_names
from ampkit.config import SCALER_FIELDS, AmpConfig, config_fields, merged_config
from ampkit.conversion import (
    ConversionConfig,
    apply_conversion,
    check_not_wrapped,
    prepare_conversion,
)
from ampkit.conversion.levels import (
    APEX_OVERRIDES,
    LEVEL_SETTINGS,
    BuiltLevel,
    LevelProperties,
    build_level,
    default_dtype,
)
from ampkit.fp8.convert import (
    Fp8SkipWarning,
    apply_fp8,
    check_fp8_converts,
    fp8_skip_message,
    prepare_fp8,
)

__all__ = ["INITIALIZE_OVERRIDES", "Prepared", "Settings", "convert_model", "initialize",
           "initialize_keywords", "prepare_models", "resolve_settings"]


def initialize_keywords() -> tuple[str, ...]:
    """Every keyword ``initialize`` takes besides ``level``, ``dtype`` and ``config``,
    read when called: :class:`ampkit.AmpConfig`'s fields, then the apex overrides
    (:data:`ampkit.conversion.levels.APEX_OVERRIDES`), then the deprecated names
    (:data:`ampkit.common.arguments.DEPRECATED_NAMES`, which warn).

    Example:
        >>> from ampkit.front_door import initialize_keywords
        >>> "hysteresis" in initialize_keywords(), "cast_model_type" in initialize_keywords()
        (True, True)
    """
    fields = tuple(f.name for f in config_fields() if f.name not in ("level", "dtype"))
    return (*fields, *APEX_OVERRIDES, *DEPRECATED_NAMES)


#: :func:`initialize_keywords` as the package is imported.
INITIALIZE_OVERRIDES: tuple[str, ...] = initialize_keywords()


def _as_list(value: Any, kind: type, argument: str) -> tuple[list[Any], bool]:
    """``(items, given_as_one)``; a TypeError naming ``argument`` otherwise."""
    if isinstance(value, kind):
        return [value], True
    if isinstance(value, list | tuple) and value and all(isinstance(v, kind) for v in value):
        return list(value), False
    wrong = (next((v for v in value if not isinstance(v, kind)), None)
             if isinstance(value, list | tuple) and value else value)
    raise TypeError(f"{argument} must be a {kind.__module__}.{kind.__qualname__} or a "
                    f"non-empty list/tuple of them, got {type(wrong).__name__}")


def _is_data(value: Any, hint: Any) -> bool:
    """A value a config (data that goes to files) holds for a field of type ``hint``:
    text, a number, a path, names, or a value of the field's own type. A module class
    or instance among the kept modules, a ``Policy`` or a torchao config is not."""
    if isinstance(value, list | tuple | set | frozenset):
        return all(isinstance(v, str) for v in value)
    if value is None or isinstance(value, str | int | float | os.PathLike):
        return True
    kinds = typing.get_args(hint) or (hint,)
    return any(isinstance(value, k) for k in kinds if isinstance(k, type))


@dataclasses.dataclass(frozen=True)
class Settings:
    """What one ``initialize`` call asks for, merged once (:func:`resolve_settings`):
    the :class:`ampkit.AmpConfig`, the in-memory values a config cannot hold (module
    classes among ``keep_fp32_modules``, a ``Policy``, a torchao config) and the apex
    overrides (:data:`ampkit.conversion.levels.APEX_OVERRIDES`).

    Example:
        >>> from ampkit.front_door import resolve_settings
        >>> s = resolve_settings(None, "O2", "float16", {"num_losses": 2}, "cpu")
        >>> s.config.level, s.by_name()["num_losses"], s.by_name()["dtype"]
        ('O2', 2, torch.float16)
    """

    config: AmpConfig
    live: MappingProxyType[str, Any]
    apex: MappingProxyType[str, Any]

    def by_name(self) -> dict[str, Any]:
        """Every setting by AmpConfig field name (an in-memory value in its field's
        place) and apex override name.

        Example:
            >>> from ampkit.front_door import resolve_settings
            >>> resolve_settings(None, "O3", "bfloat16", {}, "cpu").by_name()["level"]
            'O3'
        """
        cfg = self.config
        return {**{f.name: getattr(cfg, f.name) for f in config_fields()}, **self.live,
                **self.apex}

    def level_conversion(self, device_type: str | None) -> BuiltLevel:
        """The level's properties and conversion on ``device_type``: the config's
        (:meth:`ampkit.AmpConfig.level_conversion`), with the in-memory values and
        apex overrides that build the level in their place.

        Example:
            >>> from ampkit.front_door import resolve_settings
            >>> s = resolve_settings(None, "O2", "bfloat16", {}, "cpu")
            >>> s.level_conversion("cpu") == s.config.level_conversion()
            True
        """
        in_memory = {k: v for k, v in {**self.live, **self.apex}.items()
                     if k in LEVEL_SETTINGS}
        return self.config.level_conversion(device_type, **in_memory)


def resolve_settings(config: Any, level: Any, dtype: Any, overrides: Mapping[str, Any],
                     device_type: str | None) -> Settings:
    """``initialize``'s settings (also what ``ampkit.compare`` converts its copy with):
    the keywords and ``config`` merged by :func:`ampkit.config.merged_config` (a keyword
    given with a config must agree with it); without a config, ``dtype=None`` is
    ``device_type``'s default and an in-memory value (see :class:`Settings`) is kept
    beside the config its data makes.

    Raises:
        TypeError: an unknown keyword (the accepted ones listed), a bad type.
        ValueError: a bad value, or a keyword that contradicts ``config``.

    Example:
        >>> from ampkit.front_door import resolve_settings
        >>> resolve_settings(None, "O2", None, {"keep_norms_fp32": False}, "cpu").config.dtype
        torch.bfloat16
    """
    accepted = initialize_keywords()
    unknown = sorted(set(overrides) - set(accepted))
    if unknown:
        raise TypeError(f"initialize got unknown overrides {unknown}; accepted: "
                        f"{list(accepted)}")
    overrides = canonical_names(dict(overrides), "initialize", stacklevel=4)
    names = [f.name for f in config_fields()]
    given = {k: v for k, v in overrides.items() if k in names}
    given.update({k: v for k, v in (("level", level), ("dtype", dtype)) if v is not None})
    live: dict[str, Any] = {}
    defaults: dict[str, Any] = {}
    if config is None:
        # dtype=None is the models' device's default: the config is checked with it
        defaults["dtype"] = default_dtype(device_type)
        # read when called (a schema extended at run time is the one checked)
        from ampkit import config as schema

        hints = typing.get_type_hints(schema.AmpConfig)
        live = {k: v for k, v in given.items()
                if v is not None and not _is_data(v, hints[k])}
    cfg = merged_config({k: v for k, v in given.items() if k not in live}, config,
                        defaults=defaults)
    apex = {k: v for k, v in overrides.items() if k in APEX_OVERRIDES}
    return Settings(cfg, MappingProxyType(live), MappingProxyType(apex))


def _scale_loss_options(settings: Mapping[str, Any]) -> dict[str, Any]:
    """``configure_loss_scaling``'s keywords for ``settings``."""
    scaling: dict[str, Any] = {}
    for name in SCALER_FIELDS:
        value = settings[name]
        if value is None:
            continue
        if name in ("growth_factor", "backoff_factor"):
            raise ValueError(f"initialize: {name}={value!r} configures a GradScaler, but "
                             f"ampkit.scale_loss's scalers grow by 2 and back off by 0.5; "
                             f"leave it None here, or scale with an ampkit.GradScaler of "
                             f"your own")
        scaling[name] = value
    if settings.get("num_losses") is not None:
        scaling["num_losses"] = settings["num_losses"]
    if settings["log_skipped_steps"]:
        scaling["log_skipped_steps"] = True
    return scaling


def _check_optimizers(optimizers: list[torch.optim.Optimizer], models: list[nn.Module]) -> None:
    known: set[int] = set()
    for model in models:
        for p in model.parameters():
            known.add(id(p))
    for i, opt in enumerate(optimizers):
        for g, group in enumerate(opt.param_groups):
            for p in group["params"]:
                if id(p) not in known:
                    where = "optimizers" if len(optimizers) == 1 else f"optimizers[{i}]"
                    raise ValueError(f"{where}: param_groups[{g}] holds a parameter of shape "
                                     f"{tuple(p.shape)} that is in none of the models given; "
                                     f"pass every model whose parameters the optimizer "
                                     f"updates")


def _configure_loss_scaling(props: LevelProperties, scaling: dict[str, Any],
                            optimizers: list[torch.optim.Optimizer]) -> None:
    """This run's loss scalers, bound to its optimizers: a later ``initialize`` for
    other optimizers leaves them alone (``scale_loss`` finds them by optimizer)."""
    from ampkit.scaling.loss_scaling import configure_loss_scaling, release_optimizers

    log_skipped = scaling.pop("log_skipped_steps", False)
    if props.loss_scale is None and not scaling:
        # Nothing to set up: scale_loss keeps whatever was configured, and these
        # optimizers no longer belong to an earlier run's scalers.
        release_optimizers(optimizers)
        return
    for scaler in configure_loss_scaling(props.loss_scale, optimizers=optimizers or None,
                                         **scaling):
        scaler.log_skipped_steps = log_skipped


def initialize(models: nn.Module | list[nn.Module] | tuple[nn.Module, ...],
               optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None
               = None, *, level: Any = None, dtype: torch.dtype | str | None = None,
               config: AmpConfig | str | os.PathLike[str] | Mapping[str, Any] | None = None,
               **overrides: Any) -> Any:
    """Apply a precision level to models and their optimizers (apex's ``initialize``).

    Args:
        models: an ``nn.Module`` or a list/tuple of them: fp32, on their device, not
            wrapped in DataParallel/DistributedDataParallel/FSDP yet.
        optimizers: ``None``, a ``torch.optim.Optimizer`` or a list/tuple of them, over
            parameters of ``models``.
        level: ``"O0"``, ``"O1"`` (``None``: the default, or the config's), ``"O2"``,
            ``"O3"``; the table is in :mod:`ampkit.conversion.levels`
            (``ampkit.conversion.levels.describe_levels()`` prints it).
        dtype: ``torch.float16`` or ``torch.bfloat16``; ``None`` is the autocast default
            of the models' device: bfloat16 on CPU, float16 on CUDA.
        config: an :class:`ampkit.AmpConfig` (or the path of a config file, or a
            mapping of its fields) holding every choice below; a keyword given as well
            must agree with it (:func:`ampkit.config.merged_config`).
        **overrides: :class:`ampkit.AmpConfig`'s fields, by the same names and
            with the same values (:func:`initialize_keywords` lists them; they make
            the config, checked as every config is): ``policy``,
            ``custom_white_list``, ``custom_black_list`` (the autocast policy of
            O1/O2), ``keep_fp32_modules``, ``keep_norms_fp32``, ``master_weights``
            (``True``, ``False``, or ``"stochastic"``/``"kahan"`` for pure bfloat16
            training, see :mod:`ampkit.pure`; ``rounding_seed`` seeds
            its rounding), ``loss_scale``, the loss-scale options of
            :func:`ampkit.scale_loss` (``init_scale``, ``growth_interval``,
            ``hysteresis``, ``min_scale``, ``max_scale``, ``log_skipped_steps``),
            ``fp8`` (a recipe name, ``"tensorwise"``, ``"rowwise"``,
            ``"rowwise_with_gw_hp"``: the eligible ``nn.Linear`` and transformers
            ``Conv1D`` layers train in fp8 through torchao, needs ``ampkit[fp8]``; a
            request that converts no layer is a ``ValueError``, layers left out are
            said once in an ``ampkit.fp8.Fp8SkipWarning``), ``fp8_exclude_modules``,
            ``fp8_first_last`` (see :mod:`ampkit.fp8`), ``cast_model_outputs``,
            ``step_in_backward`` (each parameter steps inside backward as its
            gradient is ready, see :mod:`ampkit.step_in_backward`) and
            ``compile_step`` (the pure bfloat16 step runs compiled, see
            :mod:`ampkit.pure.compiled_step`).
            Here a field may also hold what a config file cannot: module classes or
            instances among ``keep_fp32_modules``, a ``Policy``, a torchao
            ``Float8LinearConfig``. Then the apex overrides
            (:data:`ampkit.conversion.levels.APEX_OVERRIDES`): ``cast_model_type``,
            ``patch_ops``, ``state_dict_dtype``, ``cast_buffers`` (``True``: store
            floating buffers in the parameters' low-precision dtype too, as
            ``model.half()`` does; by default they keep their dtype at every level,
            see :func:`ampkit.conversion.levels.build_level`) and ``num_losses``. The
            deprecated names ``min_loss_scale``, ``max_loss_scale``,
            ``keep_batchnorm_fp32`` and ``patch_torch_functions``
            (:data:`ampkit.common.arguments.DEPRECATED_NAMES`) still work, with a
            ``FutureWarning`` naming the one to use. ``None`` keeps a level default.

    Returns:
        ``models`` when ``optimizers`` is ``None``, else ``(models, optimizers)``, each
        in the shape given (the same objects, changed in place).

    Raises:
        TypeError: a model that is not an ``nn.Module``, an optimizer that is not an
            optimizer, or an unknown override (the accepted ones are listed).
        ValueError: an unknown level or dtype, a refused combination of overrides, an
            optimizer over parameters outside the models, a model that is not fp32, or
            a keyword that contradicts ``config`` (both named).
        RuntimeError: a model already wrapped in DDP/FSDP/DataParallel (call
            ``initialize`` first), or already converted with other settings.

    Example:
        >>> import torch
        >>> import ampkit
        >>> nets = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
        >>> nets = ampkit.initialize(nets, level="O3", dtype="bfloat16")
        >>> [n.weight.dtype for n in nets]
        [torch.bfloat16, torch.bfloat16]
        >>> ampkit.initialize(torch.nn.Linear(2, 2), level="O4")
        Traceback (most recent call last):
        ...
        ValueError: level must be one of ['O0', 'O1', 'O2', 'O3'], got 'O4'
        >>> cfg = ampkit.AmpConfig(level="O3", dtype="bfloat16")
        >>> ampkit.initialize(torch.nn.Linear(2, 2), config=cfg).weight.dtype
        torch.bfloat16
        >>> ampkit.initialize(torch.nn.Linear(2, 2), config=cfg, dtype="float16")
        Traceback (most recent call last):
        ...
        ValueError: dtype='float16' contradicts the config's dtype=bfloat16; give it once
    """
    model_list, one_model = _as_list(models, nn.Module, "models")
    opt_list, one_opt = ([], True) if optimizers is None else _as_list(
        optimizers, torch.optim.Optimizer, "optimizers")
    device_type = next((p.device.type for m in model_list for p in m.parameters()), None)
    settings = resolve_settings(config, level, dtype, overrides, device_type)
    scaling = _scale_loss_options(settings.by_name())
    names = ["model"] if one_model else [f"models[{i}]" for i in range(len(model_list))]
    prepared = prepare_models(model_list, settings, opt_list, names=names,
                              device_type=device_type)
    _configure_loss_scaling(prepared.properties, scaling,
                            [o for o in prepared.optimizers  # scale_loss takes these
                             if isinstance(o, torch.optim.Optimizer)])
    opt_out = prepared.optimizers
    if settings.config.step_in_backward:  # (checked by prepare_models)
        from ampkit.step_in_backward import (
            enable_step_in_backward,
            mark_step_in_backward,
            watch_models,
        )

        opt_out = [enable_step_in_backward(opt) for opt in opt_out]
        for opt in opt_out:
            watch_models(opt, model_list)
        mark_step_in_backward(model_list)  # an optimizer built later: prepare_optimizer
    if prepared.fp8_skipped is not None:  # what fp8 left out, said once
        warnings.warn(prepared.fp8_skipped, Fp8SkipWarning, stacklevel=2)
    out_models = model_list[0] if one_model else type(models)(model_list)
    if optimizers is None:
        return out_models
    out_opts = opt_out[0] if one_opt else type(optimizers)(opt_out)  # type: ignore[call-arg]
    return out_models, out_opts


@dataclasses.dataclass(frozen=True)
class Prepared:
    """What :func:`prepare_models` did: the level's properties, the conversion applied,
    the optimizers to use (pure ones where the level trains purely) and what fp8 left
    out (``None``: nothing, or no fp8).

    Example:
        >>> import torch
        >>> from ampkit.front_door import prepare_models, resolve_settings
        >>> net = torch.nn.Linear(2, 2)
        >>> done = prepare_models([net], resolve_settings(None, "O3", "bfloat16", {}, "cpu"))
        >>> done.properties.level.value, net.weight.dtype
        ('O3', torch.bfloat16)
    """

    properties: LevelProperties
    conversion: ConversionConfig
    optimizers: list[Any]
    fp8_skipped: str | None


def prepare_models(models: Sequence[nn.Module], settings: Settings,
                   optimizers: Sequence[torch.optim.Optimizer] = (), *,
                   names: Sequence[str] | None = None,
                   device_type: str | None = None) -> Prepared:
    """Turn ``models`` into what ``settings`` train (in place), the one route from
    settings to a converted model: ``ampkit.initialize`` calls it, and so does
    ``ampkit.compare`` on its low-precision copy, so that what compare measures is what
    training runs. Everything is checked before anything changes: the models (not
    wrapped, given once), the optimizers' parameters, a pure optimizer's rounding, the
    fp8 request; then the fp8 layers are swapped in, the conversion is planned once (on
    the result) and applied, and pure low precision marks the models and wraps the
    optimizers. Loss scaling is left to the caller.

    Args:
        models: fp32 ``nn.Module`` s on their device.
        settings: from :func:`resolve_settings`.
        optimizers: optimizers over the models' parameters.
        names: how errors name each model (default ``models[i]``).
        device_type: the models' device type (``dtype=None`` means its default).

    Raises:
        the errors of :func:`initialize` about models, optimizers and settings.

    Example:
        >>> import torch
        >>> from ampkit.front_door import prepare_models, resolve_settings
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))
        >>> s = resolve_settings(None, "O2", "bfloat16", {}, "cpu")
        >>> prepare_models([net], s).conversion.param_compute_dtype
        torch.bfloat16
    """
    model_list, opt_list = list(models), list(optimizers)
    labels = list(names) if names is not None else [f"models[{i}]"
                                                    for i in range(len(model_list))]
    for label, model in zip(labels, model_list):
        check_not_wrapped(model, label)
    props, converting = settings.level_conversion(device_type)
    # Check everything before changing anything: a refused call leaves all as it was.
    _check_optimizers(opt_list, model_list)
    if len({id(m) for m in model_list}) != len(model_list):
        raise ValueError("models: the same model is given twice")
    cfg = settings.config
    rounding, rounding_seed = props.master_weights.rounding, cfg.rounding_seed
    if rounding is not None:  # pure low precision
        from ampkit.pure import check_pure_optimizer
        from ampkit.pure.compiled_step import check_compile_step

        for opt in opt_list:  # (its parameters are checked once converted, in bf16)
            check_pure_optimizer(opt, rounding, seed=rounding_seed,
                                 seed_name="rounding_seed")
            check_compile_step(cfg.compile_step, rounding, opt)
    if settings.config.step_in_backward:  # before anything changes
        from ampkit.step_in_backward import check_step_in_backward

        for i, opt in enumerate(opt_list):
            check_step_in_backward(opt, loss_scale=props.loss_scale,
                                   argument="optimizer" if len(opt_list) == 1
                                   else f"optimizers[{i}]")
    chosen = settings.by_name()  # an in-memory value (a module class, a torchao config)
    fp8_plans = [prepare_fp8(model, converting, fp8=chosen["fp8"],
                             fp8_exclude_modules=chosen["fp8_exclude_modules"] or None,
                             fp8_first_last=chosen["fp8_first_last"]) for model in model_list]
    named_fp8 = [(label, plan) for label, plan in zip(labels, fp8_plans) if plan is not None]
    check_fp8_converts(named_fp8)  # an fp8 request that converts nothing is refused
    plans = [prepare_conversion(model, converting) for model in model_list]
    if any(fp8_plans):
        # Swap the fp8 Linears, then plan the conversion of the result: the plan above
        # checked it before anything changed (a refused call leaves all as it was).
        for model, fp8_plan in zip(model_list, fp8_plans):
            if fp8_plan is not None:
                apply_fp8(model, fp8_plan, opt_list)
        plans = [prepare_conversion(model, converting) for model in model_list]
    for model, plan in zip(model_list, plans):
        if plan is not None:
            apply_conversion(model, converting, plan)
    if rounding is not None:  # pure low precision: no fp32 copies
        from ampkit.pure import mark_pure_models, pure_low_precision

        # the member's rounding, checked where the user's text became the member
        mark_pure_models(model_list, rounding, rounding_seed)
        if cfg.compile_step:  # an optimizer built later: ampkit.fsdp.prepare_optimizer
            from ampkit.pure.compiled_step import mark_compiled_step_models

            mark_compiled_step_models(model_list)
        opt_list = [pure_low_precision(opt, rounding, seed=rounding_seed,
                                       compile_step=cfg.compile_step)
                    for opt in opt_list]
    return Prepared(props, converting, opt_list, fp8_skip_message(named_fp8))


def convert_model(model: nn.Module, level: Any = "O2", dtype: torch.dtype | str | None = None,
                  **overrides: Any) -> nn.Module:
    """Apply a precision level (or a :class:`~ampkit.conversion.ConversionConfig`) to
    ``model``, in place, and return it.

    Args:
        model: an fp32 ``nn.Module`` on its final device, not yet wrapped in
            DataParallel/DistributedDataParallel/FSDP.
        level: ``"O0"`` .. ``"O3"``, a :class:`~ampkit.conversion.levels.Level`, or a
            :class:`~ampkit.conversion.ConversionConfig` (then ``dtype`` and ``overrides``
            must be absent).
        dtype: the low-precision dtype; ``None``: the autocast default of the model's
            device (bfloat16 on CPU, float16 on CUDA).
        **overrides: level properties (``cast_model_type``, ``keep_norms_fp32``,
            ``master_weights``, ``patch_ops``, ``cast_model_outputs``) and
            ``keep_fp32_modules``, ``policy``, ``custom_white_list``,
            ``custom_black_list``, ``state_dict_dtype``, ``cast_buffers``; see
            :func:`~ampkit.conversion.levels.build_level`.

    Returns:
        ``model`` itself, converted. Converting it again with the same settings returns
        it unchanged.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or an unknown override.
        ValueError: unknown level or dtype, a refused combination, a module name not in
            the model, a non-fp32 model, or a tied tensor asked to be in two dtypes.
        RuntimeError: the model is wrapped (DDP & co.), or already converted otherwise.

    Example:
        >>> import torch
        >>> from ampkit.front_door import convert_model
        >>> net = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.BatchNorm2d(2))
        >>> net = convert_model(net, "O2", torch.bfloat16)
        >>> net[0].weight.dtype, net(torch.rand(1, 1, 5, 5)).dtype  # fp32 truth
        (torch.float32, torch.float32)
        >>> convert_model(net, "O3", torch.bfloat16)
        Traceback (most recent call last):
        ...
        RuntimeError: this model was already converted with different settings; ...
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    check_not_wrapped(model)
    if isinstance(level, ConversionConfig):
        if dtype is not None or overrides:
            raise TypeError("convert_model: pass either a ConversionConfig or a level with "
                            "dtype and overrides, not both")
        config = level
    else:
        device_type = next((t.device.type for t in model.parameters()), None)
        config = build_level(level, dtype, device_type=device_type, **overrides).conversion
    plan = prepare_conversion(model, config)
    if plan is not None:
        apply_conversion(model, config, plan)
    return model
