"""``AmpConfig``: everything a user chooses about mixed precision, as one typed value.

One frozen dataclass holds the level, the dtype, the policy (a preset name or the path
of a policy file, such as the one ``ampkit tune`` writes), the custom op lists, the
modules kept in fp32, the master-weights mode, the loss-scale options, the fp8
recipe with the choice of its layers, and the dtype of the model's outputs. It is
checked once, when it is made (by the same checks ``ampkit.initialize`` runs), compares
by value, and round-trips through a dict and a JSON or YAML file.

The same object drives ``ampkit.initialize(model, optimizer, config=cfg)`` and the
integrations (``AmpkitPrecision(config=cfg)``, ``AmpkitTrainer(..., config=cfg)``,
``AmpkitAccelerator(config=cfg)``), which also save it with their checkpoints.

A field left ``None`` keeps the level's default (as ``initialize``'s keywords do).
The loss-scale options ``init_scale`` ... ``max_scale`` configure the integrations'
``ampkit.GradScaler``; with ``ampkit.initialize`` they configure ``ampkit.scale_loss``.

Example:
    >>> import torch
    >>> from ampkit.config import AmpConfig
    >>> cfg = AmpConfig(level="O2", dtype="float16", custom_black_list=["softmax"],
    ...                 hysteresis=2)
    >>> cfg.dtype, cfg.custom_black_list
    (torch.float16, ('softmax',))
    >>> AmpConfig.from_dict(cfg.to_dict()) == cfg
    True
    >>> AmpConfig(level="O5")
    Traceback (most recent call last):
    ...
    ValueError: level must be one of ['O0', 'O1', 'O2', 'O3'], got 'O5'
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import numbers
import os
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from ampkit.conversion.levels import MasterWeights
from ampkit.fp8.recipe import FP8_RECIPES

if TYPE_CHECKING:
    from ampkit.conversion.levels import BuiltLevel, Level

__all__ = ["SCALER_FIELDS", "AmpConfig", "config_fields", "contradiction", "field_help",
           "merged_config", "text_kind"]

# file suffix -> format
_FORMATS = {".json": "json", ".yaml": "yaml", ".yml": "yaml"}


# -- each field's help, and the values its parser accepts, read from that parser -----------

def _levels() -> str:
    from ampkit.conversion.levels import Level

    return ", ".join(level.value for level in Level) + " (any case)"


def _dtype_values(dtypes: Iterable[torch.dtype]) -> str:
    from ampkit.common.arguments import dtype_names

    return ", ".join("|".join(dtype_names([d])) for d in dtypes) + " (any case)"


def _low_dtypes() -> str:
    from ampkit.common.arguments import LOW_PRECISION

    return _dtype_values(LOW_PRECISION)


def _float_dtypes() -> str:
    from ampkit.common.arguments import FLOAT_DTYPES

    return _dtype_values(FLOAT_DTYPES)


def _output_values() -> str:
    from ampkit.conversion.levels import AS_COMPUTED

    return f"{_float_dtypes()}, or {AS_COMPUTED}"


def _policies() -> str:
    from ampkit.policies.presets import available_policies

    return ", ".join(available_policies()) + ", or a .json policy file"


def _master_weights() -> str:
    from ampkit.conversion.levels import MasterWeights

    return ", ".join(("true", "false", *(m.value for m in MasterWeights))) + " (any case)"


def _fp8_recipes() -> str:
    return ", ".join(FP8_RECIPES) + " (any case)"


def _about(text: str, values: Any = None) -> dict[str, Any]:
    # a field's metadata: its help, and the function listing the values it accepts
    return {"help": text, "values": values}


def _scaler(text: str) -> dict[str, Any]:
    # the metadata of a field that is an ampkit.GradScaler option of the same name
    return {"help": f"GradScaler: {text}", "values": None, "scaler": True}


def field_help(name: str) -> str:
    """The help of :class:`AmpConfig`'s field ``name``, with the values it accepts
    (read from the parser that checks them): the one text every settings surface
    (the trainers' flags, the command line) shows.

    Example:
        >>> from ampkit.config import field_help
        >>> field_help("dtype")
        "low-precision dtype; unset: the device's autocast default; float16|fp16|half, \
bfloat16|bf16 (any case)"
    """
    meta = _field(name).metadata
    values = meta.get("values")
    text: str = meta.get("help", name)
    return text + (f"; {values()}" if values is not None else "")


def config_fields() -> tuple[dataclasses.Field[Any], ...]:
    """:class:`AmpConfig`'s fields, read when called: the one list every settings
    surface is generated from (``initialize``'s keywords, the integrations' options,
    the Hugging Face flags, Lightning's parameters, the command line's flags).

    Example:
        >>> from ampkit.config import config_fields
        >>> [f.name for f in config_fields()][:3]
        ['level', 'dtype', 'policy']
    """
    return dataclasses.fields(AmpConfig)


def _field(name: str) -> dataclasses.Field[Any]:
    fields = {f.name: f for f in config_fields()}
    if name not in fields:
        raise ValueError(f"AmpConfig has no field {name!r}; accepted: {list(fields)}")
    return fields[name]


def text_kind(name: str) -> type:
    """What a command line or a flag gives for :class:`AmpConfig`'s field ``name``,
    read from its type: ``bool``, ``int``, ``float``, ``list`` (of names) or ``str``
    (text the field's own check parses: a level, a dtype's name, ``"dynamic"``, ...).

    Example:
        >>> from ampkit.config import text_kind
        >>> text_kind("hysteresis"), text_kind("custom_black_list"), text_kind("dtype")
        (<class 'int'>, <class 'list'>, <class 'str'>)
    """
    hint = typing.get_type_hints(AmpConfig)[_field(name).name]
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    kinds = set(typing.get_args(hint)) - {type(None)} if union else {hint}
    if any(typing.get_origin(k) is tuple for k in kinds):
        return list
    only = next(iter(kinds))
    if len(kinds) == 1 and only in (bool, int, float):
        return typing.cast(type, only)
    return str


def _op_list(value: Any, name: str) -> tuple[str, ...]:
    from ampkit.policies.registry import resolve_ops

    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, Iterable):
        raise TypeError(f"{name} must be a list of op names, got {type(value).__name__}")
    # canonical names, sorted: two configs naming the same ops compare equal
    return tuple(sorted(resolve_ops(list(value), argument=name)))


def _module_names(value: Any, name: str) -> tuple[str, ...]:
    items = (value,) if isinstance(value, str) else value
    if not isinstance(items, Iterable) or not all(isinstance(v, str) for v in items):
        raise TypeError(f"{name} must be a list of qualified module names as "
                        f"in model.named_modules() (e.g. ['lm_head']), got {value!r}; pass "
                        f"module classes or instances to ampkit.initialize directly")
    return tuple(items)


def _optional(value: Any, name: str, kind: type, accepted: str) -> Any:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, kind):
        raise TypeError(f"{name} must be {accepted} or None, got {value!r}")
    return value


def _check_policy(value: Any) -> str:
    from ampkit.policies.presets import available_policies, get_policy

    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value:
        raise TypeError(f"policy must be a preset name {sorted(available_policies())} or "
                        f"the path of a policy file, got {value!r}")
    get_policy(value)  # an unknown preset or an unreadable file fails here, named
    return value


@dataclasses.dataclass(frozen=True)
class AmpConfig:
    """Every mixed-precision choice, typed, frozen and checked when made.

    Attributes:
        level: ``"O0"``-``"O3"`` (``ampkit.conversion.levels``); ``"O1"`` by default, as
            ``ampkit.initialize``.
        dtype: ``torch.float16`` or ``torch.bfloat16`` (names accepted, stored as the
            dtype); ``None``: the device's autocast default.
        policy: a preset name (``"torch"``, ``"conservative"``, ...) or the path of a
            policy JSON file (``ampkit tune --out``).
        custom_white_list: op names run in low precision too (stored as sorted
            canonical names).
        custom_black_list: op names run in float32 (stored as sorted canonical names).
        keep_fp32_modules: qualified module names (as in ``model.named_modules()``)
            kept in fp32.
        keep_norms_fp32: ``None`` keeps the level's default.
        master_weights: a :class:`ampkit.conversion.levels.MasterWeights` (stored as one): given
            as a member, ``True``/``False``, or its value in any case (``"fp32"``,
            ``"none"``, ``"stochastic"``/``"kahan"``: pure bfloat16, ``"true"``,
            ``"false"``); ``None`` keeps the level's default.
        rounding_seed: seeds the rounding of ``"stochastic"``/``"kahan"``.
        loss_scale: ``"dynamic"``, a positive number (static scaling), or ``None``
            (the level's default: dynamic for float16, none for bfloat16).
        init_scale: the first loss scale (an ``ampkit.GradScaler`` option); ``None``:
            its default.
        growth_factor: the factor the scale grows by; ``None``: the scaler's default.
        backoff_factor: the factor the scale shrinks by on an overflow; ``None``: the
            scaler's default.
        growth_interval: steps without an overflow before the scale grows; ``None``:
            the scaler's default.
        hysteresis: overflows tolerated before the scale shrinks; ``None``: the
            scaler's default.
        min_scale: the smallest loss scale; ``None``: the scaler's default.
        max_scale: the largest loss scale; ``None``: the scaler's default.
        log_skipped_steps: print one line for each step skipped on an overflow.
        fp8: an fp8 recipe for Linear layers, one of
            :data:`ampkit.fp8.FP8_RECIPES`, or ``None``.
        fp8_exclude_modules: qualified module names kept out of fp8 (they follow the
            level instead); needs ``fp8``.
        fp8_first_last: also train the model's first and last Linear in fp8; needs
            ``fp8``.
        cast_model_outputs: the dtype the model's low-precision floating outputs are
            cast to (``float16``, ``bfloat16`` or ``float32``, names accepted, stored as
            the dtype), or ``"as_computed"`` (as the model computed them, as native
            autocast hands them back); ``None`` keeps the level's default.
        step_in_backward: step each parameter inside backward as soon as its gradient
            is accumulated, and free the gradient (:mod:`ampkit.step_in_backward`);
            refused with loss scaling.
        compile_step: run the pure bfloat16 step (``master_weights="stochastic"`` or
            ``"kahan"``) as code compiled by ``torch.compile``
            (:mod:`ampkit.pure.compiled_step`);
            refused with any other ``master_weights``.

    Raises:
        ValueError: a bad value or a combination that means nothing (the message names
            the field and the accepted values).
        TypeError: a value of the wrong type, naming the field.

    Example:
        >>> from ampkit.config import AmpConfig
        >>> AmpConfig(level="O2", dtype="bfloat16") == AmpConfig("O2", "bf16")
        True
        >>> AmpConfig(level="O2", dtype="bfloat16", init_scale=1024.0)
        Traceback (most recent call last):
        ...
        ValueError: ['init_scale'] set up loss scaling, but level O2 with torch.bfloat16 ...
    """

    level: str = dataclasses.field(
        default="O1", metadata=_about("precision level (ampkit.conversion.levels)", _levels))
    dtype: torch.dtype | None = dataclasses.field(default=None, metadata=_about(
        "low-precision dtype; unset: the device's autocast default", _low_dtypes))
    policy: str = dataclasses.field(default="torch", metadata=_about(
        "the op lists: a preset or the path of a policy file (ampkit tune --out)",
        _policies))
    custom_white_list: tuple[str, ...] = dataclasses.field(
        default=(), metadata=_about("ops run in low precision too"))
    custom_black_list: tuple[str, ...] = dataclasses.field(
        default=(), metadata=_about("ops run in float32"))
    keep_fp32_modules: tuple[str, ...] = dataclasses.field(default=(), metadata=_about(
        "qualified module names (as in model.named_modules()) kept in float32"))
    keep_norms_fp32: bool | None = dataclasses.field(default=None, metadata=_about(
        "keep norm layers in float32; unset: the level's"))
    master_weights: MasterWeights | None = dataclasses.field(default=None, metadata=_about(
        "where the parameters' truth lives; unset: the level's", _master_weights))
    rounding_seed: int | None = dataclasses.field(
        default=None, metadata=_about("seed of the stochastic/kahan rounding"))
    loss_scale: str | float | None = dataclasses.field(default=None, metadata=_about(
        "'dynamic' or a number (static); unset: the level's (dynamic for float16)"))
    init_scale: float | None = dataclasses.field(
        default=None, metadata=_scaler("the first loss scale"))
    growth_factor: float | None = dataclasses.field(
        default=None, metadata=_scaler("the factor the scale grows by"))
    backoff_factor: float | None = dataclasses.field(default=None, metadata=_scaler(
        "the factor the scale shrinks by on an overflow"))
    growth_interval: int | None = dataclasses.field(default=None, metadata=_scaler(
        "steps without an overflow before the scale grows"))
    hysteresis: int | None = dataclasses.field(default=None, metadata=_scaler(
        "overflows tolerated before the scale shrinks"))
    min_scale: float | None = dataclasses.field(
        default=None, metadata=_scaler("the smallest loss scale"))
    max_scale: float | None = dataclasses.field(
        default=None, metadata=_scaler("the largest loss scale"))
    log_skipped_steps: bool = dataclasses.field(
        default=False, metadata=_about("print one line per step skipped on an overflow"))
    fp8: str | None = dataclasses.field(default=None, metadata=_about(
        "fp8 recipe for Linear layers (needs ampkit[fp8])", _fp8_recipes))
    fp8_exclude_modules: tuple[str, ...] = dataclasses.field(
        default=(), metadata=_about("qualified module names kept out of fp8"))
    fp8_first_last: bool = dataclasses.field(
        default=False, metadata=_about("train the first and last Linear in fp8 too"))
    cast_model_outputs: torch.dtype | str | None = dataclasses.field(
        default=None, metadata=_about(
            "dtype of the model's low-precision floating outputs, or as_computed; unset: "
            "the level's", _output_values))
    step_in_backward: bool = dataclasses.field(default=False, metadata=_about(
        "step each parameter inside backward as its gradient is ready (frees gradients)"))
    compile_step: bool = dataclasses.field(default=False, metadata=_about(
        "run the pure bf16 optimizer step (master_weights stochastic|kahan) compiled"))

    def __post_init__(self) -> None:
        # Every check is one that initialize, the level table or GradScaler already
        # runs: the config calls them, so a config that is made is one they accept.
        from ampkit.conversion.levels import Level, master_weights_value
        from ampkit.fp8.convert import check_fp8_level, check_fp8_options
        from ampkit.policies.policy import as_dtype
        from ampkit.scaling.schedule import ScaleSchedule

        put = object.__setattr__
        level = Level.parse(self.level)  # the one parse of the level's text
        put(self, "level", level.value)
        put(self, "dtype", as_dtype(self.dtype, "dtype"))
        put(self, "policy", _check_policy(self.policy))
        put(self, "custom_white_list", _op_list(self.custom_white_list, "custom_white_list"))
        put(self, "custom_black_list", _op_list(self.custom_black_list, "custom_black_list"))
        put(self, "keep_fp32_modules", _module_names(self.keep_fp32_modules,
                                                     "keep_fp32_modules"))
        put(self, "fp8_exclude_modules", _module_names(self.fp8_exclude_modules,
                                                       "fp8_exclude_modules"))
        if self.keep_norms_fp32 is not None and not isinstance(self.keep_norms_fp32, bool):
            raise TypeError(f"keep_norms_fp32 must be True, False or None, got "
                            f"{self.keep_norms_fp32!r}")
        _optional(self.rounding_seed, "rounding_seed", numbers.Integral, "an int")
        if not isinstance(self.log_skipped_steps, bool):
            raise TypeError(f"log_skipped_steps must be True or False, got "
                            f"{self.log_skipped_steps!r}")
        if self.fp8 is not None and not isinstance(self.fp8, str):
            # a config is data that goes to files: recipes by name
            raise TypeError(f"fp8 must be None or a recipe name, one of "
                            f"{list(FP8_RECIPES)}, got {type(self.fp8).__name__}; pass a "
                            f"Float8LinearConfig to ampkit.initialize(fp8=...) directly")
        for name in ("growth_interval", "hysteresis"):
            _optional(getattr(self, name), name, numbers.Integral, "an int >= 1")
        scaler = self.scaler_options()
        schedule = ScaleSchedule(**{k: v for k, v in scaler.items() if k != "init_scale"})
        if "init_scale" in scaler:
            put(self, "init_scale", schedule.check_init_scale(scaler["init_scale"]))
        for name in ("growth_factor", "backoff_factor", "min_scale", "max_scale"):
            if getattr(self, name) is not None:
                put(self, name, float(getattr(schedule, name)))
        # one form from here inward: True, "true", "fp32" are MasterWeights.FP32
        put(self, "master_weights", master_weights_value(self.master_weights))
        if isinstance(self.loss_scale, str) and self.loss_scale != "dynamic":
            # text (a flag, a command line): a number's text is the number
            with contextlib.suppress(ValueError):
                put(self, "loss_scale", float(self.loss_scale))
        built = self._build(level, None, {})
        props, conversion = built
        # kept (not a field): initialize reuses it rather than building it again
        put(self, "_conversion", built)
        if self.cast_model_outputs is not None:  # the dtype the level table parsed
            put(self, "cast_model_outputs", props.cast_model_outputs)
        if isinstance(self.loss_scale, numbers.Real):
            put(self, "loss_scale", float(self.loss_scale))
        fp8 = check_fp8_options(self.fp8, self.fp8_exclude_modules, self.fp8_first_last)
        put(self, "fp8", check_fp8_level(fp8, conversion))
        if self.rounding_seed is not None and not props.master_weights.pure:
            raise ValueError(f"rounding_seed seeds the rounding of master_weights="
                             f"'stochastic' or 'kahan'; this config keeps master_weights="
                             f"{props.master_weights.spelled()!r}")
        if scaler and self.dtype is not None and props.loss_scale is None:
            raise ValueError(f"{sorted(scaler)} set up loss scaling, but level "
                             f"{self.level} with {self.dtype} scales no loss; set "
                             f"loss_scale='dynamic' to scale it anyway")
        if not isinstance(self.step_in_backward, bool):
            raise TypeError(f"step_in_backward must be True or False, got "
                            f"{self.step_in_backward!r}")
        if not isinstance(self.compile_step, bool):
            raise TypeError(f"compile_step must be True or False, got "
                            f"{self.compile_step!r}")
        if self.compile_step and not props.master_weights.pure:
            raise ValueError(f"compile_step=True compiles the pure bfloat16 optimizer "
                             f"step, which needs master_weights='stochastic' or 'kahan' "
                             f"(at level O2 or O3 with dtype bfloat16); this config keeps "
                             f"master_weights={props.master_weights.spelled()!r}")
        if self.step_in_backward and self.dtype is not None and props.loss_scale is not None:
            from ampkit.step_in_backward import check_step_in_backward

            check_step_in_backward(None, loss_scale=props.loss_scale)

    # -- what each consumer is given ---------------------------------------------------

    def level_conversion(self, device_type: str | None = None,
                         **in_memory: Any) -> BuiltLevel:
        """The level's properties and conversion this config stands for, from
        :func:`ampkit.conversion.levels.build_level`: the ones built when the config
        was made (``dtype=None``: the default device's dtype, CUDA when available),
        or, for ``device_type`` where ``dtype`` is ``None``, or with ``in_memory``
        settings a config file cannot hold (module classes among
        ``keep_fp32_modules``, a ``Policy``, apex's ``cast_model_type``,
        ``patch_ops``, ``state_dict_dtype``, ``cast_buffers``), built for them.

        Example:
            >>> from ampkit.config import AmpConfig
            >>> props, conversion = AmpConfig("O2", "float16").level_conversion()
            >>> props.loss_scale, conversion.param_compute_dtype
            ('dynamic', torch.float16)
            >>> AmpConfig("O3").level_conversion("cpu").properties.dtype
            torch.bfloat16
        """
        from ampkit.conversion.levels import Level

        if in_memory or (device_type is not None and self.dtype is None):
            return self._build(Level(self.level), device_type, in_memory)
        built: BuiltLevel | None = self.__dict__.get("_conversion")
        if built is None:  # unpickled: the cache is not part of the state
            built = self._build(Level(self.level), None, {})
            object.__setattr__(self, "_conversion", built)
        return built

    def _build(self, level: Level, device_type: str | None,
               in_memory: Mapping[str, Any]) -> BuiltLevel:
        """:func:`~ampkit.conversion.levels.build_level` on this config's fields, with
        ``in_memory`` in their place: the one call from a config to its level."""
        from ampkit.conversion.levels import LEVEL_SETTINGS, build_level

        names = {f.name for f in dataclasses.fields(self)}
        chosen = {"level": level, **{n: getattr(self, n) for n in LEVEL_SETTINGS[1:]
                                     if n in names}, **in_memory}
        return build_level(**chosen, device_type=device_type)

    def __getstate__(self) -> dict[str, Any]:
        # the fields only: the conversion kept for level_conversion is rebuilt on use
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            object.__setattr__(self, name, value)

    def scaler_options(self) -> dict[str, Any]:
        """The ``ampkit.GradScaler`` options that are set (the others keep its defaults).

        Example:
            >>> from ampkit.config import AmpConfig
            >>> AmpConfig(dtype="float16", hysteresis=2).scaler_options()
            {'hysteresis': 2}
        """
        return {k: getattr(self, k) for k in SCALER_FIELDS if getattr(self, k) is not None}

    def replace(self, **changes: Any) -> AmpConfig:
        """A copy with ``changes`` applied (and checked again).

        Example:
            >>> from ampkit.config import AmpConfig
            >>> AmpConfig().replace(level="O2").level
            'O2'
        """
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise TypeError(f"AmpConfig has no fields {unknown}; accepted: "
                            f"{[f.name for f in dataclasses.fields(self)]}")
        return dataclasses.replace(self, **changes)

    def hyperparameters(self) -> dict[str, str | int | float | bool]:
        """The config as flat ``ampkit/<field>`` entries of plain scalars, for the
        hyperparameter logs of trackers: the fields that are set, each as its real
        value (a list as its names joined by commas, since TensorBoard's hyperparameters
        take only scalars); a field left unset (``None``, an empty list) is left out,
        so no tracker shows the text ``'None'`` or ``''`` for it.

        Example:
            >>> from ampkit.config import AmpConfig
            >>> hp = AmpConfig(custom_black_list=["exp", "softmax"]).hyperparameters()
            >>> hp["ampkit/custom_black_list"], "ampkit/dtype" in hp
            ('exp,softmax', False)
        """
        out: dict[str, str | int | float | bool] = {}
        for key, value in self.to_dict().items():
            if value is None or value == []:
                continue
            out[f"ampkit/{key}"] = ",".join(value) if isinstance(value, list) else value
        return out

    # -- dicts and files ---------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field (dtype by name, lists as lists,
        ``master_weights`` by its value); :meth:`from_dict` reads it back.

        Example:
            >>> from ampkit.config import AmpConfig
            >>> d = AmpConfig(dtype="bfloat16").to_dict()
            >>> d["level"], d["dtype"], d["custom_white_list"]
            ('O1', 'bfloat16', [])
        """
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.dtype):
                value = str(value).removeprefix("torch.")
            elif isinstance(value, MasterWeights):
                value = value.value
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AmpConfig:
        """A config from a mapping of field names (missing ones keep their defaults).

        Raises:
            ValueError: an unknown key or a bad value, naming the field and the
                accepted values.

        Example:
            >>> from ampkit.config import AmpConfig
            >>> AmpConfig.from_dict({"level": "O2", "dtype": "float16"}).dtype
            torch.float16
            >>> AmpConfig.from_dict({"levle": "O2"})
            Traceback (most recent call last):
            ...
            ValueError: unknown AmpConfig fields ['levle'] (did you mean 'level'?); ...
        """
        import difflib

        if not isinstance(data, Mapping):
            raise ValueError(f"an ampkit config must be a mapping of field names to "
                             f"values, got {type(data).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(names))
        if unknown:
            close = difflib.get_close_matches(str(unknown[0]), names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"unknown AmpConfig fields {unknown}{hint}; accepted: {names}")
        try:
            return cls(**dict(data))
        except TypeError as error:  # a file holds values, not types: one error type
            raise ValueError(str(error)) from None

    def to_file(self, path: str | os.PathLike[str]) -> None:
        """Write the config to ``path``: JSON for ``.json``, YAML for ``.yaml``/``.yml``
        (needs PyYAML: ``pip install 'ampkit[yaml]'``).

        Example:
            >>> import os, tempfile
            >>> from ampkit.config import AmpConfig
            >>> path = os.path.join(tempfile.mkdtemp(), "amp.json")
            >>> AmpConfig(level="O2", dtype="bfloat16").to_file(path)
            >>> AmpConfig.from_file(path) == AmpConfig(level="O2", dtype="bfloat16")
            True
        """
        data = self.to_dict()
        if _format(path) == "yaml":
            text = _yaml().safe_dump(data, sort_keys=False)
        else:
            text = json.dumps(data, indent=2) + "\n"
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> AmpConfig:
        """Read a config written by :meth:`to_file` (or by hand): a JSON or YAML mapping
        of field names; fields left out keep their defaults.

        Raises:
            ValueError: the file is not a mapping of known fields with valid values
                (the message names the file, the field and the accepted values), or
                not UTF-8 text, or nested too deeply to parse.
            FileNotFoundError: no such file.

        Example:
            >>> import os, tempfile
            >>> from ampkit.config import AmpConfig
            >>> path = os.path.join(tempfile.mkdtemp(), "amp.json")
            >>> with open(path, "w") as f:
            ...     _ = f.write('{"level": "O2", "master_weights": "fp16"}')
            >>> AmpConfig.from_file(path)
            Traceback (most recent call last):
            ...
            ValueError: .../amp.json: master_weights must be True (the fp32 parameters ...
        """
        kind = _format(path)  # an unknown suffix is refused before the file is read
        with open(path, encoding="utf-8") as f:
            try:
                text = f.read()
            except UnicodeDecodeError as error:
                raise ValueError(f"{os.fspath(path)}: not UTF-8 text (byte "
                                 f"{error.object[error.start]:#04x} at offset {error.start}):"
                                 f" an ampkit config file is UTF-8 JSON or YAML") from None
        try:
            data = _yaml().safe_load(text) if kind == "yaml" else json.loads(text)
        except RecursionError:  # the parsers recurse once per level of nesting
            raise ValueError(f"{os.fspath(path)}: nested too deeply to read: an ampkit "
                             f"config is a flat mapping of field names") from None
        except ValueError as error:  # json.JSONDecodeError is one
            raise ValueError(f"{os.fspath(path)}: not valid JSON: {error}") from None
        except Exception as error:  # yaml.YAMLError
            if type(error).__module__.startswith("yaml"):
                raise ValueError(f"{os.fspath(path)}: not valid YAML: {error}") from None
            raise
        try:
            return cls.from_dict(data)
        except ValueError as error:
            raise ValueError(f"{os.fspath(path)}: {error}") from None


#: The fields that configure an ``ampkit.GradScaler`` (its keyword names): those whose
#: metadata says so.
SCALER_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(AmpConfig)
                                       if f.metadata.get("scaler"))


def _shown(value: Any) -> str:
    # a dtype by its name (as a config file writes it), anything else as Python shows it
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return repr(value.value if isinstance(value, MasterWeights) else value)


def contradiction(given: str, name: str, held: Any) -> str:
    """The one wording of a setting given twice with two meanings: ``given`` is how
    the caller's surface names its value (``dtype='float16'``, ``--level O3``),
    ``held`` the config's value of field ``name``.

    Example:
        >>> import torch
        >>> from ampkit.config import contradiction
        >>> contradiction("--dtype float16", "dtype", torch.bfloat16)
        "--dtype float16 contradicts the config's dtype=bfloat16; give it once"
    """
    return f"{given} contradicts the config's {name}={_shown(held)}; give it once"


def _as_config(config: Any) -> AmpConfig:
    if isinstance(config, AmpConfig):
        return config
    if isinstance(config, str | os.PathLike):
        return AmpConfig.from_file(config)
    if isinstance(config, Mapping):
        return AmpConfig.from_dict(config)
    raise TypeError(f"config must be an ampkit.AmpConfig, the path of a config file or a "
                    f"mapping of AmpConfig fields, got {type(config).__name__}")


def merged_config(given: Mapping[str, Any], config: Any = None, *,
                  source: str | None = None, defaults: Mapping[str, Any] | None = None,
                  spell: Callable[[str, Any], str] | None = None) -> AmpConfig:
    """The one merge of settings every surface makes (``ampkit.initialize``, the
    integrations, the command line, ``ampkit.compare``): the :class:`AmpConfig` that
    the fields ``given`` (``None``: not given) and ``config`` (an ``AmpConfig``, the
    path of a config file, or a mapping of its fields) say together.

    Without a config the fields given make one (``defaults`` filling the fields not
    given); with one, each field given must say what the config says, else a
    ``ValueError`` in :func:`contradiction`'s words. ``spell(name, value)`` is how the
    caller's surface names a field it was given (default ``name=value``; a command
    line says its flag): the contradictions and the field checks' errors use it.
    ``source`` (who asks: ``"AmpkitPrecision"``) starts every error's message.

    Raises:
        TypeError, ValueError: a bad value or type (the field's own check), a config of
            the wrong type, or a field that contradicts the config.

    Example:
        >>> from ampkit.config import AmpConfig, merged_config
        >>> merged_config({"level": "O2"}, defaults={"dtype": "bfloat16"}).dtype
        torch.bfloat16
        >>> merged_config({"level": "O2"}, {"level": "O2", "dtype": "float16"}).dtype
        torch.float16
        >>> merged_config({"level": "O3"}, AmpConfig("O2"), source="P")
        Traceback (most recent call last):
        ...
        ValueError: P: level='O3' contradicts the config's level='O2'; give it once
    """
    fields = {f.name for f in config_fields()}
    unknown = sorted(set(given) - fields)
    if unknown:
        raise TypeError(f"{source + ': ' if source else ''}AmpConfig has no fields "
                        f"{unknown}; accepted: {sorted(fields)}")
    given = {k: v for k, v in given.items() if v is not None}

    def say(name: str, value: Any) -> str:
        return spell(name, value) if spell is not None else f"{name}={_shown(value)}"

    try:
        if config is None:
            return AmpConfig(**{**(defaults or {}), **given})
        cfg = _as_config(config)
        for name, value in given.items():
            if cfg.replace(**{name: value}) != cfg:
                raise ValueError(contradiction(say(name, value), name, getattr(cfg, name)))
        return cfg
    except (TypeError, ValueError) as error:
        text = str(error)
        if spell is not None:
            for name, value in given.items():  # a field's check names the field: as given
                if text.startswith(f"{name} "):
                    text = say(name, value).partition(" ")[0] + text[len(name):]
        if source:
            text = f"{source}: {text}"
        if text == str(error):
            raise
        raise type(error)(text) from None


def _format(path: str | os.PathLike[str]) -> str:
    suffix = os.path.splitext(os.fspath(path))[1].lower()
    if suffix not in _FORMATS:
        raise ValueError(f"{os.fspath(path)}: an ampkit config file is JSON (.json) or "
                         f"YAML (.yaml, .yml), and its suffix says which; got "
                         f"{suffix or 'no suffix'!r}")
    return _FORMATS[suffix]


def _yaml() -> Any:
    try:
        import yaml
    except ImportError as error:  # pragma: no cover - PyYAML ships with the extra
        raise ImportError("YAML config files need PyYAML: pip install 'ampkit[yaml]' "
                          "(or use a .json file)") from error
    return yaml
