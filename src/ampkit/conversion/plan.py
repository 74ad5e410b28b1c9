"""Plan and apply a conversion: :func:`prepare_conversion` checks a model against a
:class:`~ampkit.conversion.config.ConversionConfig` and decides, module by module, where
each tensor goes, which modules get a boundary, which cast their parameters on use and
which cast their inputs, changing nothing; :func:`apply_conversion` then casts the
tensors and installs the boundaries and calls. :func:`kept_by_conversion` says what the
conversion keeps in fp32 on its own, and :func:`check_not_wrapped` refuses a model a
wrapper already holds.

Example:
    >>> import torch
    >>> from ampkit.conversion import apply_conversion, prepare_conversion
    >>> from ampkit.conversion.levels import conversion_for_level
    >>> model, cfg = torch.nn.Linear(2, 2), conversion_for_level("O3", "bfloat16")
    >>> plan = prepare_conversion(model, cfg)
    >>> model.weight.dtype, apply_conversion(model, cfg, plan), model.weight.dtype
    (torch.float32, None, torch.bfloat16)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn as nn

from ampkit import torch_internals
from ampkit.common.arguments import LOW_PRECISION
from ampkit.common.module_selection import resolve_module_selectors as _resolve
from ampkit.common.module_selection import selects as _matches
from ampkit.conversion.boundary import Boundary, Region, install_boundary
from ampkit.conversion.classes import cast_inputs_to, give_cast_call
from ampkit.conversion.config import (
    OWN_PARAMETER_CASTS,
    ConversionConfig,
    iter_records,
    mark_converted,
)
from ampkit.conversion.norms import updates_float_buffers
from ampkit.conversion.parameter_casts import CastParametersOnUse
from ampkit.conversion.parameter_owners import record_owners
from ampkit.conversion.reparametrize import (
    legacy_reparametrizations,
    reparametrization_sources,
    reparametrize_in_fp32,
)

__all__ = ["ReportDtype", "apply_conversion", "check_not_wrapped", "kept_by_conversion",
           "prepare_conversion"]

_LOW = LOW_PRECISION


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
        >>> from ampkit.conversion.levels import conversion_for_level
        >>> lin = parametrizations.orthogonal(torch.nn.Linear(2, 2))
        >>> o2 = conversion_for_level("O2", "bfloat16")
        >>> kept_by_conversion(lin.parametrizations.weight, o2), kept_by_conversion(lin, o2)
        (True, False)
        >>> kept_by_conversion(torch.nn.Embedding(4, 2, sparse=True), o2)
        True
    """
    from torch.nn.utils.parametrize import ParametrizationList

    if isinstance(module, ParametrizationList):
        # At O3 and in pure mode too (parameters stored low): torch's parametrizations
        # compute in their parameters' dtype, and several cannot in bf16 (orthogonal's
        # matrix_exp, spectral norm's power iteration beside its fp32 u and v).
        return (config.param_compute_dtype is not None
                or config.low_precision_modules is not None
                or config.param_dtype in _LOW)
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
        return config.param_compute_dtype or (
            config.param_dtype if config.param_dtype in _LOW else None)
    return config.kept_output_dtype


# -- reported dtype -----------------------------------------------------------------------

class ReportDtype:
    """``state_dict`` post-hook of a module: every floating entry in ``dtype`` (apex
    reports fp32 at O3). (No ``__slots__``: torch tags hooks with an attribute.)"""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, module: nn.Module, state_dict: dict[str, Any], prefix: str,
                 local_metadata: Any) -> None:
        for store in (torch_internals.module_parameters(module),
                      torch_internals.module_buffers(module)):
            for name, tensor in store.items():
                key = prefix + name
                value = state_dict.get(key)
                if tensor is None or value is None or value is tensor:  # keep_vars=True
                    continue
                if value.is_floating_point() and value.dtype is not self.dtype:
                    state_dict[key] = value.to(self.dtype)


def _wrapper_types() -> tuple[type, ...]:
    types: list[type] = [nn.DataParallel, nn.parallel.DistributedDataParallel]
    for path, name in (("torch.distributed.fsdp", "FullyShardedDataParallel"),
                       ("torch.distributed.fsdp", "FSDPModule")):
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
    boundaries: dict[int, tuple[nn.Module, Boundary]] = dataclasses.field(
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
            (n, t, True) for n, t in torch_internals.module_parameters(module).items()]
        if config.cast_buffers:
            stores += [(n, t, False) for n, t in torch_internals.module_buffers(module).items()]
        # A legacy spectral_norm/weight_norm hook's sources stay fp32 when parameters go
        # low (O3, pure): the hook computes the weight from them in fp32 (spectral norm's
        # power iteration meets its fp32 u and v) and hands it on in the low dtype.
        sources = ({s for hook in legacy_reparametrizations(module)
                    for s in reparametrization_sources(hook)}
                   if dtype in _LOW else set())
        for tname, tensor, is_param in stores:
            if tensor is None or not tensor.is_floating_point() or tname in sources:
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
              and updates_float_buffers(module)):
            # Its float32 statistics stay: so do its parameters, which torch's norm
            # kernels want in the statistics' dtype (the activation may be low).
            assign(module, name, torch.float32)
        else:
            assign(module, name, None if white is not None else config.param_dtype)
            if config.param_dtype in _LOW and not config.cast_buffers and any(
                    b is not None and b.is_floating_point()
                    for b in torch_internals.module_buffers(module).values()):
                plan.keeps_float_buffers = True
        if id(module) in seen:  # a module reachable twice: its tensors were checked above
            return
        seen.add(id(module))
        boundary = None
        if kept and not in_kept:
            boundary = Boundary(Region.FP32, torch.float32,
                                 _kept_output_dtype(module, config), module_type=type(module),
                                 # at O3 and in pure mode the low dtype is the
                                 # parameter's own: read from anywhere, it is that
                                 on_use=_is_parametrization(module)
                                 and config.param_dtype not in _LOW,
                                 bare_fp32=config.param_compute_dtype is not None)
        elif whitelisted and not in_white:
            boundary = Boundary(Region.LOW, None, config.white_list_output_dtype,
                                 config.compute_dtype, module_type=type(module))
        if boundary is not None:
            plan.boundaries[id(module)] = (module, boundary)
        if torch_internals.module_parameters(module) or torch_internals.module_buffers(module):
            plan.owners.append(module)
        if not kept and white is None and config.param_dtype in _LOW:
            low_owners.append(module)
        if (config.param_compute_dtype is not None and not kept
                and not updates_float_buffers(module)
                and not getattr(module, OWN_PARAMETER_CASTS, False) and any(
                    p is not None and p.is_floating_point()
                    for p in torch_internals.module_parameters(module).values())):
            plan.cast_on_use.append(module)
        for child_name, child in module.named_children():
            walk(child, f"{name}.{child_name}" if name else child_name, kept, whitelisted)

    walk(model, "", False, False)
    if shared_fp32:
        # (param_dtype is low here, so param_compute_dtype is None: no O2 list to merge)
        plan.cast_dtype = config.param_dtype
        plan.cast_on_use = [
            m for m in low_owners if not getattr(m, OWN_PARAMETER_CASTS, False) and any(
                p is not None and id(p) in shared_fp32
                for p in torch_internals.module_parameters(m).values())]
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
               for p in torch_internals.module_parameters(module).values()):
            plan.input_casts.append(module)


def _merge_root(model: nn.Module, config: ConversionConfig, plan: _Plan) -> None:
    """The model's own boundary. When the model is itself kept (or white-listed), that
    region wins and the model's input and output dtypes apply outside it."""
    inner = plan.boundaries.get(id(model), (model, None))[1]
    if inner is not None:
        region, compute = inner.region, inner.compute_dtype
        input_dtype = inner.input_dtype or config.input_dtype
        output_dtype = config.output_dtype or inner.output_dtype
    else:
        region = Region.POLICY if config.policy is not None else Region.UNCHANGED
        compute, input_dtype, output_dtype = (config.compute_dtype, config.input_dtype,
                                              config.output_dtype)
    # (Modules casting parameters on use need the root: it starts each forward pass,
    # which bounds the copies' life.)
    if (region is Region.UNCHANGED and input_dtype is None and output_dtype is None
            and config.param_compute_dtype is None and not plan.cast_on_use):
        return
    plan.boundaries[id(model)] = (model, Boundary(
        region, input_dtype, output_dtype, compute, config.policy, root=True,
        module_type=type(model),
        loss_read_as_computed=config.outputs_read_by_loss_as_computed))


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
            for param in torch_internals.module_parameters(module).values():
                target = None if param is None else plan.tensor_dtype.get(id(param))
                if param is None or target is None or id(param) in done or (
                        param.dtype is target[0]):
                    continue
                # In place, so the Parameter object stays the same: tied modules and
                # optimizers built before the conversion keep pointing at it.
                if _holds_inner_tensors(param):
                    _swap_in_dtype(param, target[0])
                else:
                    param.data = param.data.to(target[0])
                    if param.grad is not None:
                        param.grad = param.grad.to(target[0])
                done[id(param)] = param
            for name, buf in list(torch_internals.module_buffers(module).items()):
                if buf is None:
                    continue
                if id(buf) in done:
                    torch_internals.module_buffers(module)[name] = done[id(buf)]
                    continue
                target = plan.tensor_dtype.get(id(buf))
                if target is None or buf.dtype is target[0]:
                    continue
                new = buf.to(target[0])
                done[id(buf)] = new
                torch_internals.module_buffers(module)[name] = new


def _holds_inner_tensors(param: torch.Tensor) -> bool:
    """A DTensor parameter (tensor parallelism's ``parallelize_module``, FSDP2) keeps
    its elements in an inner local tensor: ``param.data = ...`` changes the dtype the
    wrapper reports but not the local shard the ops compute with."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(param, DTensor)


def _swap_in_dtype(param: torch.Tensor, dtype: torch.dtype) -> None:
    """Give ``param`` (a DTensor) ``dtype``, local shard included, keeping the Python
    object (as ``nn.Module.to`` does for such tensors): its contents are exchanged with
    a converted Parameter's, and its gradient and user attributes come along."""
    grad = param.grad
    param.grad = None  # a reference held here would block the exchange
    attributes = dict(param.__dict__)
    converted = nn.Parameter(param.detach().to(dtype), requires_grad=param.requires_grad)
    try:
        torch.utils.swap_tensors(param, converted)
    except RuntimeError as error:
        param.grad = grad
        raise RuntimeError(
            f"cannot store this {type(param).__name__} parameter in {dtype}: something "
            f"holds a reference to it that torch.utils.swap_tensors refuses ({error}). "
            f"Call ampkit.initialize before building what holds it") from error
    for key, value in attributes.items():
        param.__dict__.setdefault(key, value)
    if grad is not None:
        param.grad = grad.to(dtype)


def _register_state_dict_hook(module: nn.Module, hook: Any) -> None:
    public = getattr(module, "register_state_dict_post_hook", None)  # torch >= 2.5
    if public is not None:
        public(hook)
    else:
        torch_internals.register_state_dict_hook(module, hook)


class CastPerSampleWeights:
    """Forward pre-hook of an ``nn.EmbeddingBag`` whose weight computes in a
    low-precision dtype (O2's copy, O3's parameter): floating ``per_sample_weights``
    are cast to it. torch's kernel takes them only in the weight's dtype, and a model
    makes them in fp32 in its own forward, where no region casts them (the bag is no
    op on any list); in fp32 training, and under native autocast, they match. (No
    ``__slots__``: torch tags hooks with an attribute.)"""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                 ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        dtype = self.dtype
        if len(args) > 2:
            weights = args[2]
            if (isinstance(weights, torch.Tensor) and weights.is_floating_point()
                    and weights.dtype is not dtype):
                return (*args[:2], weights.to(dtype), *args[3:]), kwargs
            return None
        weights = kwargs.get("per_sample_weights")
        if (isinstance(weights, torch.Tensor) and weights.is_floating_point()
                and weights.dtype is not dtype):
            return args, {**kwargs, "per_sample_weights": weights.to(dtype)}
        return None


def _cast_per_sample_weights(plan: _Plan) -> None:
    on_use = {id(m) for m in plan.cast_on_use}
    for module in plan.owners:
        if not isinstance(module, nn.EmbeddingBag):
            continue
        weight = torch_internals.module_parameters(module).get("weight")
        if weight is None:
            continue
        dtype = plan.cast_dtype if id(module) in on_use else None
        if dtype is None:
            target = plan.tensor_dtype.get(id(weight))
            dtype = None if target is None else target[0]
        if dtype in _LOW:
            # (registered last: a converted module keeps ampkit's parameter cast the
            # last of its pre-hooks, so this one runs before it, with its dtype given)
            module.register_forward_pre_hook(CastPerSampleWeights(dtype), with_kwargs=True)


def _install(model: nn.Module, config: ConversionConfig, plan: _Plan) -> None:
    if plan.cast_dtype is not None and plan.cast_on_use:
        from torch.nn.utils.parametrize import is_parametrized

        dtype = plan.cast_dtype
        # O2: the parameters are the fp32 truth, so a submodule called on its own
        # computes in fp32 (at O3 the rest of the parameters are low precision: a
        # shared one kept fp32 is cast on every use)
        bare_fp32 = config.param_compute_dtype is not None
        cast = CastParametersOnUse(dtype, bare_fp32=bare_fp32)
        for module in plan.cast_on_use:
            legacy = legacy_reparametrizations(module)
            if legacy:
                # The weight is computed by the hook, from parameters left in fp32.
                for hook in legacy:
                    reparametrize_in_fp32(hook, dtype)
                CastParametersOnUse(dtype, keep=frozenset(
                    n for hook in legacy for n in reparametrization_sources(hook)),
                    bare_fp32=bare_fp32).install(module)
            else:
                cast.install(module)
            # The hooks' work done in the module's own call while they are its only
            # hooks (classes.cast_call). Not for a boundary (its call does more: the hooks
            # stay its route), a class with a __call__ of its own, nor a parametrized
            # module (torch.nn.utils.parametrize reads the class under its own).
            if id(module) not in plan.boundaries and not is_parametrized(module):
                give_cast_call(module)
    if config.param_dtype in _LOW:
        for module in plan.owners:
            for hook in legacy_reparametrizations(module):
                if any(plan.tensor_dtype.get(id(p), (None,))[0] is config.param_dtype
                       for p in torch_internals.module_parameters(module).values()
                       if p is not None):
                    reparametrize_in_fp32(hook, config.param_dtype)
    for module, boundary in plan.boundaries.values():
        install_boundary(module, boundary)
    for module in plan.input_casts:
        cast_inputs_to(module, config.param_dtype)
    _cast_per_sample_weights(plan)
    if config.state_dict_dtype is not None:
        report = ReportDtype(config.state_dict_dtype)
        for module in plan.owners:
            _register_state_dict_hook(module, report)
    for name, module in model.named_modules():
        mark_converted(module, config, name)


def prepare_conversion(model: nn.Module, config: ConversionConfig) -> Any:
    """Check ``model`` against ``config`` and plan its conversion without changing
    anything; ``None`` when it is already converted with ``config``. With
    :func:`apply_conversion`, lets a caller check several models before converting any.

    Example:
        >>> import torch
        >>> from ampkit.conversion import prepare_conversion
        >>> from ampkit.conversion.levels import conversion_for_level
        >>> model = torch.nn.Linear(2, 2)
        >>> _ = prepare_conversion(model, conversion_for_level("O3", "bfloat16"))
        >>> model.weight.dtype
        torch.float32
    """
    _check_model(model)
    for name, record in iter_records(model):
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
        >>> from ampkit.conversion.levels import conversion_for_level
        >>> model, cfg = torch.nn.Linear(2, 2), conversion_for_level("O3", "float16")
        >>> apply_conversion(model, cfg, prepare_conversion(model, cfg))
        >>> model.weight.dtype
        torch.float16
    """
    if not isinstance(plan, _Plan):
        raise TypeError(f"plan must come from prepare_conversion, got {type(plan).__name__}")
    _cast_tensors(model, config, plan)
    _install(model, config, plan)
    # where every parameter sits now, under the model's names: an optimizer built before
    # FSDP2's fully_shard (ampkit's or torch's) replaces them is refused at its first step
    record_owners(model)
