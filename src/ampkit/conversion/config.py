"""What a conversion does, as a value: :class:`ConversionConfig` (its fields and their
validation), and the :class:`Record` of it that every module of a converted model
carries (:func:`get_conversion` reads it).

Example:
    >>> import torch
    >>> from ampkit.conversion import ConversionConfig
    >>> ConversionConfig(policy="torch").compute_dtype
    Traceback (most recent call last):
    ...
    ValueError: policy needs compute_dtype (torch.float16 or torch.bfloat16): ...
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator

import torch
import torch.nn as nn

from ampkit.common.arguments import FLOAT_DTYPES, LOW_PRECISION, parse_dtype
from ampkit.common.module_selection import ModuleSelector
from ampkit.common.module_selection import parse_module_selectors as _selectors
from ampkit.policies.policy import Policy
from ampkit.policies.presets import get_policy

__all__ = ["OWN_PARAMETER_CASTS", "ConversionConfig", "Record", "get_conversion",
           "iter_records", "mark_converted", "record_of"]

_LOW = LOW_PRECISION
_MARK = "_ampkit_conversion"

#: A module with this attribute set to True casts its fp32 parameters itself (torchao's
#: ``Float8Linear``, from ``initialize(fp8=...)``): O2 does not cast them on use for it,
#: which would round them twice.
OWN_PARAMETER_CASTS = "_ampkit_casts_own_parameters"


@dataclasses.dataclass(frozen=True)
class ConversionConfig:
    """What :func:`ampkit.convert_model` does to a model (immutable). Every field has a name
    that says what it controls, so dialects only translate their own words into these.

    Attributes:
        param_dtype: dtype of the parameters and floating buffers outside the kept-fp32
            modules (``None``: left as they are).
        keep_fp32_modules: modules kept in fp32 with everything inside them (selectors:
            classes, qualified names, instances). They compute in fp32: inputs cast to
            fp32, autocast off inside.
        kept_output_dtype: the dtype the kept modules' floating outputs are cast to
            (``None``: left fp32).
        low_precision_modules: a module white list (``None``: no white list). Only
            these modules compute in ``compute_dtype``, from fp32 parameters cast on use;
            their floating outputs are cast to ``white_list_output_dtype``.
        white_list_output_dtype: see ``low_precision_modules`` (MindSpore: float32).
        compute_dtype: the low-precision dtype of the autocast regions (``policy`` and
            the white list).
        policy: when set, the model's forward runs inside ``ampkit.autocast`` with this
            policy (a :class:`~ampkit.policies.policy.Policy` or a preset name).
        input_dtype: the model's floating inputs are cast to it (``None``: as given).
        output_dtype: the model's floating outputs are cast to it (``None``: as computed).
        outputs_read_by_loss_as_computed: with ``output_dtype`` float32, a
            low-precision output that the model itself upcast for a loss it also
            returns (a Hugging Face model given labels) keeps its dtype: that loss read
            it in fp32 already, and an fp32 copy held through the backward costs
            memory native autocast does not spend
            (:func:`ampkit.conversion.boundary.upcast_inside`). The levels' own output
            cast sets it; ``False``: every low-precision output is cast.
        cast_buffers: floating buffers follow their module's parameter dtype
            (``param_dtype``); ``False``: they keep their own, and a module that
            updates float32 running statistics (BatchNorm, InstanceNorm with
            ``track_running_stats``) keeps float32 parameters too. The levels pass
            ``False`` unless asked (:func:`ampkit.conversion.levels.build_level`).
        param_compute_dtype: the parameters stay as stored (fp32, the truth) and every
            module outside the kept ones computes with copies of its own parameters
            in this low-precision dtype, made on use (O2; ``None``: off). See
            :mod:`ampkit.conversion.parameter_casts`.
        state_dict_dtype: ``model.state_dict()`` reports floating values in this dtype
            (``None``: as stored).
        params_as_given: take the model's floating parameters in whatever dtype they
            have (float16 included) instead of refusing a model that is not fp32;
            nothing is cast that ``param_dtype`` does not ask for (apex's
            ``cast_model_type=False`` with ``allow_incoming_model_not_fp32``).
        cast_shared_on_use: a parameter shared by a kept-fp32 module and a module
            whose parameters ``param_dtype`` stores in low precision stays fp32 (the
            truth the kept module computes with), and each such low-precision module
            computes with a low-precision copy of it made on use, as O2 does (MXNet's
            offline cast, which casts a parameter only when all its users are low
            precision). ``False``: such a conversion is refused (``ValueError``), as
            is a shared floating buffer asked to be in two dtypes either way.

    Example:
        >>> import torch
        >>> from ampkit.conversion.levels import conversion_for_level
        >>> cfg = conversion_for_level("O2", torch.bfloat16)
        >>> cfg.param_dtype, cfg.param_compute_dtype, cfg.output_dtype, cfg.policy.name
        (None, torch.bfloat16, torch.float32, 'torch-O2')

        A bias shared by a bf16 layer and a kept fp32 one stays fp32:

        >>> from ampkit.front_door import convert_model
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
        >>> net[1].bias = net[0].bias
        >>> net = convert_model(net, ConversionConfig(
        ...     param_dtype=torch.bfloat16, keep_fp32_modules=("1",), input_dtype=torch.bfloat16,
        ...     cast_shared_on_use=True))
        >>> net[0].weight.dtype, net[0].bias.dtype, net(torch.rand(1, 2)).dtype
        (torch.bfloat16, torch.float32, torch.float32)
    """

    param_dtype: torch.dtype | None = None
    keep_fp32_modules: tuple[ModuleSelector, ...] = ()
    kept_output_dtype: torch.dtype | None = None
    low_precision_modules: tuple[ModuleSelector, ...] | None = None
    white_list_output_dtype: torch.dtype | None = torch.float32
    compute_dtype: torch.dtype | None = None
    policy: Policy | None = None
    input_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    outputs_read_by_loss_as_computed: bool = False
    cast_buffers: bool = True
    param_compute_dtype: torch.dtype | None = None
    state_dict_dtype: torch.dtype | None = None
    params_as_given: bool = False
    cast_shared_on_use: bool = False

    def __post_init__(self) -> None:
        put = functools.partial(object.__setattr__, self)
        for name in ("param_dtype", "kept_output_dtype", "white_list_output_dtype",
                     "input_dtype", "output_dtype", "state_dict_dtype"):
            put(name, parse_dtype(getattr(self, name), name, accept=FLOAT_DTYPES,
                                  allow_none=True))
        put("compute_dtype", parse_dtype(self.compute_dtype, "compute_dtype",
                                         accept=LOW_PRECISION, allow_none=True))
        put("param_compute_dtype", parse_dtype(self.param_compute_dtype, "param_compute_dtype",
                                               accept=LOW_PRECISION, allow_none=True))
        put("keep_fp32_modules", _selectors(self.keep_fp32_modules, "keep_fp32_modules")
            or ())
        put("low_precision_modules", _selectors(self.low_precision_modules,
                                                "low_precision_modules"))
        if self.policy is not None:
            put("policy", get_policy(self.policy))
        for name in ("cast_buffers", "params_as_given", "cast_shared_on_use"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.cast_shared_on_use and self.param_dtype not in _LOW:
            raise ValueError(f"cast_shared_on_use applies to parameters that param_dtype "
                             f"stores in low precision (torch.float16 or torch.bfloat16), "
                             f"but param_dtype is {self.param_dtype}: it would do nothing")
        needs_compute = [n for n, v in (("policy", self.policy),
                                        ("low_precision_modules", self.low_precision_modules))
                         if v is not None]
        if needs_compute and self.compute_dtype is None:
            raise ValueError(f"{needs_compute[0]} needs compute_dtype (torch.float16 or "
                             f"torch.bfloat16): the dtype its autocast region computes in")
        if self.low_precision_modules is not None and self.param_dtype in _LOW:
            raise ValueError("low_precision_modules computes the listed modules in low "
                             "precision from fp32 parameters, so param_dtype must be None "
                             f"or torch.float32, got {self.param_dtype}")
        if self.param_compute_dtype is not None and self.param_dtype in _LOW:
            raise ValueError(f"param_compute_dtype casts fp32 parameters on use, so "
                             f"param_dtype must be None or torch.float32, got "
                             f"{self.param_dtype}; store them in low precision "
                             f"(param_dtype) or cast them on use, not both")
        if self.param_compute_dtype is not None and self.low_precision_modules is not None:
            raise ValueError("param_compute_dtype and low_precision_modules both decide "
                             "which modules compute in low precision; pass one")

    @property
    def casts_parameters(self) -> bool:
        """True when parameters are stored in a low-precision dtype.

        Example:
            >>> from ampkit.conversion.levels import conversion_for_level
            >>> conversion_for_level("O1").casts_parameters
            False
            >>> conversion_for_level("O2").casts_parameters  # cast on use instead
            False
        """
        return self.param_dtype in _LOW


@dataclasses.dataclass
class Record:
    """Attached to every module of a converted model: the config, and the name the
    module has in the converted model (``""``: the model itself)."""

    config: ConversionConfig
    name: str



def get_conversion(model: nn.Module) -> ConversionConfig | None:
    """The :class:`ConversionConfig` a model (or a module inside one) was converted
    with, or ``None``.

    Example:
        >>> import torch
        >>> from ampkit.conversion import get_conversion
        >>> from ampkit.front_door import convert_model
        >>> model = convert_model(torch.nn.Linear(2, 2), "O3", torch.bfloat16)
        >>> get_conversion(model).param_dtype, get_conversion(torch.nn.Linear(2, 2))
        (torch.bfloat16, None)
    """
    record = record_of(model)
    return None if record is None else record.config


def record_of(module: nn.Module) -> Record | None:
    """The :class:`Record` a module of a converted model carries, or ``None``."""
    record = getattr(module, _MARK, None)
    return record if isinstance(record, Record) else None


def mark_converted(module: nn.Module, config: ConversionConfig, name: str) -> None:
    """Attach its :class:`Record` to a module of a model converted with ``config``."""
    object.__setattr__(module, _MARK, Record(config, name))


def iter_records(model: nn.Module) -> Iterator[tuple[str, Record]]:
    """``(name, record)`` of every module of ``model`` that carries a :class:`Record`."""
    for name, module in model.named_modules():
        record = record_of(module)
        if record is not None:
            yield name, record

