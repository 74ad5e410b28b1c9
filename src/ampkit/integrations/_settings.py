"""What every integration is given: a level, a dtype, ``initialize`` overrides and loss
scaling options, checked once, then turned into front-door calls.

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
from collections.abc import Iterator
from types import MappingProxyType
from typing import Any

import torch

import ampkit
from ampkit.front_door import INITIALIZE_OVERRIDES
from ampkit.levels import LEVEL_PROPERTY_NAMES, LevelProperties

__all__ = ["OPTIONS", "SCALER_OPTIONS", "AmpkitSettings", "missing_framework"]

#: ``ampkit.GradScaler`` options an integration accepts (all but ``device`` and
#: ``enabled``, which the integration decides).
SCALER_OPTIONS: tuple[str, ...] = ("init_scale", "growth_factor", "backoff_factor",
                                   "growth_interval", "hysteresis", "min_scale", "max_scale")
# initialize's options for apex-style scale_loss: an integration scales with its own
# GradScaler, so these would configure something it never uses.
_SCALE_LOSS_OPTIONS = {"num_losses": None, "min_loss_scale": "min_scale",
                       "max_loss_scale": "max_scale"}
_ACCEPTED = tuple(k for k in INITIALIZE_OVERRIDES if k not in _SCALE_LOSS_OPTIONS)
#: Every option an integration accepts besides ``level`` and ``dtype``.
OPTIONS: tuple[str, ...] = _ACCEPTED + SCALER_OPTIONS


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
    """A level, a dtype, ``initialize`` overrides and loss scaling options (immutable).

    Build it with :meth:`build`, which checks everything it can before any model exists.
    """

    level: str
    dtype: torch.dtype | str | None
    overrides: MappingProxyType[str, Any]
    scaler_options: MappingProxyType[str, Any]
    owner: str

    @classmethod
    def build(cls, level: Any, dtype: torch.dtype | str | None, options: dict[str, Any], *,
              owner: str) -> AmpkitSettings:
        """Split ``options`` into ``initialize`` overrides and ``GradScaler`` options and
        check them; ``owner`` (the integration's class) names the errors.

        Raises:
            TypeError: an option that is neither, listing the accepted ones.
            ValueError: a bad level, dtype, level property or scaler value, or scaler
                options for a level and dtype that scale no loss (with ``dtype=None``
                that is known, and refused, once the model's device is).

        Example:
            >>> from ampkit.integrations._settings import AmpkitSettings
            >>> AmpkitSettings.build("O2", "bfloat16", {"min_loss_scale": 1.0}, owner="P")
            Traceback (most recent call last):
            ...
            TypeError: P: min_loss_scale configures ampkit.scale_loss, ...; pass min_scale ...
        """
        for name, instead in _SCALE_LOSS_OPTIONS.items():
            if name in options:
                hint = (f"; pass {instead} (an ampkit.GradScaler option)" if instead
                        else ": it scales one loss per optimizer step")
                raise TypeError(f"{owner}: {name} configures ampkit.scale_loss, which "
                                f"{owner} does not use{hint}")
        unknown = sorted(set(options) - set(_ACCEPTED) - set(SCALER_OPTIONS))
        if unknown:
            raise TypeError(f"{owner} got unknown options {unknown}; accepted: "
                            f"{list(_ACCEPTED) + list(SCALER_OPTIONS)}")
        overrides = {k: v for k, v in options.items() if k in _ACCEPTED}
        scaler = {k: v for k, v in options.items() if k in SCALER_OPTIONS}
        settings = cls(str(getattr(level, "value", level)), dtype,
                       MappingProxyType(overrides), MappingProxyType(scaler), owner)
        props = settings.properties(None)  # a bad level, dtype or property fails here
        if scaler:
            if dtype is not None:  # else the device decides, once the model is there
                settings._check_scales(props)
            ampkit.GradScaler("cpu", **scaler)  # checks every value, naming it
        return settings

    def _check_scales(self, props: LevelProperties) -> None:
        if self.scaler_options and props.loss_scale is None:
            raise ValueError(
                f"{self.owner}: {sorted(self.scaler_options)} set up loss scaling, but level "
                f"{props.level.value} with {props.dtype} scales no loss; pass "
                f"loss_scale='dynamic' to scale it anyway")

    def properties(self, device_type: str | None) -> LevelProperties:
        """The level's properties on ``device_type`` (``None``: CUDA if available).

        Example:
            >>> from ampkit.integrations._settings import AmpkitSettings
            >>> AmpkitSettings.build("O3", None, {}, owner="P").properties("cpu").dtype
            torch.bfloat16
        """
        level_args = {k: v for k, v in self.overrides.items() if k in LEVEL_PROPERTY_NAMES}
        for alias, name in (("keep_batchnorm_fp32", "keep_norms_fp32"),
                            ("patch_torch_functions", "patch_ops")):
            if alias in self.overrides:
                level_args[name] = self.overrides[alias]
        return ampkit.level_properties(self.level, self.dtype, device_type=device_type,
                                       **level_args)

    def initialize(self, models: Any, optimizers: Any = None) -> Any:
        """``ampkit.initialize(models, optimizers, level, dtype, **overrides)``: calling it
        again with the same models changes nothing, so an integration may call it first
        with the model, then with the model and the optimizers.

        Example:
            >>> import torch
            >>> from ampkit.integrations._settings import AmpkitSettings
            >>> s = AmpkitSettings.build("O2", torch.bfloat16, {}, owner="P")
            >>> net = s.initialize(torch.nn.Linear(2, 2))
            >>> net.weight.dtype  # O2: the fp32 truth, bf16 copies made on use
            torch.float32
        """
        if optimizers is None:
            return ampkit.initialize(models, level=self.level, dtype=self.dtype,
                                     **self.overrides)
        return ampkit.initialize(models, optimizers, level=self.level, dtype=self.dtype,
                                 **self.overrides)

    def make_scaler(self, device_type: str) -> Any:
        """The ``ampkit.GradScaler`` the level calls for on ``device_type``, or ``None``
        (bfloat16, O0, O3, ``loss_scale=None``). A static ``loss_scale`` gives a scaler
        with ``dynamic=False``: overflowing steps are still skipped.

        Example:
            >>> from ampkit.integrations._settings import AmpkitSettings
            >>> s = AmpkitSettings.build("O1", "float16", {"loss_scale": 128.0}, owner="P")
            >>> scaler = s.make_scaler("cpu")
            >>> scaler.get_scale(), scaler.schedule.dynamic
            (128.0, False)
        """
        props = self.properties(device_type)
        self._check_scales(props)
        loss_scale = props.loss_scale
        if loss_scale is None:
            return None
        options = dict(self.scaler_options)
        if loss_scale != "dynamic":
            options.update(init_scale=float(loss_scale), dynamic=False)
        return ampkit.GradScaler(device_type, **options)

    @contextlib.contextmanager
    def autocast(self, device_type: str) -> Iterator[None]:
        """The level's autocast region (its policy and custom lists) for code that runs
        outside the model's own forward, such as a loss computed in a training step; no
        region for levels that patch no ops (O0, O3).

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
        with ampkit.autocast(device_type, props.dtype,
                             policy=self.overrides.get("policy", "torch"),
                             custom_white_list=self.overrides.get("custom_white_list"),
                             custom_black_list=self.overrides.get("custom_black_list")):
            yield

    def describe(self) -> str:
        """``level='O2', dtype=torch.bfloat16, ...``: for reprs and error messages.

        Example:
            >>> import torch
            >>> from ampkit.integrations._settings import AmpkitSettings
            >>> AmpkitSettings.build("O2", torch.float16, {"hysteresis": 2},
            ...                      owner="P").describe()
            "level='O2', dtype=torch.float16, hysteresis=2"
        """
        parts = [f"level={self.level!r}", f"dtype={self.dtype!r}"]
        parts += [f"{k}={v!r}" for k, v in {**self.overrides, **self.scaler_options}.items()]
        return ", ".join(parts)
