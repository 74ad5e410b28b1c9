"""What every integration is given: an :class:`ampkit.AmpConfig` (built from a config,
a config file or the integration's own typed parameters), checked once, then turned
into front-door calls.

An integration keeps one :class:`AmpkitSettings` and asks it, at the moment its
framework's hook runs, to convert a model (:meth:`AmpkitSettings.initialize`), to make
the loss scaler the level calls for (:meth:`AmpkitSettings.make_scaler`), or to open the
level's autocast region (:meth:`AmpkitSettings.autocast`). Nothing here computes.

Example:
    >>> import torch
    >>> from ampkit.integrations._settings import AmpkitSettings
    >>> s = AmpkitSettings.build("O2", torch.float16, {"hysteresis": 2}, owner="X")
    >>> s.make_scaler("cpu").get_scale(), s.make_scaler("cpu").schedule.hysteresis
    (65536.0, 2)
    >>> AmpkitSettings.build("O2", torch.bfloat16, {}, owner="X").make_scaler("cpu") is None
    True
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

import torch

import ampkit
from ampkit import config as schema
from ampkit.common.arguments import DEPRECATED_NAMES, canonical_names
from ampkit.config import SCALER_FIELDS, AmpConfig
from ampkit.conversion.levels import APEX_OVERRIDES, LEVEL_SETTINGS, LevelProperties

__all__ = ["SCALER_OPTIONS", "AmpkitSettings", "accepted_options", "missing_framework"]

#: ``ampkit.GradScaler`` options an integration accepts (all but ``device`` and
#: ``enabled``, which the integration decides).
SCALER_OPTIONS: tuple[str, ...] = SCALER_FIELDS


def _extra_names() -> tuple[str, ...]:
    # the apex overrides an integration passes on to initialize: not the scale_loss
    # ones (it scales the loss with its own GradScaler)
    return tuple(n for n, sets in APEX_OVERRIDES.items() if sets != "scale_loss")


def accepted_options() -> tuple[str, ...]:
    """Every option an integration accepts besides ``level``, ``dtype`` and ``config``,
    read when called: :class:`ampkit.AmpConfig`'s fields, the apex overrides that pass
    on to ``ampkit.initialize``, and the deprecated names (which warn).

    Example:
        >>> from ampkit.integrations._settings import accepted_options
        >>> accepted_options()[:2], "cast_model_type" in accepted_options()
        (('policy', 'custom_white_list'), True)
    """
    fields = tuple(f.name for f in schema.config_fields() if f.name not in ("level", "dtype"))
    return (*fields, *_extra_names(), *DEPRECATED_NAMES)


# host framework's precision word -> the dtype it asks for ("no": none)
_HOST_DTYPES = {"no": None, "fp32": None, "32": None, "bf16": torch.bfloat16,
                "fp16": torch.float16}


def missing_framework(module: str, extra: str) -> str:
    """The message of the ``ImportError`` an integration raises without its framework.

    Example:
        >>> from ampkit.integrations._settings import missing_framework
        >>> missing_framework("lightning", "lightning")
        "ampkit.integrations.lightning needs the 'lightning' package: pip install ..."
    """
    return (f"ampkit.integrations.{extra} needs the {module!r} package: "
            f"pip install 'ampkit[{extra}]'")


@dataclasses.dataclass(frozen=True)
class AmpkitSettings:
    """An :class:`ampkit.AmpConfig` plus the rare ``initialize`` overrides it does not
    hold (immutable), and the integration that owns them (named in errors).

    Build it with :meth:`build`, which checks everything it can before any model exists.
    """

    config: AmpConfig
    extra: MappingProxyType[str, Any]
    owner: str

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # a mappingproxy does not pickle: spawn launchers (Lightning's ddp_spawn,
        # torch.multiprocessing, notebooks) pickle the plugin or accelerator holding
        # these settings, so send the overrides as a plain dict and freeze them again
        return _rebuild_settings, (self.config, dict(self.extra), self.owner)

    @classmethod
    def build(cls, level: Any, dtype: torch.dtype | str | None, options: dict[str, Any], *,
              owner: str, config: AmpConfig | str | os.PathLike[str] | Mapping[str, Any]
              | None = None,
              default_level: str = "O2") -> AmpkitSettings:
        """Settings from ``config`` (an AmpConfig, the path of a config file or a
        mapping of its fields) and/or
        ``level``, ``dtype`` and ``options`` (AmpConfig fields and the apex overrides,
        :func:`accepted_options`); ``None`` values count as not given. Without a config,
        the fields given make one (``level`` defaulting to ``default_level``); with one,
        each field given must agree with it.

        Raises:
            TypeError: an option that is neither, listing the accepted ones.
            ValueError: a bad value, a field that contradicts ``config`` (both named),
                or scaler options for a level and dtype that scale no loss (with
                ``dtype=None`` that is known, and refused, once the model's device is).

        Example:
            >>> from ampkit.config import AmpConfig
            >>> from ampkit.integrations._settings import AmpkitSettings
            >>> AmpkitSettings.build("O2", "float16", {"num_losses": 2}, owner="P")
            Traceback (most recent call last):
            ...
            TypeError: P: num_losses configures ampkit.scale_loss, which P does not use: ...
            >>> AmpkitSettings.build("O3", None, {}, owner="P", config=AmpConfig("O2"))
            Traceback (most recent call last):
            ...
            ValueError: P: level='O3' contradicts the config's level='O2'; ...
        """
        for name, sets in APEX_OVERRIDES.items():
            if sets == "scale_loss" and options.get(name) is not None:
                raise TypeError(f"{owner}: {name} configures ampkit.scale_loss, which "
                                f"{owner} does not use: it scales one loss per optimizer "
                                f"step")
        accepted = accepted_options()
        unknown = sorted(set(options) - set(accepted))
        if unknown:
            raise TypeError(f"{owner} got unknown options {unknown}; accepted: "
                            f"{['level', 'dtype', 'config', *accepted]}")
        # the warning points at the line that made the plugin, accelerator or trainer
        options = canonical_names(options, owner, stacklevel=4)
        schema_fields = schema.config_fields()
        fields = {f.name: options[f.name] for f in schema_fields
                  if options.get(f.name) is not None}
        if level is not None:
            fields["level"] = str(getattr(level, "value", level))
        if dtype is not None:
            fields["dtype"] = dtype
        for f in schema_fields:
            if f.default is False and fields.get(f.name) is False:
                del fields[f.name]  # the default: not a choice to check
        extra = {k: v for k, v in options.items() if k in _extra_names() and v is not None}
        cfg = schema.merged_config(fields, config, source=owner,
                                   defaults={"level": default_level})
        settings = cls(cfg, MappingProxyType(extra), owner)
        settings.properties(None)  # a bad extra property fails here
        return settings

    def with_host_precision(self, setting: str, value: str | None) -> AmpkitSettings:
        """These settings with the host framework's precision ``value`` (``"no"``,
        ``"bf16"``, ``"fp16"``, ...; ``setting`` says where it was set) mapped onto
        the dtype: the same meaning is taken over, a contradiction is an error naming
        both settings, and a value ampkit has no meaning for is refused.

        Example:
            >>> from ampkit.integrations._settings import AmpkitSettings
            >>> s = AmpkitSettings.build("O2", None, {}, owner="P")
            >>> s.with_host_precision("mixed_precision='fp16'", "fp16").config.dtype
            torch.float16
            >>> s = AmpkitSettings.build("O2", "bfloat16", {}, owner="P")
            >>> s.with_host_precision("mixed_precision='fp16'", "fp16")
            Traceback (most recent call last):
            ...
            ValueError: P: mixed_precision='fp16' asks for torch.float16, but the ampkit ...
        """
        if value is None:
            return self
        key = str(value).lower()
        if key not in _HOST_DTYPES:
            raise ValueError(f"{self.owner}: {setting} has no ampkit meaning; "
                             f"leave it out (or 'no') and set the precision in the ampkit "
                             f"config ({self.describe()}); accepted: "
                             f"{sorted(_HOST_DTYPES)}")
        dtype = _HOST_DTYPES[key]
        if dtype is None or self.config.dtype is dtype:
            return self
        if self.config.dtype is not None:
            raise ValueError(f"{self.owner}: {setting} asks for {dtype}, but the "
                             f"ampkit config says dtype={self.config.dtype}; set the "
                             f"precision in one place")
        try:
            config = self.config.replace(dtype=dtype)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{self.owner}: {setting} (dtype {dtype}) does not "
                             f"fit the ampkit config: {error}") from None
        return dataclasses.replace(self, config=config)

    def properties(self, device_type: str | None) -> LevelProperties:
        """The level's properties on ``device_type`` (``None``: CUDA if available).

        Example:
            >>> from ampkit.integrations._settings import AmpkitSettings
            >>> AmpkitSettings.build("O3", None, {}, owner="P").properties("cpu").dtype
            torch.bfloat16
        """
        in_memory = {k: v for k, v in self.extra.items() if k in LEVEL_SETTINGS}
        return self.config.level_conversion(device_type, **in_memory).properties

    def initialize(self, models: Any, optimizers: Any = None) -> Any:
        """``ampkit.initialize`` with the config's choices (its loss-scale options left
        out: the integration's own GradScaler takes them): calling it again with the
        same models changes nothing, so an integration may call it first with the
        model, then with the model and the optimizers.

        Example:
            >>> import torch
            >>> from ampkit.integrations._settings import AmpkitSettings
            >>> s = AmpkitSettings.build("O2", torch.bfloat16, {}, owner="P")
            >>> net = s.initialize(torch.nn.Linear(2, 2))
            >>> net.weight.dtype  # O2: the fp32 truth, bf16 copies made on use
            torch.float32
        """
        # the integration's own GradScaler takes the loss-scale options
        config = self.config.replace(log_skipped_steps=False,
                                     **dict.fromkeys(SCALER_FIELDS))
        if optimizers is None:
            return ampkit.initialize(models, config=config, **self.extra)
        return ampkit.initialize(models, optimizers, config=config, **self.extra)

    def make_scaler(self, device_type: str) -> Any:
        """The ``ampkit.GradScaler`` the level calls for on ``device_type``, or ``None``
        (bfloat16, O0, O3, ``loss_scale=None``). A static ``loss_scale`` gives a scaler
        with ``dynamic=False``: overflowing steps are still skipped.

        Raises:
            ValueError: scaler options set, but the level scales no loss on this device.

        Example:
            >>> from ampkit.integrations._settings import AmpkitSettings
            >>> s = AmpkitSettings.build("O1", "float16", {"loss_scale": 128.0}, owner="P")
            >>> scaler = s.make_scaler("cpu")
            >>> scaler.get_scale(), scaler.schedule.dynamic
            (128.0, False)
        """
        props = self.properties(device_type)
        options: dict[str, Any] = self.config.scaler_options()
        if props.loss_scale is None:
            if options:
                raise ValueError(
                    f"{self.owner}: {sorted(options)} set up loss scaling, but level "
                    f"{props.level.value} with {props.dtype} scales no loss; pass "
                    f"loss_scale='dynamic' to scale it anyway")
            return None
        if props.loss_scale != "dynamic":
            options.update(init_scale=float(props.loss_scale), dynamic=False)
        # a scaler here was asked for (bfloat16 scales only with loss_scale set)
        return ampkit.GradScaler(device_type, log_skipped_steps=self.config.log_skipped_steps,
                                 scale_bfloat16=True, **options)

    @contextlib.contextmanager
    def autocast(self, device_type: str, cache_enabled: bool | None = None
                 ) -> Iterator[None]:
        """The level's autocast region (its policy and custom lists) for code that runs
        outside the model's own forward, such as a loss computed in a training step; no
        region for levels that patch no ops (O0, O3). ``cache_enabled`` is
        ``ampkit.autocast``'s (``None``: torch's setting).

        Example:
            >>> import torch
            >>> from ampkit.integrations._settings import AmpkitSettings
            >>> s = AmpkitSettings.build("O1", torch.bfloat16,
            ...                          {"custom_white_list": {"add"}}, owner="P")
            >>> with s.autocast("cpu"):
            ...     (torch.ones(2) + torch.ones(2)).dtype
            torch.bfloat16
        """
        props = self.properties(device_type)
        if not props.patch_ops:
            yield
            return
        cfg = self.config
        with ampkit.autocast(device_type, props.dtype, cache_enabled=cache_enabled,
                             policy=cfg.policy,
                             custom_white_list=cfg.custom_white_list or None,
                             custom_black_list=cfg.custom_black_list or None):
            yield

    def describe(self) -> str:
        """``level='O2', dtype=torch.bfloat16, ...`` (the fields that differ from
        AmpConfig's defaults): for reprs and error messages.

        Example:
            >>> import torch
            >>> from ampkit.integrations._settings import AmpkitSettings
            >>> AmpkitSettings.build("O2", torch.float16, {"hysteresis": 2},
            ...                      owner="P").describe()
            "level='O2', dtype=torch.float16, hysteresis=2"
        """
        default = AmpConfig()
        parts = [f"level={self.config.level!r}", f"dtype={self.config.dtype!r}"]
        parts += [f"{f.name}={getattr(self.config, f.name)!r}"
                  for f in dataclasses.fields(AmpConfig) if f.name not in ("level", "dtype")
                  and getattr(self.config, f.name) != getattr(default, f.name)]
        parts += [f"{k}={v!r}" for k, v in self.extra.items()]
        return ", ".join(parts)


def _rebuild_settings(config: AmpConfig, extra: dict[str, Any], owner: str) -> AmpkitSettings:
    # the other half of AmpkitSettings.__reduce__
    return AmpkitSettings(config, MappingProxyType(extra), owner)
