"""``ampkit.apex``: NVIDIA apex's ``amp`` API (removed from apex in 2025) on ampkit.

``from apex import amp`` becomes ``import ampkit.apex as amp``; the rest of an apex
script stays as it is. Unlike apex it runs on CPU too, and in bfloat16: pass
``cast_model_type=torch.bfloat16`` (O2, O3) or ``dtype=torch.bfloat16`` (any level).

apex's opt_level table, kept as apex defined it:

=====  ===============  =====================  ===================  ==============  ==========
level  cast_model_type  patch_torch_functions  keep_batchnorm_fp32  master_weights  loss_scale
=====  ===============  =====================  ===================  ==============  ==========
O0     float32          False                  None                 False           1.0
O1     None             True                   None                 None            "dynamic"
O2     float16          False                  True                 True            "dynamic"
O3     float16          False                  False                False           1.0
=====  ===============  =====================  ===================  ==============  ==========

======================================  =================================================
apex                                    ampkit core
======================================  =================================================
``initialize(...)``                     :func:`ampkit.initialize` with the table above
                                        (``keep_batchnorm_fp32`` keeps BatchNorm only;
                                        O2 does not patch ops, as in apex); O1 casts by
                                        the ``"apex-O1"`` preset
``init(...)`` and its handle            an ``"apex-O1"`` :class:`ampkit.autocast` region
(the pre-1.0 API, apex's O1)            open until ``handle._deactivate()``;
                                        ``handle.scale_loss``/``wrap_optimizer``:
                                        :func:`ampkit.scale_loss` with their own scalers
``scale_loss(loss, optimizers, ...)``   :func:`ampkit.scale_loss`
``master_params(optimizer)``            :func:`ampkit.master_params`
``state_dict()`` / ``load_state_dict``  ``ampkit.scaling.loss_scaling_state_dict`` / ``load_…``
``register_{half,float,promote}_``      :func:`ampkit.function_patching.register_function`
``function(module, name)``
``disable_casts()``                     ``ampkit.autocast(device, enabled=False)``
``_amp_state``                          a view of the above under apex's names
                                        (``loss_scalers[i].loss_scale()``, ...)
======================================  =================================================

O1 is apex's own O1: the ``"apex-O1"`` preset (:data:`ampkit.presets.APEX_O1`) holds
apex's lists (``functional_overrides``, ``torch_overrides``, ``tensor_overrides``,
the RNNs and RNN cells), on every device. Inside its regions, as in apex,
``F.binary_cross_entropy``/``nn.BCELoss`` refuse a low-precision input
(``NotImplementedError``; ``init(allow_banned=True)`` runs them in float32) and the
in-place versions of float32-list ops (``x.exp_()``, ...) refuse a low-precision tensor.
These refusals act in ``"apex-O1"`` regions only, while an apex handle is active (from
``init`` or an O1 ``initialize``, until ``handle._deactivate()``).

Optimizer wrappers that keep the optimizer they wrap as ``.optim`` (apex's
``apex.parallel.LARC``) are accepted wherever an optimizer is: the core works on the
optimizer inside, and the wrapper is returned as given. ``cast_model_type=False``
leaves the model's parameters as they are (for the fp32 model ampkit takes, that is
float32).

What differs from apex, on purpose:

* O1 casts inside the models' forward passes (apex patched torch globally); ``init``'s
  region is the calling thread's.
* A static loss scale (``loss_scale=1.0`` at O0/O3, or any number) skips a step whose
  gradients hold inf/NaN, where apex wrote them into the weights.
* ``register_*_function`` work whenever they are called, before or after
  ``initialize``, inside any autocast region.
* ``load_state_dict`` refuses a state with a different number of loss scalers (apex
  printed a warning and loaded a part).
* Overrides apex refuses but ampkit can carry out are accepted and carried out:
  ``master_weights=False`` at O1, ``patch_torch_functions=True`` at O2 (ops then cast by
  apex's O1 lists).
* ``_amp_state.allow_incoming_model_not_fp32 = True`` lets a model that is not fp32
  past apex's own check. Where the level casts no parameter (O1, or
  ``cast_model_type=False``) it is then taken as it is
  (float16 parameters stay float16 and the optimizer steps them, with no fp32 master:
  ampkit keeps no hidden copies); otherwise the core refuses it, with its reason,
  wherever a level casts or patches it.

Errors are apex's: a nonsensical override, an unknown ``opt_level``, a model that is not
fp32 (or already wrapped in DataParallel/DDP) and ``scale_loss`` before ``initialize``
raise ``RuntimeError``. The core's refusals arrive in apex's words (``opt_level``,
``keep_batchnorm_fp32``, ``patch_torch_functions``) and type, through
:func:`ampkit.dialects._errors.framework_errors`, the one way every dialect translates.

Example:
    >>> import torch
    >>> import ampkit.apex as amp
    >>> model = torch.nn.Linear(4, 2)
    >>> optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    >>> model, optimizer = amp.initialize(model, optimizer, opt_level="O2",
    ...                                   cast_model_type=torch.bfloat16, verbosity=0)
    >>> loss = model(torch.rand(3, 4)).sum()
    >>> with amp.scale_loss(loss, optimizer) as scaled_loss:
    ...     scaled_loss.backward()
    >>> optimizer.step()
    >>> model.weight.dtype, [p.dtype for p in amp.master_params(optimizer)]
    (torch.float32, [torch.float32, torch.float32])
"""

from __future__ import annotations

import contextlib
import dataclasses
import numbers
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch
import torch.nn as nn

from ampkit.arguments import default_device_type, parse_dtype, parse_loss_scale
from ampkit.autocast_mode import autocast
from ampkit.dialects._errors import framework_errors
from ampkit.front_door import initialize as _initialize
from ampkit.function_patching import (
    CastRule,
    cast_function,
    register_function,
    unregister_function,
)
from ampkit.presets import APEX_BANNED_FUNCS, APEX_O1, APEX_REFUSED_IN_PLACE
from ampkit.scaling.grad_scaler import GradScaler
from ampkit.scaling.multi_loss import (
    build_loss_scaler,
    load_loss_scaling_state_dict,
    loss_scaler,
    loss_scaling_state_dict,
)
from ampkit.scaling.multi_loss import scale_loss as _scale_loss
from ampkit.scaling.schedule import check_scale_value

__all__ = [
    "OPT_LEVELS",
    "AmpHandle",
    "NoOpHandle",
    "OptimWrapper",
    "Properties",
    "disable_casts",
    "float_function",
    "half_function",
    "init",
    "initialize",
    "load_state_dict",
    "master_params",
    "promote_function",
    "register_float_function",
    "register_half_function",
    "register_promote_function",
    "scale_loss",
    "state_dict",
]

F = TypeVar("F", bound=Callable[..., Any])

# ampkit's names in the core's errors -> apex's.
_APEX_NAMES = {"level": "opt_level", "keep_norms_fp32": "keep_batchnorm_fp32",
               "patch_ops": "patch_torch_functions"}


@dataclasses.dataclass(frozen=True)
class Properties:
    """apex's optimization properties (``amp._amp_state.opt_properties``), immutable.

    Example:
        >>> from ampkit.apex import OPT_LEVELS
        >>> OPT_LEVELS["O2"].master_weights, OPT_LEVELS["O3"].loss_scale
        (True, 1.0)
    """

    opt_level: str
    cast_model_type: torch.dtype | bool | None
    patch_torch_functions: bool
    keep_batchnorm_fp32: bool | None
    master_weights: bool | None
    loss_scale: str | float
    cast_model_outputs: torch.dtype | None = None
    enabled: bool = True

    def describe(self) -> str:
        """The properties, one per line, as apex prints them.

        Example:
            >>> from ampkit.apex import OPT_LEVELS
            >>> print(OPT_LEVELS["O0"].describe().splitlines()[0])
            cast_model_type        : torch.float32
        """
        return "\n".join(f"{f.name:<22} : {getattr(self, f.name)}"
                         for f in dataclasses.fields(self) if f.name != "opt_level")


#: apex's opt_level table.
OPT_LEVELS: dict[str, Properties] = {
    "O0": Properties("O0", torch.float32, False, None, False, 1.0),
    "O1": Properties("O1", None, True, None, None, "dynamic"),
    "O2": Properties("O2", torch.float16, False, True, True, "dynamic"),
    "O3": Properties("O3", torch.float16, False, False, False, 1.0),
}

_BRIEF = {
    "O0": "pure FP32 training",
    "O1": "casts inserted around torch functions and Tensor methods (apex's O1 lists)",
    "O2": "low-precision model, FP32 batchnorm and FP32 master weights, dynamic loss "
          "scaling",
    "O3": "pure low-precision training",
}

_MODEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclasses.dataclass(frozen=True)
class _State:
    properties: Properties


_lock = threading.Lock()
_state: _State | None = None


# -- initialize ------------------------------------------------------------------------------

def _dtype_override(value: Any, argument: str) -> torch.dtype:
    return parse_dtype(value, argument, accept=_MODEL_DTYPES)


def _bool_override(value: Any, argument: str) -> bool:
    # apex accepts the strings "True"/"False" (as they come from argparse).
    if isinstance(value, bool):
        return value
    if value in ("True", "False"):
        return value == "True"
    raise ValueError(f"{argument} must be True, False (or 'True'/'False') or None, got "
                     f"{value!r}")


def _loss_scale_override(value: Any) -> str | float:
    # apex also takes a number's string (as it comes from argparse).
    number = value
    if isinstance(value, str) and value != "dynamic":
        try:
            number = float(value)
        except ValueError:
            pass
    try:
        return parse_loss_scale(number, allow_none=False)
    except ValueError:  # apex's wording
        raise ValueError(f"loss_scale must be 'dynamic' or a positive number, got "
                         f"{value!r}") from None


def _apply_overrides(opt_level: str, overrides: dict[str, Any]) -> Properties:
    """apex's spellings of the overrides, parsed; which combinations make sense is the
    core's to say (``ampkit.levels``), in :func:`initialize`."""
    changes: dict[str, Any] = {}
    for name, value in overrides.items():
        if value is None:
            continue
        if name == "cast_model_type":
            # False: apex's "leave the model as it is" (falsy: nothing is cast).
            changes[name] = False if value is False else _dtype_override(value, name)
        elif name in ("patch_torch_functions", "keep_batchnorm_fp32", "master_weights"):
            changes[name] = _bool_override(value, name)
        elif name == "loss_scale":
            changes[name] = _loss_scale_override(value)
        elif name == "cast_model_outputs":
            changes[name] = _dtype_override(value, name)
    return dataclasses.replace(OPT_LEVELS[opt_level], **changes)


def _check_fp32(models: list[nn.Module]) -> None:
    if _amp_state.allow_incoming_model_not_fp32:
        return  # apex's switch for its own check; the core still has its say
    for i, model in enumerate(models):
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if tensor.is_floating_point() and tensor.dtype is not torch.float32:
                raise RuntimeError(f"models[{i}]: found {name!r} of dtype {tensor.dtype}, "
                                   f"expected torch.float32; amp.initialize takes the FP32 "
                                   f"model as it is, whatever the opt_level (do not call "
                                   f".half() on it first)")


def _inner_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside an apex-style wrapper (``.optim``: apex's LARC), or
    ``optimizer`` itself (checked by the core)."""
    if not isinstance(optimizer, torch.optim.Optimizer) and isinstance(
            getattr(optimizer, "optim", None), torch.optim.Optimizer):
        return optimizer.optim
    return optimizer


def _inner_optimizers(optimizers: Any) -> Any:
    if isinstance(optimizers, list | tuple):
        return type(optimizers)(_inner_optimizer(o) for o in optimizers)
    return _inner_optimizer(optimizers)


def _core_overrides(props: Properties, low: torch.dtype) -> dict[str, Any]:
    """apex's properties as the core's level overrides (names and meanings)."""
    level = props.opt_level
    cast = props.cast_model_type
    # cast_model_type=False: the core's "the model as given" (nothing cast, float16
    # parameters taken as they are once apex's own fp32 check let them through).
    if cast is None and _amp_state.allow_incoming_model_not_fp32:
        cast = False  # apex's O1 casts no parameter: a non-fp32 model runs as given
    overrides: dict[str, Any] = {"loss_scale": props.loss_scale}
    if cast not in (None, False):
        # apex's model.state_dict() holds float32 wherever it casts the model (O2, O3).
        overrides["state_dict_dtype"] = torch.float32
        # apex casts the model with model.half() (or .to(dtype)): floating buffers too,
        # where the core keeps them. Only where parameters are stored low does it show
        # (O3; O2 with master_weights=False); O2's fp32 truth casts nothing stored.
        overrides["cast_buffers"] = True
    if level == "O1":
        overrides["cast_model_type"] = cast
        overrides["keep_norms_fp32"] = props.keep_batchnorm_fp32
        overrides["master_weights"] = props.master_weights
        if props.cast_model_outputs is not None:
            overrides["cast_model_outputs"] = props.cast_model_outputs
    else:
        # apex keeps BatchNorm only (ampkit's norms default would keep LayerNorm too).
        from torch.nn.modules.batchnorm import _BatchNorm

        overrides["cast_model_type"] = cast
        overrides["keep_norms_fp32"] = False
        overrides["keep_fp32_modules"] = [_BatchNorm] if props.keep_batchnorm_fp32 else []
        overrides["master_weights"] = bool(props.master_weights)
        overrides["patch_ops"] = props.patch_torch_functions
        # apex casts outputs only where it casts the model (cast_model_type given).
        if props.cast_model_type is not False:
            overrides["cast_model_outputs"] = props.cast_model_outputs or torch.float32
    if props.patch_torch_functions:
        overrides["policy"] = APEX_O1
    return overrides


def initialize(models: nn.Module | Sequence[nn.Module],
               optimizers: Any = None, enabled: bool = True, opt_level: str = "O1",
               cast_model_type: torch.dtype | bool | None = None,
               patch_torch_functions: bool | None = None,
               keep_batchnorm_fp32: bool | str | None = None,
               master_weights: bool | None = None, loss_scale: float | str | None = None,
               cast_model_outputs: torch.dtype | None = None, num_losses: int = 1,
               verbosity: int = 1, min_loss_scale: float | None = None,
               max_loss_scale: float = 2.0 ** 24, *,
               dtype: torch.dtype | None = None) -> Any:
    """apex's ``amp.initialize``: apply an opt_level to models and optimizers.

    Args:
        models: a model or a list of models (FP32, not yet wrapped in DataParallel/DDP).
        optimizers: an optimizer (or an apex-style wrapper of one, ``.optim``: apex's
            LARC), a list of them, or ``None``.
        enabled: ``False`` returns everything unchanged and makes :func:`scale_loss`
            yield the loss as it is.
        opt_level: ``"O0"``, ``"O1"``, ``"O2"`` or ``"O3"`` (the letter O).
        cast_model_type, patch_torch_functions, keep_batchnorm_fp32, master_weights,
        loss_scale, cast_model_outputs: override the opt_level's properties (``None``
            keeps its default); ``cast_model_type`` may be ``torch.bfloat16``, or
            ``False`` to leave the model as it is.
        num_losses: how many ``loss_id`` values :func:`scale_loss` takes.
        verbosity: 0 prints nothing; 1 prints the properties chosen.
        min_loss_scale, max_loss_scale: bounds of the dynamic loss scale.
        dtype: an ampkit extra: the low-precision dtype (``torch.float16`` by default,
            ``torch.bfloat16``); O1 casts ops to it.

    Returns:
        ``models`` when ``optimizers`` is ``None``, else ``(models, optimizers)``, in the
        shape given.

    Raises:
        RuntimeError: an unknown ``opt_level``, a nonsensical override (the core's
            refusals, in apex's words), a model that is not FP32 or already wrapped.
        ValueError: a bad override value, or ``dtype`` contradicting
            ``cast_model_type``.

    Example:
        >>> import torch
        >>> import ampkit.apex as amp
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
        >>> model = amp.initialize(model, opt_level="O3", keep_batchnorm_fp32=True,
        ...                        verbosity=0)
        >>> model[0].weight.dtype, model[1].weight.dtype, model(torch.rand(3, 2)).dtype
        (torch.float16, torch.float32, torch.float32)
        >>> amp.initialize(torch.nn.Linear(2, 2), opt_level="O1", master_weights=True)
        Traceback (most recent call last):
        ...
        RuntimeError: opt_level O1 keeps fp32 parameters, so there is nothing for ...
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    if isinstance(verbosity, bool) or not isinstance(verbosity, int) or verbosity < 0:
        raise ValueError(f"verbosity must be an int >= 0, got {verbosity!r}")
    global _state
    if not enabled:
        with _lock:
            _state = _State(dataclasses.replace(OPT_LEVELS["O0"], enabled=False))
        return models if optimizers is None else (models, optimizers)
    if opt_level not in OPT_LEVELS:
        raise RuntimeError(f"unexpected opt_level {opt_level!r}; options are 'O0', 'O1', "
                           f"'O2', 'O3' (the letter O, not the digit zero)")
    props = _apply_overrides(opt_level, {
        "cast_model_type": cast_model_type, "patch_torch_functions": patch_torch_functions,
        "keep_batchnorm_fp32": keep_batchnorm_fp32, "master_weights": master_weights,
        "loss_scale": loss_scale, "cast_model_outputs": cast_model_outputs})
    low = props.cast_model_type if props.cast_model_type in (torch.float16,
                                                              torch.bfloat16) else None
    if dtype is not None:
        dtype = _dtype_override(dtype, "dtype")
        if dtype is torch.float32:
            raise ValueError("dtype is the low-precision dtype: torch.float16 or "
                             "torch.bfloat16, got torch.float32")
        if cast_model_type is not None and low is not None and dtype is not low:
            raise ValueError(f"dtype ({dtype}) contradicts cast_model_type ({low}); pass one")
        if low is not None:  # O2/O3 without cast_model_type: the model is cast to dtype
            props = dataclasses.replace(props, cast_model_type=dtype)
            low = dtype
    low = low or dtype or torch.float16

    model_list = [models] if isinstance(models, nn.Module) else models
    if not isinstance(model_list, list | tuple) or not all(
            isinstance(m, nn.Module) for m in model_list):
        raise TypeError(f"models must be a torch.nn.Module or a list of them, got "
                        f"{type(models).__name__}")
    _check_fp32(list(model_list))

    inner = None if optimizers is None else _inner_optimizers(optimizers)
    with framework_errors(names=_APEX_NAMES, types={ValueError: RuntimeError}):
        checked: Any = models  # a module, or a list or tuple of them (checked above)
        result = _initialize(checked, inner, level=opt_level, dtype=low,
                             num_losses=num_losses, min_scale=min_loss_scale,
                             max_scale=max_loss_scale, **_core_overrides(props, low))
    with _lock:
        _state = _State(props)
    _amp_state.handle = (AmpHandle(allow_banned=False, scaling=False)
                         if props.patch_torch_functions else None)
    if verbosity > 0:
        print(f"ampkit.apex: selected opt_level {opt_level}: {_BRIEF[opt_level]}, "
              f"low-precision dtype {low}")
        print(props.describe())
    # The core's optimizers are the ones given (changed in place); apex's wrappers
    # (LARC) go back as they came.
    return result if optimizers is None else (result[0], optimizers)


def _require_state(caller: str) -> _State:
    with _lock:
        state = _state
    if state is None:
        raise RuntimeError(f"amp.{caller}() was called before amp.initialize(); call "
                           f"model, optimizer = amp.initialize(model, optimizer, "
                           f"opt_level=...) first")
    return state


# -- the training step -----------------------------------------------------------------------

@contextlib.contextmanager
def scale_loss(loss: torch.Tensor, optimizers: Any, loss_id: int = 0,
               model: nn.Module | None = None,
               delay_unscale: bool = False) -> Iterator[torch.Tensor]:
    """apex's ``amp.scale_loss``: yield ``loss`` times the scale of ``loss_id``; on
    exit unscale the optimizers' gradients, and on overflow make the next ``step()`` of
    each optimizer named here a no-op and lower the scale. An optimizer whose gradients
    put aside from an earlier ``scale_loss`` overflowed skips its step too, and only it.

    ``model`` is accepted and unused, as in apex. ``delay_unscale=True`` keeps the
    gradients scaled for a later ``scale_loss`` (gradient accumulation).

    Raises:
        RuntimeError: :func:`initialize` was not called.

    Example:
        >>> import torch
        >>> import ampkit.apex as amp
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
        >>> before = model.weight.detach().clone()
        >>> with amp.scale_loss(model(torch.rand(1, 2)).sum() * float("inf"), opt) as s:
        ...     s.backward()
        >>> opt.step()                                  # the overflow skips this step
        >>> torch.equal(model.weight, before), amp.state_dict()["loss_scaler0"]["loss_scale"]
        (True, 32768.0)
        >>> amp._amp_state.handle._deactivate()
    """
    state = _require_state("scale_loss")
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"model must be None or a torch.nn.Module, got "
                        f"{type(model).__name__}")
    if not state.properties.enabled:
        yield loss
        return
    # apex's loss scalers are process-wide: each amp.initialize replaces them, and
    # every scale_loss uses the latest ones, whatever optimizers it is given (the core
    # keeps each initialize's scalers with that call's optimizers instead).
    with _scale_loss(loss, _inner_optimizers(optimizers), loss_id,
                     delay_unscale=delay_unscale, scaler=loss_scaler(loss_id)) as scaled:
        yield scaled


def master_params(optimizer: Any) -> Iterator[torch.Tensor]:
    """The parameters the optimizer updates: at O2 these are the fp32 parameters
    themselves (the truth; modules compute with fp16 copies made on use), so apex's
    master parameters and the model's are the same tensors. Clip gradients on these.

    Example:
        >>> import torch
        >>> import ampkit.apex as amp
        >>> w = torch.nn.Parameter(torch.ones(1))
        >>> list(amp.master_params(torch.optim.SGD([w], lr=0.1)))[0] is w
        True
    """
    inner = _inner_optimizer(optimizer)
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    for group in inner.param_groups:
        yield from group["params"]


# -- the pre-1.0 API: amp.init() and its handle ---------------------------------------------

_handles_lock = threading.Lock()
_active_handles: list[AmpHandle] = []


def _refusals_for(handles: list[AmpHandle]) -> list[tuple[Any, str, str | None]]:
    """``(owner, name, message)`` of every refusal the active handles call for."""
    wanted: list[tuple[Any, str, str | None]] = []
    if handles:
        for name in APEX_REFUSED_IN_PLACE:
            message = (f"in-place {name} refuses a low-precision tensor under apex's O1 "
                       f"lists: its out-of-place {name[:-1]} runs in float32, this could "
                       f"only compute in the tensor's precision; call {name[:-1]} instead")
            for owner in (torch, torch.Tensor):
                if hasattr(owner, name):
                    wanted.append((owner, name, message))
    # The newest handle decides, as in apex, where each amp.init() patched the banned
    # functions again on top of the earlier handles' patches.
    if handles and not handles[-1]._allow_banned:
        wanted += [(torch.nn.functional, op, message) for op, message in APEX_BANNED_FUNCS]
    return wanted


def _sync_refusals(before: list[AmpHandle], after: list[AmpHandle]) -> None:
    old = {(id(o), n): (o, n) for o, n, _ in _refusals_for(before)}
    new = _refusals_for(after)
    for owner, name, message in new:
        if (id(owner), name) not in old:
            register_function(owner, name, CastRule.REFUSE_LOW, message=message,
                              policy=APEX_O1.name)
    keep = {(id(o), n) for o, n, _ in new}
    for key, (owner, name) in old.items():
        if key not in keep:
            unregister_function(owner, name)


class AmpHandle:
    """The handle ``amp.init()`` returns (and ``amp._amp_state.handle`` after an O1
    ``initialize``): while active, apex's O1 refusals hold in ``"apex-O1"`` regions
    (banned functions unless ``allow_banned``; in-place float32-list ops on
    low-precision tensors). ``init``'s handle also owns the O1 region it opened.

    Example:
        >>> import torch
        >>> import ampkit.apex as amp
        >>> handle = amp.init()                     # O1 casts from here on, this thread
        >>> (torch.ones(2, 2) @ torch.ones(2, 2)).dtype, torch.ones(2).sum().dtype
        (torch.float16, torch.float32)
        >>> handle._deactivate()
        >>> (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
        torch.float32
    """

    def __init__(self, *, allow_banned: bool = False, scaling: bool = True,
                 loss_scale: str | float = "dynamic", region: autocast | None = None,
                 enable_caching: bool = True, verbose: bool = False) -> None:
        self._allow_banned = allow_banned
        self._region = region
        self._enable_caching = enable_caching
        self._verbose = verbose
        # The legacy handle.scale_loss's own scaler (None after wrap_optimizer, as in
        # apex, or for the handle of an O1 initialize, which scales with amp.scale_loss).
        self._default_scaler: GradScaler | None = (
            build_loss_scaler(loss_scale) if scaling else None)
        self._is_active = True
        with _handles_lock:
            before = list(_active_handles)
            _active_handles.append(self)
            _sync_refusals(before, _active_handles)
        if region is not None:
            region.__enter__()

    def is_active(self) -> bool:
        """Whether the handle is active (until :meth:`_deactivate`)."""
        return self._is_active

    def _deactivate(self) -> None:
        """Close the O1 region ``init`` opened (in the thread that opened it) and lift
        this handle's refusals; calling it again does nothing."""
        if not self._is_active:
            return
        self._is_active = False
        if self._region is not None:
            self._region.__exit__(None, None, None)
        with _handles_lock:
            before = list(_active_handles)
            _active_handles.remove(self)
            _sync_refusals(before, _active_handles)
        if _amp_state.handle is self:
            _amp_state.handle = None

    @contextlib.contextmanager
    def _disable_casts(self) -> Iterator[None]:
        with disable_casts():
            yield

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer,
                       num_loss: int = 1) -> OptimWrapper:
        """The legacy multi-loss API: an optimizer whose ``scale_loss(loss)`` scales
        each of its ``num_loss`` losses with its own dynamic scale (in call order) and
        whose ``step()`` is skipped when any of them overflowed.

        Example:
            >>> import torch
            >>> import ampkit.apex as amp
            >>> handle = amp.init(enabled=False)
            >>> w = torch.nn.Parameter(torch.ones(1))
            >>> opt = handle.wrap_optimizer(torch.optim.SGD([w], lr=0.5))
            >>> with opt.scale_loss(w.sum()) as loss:
            ...     loss.backward()
            >>> opt.step(); w.item()
            0.5
        """
        self._default_scaler = None
        return OptimWrapper(optimizer, self, num_loss)

    @contextlib.contextmanager
    def scale_loss(self, loss: torch.Tensor,
                   optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
        """The legacy ``with handle.scale_loss(loss, optimizer) as scaled``: the loss
        times the handle's own scale; on exit the gradients are unscaled, and an
        overflow skips the optimizer's next step and lowers the scale.

        Raises:
            RuntimeError: after :meth:`wrap_optimizer` (use the wrapper's
                ``scale_loss``), or for the handle of an ``initialize`` (use
                :func:`scale_loss`).
        """
        if not self.is_active():
            yield loss
            return
        if self._default_scaler is None:
            raise RuntimeError("this handle has no loss scaler of its own: after "
                               "handle.wrap_optimizer(), use optimizer.scale_loss(loss); "
                               "after amp.initialize(), use amp.scale_loss(loss, "
                               "optimizer)")
        with _scale_loss(loss, _inner_optimizer(optimizer),
                         scaler=self._default_scaler) as scaled:
            yield scaled

    def _clear_cache(self) -> None:
        """Nothing to do: ampkit's weight-cast cache lives with its regions."""

    @property
    def has_cache(self) -> bool:
        """Whether ``init`` was asked to cache weight casts."""
        return self._enable_caching

    @property
    def verbose(self) -> bool:
        """``init``'s ``verbose``."""
        return self._verbose


class NoOpHandle(AmpHandle):
    """``amp.init(enabled=False)``'s handle: nothing casts, nothing scales.

    Example:
        >>> import ampkit.apex as amp
        >>> amp.init(enabled=False).is_active()
        False
    """

    def __init__(self) -> None:
        self._allow_banned = True
        self._region = None
        self._enable_caching = False
        self._verbose = False
        self._default_scaler = None
        self._is_active = False

    @contextlib.contextmanager
    def scale_loss(self, loss: torch.Tensor,
                   optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
        """Yield the loss as it is."""
        yield loss


class OptimWrapper:
    """The optimizer :meth:`AmpHandle.wrap_optimizer` returns: ``scale_loss(loss)``
    per loss (each of the ``num_loss`` losses of an iteration, in call order, has its
    own dynamic scale), then ``step()``, skipped when any of them overflowed. Every
    other attribute is the wrapped optimizer's.

    Example:
        >>> import torch
        >>> import ampkit.apex as amp
        >>> handle = amp.init(device_type="cpu")
        >>> w = torch.nn.Parameter(torch.ones(1))
        >>> opt = handle.wrap_optimizer(torch.optim.SGD([w], lr=0.5), num_loss=2)
        >>> with opt.scale_loss(w.sum()) as loss:
        ...     loss.backward()
        >>> with opt.scale_loss(w.sum() * float("inf")) as loss:
        ...     loss.backward()
        >>> opt.step(); w.item()                     # the second loss overflowed
        1.0
        >>> handle._deactivate()
    """

    def __init__(self, optimizer: torch.optim.Optimizer, amp_handle: AmpHandle,
                 num_loss: int) -> None:
        if isinstance(num_loss, bool) or not isinstance(num_loss, int) or num_loss < 1:
            raise ValueError(f"num_loss must be an int >= 1, got {num_loss!r}")
        self._optimizer = optimizer
        self._amp_handle = amp_handle
        self._num_loss = num_loss
        self._loss_idx = 0
        self._loss_scaler = [build_loss_scaler("dynamic") for _ in range(num_loss)]

    @contextlib.contextmanager
    def scale_loss(self, loss: torch.Tensor) -> Iterator[torch.Tensor]:
        """Scale the next loss of this iteration; unscale and check on exit."""
        if not self._amp_handle.is_active():
            yield loss
            return
        if self._loss_idx >= self._num_loss:
            raise RuntimeError(f"scale_loss was called more than num_loss={self._num_loss} "
                               f"times before step(); pass num_loss to wrap_optimizer")
        with _scale_loss(loss, _inner_optimizer(self._optimizer), self._loss_idx,
                         scaler=self._loss_scaler[self._loss_idx]) as scaled:
            yield scaled
        self._loss_idx += 1

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Step the optimizer, unless a loss of this iteration overflowed."""
        if not self._amp_handle.is_active():
            return self._optimizer.step(closure)
        self._loss_idx = 0
        if closure is not None:
            raise NotImplementedError("the closure argument is unsupported by the amp "
                                      "optimizer wrapper")
        return self._optimizer.step()

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.__dict__["_optimizer"], attr)

    def __repr__(self) -> str:
        return repr(self._optimizer)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's ``state_dict``."""
        return self._optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The wrapped optimizer's ``load_state_dict``."""
        self._optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's ``zero_grad``."""
        self._optimizer.zero_grad(set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """The wrapped optimizer's ``add_param_group``."""
        self._optimizer.add_param_group(param_group)


def init(enabled: bool = True, loss_scale: str | float = "dynamic",
         enable_caching: bool = True, verbose: bool = False, allow_banned: bool = False,
         *, device_type: str | None = None) -> AmpHandle:
    """apex's pre-1.0 ``amp.init()`` (the legacy API, apex's O1): from here on, in this
    thread, ops run by apex's O1 lists (the ``"apex-O1"`` preset, float16) until
    ``handle._deactivate()``.

    Args:
        enabled: ``False`` returns a :class:`NoOpHandle`.
        loss_scale: ``"dynamic"`` or a number: the scale of ``handle.scale_loss``.
        enable_caching: cache the float16 casts of weights within the region.
        verbose: kept for apex's signature (ampkit prints no casts).
        allow_banned: run apex's banned functions (``F.binary_cross_entropy``) in
            float32 instead of refusing a low-precision input.
        device_type: an ampkit extra: the device whose ops are cast; ``None``: CUDA when
            available, else the CPU.

    Example:
        >>> import torch
        >>> import ampkit.apex as amp
        >>> handle = amp.init(device_type="cpu")
        >>> torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype
        torch.float16
        >>> torch.ones(2, dtype=torch.float16).exp_()
        Traceback (most recent call last):
        ...
        NotImplementedError: in-place exp_ refuses a low-precision tensor under ...
        >>> handle._deactivate()
    """
    for value, argument in ((enabled, "enabled"), (enable_caching, "enable_caching"),
                            (verbose, "verbose"), (allow_banned, "allow_banned")):
        if not isinstance(value, bool):
            raise TypeError(f"{argument} must be a bool, got {type(value).__name__}")
    if not enabled:
        handle: AmpHandle = NoOpHandle()
    else:
        device = device_type or default_device_type()
        region = autocast(device, torch.float16, policy=APEX_O1,
                          cache_enabled=enable_caching)
        handle = AmpHandle(allow_banned=allow_banned, loss_scale=_loss_scale_override(
            loss_scale), region=region, enable_caching=enable_caching, verbose=verbose)
    _amp_state.handle = handle
    return handle


# -- apex's _amp_state ---------------------------------------------------------------------

class _LossScalerView:
    """apex's ``LossScaler`` of one loss id, over the core's scaler."""

    def __init__(self, loss_id: int) -> None:
        self._loss_id = loss_id

    def loss_scale(self) -> float:
        """The current scale."""
        return loss_scaler(self._loss_id).get_scale()

    @property
    def _loss_scale(self) -> float:
        return self.loss_scale()

    @_loss_scale.setter
    def _loss_scale(self, value: float) -> None:
        value = check_scale_value(value, "_loss_scale")  # before anything changes
        scaler = loss_scaler(self._loss_id)
        if scaler.is_enabled():
            scaler.load_state_dict({**scaler.state_dict(), "scale": float(value)})

    @property
    def dynamic(self) -> bool:
        """Whether the scale is dynamic."""
        scaler = loss_scaler(self._loss_id)
        return scaler.is_enabled() and scaler.schedule.dynamic

    @property
    def _unskipped(self) -> int:
        scaler = loss_scaler(self._loss_id)
        return int(scaler.state_dict()["_growth_tracker"]) if scaler.is_enabled() else 0


class _AmpState:
    """``amp._amp_state``: apex's internal state, which apex scripts read (loss scales
    for logging) and apex's own tests set. A view of the core's state under apex's
    names.

    Example:
        >>> import torch
        >>> import ampkit.apex as amp
        >>> _ = amp.initialize(torch.nn.Linear(2, 2), opt_level="O2", verbosity=0)
        >>> amp._amp_state.opt_properties.opt_level
        'O2'
        >>> amp._amp_state.loss_scalers[0].loss_scale()
        65536.0
    """

    def __init__(self) -> None:
        self.handle: AmpHandle | None = None
        self.allow_incoming_model_not_fp32 = False
        self.verbosity = 1

    @property
    def opt_properties(self) -> Properties:
        """The properties of the last :func:`initialize` (AttributeError before it, as
        in apex, which scripts test with ``hasattr``)."""
        with _lock:
            state = _state
        if state is None:
            raise AttributeError("opt_properties: amp.initialize() has not been called")
        return state.properties

    @property
    def loss_scalers(self) -> list[_LossScalerView]:
        """One view per loss id: ``loss_scale()``, ``_loss_scale`` (settable),
        ``dynamic``."""
        return [_LossScalerView(i) for i in range(len(loss_scaling_state_dict()))]


_amp_state = _AmpState()
#: ``_amp_state`` under a name other modules may import: ``ampkit.apex`` re-exports it
#: as apex's ``amp._amp_state`` (apex's own spelling, underscore included).
amp_state = _amp_state


# -- checkpoints -----------------------------------------------------------------------------

def state_dict(destination: dict[str, Any] | None = None) -> dict[str, Any]:
    """The loss scalers' state, apex's format: ``{"loss_scaler0": {"loss_scale": ...,
    "unskipped": ...}, ...}`` (into ``destination`` when given).

    Raises:
        RuntimeError: :func:`initialize` was not called.

    Example:
        >>> import torch
        >>> import ampkit.apex as amp
        >>> _ = amp.initialize(torch.nn.Linear(2, 2), opt_level="O1", num_losses=2,
        ...                    verbosity=0)
        >>> dict(amp.state_dict())  # doctest: +NORMALIZE_WHITESPACE
        {'loss_scaler0': {'loss_scale': 65536.0, 'unskipped': 0},
         'loss_scaler1': {'loss_scale': 65536.0, 'unskipped': 0}}
    """
    state = _require_state("state_dict")
    out: dict[str, Any] = OrderedDict() if destination is None else destination
    if not state.properties.enabled:
        return out
    for key, core in loss_scaling_state_dict().items():
        out[key] = ({"loss_scale": core["scale"], "unskipped": core["_growth_tracker"]}
                    if core else {"loss_scale": 1.0, "unskipped": 0})
    return out


def load_state_dict(state_dict: dict[str, Any]) -> None:
    """Restore :func:`state_dict`'s output into the loss scalers.

    Raises:
        RuntimeError: unexpected keys (any without ``"loss_scaler"``), or a number of
            loss scalers different from ``num_losses``; :func:`initialize` not called.
        ValueError: an entry without ``loss_scale`` and ``unskipped``.

    Example:
        >>> import torch
        >>> import ampkit.apex as amp
        >>> _ = amp.initialize(torch.nn.Linear(2, 2), opt_level="O1", verbosity=0)
        >>> amp.load_state_dict({"loss_scaler0": {"loss_scale": 128.0, "unskipped": 7}})
        >>> amp.state_dict()["loss_scaler0"]
        {'loss_scale': 128.0, 'unskipped': 7}
    """
    state = _require_state("load_state_dict")
    if not isinstance(state_dict, dict):
        raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
    unexpected = [k for k in state_dict if "loss_scaler" not in str(k)]
    if unexpected:
        raise RuntimeError(f"error(s) in loading state_dict: unexpected key(s) "
                           f"{', '.join(repr(k) for k in unexpected)}")
    if not state.properties.enabled:
        return
    current = loss_scaling_state_dict()
    entries = list(state_dict.values())
    if len(entries) != len(current):
        raise RuntimeError(f"state_dict holds {len(entries)} loss scaler(s), but "
                           f"amp.initialize set up {len(current)} (num_losses)")
    for key, entry in zip(current, entries):
        if not isinstance(entry, dict) or not {"loss_scale", "unskipped"} <= set(entry):
            raise ValueError(f"each loss scaler's state must be a dict with 'loss_scale' "
                             f"and 'unskipped', got {entry!r}")
        unskipped = entry["unskipped"]
        if isinstance(unskipped, bool) or not isinstance(unskipped, numbers.Integral) or (
                unskipped < 0):
            raise ValueError(f"'unskipped' must be an int >= 0, got {unskipped!r}")
        if current[key]:  # a scaler that scales (not disabled)
            current[key] = {**current[key], "scale": entry["loss_scale"],
                            "_growth_tracker": int(unskipped)}
    load_loss_scaling_state_dict(current)


# -- user functions ----------------------------------------------------------------------------

def register_half_function(module: Any, function_name: str) -> None:
    """Make ``module.function_name`` run in the low-precision dtype inside autocast.

    Raises:
        ValueError: ``module`` has no such function.

    Example:
        >>> import types, torch
        >>> import ampkit
        >>> import ampkit.apex as amp
        >>> ext = types.SimpleNamespace(scale2=lambda x: x * 2)
        >>> amp.register_half_function(ext, "scale2")
        >>> with ampkit.autocast("cpu", torch.float16):
        ...     ext.scale2(torch.ones(1)).dtype
        torch.float16
    """
    register_function(module, function_name, CastRule.LOWER)


def register_float_function(module: Any, function_name: str) -> None:
    """Make ``module.function_name`` run in float32 inside autocast.

    Example:
        >>> import types, torch
        >>> import ampkit
        >>> import ampkit.apex as amp
        >>> ext = types.SimpleNamespace(total=lambda x: x.sum())
        >>> amp.register_float_function(ext, "total")
        >>> with ampkit.autocast("cpu", torch.float16):
        ...     ext.total(torch.ones(2, dtype=torch.float16)).dtype
        torch.float32
    """
    register_function(module, function_name, CastRule.FP32)


def register_promote_function(module: Any, function_name: str) -> None:
    """Make ``module.function_name`` run in the widest floating dtype of its arguments
    inside autocast.

    Example:
        >>> import types, torch
        >>> import ampkit
        >>> import ampkit.apex as amp
        >>> ext = types.SimpleNamespace(mix=lambda a, b: torch.cat([a, b]))
        >>> amp.register_promote_function(ext, "mix")
        >>> with ampkit.autocast("cpu", torch.float16):
        ...     ext.mix(torch.ones(1, dtype=torch.float16), torch.ones(1)).dtype
        torch.float32
    """
    register_function(module, function_name, CastRule.PROMOTE)


def half_function(fn: F) -> F:
    """Decorator form of :func:`register_half_function`.

    Example:
        >>> import torch
        >>> import ampkit
        >>> import ampkit.apex as amp
        >>> @amp.half_function
        ... def double(x):
        ...     return x * 2
        >>> with ampkit.autocast("cpu", torch.float16):
        ...     double(torch.ones(1)).dtype
        torch.float16
    """
    return cast_function(CastRule.LOWER)(fn)


def float_function(fn: F) -> F:
    """Decorator form of :func:`register_float_function`.

    Example:
        >>> import torch
        >>> import ampkit
        >>> import ampkit.apex as amp
        >>> @amp.float_function
        ... def total(x):
        ...     return x.sum()
        >>> with ampkit.autocast("cpu", torch.float16):
        ...     total(torch.ones(2, dtype=torch.float16)).dtype
        torch.float32
    """
    return cast_function(CastRule.FP32)(fn)


def promote_function(fn: F) -> F:
    """Decorator form of :func:`register_promote_function`.

    Example:
        >>> import torch
        >>> import ampkit
        >>> import ampkit.apex as amp
        >>> @amp.promote_function
        ... def mix(a, b):
        ...     return a * b
        >>> with ampkit.autocast("cpu", torch.float16):
        ...     mix(torch.ones(1, dtype=torch.float16), torch.ones(1)).dtype
        torch.float32
    """
    return cast_function(CastRule.PROMOTE)(fn)


@contextlib.contextmanager
def disable_casts() -> Iterator[None]:
    """Inside this context no autocast casts apply (ops run in their inputs' dtype,
    registered functions too), on every device where autocast was on.

    Example:
        >>> import torch
        >>> import ampkit
        >>> import ampkit.apex as amp
        >>> with ampkit.autocast("cpu", torch.float16):
        ...     with amp.disable_casts():
        ...         torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype
        torch.float32
    """
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    with contextlib.ExitStack() as stack:
        for device in devices:
            if torch.is_autocast_enabled(device):
                stack.enter_context(autocast(device, enabled=False))
        yield
