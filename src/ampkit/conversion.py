"""Model conversion: a precision level applied to a whole ``nn.Module``.

:func:`ampkit.convert_model` decides, module by module, where parameters live and in which
dtype each module computes, then installs casts at the few module boundaries where the
dtype changes, so every module receives inputs in the dtype its parameters have:

* **parameters** are stored in ``param_dtype`` (O3, pure low precision), except in
  the modules kept in fp32 (norms by default, or any module by type, qualified name
  or instance) and everything inside them. Floating buffers (rotary frequencies,
  masks, running statistics) keep their dtype unless ``cast_buffers`` asks for them
  to follow (apex's ``model.half()``); a BatchNorm or InstanceNorm that updates
  float32 running statistics then keeps float32 parameters as well, since torch's
  kernels refuse low-precision parameters next to float32 statistics (they take the
  low-precision activation as it is). An op mixing a float32 buffer into an activation
  follows torch's type promotion; with no policy region (O3), each module holding
  low-precision parameters then casts its floating inputs to their dtype, in models
  that keep such a buffer. Integer buffers and inputs (token ids,
  ``num_batches_tracked``) are never touched. A parameter shared by several modules
  (tied weights) stays one parameter, cast once.
* **the model's boundary**: floating inputs are cast to ``input_dtype``, the forward
  runs inside :class:`ampkit.autocast` with the level's policy when ``policy`` is set
  (O1, O2: "patch ops"), and floating outputs are cast to ``output_dtype``. Inputs and
  outputs may be tensors or any nesting of lists, tuples, dicts and dataclasses.
* **a kept-fp32 module's boundary**: inputs are cast to float32, autocast is off inside
  (so it really computes in fp32), and outputs are cast to ``kept_output_dtype``
  (O2: back to the low dtype, so the next module gets what its parameters have).
  Norms whose torch kernel computes in fp32 from a low-precision input and fp32
  parameters (:data:`MIXED_INPUT_NORMS`; LayerNorm on CPU through
  :class:`_LowInputLayerNorm`) take the low-precision activation as it is when the
  kept output dtype is low precision too: the same fp32 arithmetic, without an
  activation-sized copy each way.
* **what the conversion keeps in fp32 on its own** (:func:`kept_by_conversion`): a
  parametrization's list (``torch.nn.utils.parametrize``) when parameters are cast on
  use, which computes the weight from the fp32 ``original`` in fp32 and hands it on
  cast to the compute dtype; a sparse embedding at O2, whose sparse gradient cannot be
  cast. The legacy ``spectral_norm``/``weight_norm`` hooks on a module cast on use
  compute from its uncast fp32 parameters with autocast off, then cast the weight.
* **a module white list** (``low_precision_modules``, MindSpore's O1): only the listed
  modules compute in low precision (their inputs and their fp32 parameters are cast on
  the way in, by an autocast region that runs every op in ``compute_dtype``), and their
  floating outputs go back to float32; everything else is fp32.

Each boundary module (the model, the outermost kept and white-listed modules) gets a
subclass of its own class, with the same name, whose ``__call__`` runs the module's call
inside its boundary as one ``with``-like block: a ``KeyboardInterrupt`` leaves nothing
behind, and ``torch.compile`` traces it without a graph break. There is no Python work
per op beyond what ``ampkit.autocast`` itself does.

With ``param_compute_dtype`` set (O2) the parameters are not cast at all: they stay the
fp32 truth, the module's own ``nn.Parameter`` objects that the optimizer steps, and each
module outside the kept ones runs its forward with low-precision copies of its own
parameters, made on use and kept for one forward of the converted model
(:mod:`ampkit.parameter_casts`). Gradients reach the fp32 ``.grad`` through autograd.
Floating buffers are never cast at O2: an op that mixes one with low-precision
activations follows torch's type promotion, and the policy's region decides the rest.

Converting is done once: calling :func:`ampkit.convert_model` again on the same model with the
same settings returns it unchanged; different settings, or converting a module inside
(or around) an already-converted one, is a ``RuntimeError``, never a second cast.

Example:
    >>> import torch
    >>> import ampkit
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8),
    ...                             torch.nn.Linear(8, 2))
    >>> model = ampkit.convert_model(model, "O2", torch.bfloat16)
    >>> [p.dtype for p in model.parameters()] == [torch.float32] * 6  # the truth: fp32
    True
    >>> model(torch.rand(3, 4)).dtype
    torch.float32
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

# Mutated in place by torch, never rebound: nn.Module._call_impl reads them the same way.
from torch.nn.modules.module import (
    _global_backward_hooks,
    _global_backward_pre_hooks,
    _global_forward_hooks,
    _global_forward_pre_hooks,
)

from ampkit.arguments import FLOAT_DTYPES, LOW_PRECISION, parse_dtype
from ampkit.autocast_mode import autocast, enter_in_graph, exit_in_graph, in_graph_key
from ampkit.casting import cast_tree
from ampkit.compile_frames import not_traced, skip_frame_only, skip_recursively
from ampkit.containers import iter_tensors
from ampkit.module_selection import ModuleSelector
from ampkit.module_selection import parse_module_selectors as _selectors
from ampkit.module_selection import resolve_module_selectors as _resolve
from ampkit.module_selection import selects as _matches
from ampkit.parameter_casts import (
    CAST_HOOKS,
    CastParametersOnUse,
    casting_on_use,
    end_forward_pass,
    new_forward_pass,
    restore_swapped,
    restore_to,
    swap_depth,
    swap_params,
)
from ampkit.policy import Policy
from ampkit.presets import get_policy

__all__ = [
    "ALL_LOW_PRECISION",
    "LOW_INPUT_LAYER_NORM_DEVICES",
    "MIXED_INPUT_NORMS",
    "NORM_MODULES",
    "OWN_PARAMETER_CASTS",
    "ConversionConfig",
    "ModuleSelector",
    "apply_conversion",
    "check_not_wrapped",
    "get_conversion",
    "kept_by_conversion",
    "prepare_conversion",
]


def _norm_modules() -> tuple[type[nn.Module], ...]:
    from torch.nn.modules.batchnorm import _BatchNorm
    from torch.nn.modules.instancenorm import _InstanceNorm

    norms: list[type[nn.Module]] = [_BatchNorm, nn.LayerNorm, nn.GroupNorm, _InstanceNorm]
    if hasattr(nn, "RMSNorm"):  # torch >= 2.4
        norms.append(nn.RMSNorm)
    return tuple(norms)


#: The modules ``keep_norms_fp32`` keeps in fp32: every BatchNorm (incl. SyncBatchNorm),
#: LayerNorm, GroupNorm, InstanceNorm and RMSNorm.
NORM_MODULES: tuple[type[nn.Module], ...] = _norm_modules()

#: The policy of a white-listed module's region: every op on floating inputs runs in
#: the low-precision dtype (its fp32 parameters are cast on use, once per region).
ALL_LOW_PRECISION = Policy(
    name="all-low-precision", unlisted="lower",
    description="Every compute op runs in the low-precision dtype (module white lists).")

_LOW = LOW_PRECISION
_FLOATS = FLOAT_DTYPES
_MARK = "_ampkit_conversion"

#: A module with this attribute set to True casts its fp32 parameters itself (torchao's
#: ``Float8Linear``, from ``initialize(fp8=...)``): O2 does not cast them on use for it,
#: which would round them twice.
OWN_PARAMETER_CASTS = "_ampkit_casts_own_parameters"


def kept_by_conversion(module: nn.Module, config: ConversionConfig) -> bool:
    """Whether the conversion keeps ``module`` in fp32 on its own, beside
    ``keep_fp32_modules``: a module that casts parameters on use would otherwise
    compute something that is not a parameter's use in low precision.

    * A parametrization's list (``torch.nn.utils.parametrize``: orthogonal, weight
      norm, spectral norm, user parametrizations), at O2 and in the module white
      list: it computes the weight from the fp32 ``original``, in fp32 (autocast off,
      its buffers such as spectral norm's ``_u``/``_v`` in their dtype), and its result
      is cast on use, to the compute dtype at O2 (and by the white-listed module's
      region otherwise). Only the op that uses the weight sees a low-precision copy.
    * A sparse ``nn.Embedding``/``nn.EmbeddingBag`` (``sparse=True``) at O2: a cast
      copy's gradient would be sparse in low precision, which autograd cannot cast back
      into the fp32 ``.grad`` (torch: "to(options) doesn't support converting to a
      different layout"). It looks up rows of its fp32 weight, as native autocast
      does, gets a sparse fp32 gradient, and its output goes on in low precision like
      a kept module's.

    Example:
        >>> import torch
        >>> from torch.nn.utils import parametrizations
        >>> from ampkit.conversion import kept_by_conversion
        >>> from ampkit.levels import conversion_for_level
        >>> lin = parametrizations.orthogonal(torch.nn.Linear(2, 2))
        >>> o2 = conversion_for_level("O2", "bfloat16")
        >>> kept_by_conversion(lin.parametrizations.weight, o2), kept_by_conversion(lin, o2)
        (True, False)
        >>> kept_by_conversion(torch.nn.Embedding(4, 2, sparse=True), o2)
        True
    """
    from torch.nn.utils.parametrize import ParametrizationList

    if isinstance(module, ParametrizationList):
        return (config.param_compute_dtype is not None
                or config.low_precision_modules is not None)
    return (config.param_compute_dtype is not None
            and isinstance(module, nn.Embedding | nn.EmbeddingBag)
            and bool(module.sparse))


def _is_parametrization(module: nn.Module) -> bool:
    from torch.nn.utils.parametrize import ParametrizationList

    return isinstance(module, ParametrizationList)


def _kept_output_dtype(module: nn.Module, config: ConversionConfig) -> torch.dtype | None:
    """The dtype a kept module's floating outputs are cast to: a parametrization's
    result is a parameter's value, cast on use to the compute dtype."""
    if _is_parametrization(module):
        return config.param_compute_dtype
    return config.kept_output_dtype


def _legacy_reparametrizations(module: nn.Module) -> list[Any]:
    """The forward pre-hooks of ``torch.nn.utils.spectral_norm``/``weight_norm`` (the
    hooks that predate ``torch.nn.utils.parametrizations``) on ``module``."""
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm

    return [hook for hook in module._forward_pre_hooks.values()
            if isinstance(hook, SpectralNorm | WeightNorm)]


def _reparametrization_sources(hook: Any) -> tuple[str, ...]:
    """The parameters a legacy hook computes its weight from."""
    from torch.nn.utils.spectral_norm import SpectralNorm

    if isinstance(hook, SpectralNorm):
        return (hook.name + "_orig",)
    return (hook.name + "_g", hook.name + "_v")


class _ReparametrizeInFp32:
    """A legacy ``spectral_norm``/``weight_norm`` hook on a module cast on use: the
    hook computes the weight from its fp32 parameters with autocast off (spectral
    norm's power iteration in fp32, on its fp32 ``u``/``v`` buffers), then the result
    is cast to the compute dtype, the low-precision copy the module's forward uses. The
    hook's class becomes a subclass of its own (``remove_spectral_norm`` and
    ``remove_weight_norm`` still find it); ``_ampkit_dtype`` is set on the hook."""

    name: str
    _ampkit_dtype: torch.dtype

    def __call__(self, module: nn.Module, inputs: Any) -> None:
        device_type = _compute_device_type(module, inputs)
        compute = super().__call__  # type: ignore[misc]
        if not torch.is_autocast_enabled(device_type):
            compute(module, inputs)
        elif torch.compiler.is_compiling():
            with torch.autocast(device_type, enabled=False):
                compute(module, inputs)
        else:
            with _region_autocast(device_type, None, None):
                compute(module, inputs)
        weight = getattr(module, self.name)
        if weight.dtype is torch.float32:
            setattr(module, self.name, weight.to(self._ampkit_dtype))


def _reparametrize_in_fp32(hook: Any, dtype: torch.dtype) -> None:
    from torch.nn.utils.spectral_norm import SpectralNorm

    hook.__class__ = (_SpectralNormInFp32 if isinstance(hook, SpectralNorm)
                      else _WeightNormInFp32)
    hook._ampkit_dtype = dtype


def _legacy_classes() -> tuple[type, type]:
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm

    spectral = type("_SpectralNormInFp32", (_ReparametrizeInFp32, SpectralNorm),
                    {"__module__": __name__})
    weight = type("_WeightNormInFp32", (_ReparametrizeInFp32, WeightNorm),
                  {"__module__": __name__})
    return spectral, weight


# -- configuration ------------------------------------------------------------------------

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
            policy (a :class:`~ampkit.policy.Policy` or a preset name).
        input_dtype: the model's floating inputs are cast to it (``None``: as given).
        output_dtype: the model's floating outputs are cast to it (``None``: as computed).
        cast_buffers: floating buffers follow their module's parameter dtype
            (``param_dtype``); ``False``: they keep their own, and a module that
            updates float32 running statistics (BatchNorm, InstanceNorm with
            ``track_running_stats``) keeps float32 parameters too. The levels pass
            ``False`` unless asked (:func:`ampkit.levels.conversion_config`).
        param_compute_dtype: the parameters stay as stored (fp32, the truth) and every
            module outside the kept ones computes with copies of its own parameters
            in this low-precision dtype, made on use (O2; ``None``: off). See
            :mod:`ampkit.parameter_casts`.
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
        >>> from ampkit.levels import conversion_for_level
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
            >>> from ampkit.levels import conversion_for_level
            >>> conversion_for_level("O1").casts_parameters
            False
            >>> conversion_for_level("O2").casts_parameters  # cast on use instead
            False
        """
        return self.param_dtype in _LOW


# -- reported dtype -----------------------------------------------------------------------

class _ReportDtype:
    """``state_dict`` post-hook of a module: every floating entry in ``dtype`` (apex
    reports fp32 at O3). (No ``__slots__``: torch tags hooks with an attribute.)"""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, module: nn.Module, state_dict: dict[str, Any], prefix: str,
                 local_metadata: Any) -> None:
        for store in (module._parameters, module._buffers):
            for name, tensor in store.items():
                key = prefix + name
                value = state_dict.get(key)
                if tensor is None or value is None or value is tensor:  # keep_vars=True
                    continue
                if value.is_floating_point() and value.dtype is not self.dtype:
                    state_dict[key] = value.to(self.dtype)


# -- boundaries -----------------------------------------------------------------------------

class _Region(enum.Enum):
    """What a boundary module's forward runs inside."""

    UNCHANGED = "unchanged"
    POLICY = "policy"  # ampkit.autocast with the conversion's policy (O1, O2)
    LOW = "low"  # ampkit.autocast running every op in low precision (white list)
    FP32 = "fp32"  # autocast off: a kept-fp32 module


@functools.lru_cache(maxsize=64)
def _region_autocast(device_type: str, dtype: torch.dtype | None,
                     policy: Policy | None) -> autocast:
    """One reusable region per (device, dtype, policy): ampkit.autocast keeps its state
    on a thread-local stack, so one object can be entered by nested and other threads."""
    if policy is None:
        return autocast(device_type, enabled=False)
    return autocast(device_type, dtype, policy=policy)


def _compute_device_type(module: nn.Module, args: Any) -> str:
    """The device a module computes on: its first parameter's (or buffer's), else its
    first tensor input's."""
    # The module's own tensors first: cheap, and almost always there (norms, the root's
    # first layer is usually reached after one or two children).
    for store in (module._parameters, module._buffers):
        for tensor in store.values():
            if tensor is not None:
                return tensor.device.type
    for tensor in module.parameters():
        return tensor.device.type
    for tensor in iter_tensors(args):
        return tensor.device.type
    return "cpu"


class _LowCopy:
    """What autograd keeps instead of an fp32 upcast of a low-precision input: the input
    itself (half the bytes). Upcasting is exact, so unpacking gives the same bits."""

    __slots__ = ("low", "version")

    def __init__(self, low: torch.Tensor) -> None:
        self.low = low
        self.version = low._version


class _SaveLowCopies:
    """saved_tensors_hooks that store the low-precision original of each fp32 upcast a
    kept-fp32 module saves for backward (norms save their input), instead of the upcast.

    ``upcasts``: id(upcast) -> (upcast, original, upcast's version when made). Autograd
    keeps the hook functions with every tensor saved meanwhile, so the table is emptied
    on exit: otherwise it would keep the fp32 upcasts alive as long as the graph."""

    __slots__ = ("hooks", "upcasts")

    def __init__(self, upcasts: dict[int, tuple[torch.Tensor, torch.Tensor, int]]) -> None:
        self.upcasts = upcasts
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack_low_copy)

    def _pack(self, tensor: torch.Tensor) -> Any:
        entry = self.upcasts.get(id(tensor))
        # Only the untouched upcast itself: a view or an in-place-modified copy differs.
        if entry is not None and entry[0] is tensor and tensor._version == entry[2]:
            return _LowCopy(entry[1])
        return tensor

    def __enter__(self) -> None:
        self.hooks.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.hooks.__exit__(*exc)
        self.upcasts.clear()


def _unpack_low_copy(packed: Any) -> torch.Tensor:
    if not isinstance(packed, _LowCopy):
        unchanged: torch.Tensor = packed
        return unchanged
    if packed.low._version != packed.version:
        raise RuntimeError("one of the variables needed for gradient computation has been "
                           "modified by an inplace operation: the low-precision input of a "
                           "kept-fp32 module (ampkit saved it in place of its fp32 copy)")
    return packed.low.to(torch.float32)


def _saved_tensor_hooks_free() -> bool:
    """True when no other saved-tensor hooks are active (activation checkpointing and
    offloading use them; ours must not shadow theirs)."""
    autograd: Any = torch._C._autograd  # private hooks, not all in torch's stubs
    try:
        return (autograd._saved_tensors_hooks_is_enabled()
                and autograd._top_saved_tensors_default_hooks(False) is None)
    except (AttributeError, TypeError):  # a torch without these internals: stay out
        return False


def _mixed_input_norms() -> dict[str, tuple[type[nn.Module], ...]]:
    """Per device type, the norm classes whose torch kernels take a low-precision input
    with fp32 weight, bias and running statistics, compute in fp32 inside and return the
    input's dtype, with gradients as exact as the fp32 computation's. Exact classes only:
    a subclass may override ``forward`` with ops that would then run in low precision.

    Checked against float64 on torch 2.13 CPU (output, input gradient, weight and bias
    gradients, running statistics; bfloat16 and float16): BatchNorm, GroupNorm and
    InstanceNorm match the cast-to-fp32 path to fp32 rounding. Left out on purpose:

    * LayerNorm: the CPU kernel takes mixed input, but its backward accumulates the
      weight and bias gradients in the input's dtype (1-2% relative error in bfloat16),
      so on CPU it runs through :class:`_LowInputLayerNorm` instead (see
      :data:`LOW_INPUT_LAYER_NORM_DEVICES`); CUDA refuses mixed input (torch 2.11:
      "expected scalar type BFloat16 but found Float").
    * RMSNorm: with mixed dtypes ``F.rms_norm`` falls back to a composite that upcasts
      the input itself and rounds twice, so nothing is saved.
    * SyncBatchNorm, and on CUDA GroupNorm (refuses mixed input, torch 2.11) and
      InstanceNorm (not checked on a GPU).

    CUDA BatchNorm (native and cuDNN kernels) takes mixed input: measured on an H100
    with torch 2.11 (issue 10), and the way apex's O2 has always run it.

    Even for these classes the input is still cast (see :func:`_takes_low_input` and
    :func:`_low_contiguous`) when the norm has no weight or bias (``affine=False``: torch
    then runs its all-low-precision kernel, several ulps off), when the input is not
    contiguous (channels-last and strided inputs take CPU kernels whose mixed backward
    sums the bias gradient in low precision) and when it is in the other low dtype
    (it would be rounded twice)."""
    from torch.nn.modules import batchnorm, instancenorm

    batch = (batchnorm.BatchNorm1d, batchnorm.BatchNorm2d, batchnorm.BatchNorm3d)
    instance = (instancenorm.InstanceNorm1d, instancenorm.InstanceNorm2d,
                instancenorm.InstanceNorm3d)
    return {"cpu": (*batch, nn.GroupNorm, *instance), "cuda": batch}


#: Per device type, the kept-fp32 norm classes that take the low-precision activation
#: as it is (see :func:`_mixed_input_norms`): no fp32 copy of their input is made.
MIXED_INPUT_NORMS: dict[str, tuple[type[nn.Module], ...]] = _mixed_input_norms()


#: Device types on which a kept-fp32 ``nn.LayerNorm`` takes the low-precision
#: activation as it is, through :class:`_LowInputLayerNorm`.
LOW_INPUT_LAYER_NORM_DEVICES: tuple[str, ...] = ("cpu",)


class _LowInputLayerNorm(torch.autograd.Function):
    """``F.layer_norm`` of a low-precision input with fp32 weight and bias, fp32
    statistics and fp32 arithmetic, without an fp32 copy of the input in the forward.

    Forward and input gradient: torch's mixed-dtype kernels (bit-equal, on torch 2.13
    CPU, to normalising an fp32 copy and rounding). Weight and bias gradients: torch's
    fp32 kernel on fp32 copies of the input and the incoming gradient, made only in the
    backward and only when those gradients are needed, because the mixed kernel sums
    them in the input's dtype. A backward with ``create_graph=True`` (double backward,
    gradient penalties) differentiates ``F.layer_norm`` of an fp32 copy instead, so it
    can be differentiated again."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, normalized_shape: Any, weight: Any, bias: Any,
                eps: float) -> torch.Tensor:
        out, mean, rstd = torch.native_layer_norm(x, normalized_shape, weight, bias, eps)
        ctx.save_for_backward(x, mean, rstd, weight, bias)
        ctx.normalized_shape = normalized_shape
        ctx.eps = eps
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, mean, rstd, weight, bias = ctx.saved_tensors
        needs_x, _, needs_w, needs_b, _ = ctx.needs_input_grad
        if torch.is_grad_enabled():  # create_graph=True: a backward autograd can follow
            x32 = x.float()
            wanted = [(i, t) for i, t in ((0, x32), (2, weight), (3, bias))
                      if ctx.needs_input_grad[i]]
            out = F.layer_norm(x32, ctx.normalized_shape, weight, bias, ctx.eps)
            grads = torch.autograd.grad(out, [t for _, t in wanted], grad.float(),
                                        create_graph=True)
            result: list[Any] = [None] * 5
            for (i, _), g in zip(wanted, grads):
                result[i] = g
            if result[0] is not None:
                result[0] = result[0].to(x.dtype)
            return tuple(result)
        backward = torch.ops.aten.native_layer_norm_backward
        shape = ctx.normalized_shape
        grad_x = grad_w = grad_b = None
        if needs_x:
            grad_x = backward(grad, x, shape, mean, rstd, weight, bias,
                              [True, False, False])[0]
        if needs_w or needs_b:
            _, grad_w, grad_b = backward(grad.float(), x.float(), shape, mean, rstd, weight,
                                         bias, [False, needs_w, needs_b])
        return grad_x, None, grad_w, grad_b, None


def _is_fp32(t: Any) -> bool:
    return t is None or (isinstance(t, torch.Tensor) and t.dtype is torch.float32)


class _LayerNormFromLowInput(torch.overrides.TorchFunctionMode):
    """Entered around a kept ``nn.LayerNorm``'s forward: its ``F.layer_norm`` call
    goes to :class:`_LowInputLayerNorm`."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.layer_norm:
            bound = dict(zip(("input", "normalized_shape", "weight", "bias", "eps"), args))
            bound.update(kwargs)
            x, weight, bias = bound["input"], bound.get("weight"), bound.get("bias")
            if x.dtype in _LOW and _is_fp32(weight) and _is_fp32(bias):
                return _LowInputLayerNorm.apply(  # type: ignore[no-untyped-call]
                    x, tuple(bound["normalized_shape"]), weight, bias, bound.get("eps", 1e-5))
        return func(*args, **kwargs)


_LOW_INPUT_LAYER_NORM = _LayerNormFromLowInput()


def _takes_low_input(module: nn.Module, device_type: str,
                     module_type: type | None = None) -> bool:
    # ``module_type``: the class the module had when converted; FSDP2 swaps in a
    # subclass of its own (FSDPBatchNorm1d), which must still count as the norm it is.
    # Only with an fp32 weight or bias: without one (affine=False, the InstanceNorm
    # default) torch runs its all-low-precision kernels (running statistics alone do not
    # always switch InstanceNorm to the mixed one), several ulps off in output and
    # input gradient.
    cls = module_type or _original_class(type(module))
    return (cls in MIXED_INPUT_NORMS.get(device_type, ()) or (
        cls is nn.LayerNorm and device_type in LOW_INPUT_LAYER_NORM_DEVICES)) and any(
        p is not None and p.dtype is torch.float32 for p in module._parameters.values())


def _check_gathered_fp32(module: nn.Module) -> None:
    """A kept-fp32 module in an FSDP2 group: its parameters, as FSDP gathered them for
    this forward, must be fp32, or the group's ``MixedPrecisionPolicy`` rounds what the
    level keeps in fp32."""
    low = next(((n, p.dtype) for n, p in module._parameters.items()
                if p is not None and p.is_floating_point() and p.dtype is not torch.float32),
               None)
    if low is None:
        return
    record = getattr(module, _MARK, None)
    name = record.name if isinstance(record, _Record) else "?"
    level = ""
    if isinstance(record, _Record) and record.config.param_compute_dtype is not None:
        level = " at O2"
    raise RuntimeError(
        f"ampkit keeps module {name!r} ({_original_class(type(module)).__name__}) in "
        f"float32{level}, but FSDP2 gathered its parameter {low[0]!r} as {low[1]}: it is "
        f"in a fully_shard group whose MixedPrecisionPolicy has param_dtype={low[1]}. "
        f"Shard the model with ampkit.fsdp.fully_shard(model, blocks=...), which gives "
        f"kept modules fp32 groups of their own, or call fully_shard on this module "
        f"first with mp_policy=ampkit.fsdp.mixed_precision_policy(model, kept=True)")


def _original_class(cls: type) -> type:
    """``cls`` without the subclasses FSDP2 (``FSDP<Name>``) and a converted model's
    own class swap put on top of the module's class."""
    while (cls in _converted_classes or any(b.__name__ == "FSDPModule" for b in cls.__bases__)
           ) and cls.__bases__:
        cls = _converted_classes.get(cls) or cls.__bases__[-1]
    return cls


def _low_contiguous(args: Any, dtype: torch.dtype) -> bool:
    """Every floating input is contiguous and already in ``dtype``, the kept output
    dtype. Another low dtype would be rounded twice (in the kernel, then by the output
    cast). Channels-last and strided inputs take other CPU kernels, whose mixed-dtype
    backward sums in low precision (BatchNorm's bias gradient 1e-3 off in bfloat16);
    on CUDA too, where no other layout has been checked."""
    return all(t.dtype is dtype and t.is_contiguous()
               for t in iter_tensors(args) if t.is_floating_point())


@dataclasses.dataclass(slots=True, eq=False)
class _Boundary:
    """One module's boundary: casts on the way in, a region around the forward, casts
    on the way out, as one ``try``/``finally`` around the module's call
    (:func:`_converted_call`, the ``__call__`` of the module's converted class). Holds
    no reference to the module, so ``copy.deepcopy`` of a converted model gets working
    boundaries of its own.

    A ``with`` around the call, not a pre-hook and a post-hook: torch runs
    ``always_call`` post-hooks for ``Exception`` only, so after a ``KeyboardInterrupt``
    a hook pair would leave its region entered and parameters swapped; and a region
    entered in one hook and left in another cannot be traced by ``torch.compile``.

    A kept-fp32 norm in :data:`MIXED_INPUT_NORMS` gets its low-precision input as it is
    (its kernel computes in fp32 inside from fp32 parameters and statistics, and
    returns the input's dtype): no activation-sized cast on the way in, none on the way
    out, none in the backward pass."""

    region: _Region
    input_dtype: torch.dtype | None
    output_dtype: torch.dtype | None
    compute_dtype: torch.dtype | None = None
    policy: Policy | None = None
    _: dataclasses.KW_ONLY
    root: bool = False  # the converted model's own boundary: a forward pass starts
    # The module's class when it was converted: the conversion's own class swap and
    # FSDP2's later replace it with subclasses.
    module_type: type | None = None
    # The output is a parameter's value (a parametrization's result): cast only while
    # a converted model's forward or a module cast on use runs, its use; read from
    # outside (``model[0].weight``, ``remove_parametrizations``) it stays fp32.
    on_use: bool = False
    # Device type -> key of the region's policy for autocast_mode.enter_in_graph (made
    # when the boundary is installed, for the module's device: compiled code enters
    # the region through it); a missing or None key: entered as an ampkit.autocast.
    graph_keys: dict[str, int | None] = dataclasses.field(default_factory=dict)

    def _listed_policy(self) -> Policy | None:
        """The region's policy where it has lists (an ampkit region, not torch.autocast)."""
        if self.region is _Region.POLICY:
            policy = self.policy
        elif self.region is _Region.LOW:
            policy = ALL_LOW_PRECISION
        else:
            return None
        return None if policy is None or policy.is_native else policy

    def prepare_graph_region(self, device_type: str) -> None:
        """Make the key compiled code enters this region's policy with on ``device_type``."""
        policy = self._listed_policy()
        if policy is not None and device_type not in self.graph_keys:
            self.graph_keys[device_type] = in_graph_key(device_type, policy)

    # The keys index this process's table of regions: a pickled (or copied) boundary
    # carries the device types and makes its keys again where it is loaded.
    def __getstate__(self) -> dict[str, Any]:
        state = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        state["graph_keys"] = list(self.graph_keys)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        devices = state.pop("graph_keys", [])
        for name, value in state.items():
            object.__setattr__(self, name, value)
        self.graph_keys = {}
        for device_type in devices:
            self.prepare_graph_region(device_type)

    def _contexts(self, device_type: str) -> list[Any]:
        if self.region is _Region.UNCHANGED:
            return []
        if self.region is _Region.FP32:
            # Nothing to switch off when no autocast is on (O3, outside regions).
            if torch.is_autocast_enabled(device_type):
                return [_region_autocast(device_type, None, None)]
            return []
        policy = self.policy if self.region is _Region.POLICY else ALL_LOW_PRECISION
        return [_region_autocast(device_type, self.compute_dtype, policy)]

    def _low_input(self, module: nn.Module, device_type: str, args: Any) -> bool:
        """A kept norm that takes its low-precision input as it is."""
        return (self.region is _Region.FP32 and self.output_dtype in _LOW
                and _takes_low_input(module, device_type, self.module_type)
                and _low_contiguous(args, self.output_dtype))

    def enter(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
              ) -> tuple[list[Any], int, tuple[Any, ...], dict[str, Any]]:
        """Eager: enter the boundary (all or nothing); ``(entered contexts, swap depth,
        args, kwargs)`` for :meth:`leave` and the call."""
        if not self.root and self.region is _Region.FP32 and getattr(
                module, "_is_fsdp_managed_module", False):
            _check_gathered_fp32(module)
        swaps = swap_depth()
        device_type = _compute_device_type(module, (args, kwargs))
        entered: list[Any] = []
        if self.root:
            # A forward of the model begins: the copies of its parameters live until
            # the outermost one ends (leave, which the except below reaches too).
            new_forward_pass()
        try:
            for context in self._contexts(device_type):
                context.__enter__()
                entered.append(context)
            if self.input_dtype is not None:
                if self._low_input(module, device_type, (args, kwargs)):
                    if issubclass(self.module_type or type(module), nn.LayerNorm):
                        _LOW_INPUT_LAYER_NORM.__enter__()  # type: ignore[no-untyped-call]
                        entered.append(_LOW_INPUT_LAYER_NORM)
                else:
                    cast = cast_tree((args, kwargs), self.input_dtype)
                    if (self.region is _Region.FP32 and torch.is_grad_enabled()
                            and _saved_tensor_hooks_free()):
                        upcasts = {id(new): (new, old, new._version) for old, new in zip(
                            iter_tensors((args, kwargs)), iter_tensors(cast))
                            if new is not old and old.dtype in _LOW}
                        if upcasts:
                            hooks = _SaveLowCopies(upcasts)
                            hooks.__enter__()
                            entered.append(hooks)
                    args, kwargs = cast
        except BaseException:
            self.leave(entered, swaps)
            raise
        return entered, swaps, args, kwargs

    def leave(self, entered: list[Any], swaps: int) -> None:
        """Eager: put swapped parameters back and close the contexts, in that order,
        each step even when an earlier one raised."""
        try:
            restore_to(swaps)
        finally:
            if self.root:
                end_forward_pass()
            while entered:
                entered.pop().__exit__(None, None, None)

    def cast_output(self, module: nn.Module, args: Any, output: Any) -> Any:
        """A forward hook, the first of the module's: the output cast. A hook, so that
        forward hooks the user registered on the module see what it hands back."""
        if self.output_dtype is None or output is None or (
                self.on_use and not torch.compiler.is_compiling() and not casting_on_use()):
            return None
        return cast_tree(output, self.output_dtype)

    def _call_traced(self, module: nn.Module, call: Any, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> Any:
        # Traced by dynamo (the module is called inside compiled code): only what it
        # traces, regions as ``with torch.autocast`` blocks. torch.compile of the model
        # itself runs the model's own call outside the graph (see _converted_call), so
        # its region, whatever the policy, is in effect while the forward is traced.
        # A policy with lists enters its rules as two nodes of the graph around a
        # traced torch.autocast block (autocast_mode.enter_in_graph); one that
        # intercepts a composite through the Python mode cannot be entered by a graph:
        # an ampkit region, a graph break at its entry and exit.
        device_type = _compute_device_type(module, (args, kwargs))
        if self.input_dtype is not None and not (
                self._low_input(module, device_type, (args, kwargs))
                and not issubclass(self.module_type or type(module), nn.LayerNorm)):
            # (LayerNorm's low-input kernel is entered through a function mode, which
            # is not traced here: its input is cast, the forward is the same.)
            args, kwargs = cast_tree((args, kwargs), self.input_dtype)
        if self.region is _Region.UNCHANGED:
            return call(*args, **kwargs)
        if self.region is _Region.FP32:
            if not torch.is_autocast_enabled(device_type):
                return call(*args, **kwargs)
            with torch.autocast(device_type, enabled=False):
                return call(*args, **kwargs)
        policy = self.policy if self.region is _Region.POLICY else ALL_LOW_PRECISION
        if policy is None or policy.is_native:
            with torch.autocast(device_type, self.compute_dtype):
                return call(*args, **kwargs)
        key = self.graph_keys.get(device_type)
        if key is not None:
            # The policy's lists as two nodes of the graph around the call, inside the
            # traced native region: no graph break (see autocast_mode.enter_in_graph).
            with torch.autocast(device_type, self.compute_dtype):
                enter_in_graph(key)
                try:
                    return call(*args, **kwargs)
                finally:
                    exit_in_graph(key)
        _region_outside_the_graph()  # a graph break, named (fullgraph=True: the error)
        with _region_autocast(device_type, self.compute_dtype, policy):
            return call(*args, **kwargs)


@not_traced
def _region_outside_the_graph() -> None:
    """Where compiled code meets a converted module's region that a graph cannot enter:
    the graph breaks here, and ``fullgraph=True`` fails with the reason below."""


_region_outside_the_graph._torchdynamo_disable_msg = (  # type: ignore[attr-defined]
    "ampkit: a converted module's region, called inside compiled code, has a policy "
    "that intercepts a Python-level composite (an op with no dispatcher op, such as "
    "F.interpolate, on its lists, or an unlisted rule other than 'native', such as "
    "MindSpore O1's white-listed modules); compiled code cannot enter it, so the "
    "region runs outside the graph. Compile the model itself (torch.compile(model)) "
    "or leave that op off the lists to get one graph")


def _converted_call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``__call__`` of a module with a boundary (the converted model, a kept-fp32 or
    white-listed module): the module's own call, inside its boundary, as one
    ``try``/``finally``.

    ``torch.compile(model)`` runs this frame and the boundary's bookkeeping as plain
    Python (see :func:`skip_frame_only`) and compiles the module call it makes, so the
    model's region is in effect when dynamo traces the forward: its policy is traced
    and guarded on, with no graph break, and one graph serves every call under that
    policy. Called from compiled code, it is traced (:meth:`_Boundary._call_traced`)."""
    boundary = self.__dict__.get(_BOUNDARY)
    call = super(_converted_in(type(self)), self).__call__  # type: ignore[arg-type]
    if boundary is None:  # a copy made without the record: a plain module again
        return call(*args, **kwargs)
    if torch.compiler.is_compiling():
        return boundary._call_traced(self, call, args, kwargs)
    entered, swaps, args, kwargs = boundary.enter(self, args, kwargs)
    try:
        return call(*args, **kwargs)
    finally:
        boundary.leave(entered, swaps)


skip_frame_only(_converted_call.__code__)
for _eager in (_Boundary.enter, _Boundary.leave, _Boundary.cast_output):
    # The boundary's eager bookkeeping and everything it calls: plain Python when
    # dynamo meets it as a frame of its own (the model's hooks, which torch.compile of
    # the model runs outside the graph); traced where compiled code calls it.
    skip_recursively(_eager.__code__)
_BOUNDARY = "_ampkit_boundary"


def _cast_call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``__call__`` of a module whose parameters are cast on use (and that has no
    boundary): while the pair of forward hooks :class:`CastParametersOnUse` installed
    are its only hooks (and no global module hooks are set), their work done here
    instead, around the module's forward, as ``nn.Module.__call__`` would call it.

    Host cost: a module with hooks takes ``nn.Module._call_impl``'s slow path and two
    Python hook calls; here, one frame and a ``try``/``finally``. The outcome is the
    hooks': the copies are swapped in where the pre-hook (first of the module's) would
    swap them, and the parameters are back before anything after the forward runs,
    exceptions of every kind (``KeyboardInterrupt`` too) included. With any other
    hook on the module (FSDP2's unshard, which must come before the swap, a user's, a
    checkpointing hook) or under tracing (``torch.compile``, ``torch.jit.trace``), or
    with ``module.compile()``, the module's ordinary call runs, hooks and all."""
    own = self.__dict__.get(CAST_HOOKS)
    if (own is None or torch.compiler.is_compiling() or _tracing_state() is not None
            or len(self._forward_pre_hooks) != 1 or len(self._forward_hooks) != 1
            or own[1] not in self._forward_pre_hooks or own[2] not in self._forward_hooks
            or self._backward_pre_hooks or self._backward_hooks
            or self._compiled_call_impl is not None
            or _global_forward_pre_hooks or _global_forward_hooks
            or _global_backward_pre_hooks or _global_backward_hooks):
        return super(_converted_in(type(self)), self).__call__(  # type: ignore[arg-type]
            *args, **kwargs)
    swapped: list[tuple[str, torch.Tensor]] = []
    try:
        # (CastParametersOnUse.swap_in, not asking is_compiling again)
        swap_params(self, swapped, own[0].dtype, False, own[0].keep)
        return self.forward(*args, **kwargs)
    finally:
        restore_swapped(self, swapped)


# Run as plain Python when dynamo meets it as a frame of its own
# (torch.compile(module) of such a module: the swap made eagerly and the forward
# compiled, as the hooks were); traced, taking the ordinary call, inside compiled code.
skip_frame_only(_cast_call.__code__)
_tracing_state = torch._C._get_tracing_state
_INPUT_DTYPE = "_ampkit_input_dtype"


def _input_cast_call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``__call__`` of a module that casts its floating inputs to its parameters'
    low-precision dtype (O3 in a model that keeps float32 buffers; see
    :func:`_cast_inputs_past_buffers`): the cast, then the module's ordinary call,
    hooks and all. One frame and one walk of the arguments, not a boundary's region
    bookkeeping: nothing else happens at this boundary."""
    dtype = self.__dict__.get(_INPUT_DTYPE)
    if dtype is not None:
        args, kwargs = cast_tree((args, kwargs), dtype)
    return super(_converted_in(type(self)), self).__call__(  # type: ignore[arg-type]
        *args, **kwargs)


def _cast_inputs_hook(module: nn.Module, args: Any, kwargs: Any) -> Any:
    """The same cast as a forward pre-hook, for a module whose class has a ``__call__``
    of its own (or was given another by the conversion)."""
    dtype = module.__dict__.get(_INPUT_DTYPE)
    return None if dtype is None else cast_tree((args, kwargs), dtype)
# converted class -> the class it was made from (and its inverse below)
_converted_classes: dict[type, type] = {}
_converted_of: dict[tuple[type, Any], type] = {}
_converted_lock = threading.Lock()


def _converted_in(cls: type) -> type:
    """The converted class in ``cls``'s MRO (``cls`` itself, or FSDP2's subclass of it)."""
    return next(klass for klass in cls.__mro__ if klass in _converted_classes)


def _rebuild_converted(base: type, call: Any = None) -> nn.Module:
    """Unpickling a converted model: an empty instance of its converted class
    (``call``: its ``__call__``; ``None``, as pickles made before it was recorded have
    it: :func:`_converted_call`)."""
    return object.__new__(_converted_class(base, call or _converted_call))


def _reduce_converted(self: nn.Module, protocol: int) -> Any:
    converted = _converted_in(type(self))
    if converted is not type(self):  # a further subclass (FSDP2's): pickled its own way
        return super(converted, self).__reduce_ex__(protocol)  # type: ignore[arg-type]
    call = converted.__dict__["__call__"]
    base = _converted_classes[converted]
    return (_rebuild_converted, (base,) if call is _converted_call else (base, call),
            self.__dict__.copy())


def _own_forward_frame(forward: Any) -> Any:
    """A ``forward`` that calls torch's own (``nn.Sequential.forward``, ...) from a frame
    of ampkit's. ``torch.compile`` of a module whose forward is torch's traces its call
    from a frame of its own (the boundary then runs inside the graph); with this
    forward it runs the module's call (its boundary, the region entered) as Python and
    compiles the forward, as for a model class of the user's own: one graph, whatever
    the policy."""

    def forward_frame(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return forward(self, *args, **kwargs)

    forward_frame.__doc__ = forward.__doc__
    return forward_frame


def _converted_class(base: type, call: Any = _converted_call) -> type:
    """The subclass of ``base`` a converted model gets: the same name, with ``call``
    (:func:`_converted_call` for a boundary, :func:`_cast_call` for a module cast on
    use) as its ``__call__`` (made once per class and call)."""
    with _converted_lock:
        cls = _converted_of.get((base, call))
        if cls is None:
            namespace = {"__call__": call, "__reduce_ex__": _reduce_converted,
                         "__module__": base.__module__, "__qualname__": base.__qualname__,
                         "__doc__": base.__doc__}
            forward = getattr(base, "forward", None)
            if call is _converted_call and getattr(forward, "__module__", "").startswith(
                    "torch."):
                namespace["forward"] = _own_forward_frame(forward)
            cls = type(base.__name__, (base,), namespace)
            _converted_of[(base, call)] = cls
            _converted_classes[cls] = base
        return cls


def _install_boundary(module: nn.Module, boundary: _Boundary) -> None:
    base = type(module)
    if base.__dict__.get("__call__") is not _converted_call:
        module.__class__ = _converted_class(_converted_classes.get(base, base))
    object.__setattr__(module, _BOUNDARY, boundary)
    boundary.prepare_graph_region(_compute_device_type(module, ()))
    if boundary.output_dtype is not None:
        module.register_forward_hook(boundary.cast_output, prepend=True)


# -- the conversion -----------------------------------------------------------------------

@dataclasses.dataclass
class _Record:
    """Attached to every module of a converted model: the config, and the name the
    module has in the converted model (``""``: the model itself)."""

    config: ConversionConfig
    name: str


def _wrapper_types() -> tuple[type, ...]:
    types: list[type] = [nn.DataParallel, nn.parallel.DistributedDataParallel]
    for path, name in (("torch.distributed.fsdp", "FullyShardedDataParallel"),
                       ("torch.distributed.fsdp", "FSDPModule"),
                       ("torch.distributed._composable.fsdp", "FSDPModule")):
        try:
            module = __import__(path, fromlist=[name])
        except ImportError:
            continue
        cls = getattr(module, name, None)
        if isinstance(cls, type):
            types.append(cls)
    return tuple(types)


def check_not_wrapped(model: nn.Module, argument: str = "model") -> None:
    """Raise ``RuntimeError`` when ``model`` (or a module in it) is already wrapped by
    DataParallel, DistributedDataParallel or FSDP: conversion must come first, because
    those wrappers hold (or shard) the fp32 parameters as they found them. FSDP2 (an
    ``FSDPModule`` anywhere in the model) swaps sharded and unsharded parameters in its
    own forward hooks, and the conversion's hooks must run after those, on the
    parameters FSDP2 gathered (see :mod:`ampkit.fsdp`).

    Example:
        >>> import torch
        >>> from ampkit.conversion import check_not_wrapped
        >>> check_not_wrapped(torch.nn.Linear(2, 2))
        >>> check_not_wrapped(torch.nn.DataParallel(torch.nn.Linear(2, 2)))
        Traceback (most recent call last):
        ...
        RuntimeError: model is wrapped in DataParallel; ...
    """
    wrappers = _wrapper_types()
    for name, module in model.named_modules():
        if isinstance(module, wrappers):
            where = f"model (its submodule {name!r})" if name else argument
            kind = next(c.__name__ for c in type(module).__mro__ if c in wrappers)
            then = f"wrap the result in {kind}"
            if kind == "FSDPModule":
                kind = "FSDP2 (fully_shard)"
                then = ("shard the result (ampkit.fsdp.fully_shard gives it the level's "
                        "mixed precision)")
            raise RuntimeError(f"{where} is wrapped in {kind}; call ampkit.initialize / "
                               f"convert_model on the bare model first, then {then}")


def _check_model(model: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    check_not_wrapped(model)


@dataclasses.dataclass
class _Plan:
    """Where every tensor goes and which modules get hooks."""

    tensor_dtype: dict[int, tuple[torch.dtype, str]] = dataclasses.field(default_factory=dict)
    boundaries: dict[int, tuple[nn.Module, _Boundary]] = dataclasses.field(
        default_factory=dict)
    owners: list[nn.Module] = dataclasses.field(default_factory=list)
    # modules that compute with low-precision copies of their fp32 parameters, made on
    # use, in cast_dtype (O2's param_compute_dtype; or param_dtype, for the parameters
    # cast_shared_on_use keeps fp32)
    cast_on_use: list[nn.Module] = dataclasses.field(default_factory=list)
    input_casts: list[nn.Module] = dataclasses.field(default_factory=list)
    # a module outside the kept ones keeps float buffers while parameters go low
    keeps_float_buffers: bool = False
    cast_dtype: torch.dtype | None = None


def _plan(model: nn.Module, config: ConversionConfig) -> _Plan:
    keep = _resolve(model, config.keep_fp32_modules, "keep_fp32_modules")
    white = (_resolve(model, config.low_precision_modules, "low_precision_modules")
             if config.low_precision_modules is not None else None)
    plan = _Plan(cast_dtype=config.param_compute_dtype)
    seen: set[int] = set()
    shared_fp32: set[int] = set()  # parameters kept fp32 for a kept module (see below)
    low_owners: list[nn.Module] = []  # modules whose parameters go to low precision

    def assign(module: nn.Module, name: str, dtype: torch.dtype | None) -> None:
        if dtype is None:
            return
        stores: list[tuple[str, torch.Tensor | None, bool]] = [
            (n, t, True) for n, t in module._parameters.items()]
        if config.cast_buffers:
            stores += [(n, t, False) for n, t in module._buffers.items()]
        for tname, tensor, is_param in stores:
            if tensor is None or not tensor.is_floating_point():
                continue
            full = f"{name}.{tname}" if name else tname
            earlier = plan.tensor_dtype.get(id(tensor))
            if earlier is not None and earlier[0] is not dtype:
                if not (config.cast_shared_on_use and is_param):
                    raise ValueError(
                        f"{full} and {earlier[1]} are one shared tensor, but the "
                        f"conversion would store it as {earlier[0]} in one place and "
                        f"{dtype} in the other; keep both modules in fp32 "
                        f"(keep_fp32_modules) or neither" + (
                            "" if config.cast_shared_on_use or not is_param else
                            ", or keep it fp32 and cast it on use for the other "
                            "(ConversionConfig's cast_shared_on_use=True)"))
                # One of the two is a kept module's fp32: that is what is stored (the
                # truth), and the low-precision owners cast it on use (after the walk).
                shared_fp32.add(id(tensor))
                if dtype is torch.float32:
                    plan.tensor_dtype[id(tensor)] = (dtype, full)
                continue
            plan.tensor_dtype[id(tensor)] = (dtype, full)

    def walk(module: nn.Module, name: str, in_kept: bool, in_white: bool) -> None:
        kept = in_kept or _matches(module, name, keep) or kept_by_conversion(module, config)
        whitelisted = white is not None and not kept and (
            in_white or _matches(module, name, white))
        if kept:
            assign(module, name, torch.float32 if config.param_dtype is not None else None)
        elif (config.param_dtype in _LOW and not config.cast_buffers
              and _updates_float_buffers(module)):
            # Its float32 statistics stay: so do its parameters, which torch's norm
            # kernels want in the statistics' dtype (the activation may be low).
            assign(module, name, torch.float32)
        else:
            assign(module, name, None if white is not None else config.param_dtype)
            if config.param_dtype in _LOW and not config.cast_buffers and any(
                    b is not None and b.is_floating_point()
                    for b in module._buffers.values()):
                plan.keeps_float_buffers = True
        if id(module) in seen:  # a module reachable twice: its tensors were checked above
            return
        seen.add(id(module))
        boundary = None
        if kept and not in_kept:
            boundary = _Boundary(_Region.FP32, torch.float32,
                                 _kept_output_dtype(module, config), module_type=type(module),
                                 on_use=_is_parametrization(module))
        elif whitelisted and not in_white:
            boundary = _Boundary(_Region.LOW, None, config.white_list_output_dtype,
                                 config.compute_dtype, module_type=type(module))
        if boundary is not None:
            plan.boundaries[id(module)] = (module, boundary)
        if module._parameters or module._buffers:
            plan.owners.append(module)
        if not kept and white is None and config.param_dtype in _LOW:
            low_owners.append(module)
        if (config.param_compute_dtype is not None and not kept
                and not _updates_float_buffers(module)
                and not getattr(module, OWN_PARAMETER_CASTS, False) and any(
                    p is not None and p.is_floating_point()
                    for p in module._parameters.values())):
            plan.cast_on_use.append(module)
        for child_name, child in module.named_children():
            walk(child, f"{name}.{child_name}" if name else child_name, kept, whitelisted)

    walk(model, "", False, False)
    if shared_fp32:
        # (param_dtype is low here, so param_compute_dtype is None: no O2 list to merge)
        plan.cast_dtype = config.param_dtype
        plan.cast_on_use = [
            m for m in low_owners if not getattr(m, OWN_PARAMETER_CASTS, False) and any(
                p is not None and id(p) in shared_fp32 for p in m._parameters.values())]
    _cast_inputs_past_buffers(model, config, plan)
    _merge_root(model, config, plan)
    return plan


def _cast_inputs_past_buffers(model: nn.Module, config: ConversionConfig, plan: _Plan
                              ) -> None:
    """Low-precision parameters and float32 buffers, with no policy region (O3): an op
    that mixes a buffer into an activation (a position table added to embeddings, a
    float mask) promotes it to float32, as torch's type promotion says, and modules
    after it would get float32 inputs that their low-precision parameters' kernels
    refuse. So each module holding low-precision parameters casts its floating inputs
    to their dtype, as the model's boundary does, and computes as its parameters say.
    Only where such a buffer exists: otherwise every activation is low already. (With
    a policy region, pure low precision at O2, its ops cast their inputs themselves.)"""
    low = config.param_dtype
    if not plan.keeps_float_buffers or config.policy is not None:
        return
    for module in plan.owners:
        if module is model or id(module) in plan.boundaries:
            continue  # the model's boundary casts its inputs; kept modules go to fp32
        if any(p is not None and plan.tensor_dtype.get(id(p), (None,))[0] is low
               for p in module._parameters.values()):
            plan.input_casts.append(module)


def _updates_float_buffers(module: nn.Module) -> bool:
    """A norm that updates fp32 running statistics in place (BatchNorm, InstanceNorm
    with ``track_running_stats``). Cast on use, its parameters would be low precision
    next to fp32 statistics, which torch's kernels refuse; its statistics cannot be
    copies either, or their updates would be lost. So at O2 it computes with its fp32
    parameters even when norms are not kept (``keep_norms_fp32=False``), taking the
    low-precision activation as it is."""
    from torch.nn.modules.batchnorm import _NormBase

    return isinstance(module, _NormBase) and any(
        b is not None and b.is_floating_point() for b in module._buffers.values())


def _merge_root(model: nn.Module, config: ConversionConfig, plan: _Plan) -> None:
    """The model's own boundary. When the model is itself kept (or white-listed), that
    region wins and the model's input and output dtypes apply outside it."""
    inner = plan.boundaries.get(id(model), (model, None))[1]
    if inner is not None:
        region, compute = inner.region, inner.compute_dtype
        input_dtype = inner.input_dtype or config.input_dtype
        output_dtype = config.output_dtype or inner.output_dtype
    else:
        region = _Region.POLICY if config.policy is not None else _Region.UNCHANGED
        compute, input_dtype, output_dtype = (config.compute_dtype, config.input_dtype,
                                              config.output_dtype)
    # (Modules casting parameters on use need the root: it starts each forward pass,
    # which bounds the copies' life.)
    if (region is _Region.UNCHANGED and input_dtype is None and output_dtype is None
            and config.param_compute_dtype is None and not plan.cast_on_use):
        return
    plan.boundaries[id(model)] = (model, _Boundary(region, input_dtype, output_dtype,
                                                   compute, config.policy, root=True,
                                                   module_type=type(model)))


def _check_tensors(model: nn.Module, config: ConversionConfig) -> None:
    for name, param in model.named_parameters():
        if isinstance(param, nn.parameter.UninitializedParameter):
            raise ValueError(f"parameter {name!r} is uninitialized (a lazy module); run one "
                             f"forward pass before converting the model")
    if config.params_as_given or not (config.casts_parameters or config.policy is not None
            or config.param_compute_dtype is not None
            or config.low_precision_modules is not None):
        return  # O0-like: casting whatever is there to fp32 loses nothing
    for name, param in model.named_parameters():
        if param.is_floating_point() and param.dtype is not torch.float32:
            raise ValueError(f"convert_model expects an fp32 model, but parameter {name!r} is "
                             f"{param.dtype}; call model.float() first (mixed precision "
                             f"decides the low-precision dtypes itself)")


def _cast_tensors(model: nn.Module, config: ConversionConfig, plan: _Plan) -> None:
    done: dict[int, torch.Tensor] = {}  # old tensor id -> tensor now in its place
    with torch.no_grad():
        for module in plan.owners:
            for param in module._parameters.values():
                target = None if param is None else plan.tensor_dtype.get(id(param))
                if param is None or target is None or id(param) in done or (
                        param.dtype is target[0]):
                    continue
                # In place, so the Parameter object stays the same: tied modules and
                # optimizers built before the conversion keep pointing at it.
                param.data = param.data.to(target[0])
                if param.grad is not None:
                    param.grad = param.grad.to(target[0])
                done[id(param)] = param
            for name, buf in list(module._buffers.items()):
                if buf is None:
                    continue
                if id(buf) in done:
                    module._buffers[name] = done[id(buf)]
                    continue
                target = plan.tensor_dtype.get(id(buf))
                if target is None or buf.dtype is target[0]:
                    continue
                new = buf.to(target[0])
                done[id(buf)] = new
                module._buffers[name] = new


def _register_state_dict_hook(module: nn.Module, hook: Any) -> None:
    public = getattr(module, "register_state_dict_post_hook", None)  # torch >= 2.5
    if public is not None:
        public(hook)
    else:
        module._register_state_dict_hook(hook)


def _install(model: nn.Module, config: ConversionConfig, plan: _Plan) -> None:
    if plan.cast_dtype is not None and plan.cast_on_use:
        from torch.nn.utils.parametrize import is_parametrized

        dtype = plan.cast_dtype
        cast = CastParametersOnUse(dtype)
        for module in plan.cast_on_use:
            legacy = _legacy_reparametrizations(module)
            if legacy:
                # The weight is computed by the hook, from parameters left in fp32.
                for hook in legacy:
                    _reparametrize_in_fp32(hook, dtype)
                CastParametersOnUse(dtype, keep=frozenset(
                    n for hook in legacy for n in _reparametrization_sources(hook))
                ).install(module)
            else:
                cast.install(module)
            # The hooks' work done in the module's own call while they are its only
            # hooks (_cast_call). Not for a boundary (its call does more: the hooks
            # stay its route), a class with a __call__ of its own, nor a parametrized
            # module (torch.nn.utils.parametrize reads the class under its own).
            if (id(module) not in plan.boundaries and type(module) not in _converted_classes
                    and type(module).__call__ is nn.Module.__call__
                    and not is_parametrized(module)):
                module.__class__ = _converted_class(type(module), _cast_call)
    for module, boundary in plan.boundaries.values():
        _install_boundary(module, boundary)
    for module in plan.input_casts:
        object.__setattr__(module, _INPUT_DTYPE, config.param_dtype)
        if type(module) not in _converted_classes and type(module).__call__ is \
                nn.Module.__call__:
            module.__class__ = _converted_class(type(module), _input_cast_call)
        else:
            module.register_forward_pre_hook(_cast_inputs_hook, prepend=True,
                                              with_kwargs=True)
    if config.state_dict_dtype is not None:
        report = _ReportDtype(config.state_dict_dtype)
        for module in plan.owners:
            _register_state_dict_hook(module, report)
    for name, module in model.named_modules():
        object.__setattr__(module, _MARK, _Record(config, name))


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
    record = getattr(model, _MARK, None)
    return record.config if isinstance(record, _Record) else None


def _iter_records(model: nn.Module) -> Iterator[tuple[str, _Record]]:
    for name, module in model.named_modules():
        record = getattr(module, _MARK, None)
        if isinstance(record, _Record):
            yield name, record


def prepare_conversion(model: nn.Module, config: ConversionConfig) -> Any:
    """Check ``model`` against ``config`` and plan its conversion without changing
    anything; ``None`` when it is already converted with ``config``. With
    :func:`apply_conversion`, lets a caller check several models before converting any.

    Example:
        >>> import torch
        >>> from ampkit.conversion import prepare_conversion
        >>> from ampkit.levels import conversion_for_level
        >>> model = torch.nn.Linear(2, 2)
        >>> _ = prepare_conversion(model, conversion_for_level("O3", "bfloat16"))
        >>> model.weight.dtype
        torch.float32
    """
    _check_model(model)
    for name, record in _iter_records(model):
        if name == "" and record.name == "":
            if record.config == config:
                return None  # idempotent: nothing is cast twice
            raise RuntimeError("this model was already converted with different settings; "
                               "converting again would cast it twice. Convert a fresh fp32 "
                               "model instead")
        where = f"its submodule {name!r}" if name else "it"
        raise RuntimeError(f"{where} is part of a model converted earlier (as "
                           f"{record.name!r}); convert the whole fp32 model once instead")
    _check_tensors(model, config)
    if config.casts_parameters:
        _check_not_held_by_ddp(model)
    return _plan(model, config)


def _check_not_held_by_ddp(model: nn.Module) -> None:
    """``DistributedDataParallel(model)`` built before the conversion: its reducer
    holds the fp32 parameters as it found them (their sizes, dtypes and gradient
    buckets), and storing them in low precision breaks it at the first backward, with
    an error that names nothing of the order. Nothing in ``model`` says a DDP holds it,
    so the DDPs referring to it are looked for, and only where one can exist (a
    process group is up) and the conversion changes parameters."""
    import gc

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    ddp = nn.parallel.DistributedDataParallel
    # model <- the DDP's _modules dict <- (its __dict__ <-) the DDP: three scans at most
    frontier: list[Any] = [r for r in gc.get_referrers(model)
                           if isinstance(r, dict) and r.get("module") is model]
    for _ in range(2):
        if not frontier:
            return
        referrers = gc.get_referrers(*frontier)
        if any(isinstance(r, ddp) and r.module is model for r in referrers):
            raise RuntimeError(
                "model is already wrapped: DistributedDataParallel(model) was built "
                "before ampkit.initialize / convert_model, over the fp32 parameters this "
                "level stores in low precision, and its first backward would fail. Call "
                "ampkit.initialize on the bare model first, then wrap the result in "
                "DistributedDataParallel")
        frontier = [r for r in referrers if isinstance(r, dict)]


def apply_conversion(model: nn.Module, config: ConversionConfig, plan: Any) -> None:
    """Carry out a plan made by :func:`prepare_conversion` (for the same model and
    config, with nothing changed in between).

    Example:
        >>> import torch
        >>> from ampkit.conversion import apply_conversion, prepare_conversion
        >>> from ampkit.levels import conversion_for_level
        >>> model, cfg = torch.nn.Linear(2, 2), conversion_for_level("O3", "float16")
        >>> apply_conversion(model, cfg, prepare_conversion(model, cfg))
        >>> model.weight.dtype
        torch.float16
    """
    if not isinstance(plan, _Plan):
        raise TypeError(f"plan must come from prepare_conversion, got {type(plan).__name__}")
    _cast_tensors(model, config, plan)
    _install(model, config, plan)


# Module-level names, so that a pickled or deep-copied hook finds its class.
_SpectralNormInFp32, _WeightNormInFp32 = _legacy_classes()
