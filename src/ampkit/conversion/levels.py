"""Precision levels O0-O3 and the property table each one stands for.

A level is a named set of defaults for how a whole model trains (apex's ``opt_level``,
Paddle's ``level``, MindSpore's ``amp_level``). Every level is a point on two axes:
**where the truth lives** (the dtype the parameters are stored in, which the optimizer
steps and ``state_dict`` saves; ampkit never keeps a second copy) and **which ops run
in low precision** (the policy):

==============================  ==========  ===========================================
level                           truth       ops that run low
==============================  ==========  ===========================================
O0                              fp32        none
O1                              fp32        the policy's low list (``ampkit.autocast``
                                            around the forward; default: native
                                            autocast's); operands are cast per op
O2                              fp32        every module outside the kept-fp32 norms,
                                            with low-precision copies of its weights
                                            made on use; native autocast's fp32 list
                                            (:func:`keep_native_fp32`), the policy's
                                            and the kept norms stay fp32
O2, ``master_weights=False`` /  low         as O2 (bf16 pure: the optimizer rounds its
``"stochastic"`` / ``"kahan"``              updates into the bf16 truth)
O3                              low         all, norms included
==============================  ==========  ===========================================

Every dialect's levels map onto these two axes (``docs/migration.md``, "Levels as two
axes"). The properties below are the override vocabulary (apex's words) that picks a
point:

* ``cast_model_type``: the dtype parameters are stored in (floating buffers keep
  theirs, see :func:`build_level`; ``None``: left as they are; ``False``, as an
  override: left as they are *and* taken in whatever floating dtype they have, float16
  included: the model as given, apex's ``cast_model_type=False`` with
  ``allow_incoming_model_not_fp32``);
* ``keep_norms_fp32``: BatchNorm, LayerNorm, GroupNorm, InstanceNorm and RMSNorm
  modules keep fp32 parameters and statistics and compute in fp32; at O2 their input
  and output are low precision (a norm whose kernel computes in fp32 from a
  low-precision input gets it as it is; see ``ampkit.conversion``) (``None``: the
  level does not decide);
* ``master_weights``: ``True``: the fp32 parameters are the truth and modules compute
  with low-precision copies of them (no second copy is kept: apex's word for where the
  truth lives); ``"stochastic"`` or ``"kahan"``: pure low precision, no fp32 copies: bf16
  parameters and optimizer state, each update rounded stochastically or
  Kahan-compensated (:mod:`ampkit.pure`; bfloat16 only);
* ``loss_scale``: ``"dynamic"``, a static scale (a positive number) or ``None``;
* ``patch_ops``: the model's forward runs inside :class:`ampkit.autocast`, so each op
  is cast by the policy's lists;
* ``cast_model_outputs``: the dtype the model's low-precision floating outputs are cast
  to (``None`` or ``"as_computed"``: as computed, as native autocast hands them back).
  float32 at O1, O2 and O3: a loss computed outside the model is then never computed
  in lower precision than native autocast computes it inside its region. An output the
  model itself upcast for an fp32 tensor it also returns (its own loss) comes back as
  computed: it was already read in full precision, and a second fp32 copy of the
  logits would cost memory native does not spend.

=====  ==========  ==========  =======  ============  =========  ==========
level  cast_model  keep_norms  master   loss_scale    patch_ops  cast_model
       _type       _fp32       weights                           _outputs
=====  ==========  ==========  =======  ============  =========  ==========
O0     float32     None        False    None          False      None
O1     None        None        False    dynamic [1]_  True       float32
O2     low dtype   True        True     dynamic [1]_  True       float32
O3     low dtype   False       False    None          False      float32
=====  ==========  ==========  =======  ============  =========  ==========

Pure low precision is level O2 (or O3) with ``master_weights="stochastic"`` or
``"kahan"`` and ``dtype=torch.bfloat16``; :func:`describe_levels` adds their rows.

.. [1] ``"dynamic"`` for float16 only: bfloat16 has float32's range, so its default is
   ``None`` (no loss scaling). O3's ``None`` is the same numerics as a static scale of 1.

At O2, ``cast_model_type`` names the dtype the modules compute their weights in; with
``master_weights=True`` (the default) the truth stays fp32 and the weights are cast on
use, with ``False`` the parameters are stored in that dtype. O2 patches ops too (unlike
apex's O2): native autocast's float32 list (softmax, log_softmax, losses, norms,
exp/log/pow, ...; :data:`ampkit.policies.registry.AUTOCAST_FP32_OPS`) and the policy's own run in
float32, although O2's activations are low precision (:func:`keep_native_fp32`).
``ampkit.apex`` keeps apex's own table.

``dtype=None`` picks the device's autocast default: bfloat16 on CPU, float16 on CUDA.

Example:
    >>> import torch
    >>> from ampkit.conversion.levels import level_properties
    >>> props = level_properties("O2", dtype=torch.float16)
    >>> props.cast_model_type, props.master_weights, props.loss_scale
    (torch.float16, <MasterWeights.FP32: 'fp32'>, 'dynamic')
    >>> level_properties("O2", dtype="bfloat16").loss_scale is None
    True
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

import torch

from ampkit.common.arguments import FLOAT_DTYPES, default_device_type, parse_dtype, parse_loss_scale
from ampkit.common.module_selection import ModuleSelector, parse_module_selectors
from ampkit.conversion import NORM_MODULES, ConversionConfig
from ampkit.policies.policy import Policy, as_dtype
from ampkit.policies.presets import get_policy
from ampkit.policies.registry import OpEntry, autocast_fp32_ops

__all__ = [
    "APEX_OVERRIDES",
    "AS_COMPUTED",
    "CONVERSION_SETTINGS",
    "LEVEL_SETTINGS",
    "LEVEL_PROPERTY_NAMES",
    "PURE_MASTER_WEIGHTS",
    "MasterWeights",
    "Rounding",
    "conversion_for_level",
    "BuiltLevel",
    "Level",
    "LevelProperties",
    "build_level",
    "default_dtype",
    "describe_levels",
    "keep_native_fp32",
    "level_properties",
    "master_weights_value",
]


class Level(enum.Enum):
    """The four precision levels.

    Example:
        >>> from ampkit.conversion.levels import Level
        >>> Level.parse("o2") is Level.O2
        True
    """

    O0 = "O0"  # fp32 everywhere: the baseline
    O1 = "O1"  # fp32 parameters, ops cast by the policy lists
    O2 = "O2"  # fp32 truth, modules compute with low copies; norms, fp32-list ops fp32
    O3 = "O3"  # everything low precision

    @classmethod
    def parse(cls, value: Level | str) -> Level:
        """The level named by ``value`` (``Level.O2``, ``"O2"`` or ``"o2"``).

        Raises:
            ValueError: an unknown level, listing the accepted ones.

        Example:
            >>> from ampkit.conversion.levels import Level
            >>> Level.parse("O3")
            <Level.O3: 'O3'>
        """
        if isinstance(value, Level):
            return value
        if isinstance(value, str):
            key = value.strip().upper()
            if key in cls.__members__:
                return cls[key]
        raise ValueError(f"level must be one of {[m.value for m in cls]}, got {value!r}")


#: The property names a level defines, in table order (the overridable ones).
LEVEL_PROPERTY_NAMES: tuple[str, ...] = (
    "cast_model_type", "keep_norms_fp32", "master_weights", "loss_scale", "patch_ops",
    "cast_model_outputs",
)

#: ``initialize``'s keywords that :class:`ampkit.AmpConfig` does not hold: apex's rarer
#: level properties and conversion options, each mapped to what it sets (``"level"``:
#: :func:`level_properties`; ``"conversion"``: :func:`build_level`'s conversion;
#: ``"scale_loss"``: ``ampkit.scale_loss``'s set-up). They are in-memory choices of
#: the apex dialect and of porting code; a config file holds none of them.
APEX_OVERRIDES: Mapping[str, str] = MappingProxyType({
    "cast_model_type": "level", "patch_ops": "level",
    "state_dict_dtype": "conversion", "cast_buffers": "conversion",
    "num_losses": "scale_loss"})


class Rounding(enum.Enum):
    """How a pure bfloat16 optimizer rounds its results into the bf16 parameters and
    state (:mod:`ampkit.pure`): the rounding of a pure :class:`MasterWeights` member
    (:attr:`MasterWeights.rounding`), or :attr:`NEAREST`, the stalling baseline. The
    one form a rounding takes inside ampkit; checkpoints and pickles hold its value.

    Example:
        >>> from ampkit.conversion.levels import Rounding
        >>> Rounding.parse("kahan"), Rounding.parse(Rounding.NEAREST).value
        (<Rounding.KAHAN: 'kahan'>, 'nearest')
    """

    #: each update rounded up or down at random, in proportion to its distance
    STOCHASTIC = "stochastic"
    #: rounded to nearest, what that loses kept as a bf16 compensation
    KAHAN = "kahan"
    #: rounded to nearest: small updates are lost (the baseline the others beat)
    NEAREST = "nearest"

    @classmethod
    def parse(cls, value: Rounding | str) -> Rounding:
        """The rounding named by ``value`` (a member or its value, as written).

        Raises:
            ValueError: anything else, listing the accepted values.

        Example:
            >>> from ampkit.conversion.levels import Rounding
            >>> Rounding.parse("kahn")
            Traceback (most recent call last):
            ...
            ValueError: rounding must be one of ['stochastic', 'kahan', 'nearest'], got 'kahn'
        """
        if isinstance(value, Rounding):
            return value
        if isinstance(value, str):
            for member in cls:
                if member.value == value:
                    return member
        raise ValueError(f"rounding must be one of {[m.value for m in cls]}, got {value!r}")


class MasterWeights(enum.Enum):
    """Where the truth lives: the one form ``master_weights`` takes inside ampkit. A
    user's value (apex's ``True``/``False``, a mode's name, text from a flag or a file)
    is turned into one by :func:`master_weights_value` where it enters (an
    :class:`ampkit.AmpConfig`, :func:`level_properties`), and every spelling ampkit
    shows back (``True``/``False`` in the level tables, a member's value in a config
    file) is accepted there again.

    Example:
        >>> from ampkit.conversion.levels import MasterWeights, master_weights_value
        >>> master_weights_value(True), master_weights_value("kahan").pure
        (<MasterWeights.FP32: 'fp32'>, True)
        >>> master_weights_value(MasterWeights.FP32.value) is MasterWeights.FP32
        True
    """

    #: ``False``: no second copy; parameters are stored in the level's dtype.
    NONE = "none"
    #: ``True``: the fp32 parameters are the truth; modules compute with low copies.
    FP32 = "fp32"
    #: ``"stochastic"``: bf16 parameters and state, updates stochastically rounded.
    STOCHASTIC = "stochastic"
    #: ``"kahan"``: bf16 parameters and state, Kahan-compensated updates.
    KAHAN = "kahan"

    @property
    def pure(self) -> bool:
        """Parameters and optimizer state in bfloat16 with no fp32 copy.

        Example:
            >>> from ampkit.conversion.levels import MasterWeights
            >>> MasterWeights.KAHAN.pure, MasterWeights.FP32.pure
            (True, False)
        """
        return self in (MasterWeights.STOCHASTIC, MasterWeights.KAHAN)

    @property
    def rounding(self) -> Rounding | None:
        """The rounding a pure mode's optimizer applies (``None``: not pure, the
        optimizer is left as it is).

        Example:
            >>> from ampkit.conversion.levels import MasterWeights
            >>> MasterWeights.KAHAN.rounding, MasterWeights.FP32.rounding
            (<Rounding.KAHAN: 'kahan'>, None)
        """
        return _PURE_ROUNDING.get(self)

    def spelled(self) -> bool | str:
        """The value as the level tables and messages show it: apex's ``True``
        (:attr:`FP32`) and ``False`` (:attr:`NONE`), a pure mode by its name.

        Example:
            >>> from ampkit.conversion.levels import MasterWeights
            >>> MasterWeights.FP32.spelled(), MasterWeights.KAHAN.spelled()
            (True, 'kahan')
        """
        if self is MasterWeights.FP32:
            return True
        if self is MasterWeights.NONE:
            return False
        name: str = self.value
        return name


_PURE_ROUNDING: Mapping[MasterWeights, Rounding] = MappingProxyType({
    MasterWeights.STOCHASTIC: Rounding.STOCHASTIC, MasterWeights.KAHAN: Rounding.KAHAN})

#: The pure low-precision values ``master_weights`` takes besides True/False/None: the
#: one spelling of each pure mode (:class:`MasterWeights`' own values).
PURE_MASTER_WEIGHTS: tuple[str, ...] = tuple(m.value for m in MasterWeights if m.pure)


def default_dtype(device_type: str | None = None) -> torch.dtype:
    """The low-precision dtype ``dtype=None`` means: the device's autocast default
    (bfloat16 on CPU, float16 on CUDA). ``device_type=None`` is CUDA when available.

    A model on the ``"meta"`` device (deferred initialisation) has no device yet: it
    gets the default of the device ``device_type=None`` means (CUDA when available,
    else CPU); pass ``dtype`` to choose another. A device type without autocast is a
    ``ValueError`` naming it.

    Example:
        >>> from ampkit.conversion.levels import default_dtype
        >>> default_dtype("cpu")
        torch.bfloat16
        >>> default_dtype("meta") == default_dtype(None)
        True
    """
    if device_type is None or device_type == "meta":
        device_type = default_device_type()
    try:
        dtype = torch.get_autocast_dtype(device_type)
    except RuntimeError as error:  # torch's "unsupported scalarType" names nothing
        raise ValueError(f"dtype=None means the autocast default of the model's device, "
                         f"but device type {device_type!r} has none ({error}); pass "
                         f"dtype=torch.bfloat16 or torch.float16") from None
    return dtype if dtype in (torch.float16, torch.bfloat16) else torch.bfloat16


def _cast_model_type(value: Any) -> torch.dtype | bool | None:
    if value is False:
        return False  # the model as given (apex's cast_model_type=False)
    return parse_dtype(value, "cast_model_type", accept=FLOAT_DTYPES, allow_none=True)


#: Text that names a :class:`MasterWeights` (any case, spaces around ignored): each
#: member's value, and apex's booleans as a flag or a file writes them.
_MASTER_WEIGHTS_TEXT: Mapping[str, MasterWeights] = MappingProxyType({
    **{m.value: m for m in MasterWeights}, "true": MasterWeights.FP32,
    "false": MasterWeights.NONE})


def master_weights_value(value: Any) -> MasterWeights | None:
    """The :class:`MasterWeights` a user's ``master_weights`` stands for (``None``: the
    level's default): a member; ``True`` (the fp32 parameters are the truth) or
    ``False`` (the parameters are stored in the low dtype); or text, in any case: a
    member's value (``"fp32"``, ``"none"``, ``"stochastic"``, ``"kahan"``) or
    ``"true"``/``"false"``. The one parser of the value, wherever it comes from.

    Example:
        >>> from ampkit.conversion.levels import master_weights_value
        >>> master_weights_value("True"), master_weights_value("kahan")
        (<MasterWeights.FP32: 'fp32'>, <MasterWeights.KAHAN: 'kahan'>)
        >>> master_weights_value("fp16")
        Traceback (most recent call last):
        ...
        ValueError: master_weights must be True (the fp32 parameters are the truth), ...
    """
    if value is None or isinstance(value, MasterWeights):
        return value
    if isinstance(value, bool):
        return MasterWeights.FP32 if value else MasterWeights.NONE
    if isinstance(value, str) and value.strip().lower() in _MASTER_WEIGHTS_TEXT:
        return _MASTER_WEIGHTS_TEXT[value.strip().lower()]
    raise ValueError(f"master_weights must be True (the fp32 parameters are the truth), "
                     f"False (parameters stored in the low dtype), None (the level's "
                     f"default), a MasterWeights or its value {list(_MASTER_WEIGHTS_TEXT)} "
                     f"(any case; {list(PURE_MASTER_WEIGHTS)}: pure bfloat16 training), "
                     f"got {value!r}")


def _optional_bool(value: Any, argument: str) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    raise TypeError(f"{argument} must be True, False or None, got {value!r}")


@dataclasses.dataclass(frozen=True)
class LevelProperties:
    """The properties of one level for one low-precision dtype (immutable).

    Build it with :func:`level_properties`, which applies overrides and refuses
    nonsensical combinations; :meth:`describe` prints it as a table.

    Example:
        >>> import torch
        >>> from ampkit.conversion.levels import level_properties
        >>> print(level_properties("O1", dtype=torch.bfloat16).describe())
        level O1 (low-precision dtype bfloat16)
          cast_model_type     None
          keep_norms_fp32     None
          master_weights      False
          loss_scale          None
          patch_ops           True
          cast_model_outputs  float32
    """

    level: Level
    dtype: torch.dtype
    cast_model_type: torch.dtype | bool | None
    keep_norms_fp32: bool | None
    master_weights: MasterWeights
    loss_scale: str | float | None
    patch_ops: bool
    cast_model_outputs: torch.dtype | str | None
    # The level's own output cast, not one asked for: an output the model's own loss
    # read in fp32 keeps its dtype (docs/levels.md, "What the fp32 outputs cost"). An
    # explicit cast_model_outputs casts every low-precision output, as apex does.
    outputs_by_level: bool = dataclasses.field(default=True, compare=False, repr=False)

    @property
    def casts_parameters(self) -> bool:
        """True when parameters are stored in a low-precision dtype.

        Example:
            >>> from ampkit.conversion.levels import level_properties
            >>> level_properties("O3").casts_parameters
            True
        """
        return self.cast_model_type in (torch.float16, torch.bfloat16)

    def describe(self) -> str:
        """The properties as an aligned two-column table.

        Example:
            >>> from ampkit.conversion.levels import level_properties
            >>> level_properties("O0").describe().splitlines()[1]
            '  cast_model_type     float32'
        """
        lines = [f"level {self.level.value} (low-precision dtype {_name(self.dtype)})"]
        for name in LEVEL_PROPERTY_NAMES:
            lines.append(f"  {name:<18}  {_name(getattr(self, name))}")
        return "\n".join(lines)


def _name(value: Any) -> str:
    if isinstance(value, MasterWeights):
        return str(value.spelled())
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return str(value)


def _defaults(level: Level, dtype: torch.dtype) -> dict[str, Any]:
    scaled = "dynamic" if dtype is torch.float16 else None
    fp32, none = MasterWeights.FP32, MasterWeights.NONE
    table: dict[Level, dict[str, Any]] = {
        Level.O0: dict(cast_model_type=torch.float32, keep_norms_fp32=None,
                       master_weights=none, loss_scale=None, patch_ops=False,
                       cast_model_outputs=None),
        # O1 hands its floating outputs back in fp32 (one cast of the output): a loss
        # the user computes outside the model is then never computed in lower
        # precision than native autocast computes it inside its region.
        Level.O1: dict(cast_model_type=None, keep_norms_fp32=None, master_weights=none,
                       loss_scale=scaled, patch_ops=True, cast_model_outputs=torch.float32),
        Level.O2: dict(cast_model_type=dtype, keep_norms_fp32=True, master_weights=fp32,
                       loss_scale=scaled, patch_ops=True, cast_model_outputs=torch.float32),
        Level.O3: dict(cast_model_type=dtype, keep_norms_fp32=False, master_weights=none,
                       loss_scale=None, patch_ops=False, cast_model_outputs=torch.float32),
    }
    return table[level]


def _refuse(level: Level, props: Mapping[str, Any], given: Mapping[str, Any]) -> None:
    """apex's refusals, plus the combinations that cannot mean anything here."""
    low = props["cast_model_type"] in (torch.float16, torch.bfloat16)
    if level is Level.O1:
        if props["cast_model_type"] not in (None, torch.float32, False):
            raise ValueError(f"level O1 keeps fp32 parameters and casts ops instead, so "
                             f"cast_model_type must be None or torch.float32, got "
                             f"{given['cast_model_type']!r}; use level O2 or O3 for "
                             f"low-precision parameters")
        if given.get("keep_norms_fp32") is not None:
            raise ValueError("level O1 casts norms by the policy lists (its parameters "
                             "stay fp32), so keep_norms_fp32 must be None; use "
                             "keep_fp32_modules to run modules in fp32, or level O2")
        if "master_weights" in given and props["master_weights"] is not MasterWeights.NONE:
            raise ValueError("level O1 keeps fp32 parameters, so there is nothing for "
                             "master_weights to copy; it must be False or None")
    if level is Level.O0 and low:
        raise ValueError(f"level O0 trains in float32, so cast_model_type must be "
                         f"torch.float32 or None, got {given['cast_model_type']!r}; use "
                         f"level O3 for pure low-precision training")
    if props["patch_ops"] and level in (Level.O0, Level.O3):
        hint = "O1" if level is Level.O0 else "O2"
        raise ValueError(f"patch_ops=True casts each op by the policy lists, which level "
                         f"{level.value} does not do (O0: all fp32, O3: all low precision); "
                         f"use level {hint}")
    mode: MasterWeights = props["master_weights"]
    if mode.pure and not low:
        raise ValueError(f"master_weights={mode.value!r} trains bfloat16 "
                         f"parameters without fp32 copies, so it needs level O2 or O3 "
                         f"with dtype torch.bfloat16; level {level.value} stores them as "
                         f"{_name(props['cast_model_type'])}")
    if mode.pure and props["cast_model_type"] is not torch.bfloat16:
        raise ValueError(f"master_weights={mode.value!r} trains bfloat16 "
                         f"parameters and optimizer state without fp32 copies, so the "
                         f"parameters must be torch.bfloat16, got "
                         f"{_name(props['cast_model_type'])}; float16 has too little range "
                         f"for pure low-precision training: use master_weights=True")
    if mode is MasterWeights.FP32 and level in (Level.O2, Level.O3) and \
            props["cast_model_type"] in (torch.float32, False):
        return  # fp32 (or as given) parameters are their own truth: nothing to copy
    if mode is MasterWeights.FP32 and not low:
        raise ValueError(f"master_weights=True needs low-precision parameters (level O2 or "
                         f"O3 with cast_model_type float16/bfloat16); level {level.value} "
                         f"stores them as {_name(props['cast_model_type'])}")


def _check_property_names(overrides: Mapping[str, Any]) -> None:
    unknown = sorted(set(overrides) - set(LEVEL_PROPERTY_NAMES))
    if unknown:
        raise TypeError(f"unknown level properties {unknown}; accepted: "
                        f"{list(LEVEL_PROPERTY_NAMES)}")


def _properties(level: Level, dtype: torch.dtype | str | None, device_type: str | None,
                overrides: Mapping[str, Any]) -> LevelProperties:
    """:func:`build_level`'s first step: the level's table row for the dtype, with the
    overrides checked and applied and apex's refusals raised."""
    low = as_dtype(dtype) or default_dtype(device_type)
    _check_property_names(overrides)
    given = {k: v for k, v in overrides.items() if v is not None}
    checked: dict[str, Any] = {}
    for name, value in given.items():
        if name == "cast_model_type":
            checked[name] = _cast_model_type(value)
        elif name == "cast_model_outputs":
            checked[name] = _cast_model_outputs(value)
        elif name == "loss_scale":
            checked[name] = parse_loss_scale(value)
        elif name == "master_weights":
            checked[name] = master_weights_value(value)
        else:
            checked[name] = _optional_bool(value, name)
    props = {**_defaults(level, low), **checked}
    _refuse(level, props, given)
    return LevelProperties(level=level, dtype=low, **props,
                           outputs_by_level="cast_model_outputs" not in checked)


def level_properties(level: Level | str, dtype: torch.dtype | str | None = None, *,
                     device_type: str | None = None, **overrides: Any) -> LevelProperties:
    """The properties of ``level`` for ``dtype``, with ``overrides`` applied: the
    :attr:`~BuiltLevel.properties` half of :func:`build_level`.

    Args:
        level: ``"O0"``, ``"O1"``, ``"O2"``, ``"O3"`` or a :class:`Level`.
        dtype: ``torch.float16`` or ``torch.bfloat16`` (or their names); ``None`` takes
            the autocast default of ``device_type`` (bfloat16 on CPU, float16 on CUDA).
        device_type: only used when ``dtype`` is ``None``; ``None`` means CUDA when
            available, else CPU.
        **overrides: any of :data:`LEVEL_PROPERTY_NAMES`; ``None`` keeps the level's
            default (as in apex). ``cast_model_type`` and ``cast_model_outputs`` take
            float16, bfloat16 or float32.

    Raises:
        ValueError: an unknown level, dtype or property value, or a combination that
            means nothing (apex's refusals: O1 with low-precision parameters,
            ``keep_norms_fp32`` or ``master_weights`` at O1; ``patch_ops`` at O0/O3;
            master weights without low-precision parameters).
        TypeError: an unknown override name, listing the accepted ones.

    Example:
        >>> import torch
        >>> from ampkit.conversion.levels import level_properties
        >>> level_properties("O2", torch.bfloat16, loss_scale=128.0).loss_scale
        128.0
        >>> level_properties("O1", torch.float16, cast_model_type=torch.float16)
        Traceback (most recent call last):
        ...
        ValueError: level O1 keeps fp32 parameters and casts ops instead, ...
    """
    _check_property_names(overrides)  # the conversion's settings are not properties
    return build_level(level, dtype, device_type=device_type, **overrides).properties


#: ``cast_model_outputs``'s value for outputs handed back exactly as the model computed
#: them (native autocast's outputs), whatever the level's default.
AS_COMPUTED = "as_computed"


def _cast_model_outputs(value: Any) -> torch.dtype | str | None:
    if isinstance(value, str) and value.strip().lower() == AS_COMPUTED:
        return AS_COMPUTED
    try:
        return parse_dtype(value, "cast_model_outputs", accept=FLOAT_DTYPES, allow_none=True)
    except ValueError as error:
        raise ValueError(f"{error}; or {AS_COMPUTED!r} to hand the model's outputs back "
                         f"as computed") from None


def describe_levels(dtype: torch.dtype | str | None = None) -> str:
    """All four levels' default properties for ``dtype`` as a markdown table, and for
    bfloat16 the two pure low-precision rows (O2 with ``master_weights="stochastic"`` or
    ``"kahan"``).

    Example:
        >>> import torch
        >>> from ampkit.conversion.levels import describe_levels
        >>> print(describe_levels(torch.float16).splitlines()[4])
        | O2 | float16 | True | True | dynamic | True | float32 |
    """
    header = "| level | " + " | ".join(LEVEL_PROPERTY_NAMES) + " |"
    rule = "|---" * (len(LEVEL_PROPERTY_NAMES) + 1) + "|"
    rows = [header, rule]
    for lvl in Level:
        props = level_properties(lvl, dtype, device_type="cpu")
        cells = [_name(getattr(props, n)) for n in LEVEL_PROPERTY_NAMES]
        rows.append(f"| {lvl.value} | " + " | ".join(cells) + " |")
    if (as_dtype(dtype) or default_dtype("cpu")) is torch.bfloat16:
        for mode in PURE_MASTER_WEIGHTS:  # pure low precision: bfloat16 only
            props = level_properties(Level.O2, dtype, device_type="cpu",
                                     master_weights=mode)
            cells = [_name(getattr(props, n)) for n in LEVEL_PROPERTY_NAMES]
            rows.append("| O2 | " + " | ".join(cells) + " |")
    return "\n".join(rows)


# -- the level, in the conversion's own words ---------------------------------------------

def keep_native_fp32(policy: Policy) -> Policy:
    """``policy``, with native autocast's float32 list
    (:data:`ampkit.policies.registry.AUTOCAST_FP32_OPS`: softmax, log_softmax, norms, losses,
    exp/log/pow, ...) on its own fp32 list for every op it leaves to native autocast:
    level O2's policy. Ops the policy decides itself keep its decision.

    At O2 the activations are low precision end to end, so native autocast, which runs
    an unlisted op in its inputs' dtype, would run softmax and the attention mask in low
    precision (on CPU, whose native float32 list has no softmax, always). With this
    list they run in float32 as native autocast runs them on CUDA, and as O1 runs them
    where an fp32 input promotes them. A custom white list takes an op back off it.

    Example:
        >>> from ampkit.conversion.levels import keep_native_fp32
        >>> from ampkit.policies.presets import get_policy
        >>> o2 = keep_native_fp32(get_policy("torch"))
        >>> o2.name, o2.rule_for("softmax"), o2.rule_for("linear")
        ('torch-O2', 'fp32', 'native')
        >>> o2.with_lists(custom_white_list=["softmax"]).rule_for("softmax")
        'lower'
        >>> keep_native_fp32(get_policy("conservative")).rule_for("gelu")  # unlisted: keep
        'keep'
    """
    added = frozenset(op for op in autocast_fp32_ops() if policy.rule_for(op) == "native")
    if not added:
        return policy
    return dataclasses.replace(policy, name=f"{policy.name}-O2",
                               fp32_ops=policy.fp32_ops | added)


def _conversion(props: LevelProperties, *,
                keep_fp32_modules: Iterable[ModuleSelector] | ModuleSelector | None,
                policy: str | Policy | None,
                custom_white_list: Iterable[OpEntry] | None,
                custom_black_list: Iterable[OpEntry] | None,
                state_dict_dtype: torch.dtype | str | None,
                cast_buffers: bool | None) -> ConversionConfig:
    """:func:`build_level`'s second step: the conversion
    (:class:`~ampkit.conversion.ConversionConfig`, in its own vocabulary) that a level's
    :class:`LevelProperties` (apex's vocabulary) stand for: the one place the two meet.
    An empty custom list is no list; ``None`` is each setting's default.

    ``keep_fp32_modules`` adds to the norms that ``keep_norms_fp32`` keeps; apex
    asks for ``cast_buffers`` and a float32 ``state_dict_dtype`` wherever it casts the
    model.
    """
    custom_white_list = custom_white_list or None
    custom_black_list = custom_black_list or None
    policy = "torch" if policy is None else policy
    white_or_black = custom_white_list is not None or custom_black_list is not None
    if not props.patch_ops and (white_or_black or policy != "torch"):
        raise ValueError(f"policy, custom_white_list and custom_black_list choose how "
                         f"ops are cast, which level {props.level.value} with "
                         f"patch_ops=False does not do; use level O1 or O2")
    keep = parse_module_selectors(() if keep_fp32_modules is None else keep_fp32_modules,
                                  "keep_fp32_modules") or ()
    norms = NORM_MODULES if props.keep_norms_fp32 else ()
    low = props.casts_parameters
    # master_weights=True: the fp32 parameters are the truth and modules compute
    # with low-precision copies made on use (no second copy of anything).
    fp32_truth = low and props.master_weights is MasterWeights.FP32
    as_given = props.cast_model_type is False
    # False (as given) is no dtype: the fields below take a dtype or None.
    model_dtype = (props.cast_model_type
                   if isinstance(props.cast_model_type, torch.dtype) else None)
    return ConversionConfig(
        param_dtype=None if fp32_truth else model_dtype,
        param_compute_dtype=model_dtype if fp32_truth else None,
        keep_fp32_modules=tuple(norms) + keep,
        kept_output_dtype=model_dtype if low else None,
        compute_dtype=props.dtype,
        policy=(_level_policy(props, get_policy(policy)).with_lists(custom_white_list,
                                                                    custom_black_list)
                if props.patch_ops else None),
        input_dtype=model_dtype if low else None,
        output_dtype=(props.cast_model_outputs
                      if isinstance(props.cast_model_outputs, torch.dtype) else None),
        outputs_read_by_loss_as_computed=props.outputs_by_level,
        state_dict_dtype=parse_dtype(state_dict_dtype, "state_dict_dtype",
                                     accept=FLOAT_DTYPES, allow_none=True),
        params_as_given=as_given,
        cast_buffers=False if cast_buffers is None else cast_buffers,
    )


def _level_policy(props: LevelProperties, base: Policy) -> Policy:
    """The policy of a level that patches ops: where the model computes in low precision
    end to end (O2), native autocast's float32 list stays float32 (:func:`keep_native_fp32`);
    elsewhere (O1, O2 with fp32 parameters) fp32 activations promote as they would."""
    return keep_native_fp32(base) if props.casts_parameters else base


class BuiltLevel(NamedTuple):
    """What :func:`build_level` makes: the level's properties (apex's vocabulary: what
    loss scaling and the pure optimizer read) and the conversion they stand for (the
    conversion's own vocabulary: what the model is converted with)."""

    properties: LevelProperties
    conversion: ConversionConfig


#: The settings :func:`build_level` reads besides ``level``, ``dtype`` and the level
#: table's columns (:data:`LEVEL_PROPERTY_NAMES`): how the conversion is made.
CONVERSION_SETTINGS: tuple[str, ...] = (
    "keep_fp32_modules", "policy", "custom_white_list", "custom_black_list",
    "state_dict_dtype", "cast_buffers")

#: Every setting :func:`build_level` reads, by the name :class:`ampkit.AmpConfig`'s
#: fields and ``initialize``'s keywords give it.
LEVEL_SETTINGS: tuple[str, ...] = ("level", "dtype", *LEVEL_PROPERTY_NAMES,
                                   *CONVERSION_SETTINGS)


def build_level(level: Level | str, dtype: torch.dtype | str | None = None, *,
                device_type: str | None = None,
                keep_fp32_modules: Iterable[ModuleSelector] | ModuleSelector | None = None,
                policy: str | Policy | None = None,
                custom_white_list: Iterable[OpEntry] | None = None,
                custom_black_list: Iterable[OpEntry] | None = None,
                state_dict_dtype: torch.dtype | str | None = None,
                cast_buffers: bool | None = None,
                **level_overrides: Any) -> BuiltLevel:
    """The one builder from a level to what it stands for: ``level`` is parsed, its
    table row for ``dtype`` is taken with ``level_overrides`` applied (apex's refusals
    raised), and the conversion those properties stand for is made with the
    conversion's settings. :class:`ampkit.AmpConfig`, ``ampkit.initialize``,
    :func:`ampkit.convert_model <ampkit.front_door.convert_model>`,
    :func:`level_properties` and :func:`conversion_for_level` all build through it.

    Args:
        level: ``"O0"`` .. ``"O3"`` (any case) or a :class:`Level`.
        dtype: the low-precision dtype (or its name); ``None``: ``device_type``'s
            autocast default (bfloat16 on CPU, float16 on CUDA).
        device_type: only read when ``dtype`` is ``None``; ``None`` means CUDA when
            available, else CPU.
        keep_fp32_modules: modules (names, classes or instances) kept in float32,
            besides the norms ``keep_norms_fp32`` keeps.
        policy: the autocast policy (a preset name, a policy file or a ``Policy``;
            ``None``: ``"torch"``) of levels that patch ops; with the custom lists, a
            ``ValueError`` at a level that does not patch ops, where it would do nothing.
        custom_white_list: ops run in low precision too (empty: none).
        custom_black_list: ops run in float32 (empty: none).
        state_dict_dtype: the dtype ``model.state_dict()`` reports (``None``: the
            parameters' own).
        cast_buffers: ``True`` stores floating buffers in the parameters' dtype too
            (what ``model.half()`` does); by default they keep theirs at every level.
        **level_overrides: the level table's columns (:data:`LEVEL_PROPERTY_NAMES`);
            ``None`` keeps the level's default.

    Floating buffers (rotary frequencies, masks, running statistics) keep their dtype
    at every level, pure low precision included: low precision is for parameters and
    activations. A BatchNorm or InstanceNorm that updates running statistics it keeps
    in float32 keeps its parameters in float32 too at O3 and in pure mode, as at O2:
    torch's kernels take the low-precision activation with float32 parameters and
    statistics, and refuse low-precision parameters next to float32 statistics.
    ``cast_model_type=False`` takes the model as given (``params_as_given``).

    Raises:
        ValueError: an unknown level, dtype or value, or a combination that means
            nothing (see :func:`level_properties`).
        TypeError: an unknown setting name, listing the accepted ones.

    Example:
        >>> from ampkit.conversion.levels import build_level
        >>> props, conv = build_level("o2", "float16", custom_black_list=["gelu"])
        >>> props.loss_scale, conv.param_compute_dtype, conv.policy.rule_for("gelu")
        ('dynamic', torch.float16, 'fp32')
        >>> build_level("O3", "bfloat16", policy="conservative")
        Traceback (most recent call last):
        ...
        ValueError: policy, custom_white_list and custom_black_list choose how ops are ...
    """
    props = _properties(Level.parse(level), dtype, device_type, level_overrides)
    return BuiltLevel(props, _conversion(
        props, keep_fp32_modules=keep_fp32_modules, policy=policy,
        custom_white_list=custom_white_list, custom_black_list=custom_black_list,
        state_dict_dtype=state_dict_dtype, cast_buffers=cast_buffers))


def conversion_for_level(level: Level | str = "O2", dtype: torch.dtype | str | None = None,
                         *, device_type: str | None = None,
                         **settings: Any) -> ConversionConfig:
    """The conversion for ``level`` and ``dtype``: the
    :attr:`~BuiltLevel.conversion` half of :func:`build_level`, which takes the same
    ``settings`` (the level table's columns and :data:`CONVERSION_SETTINGS`).

    Example:
        >>> import torch
        >>> from ampkit.conversion.levels import conversion_for_level
        >>> cfg = conversion_for_level("O2", "bfloat16", keep_norms_fp32=False,
        ...                            keep_fp32_modules=["head"])
        >>> cfg.keep_fp32_modules
        ('head',)
    """
    return build_level(level, dtype, device_type=device_type, **settings).conversion
