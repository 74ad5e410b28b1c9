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
                                        O2 does not patch ops, as in apex)
``scale_loss(loss, optimizers, ...)``   :func:`ampkit.scale_loss`
``master_params(optimizer)``            :func:`ampkit.master_params`
``state_dict()`` / ``load_state_dict``  ``ampkit.scaling.loss_scaling_state_dict`` / ``load_…``
``register_{half,float,promote}_``      :func:`ampkit.function_patching.register_function`
``function(module, name)``
``disable_casts()``                     ``ampkit.autocast(device, enabled=False)``
======================================  =================================================

What differs from apex, on purpose:

* O1 casts ops by native ``torch.autocast``'s lists for the device (ampkit's default
  policy), not by apex's own patch lists; apex itself pointed O1 users to
  ``torch.autocast``. O1 casts inside the models' forward passes.
* A static loss scale (``loss_scale=1.0`` at O0/O3, or any number) skips a step whose
  gradients hold inf/NaN, where apex wrote them into the weights.
* ``register_*_function`` work whenever they are called, before or after
  ``initialize``, inside any autocast region.
* ``load_state_dict`` refuses a state with a different number of loss scalers (apex
  printed a warning and loaded a part).

Errors are apex's: a nonsensical override, an unknown ``opt_level``, a model that is not
fp32 (or already wrapped in DataParallel/DDP) and ``scale_loss`` before ``initialize``
raise ``RuntimeError``.

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

from ampkit.autocast_mode import autocast
from ampkit.front_door import initialize as _initialize
from ampkit.function_patching import CastRule, cast_function, register_function
from ampkit.scaling.multi_loss import (
    load_loss_scaling_state_dict,
    loss_scaling_state_dict,
)
from ampkit.scaling.multi_loss import scale_loss as _scale_loss

__all__ = [
    "OPT_LEVELS",
    "Properties",
    "disable_casts",
    "float_function",
    "half_function",
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


@dataclasses.dataclass(frozen=True)
class Properties:
    """apex's optimization properties (``amp._amp_state.opt_properties``), immutable.

    Example:
        >>> from ampkit.apex import OPT_LEVELS
        >>> OPT_LEVELS["O2"].master_weights, OPT_LEVELS["O3"].loss_scale
        (True, 1.0)
    """

    opt_level: str
    cast_model_type: torch.dtype | None
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
    "O1": "casts inserted around torch functions and Tensor methods (torch.autocast lists)",
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
    if isinstance(value, torch.dtype) and value in _MODEL_DTYPES:
        return value
    raise ValueError(f"{argument} must be torch.float16, torch.bfloat16 or torch.float32, "
                     f"got {value!r}")


def _bool_override(value: Any, argument: str) -> bool:
    # apex accepts the strings "True"/"False" (as they come from argparse).
    if isinstance(value, bool):
        return value
    if value in ("True", "False"):
        return value == "True"
    raise ValueError(f"{argument} must be True, False (or 'True'/'False') or None, got "
                     f"{value!r}")


def _loss_scale_override(value: Any) -> str | float:
    if value == "dynamic":
        return "dynamic"
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = float("nan")
    if isinstance(value, bool) or not number > 0 or number == float("inf"):
        raise ValueError(f"loss_scale must be 'dynamic' or a positive number, got {value!r}")
    return number


def _apply_overrides(opt_level: str, overrides: dict[str, Any]) -> Properties:
    """apex's property checks: nonsensical overrides are a RuntimeError."""
    props = OPT_LEVELS[opt_level]
    changes: dict[str, Any] = {}
    for name, value in overrides.items():
        if value is None:
            continue
        if name == "cast_model_type":
            dtype = _dtype_override(value, name)
            if opt_level == "O1" and dtype is not torch.float32:
                raise RuntimeError(f"O1 inserts casts around torch functions and keeps the "
                                   f"model's weights FP32, so cast_model_type must be None "
                                   f"or torch.float32 with O1, got {dtype}; use opt_level "
                                   f"'O2' or 'O3' to cast the model")
            changes[name] = dtype
        elif name == "patch_torch_functions":
            flag = _bool_override(value, name)
            if flag and opt_level != "O1":
                raise RuntimeError(f"patch_torch_functions=True is only meaningful with "
                                   f"opt_level 'O1', got opt_level {opt_level!r}")
            changes[name] = flag
        elif name == "keep_batchnorm_fp32":
            if opt_level == "O1":
                raise RuntimeError(f"with opt_level O1 the batchnorm functions run as "
                                   f"autocast decides and the weights stay FP32, so "
                                   f"keep_batchnorm_fp32 must be None, got {value!r}")
            changes[name] = _bool_override(value, name)
        elif name == "master_weights":
            if opt_level == "O1":
                raise RuntimeError(f"master_weights make no sense with opt_level O1: its "
                                   f"model weights are FP32 already; got {value!r}")
            changes[name] = _bool_override(value, name)
        elif name == "loss_scale":
            changes[name] = _loss_scale_override(value)
        elif name == "cast_model_outputs":
            changes[name] = _dtype_override(value, name)
    return dataclasses.replace(props, **changes)


def _check_fp32(models: list[nn.Module]) -> None:
    for i, model in enumerate(models):
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if tensor.is_floating_point() and tensor.dtype is not torch.float32:
                raise RuntimeError(f"models[{i}]: found {name!r} of dtype {tensor.dtype}, "
                                   f"expected torch.float32; amp.initialize takes the FP32 "
                                   f"model as it is, whatever the opt_level (do not call "
                                   f".half() on it first)")


def initialize(models: nn.Module | Sequence[nn.Module],
               optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None
               = None, enabled: bool = True, opt_level: str = "O1",
               cast_model_type: torch.dtype | None = None,
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
        optimizers: an optimizer, a list of them, or ``None``.
        enabled: ``False`` returns everything unchanged and makes :func:`scale_loss`
            yield the loss as it is.
        opt_level: ``"O0"``, ``"O1"``, ``"O2"`` or ``"O3"`` (the letter O).
        cast_model_type, patch_torch_functions, keep_batchnorm_fp32, master_weights,
        loss_scale, cast_model_outputs: override the opt_level's properties (``None``
            keeps its default); ``cast_model_type`` may be ``torch.bfloat16``.
        num_losses: how many ``loss_id`` values :func:`scale_loss` takes.
        verbosity: 0 prints nothing; 1 prints the properties chosen.
        min_loss_scale, max_loss_scale: bounds of the dynamic loss scale.
        dtype: an ampkit extra: the low-precision dtype (``torch.float16`` by default,
            ``torch.bfloat16``); O1 casts ops to it.

    Returns:
        ``models`` when ``optimizers`` is ``None``, else ``(models, optimizers)``, in the
        shape given.

    Raises:
        RuntimeError: an unknown ``opt_level``, a nonsensical override (apex's checks),
            a model that is not FP32 or already wrapped.
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
        RuntimeError: master_weights make no sense with opt_level O1: ...
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

    overrides: dict[str, Any] = {
        "loss_scale": props.loss_scale, "num_losses": num_losses,
        "min_loss_scale": min_loss_scale, "max_loss_scale": max_loss_scale}
    if opt_level != "O1":
        # apex keeps BatchNorm only (ampkit's norms default would keep LayerNorm too).
        from torch.nn.modules.batchnorm import _BatchNorm

        overrides["cast_model_type"] = props.cast_model_type
        overrides["keep_norms_fp32"] = False
        overrides["keep_fp32_modules"] = [_BatchNorm] if props.keep_batchnorm_fp32 else []
        overrides["master_weights"] = bool(props.master_weights)
        overrides["patch_ops"] = props.patch_torch_functions
        overrides["cast_model_outputs"] = props.cast_model_outputs or torch.float32
    elif props.cast_model_outputs is not None:
        overrides["cast_model_outputs"] = props.cast_model_outputs
    result = _initialize(models, optimizers, level=opt_level, dtype=low, **overrides)
    with _lock:
        _state = _State(props)
    if verbosity > 0:
        print(f"ampkit.apex: selected opt_level {opt_level}: {_BRIEF[opt_level]}, "
              f"low-precision dtype {low}")
        print(props.describe())
    return result


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
def scale_loss(loss: torch.Tensor,
               optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
               loss_id: int = 0, model: nn.Module | None = None,
               delay_unscale: bool = False) -> Iterator[torch.Tensor]:
    """apex's ``amp.scale_loss``: yield ``loss`` times the scale of ``loss_id``; on
    exit unscale the optimizers' gradients, and on overflow make each optimizer's next
    ``step()`` a no-op and lower the scale.

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
    """
    state = _require_state("scale_loss")
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"model must be None or a torch.nn.Module, got "
                        f"{type(model).__name__}")
    if not state.properties.enabled:
        yield loss
        return
    with _scale_loss(loss, optimizers, loss_id, delay_unscale=delay_unscale) as scaled:
        yield scaled


def master_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
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
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    for group in optimizer.param_groups:
        yield from group["params"]


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
