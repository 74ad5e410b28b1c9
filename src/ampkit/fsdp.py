"""FSDP2 for converted models: ampkit's level on PyTorch's own ``fully_shard``.

At O2 the fp32 parameters are the truth, so FSDP2 shards them like any fp32 model:
parameters, gradients and optimizer state. What ampkit adds is the grouping and the
mixed precision policy. ``fully_shard`` all-gathers one group of parameters in one
dtype, and an O2 model computes its norms from fp32 parameters and everything else from
low-precision copies. So the recipe is:

1. ``ampkit.initialize(model, level="O2", dtype=...)`` on the bare fp32 model;
2. :func:`fully_shard` (this module's): every module kept in fp32 (norms) and every fp8
   layer (``initialize(fp8=...)``: it casts its fp32 weights to fp8 itself) gets a
   group of its own with an fp32 policy, grouped per block; then each of ``blocks`` (e.g. your
   transformer block class) and finally the model get
   ``MixedPrecisionPolicy(param_dtype=<low>, reduce_dtype=torch.float32)``. The
   low-precision all-gathers happen where native FSDP2 mixed precision has them, and
   gradients are reduce-scattered in fp32 into the fp32 shards;
3. build the optimizer *after* sharding, over ``model.parameters()``: sharding replaces
   the parameters with sharded ``DTensor`` ones (as with ``torch.distributed.fsdp``).
   :func:`prepare_optimizer` is the one call for it at every level:
   ``optimizer = ampkit.fsdp.prepare_optimizer(model, torch.optim.AdamW(
   model.parameters(), lr=...))``. In pure low precision (``master_weights=
   "stochastic"``/``"kahan"``) it makes the optimizer pure with the rounding and seed
   ``initialize`` recorded on the model; at the other levels it checks the optimizer
   and hands it back. An optimizer built before sharding, which would step tensors the
   model no longer uses, raises ``RuntimeError`` at its first step (and at
   :func:`prepare_optimizer`), naming the parameter, at every level and whichever
   ``fully_shard`` sharded (:mod:`ampkit.conversion.parameter_owners`); so does a
   plain optimizer over a pure model's sharded parameters, whose updates would round
   to nearest.

Under this policy the parameters reach each module already in low precision (from the
all-gather), so ampkit's cast on use (:mod:`ampkit.conversion.parameter_casts`) has nothing to do
and keeps nothing; the kept norms get fp32 parameters, and so do the fp8 layers, which
torchao casts to fp8 from the fp32 values, as in one process (with
``Float8LinearConfig(enable_fsdp_float8_all_gather=True)`` their weights all-gather in
fp8 instead, cast from the fp32 shards). Never bf16: torchao would then quantize bf16
values, rounding each weight twice.

Other orders:

* ``torch.distributed.fsdp.fully_shard`` without a ``mp_policy`` after ``initialize``
  trains too, with the same numerics: FSDP2 all-gathers fp32 and ampkit casts each
  layer's unsharded parameters on use. That moves twice the bytes per all-gather, and
  each layer's low-precision copy lives from its forward to its backward.
* ``fully_shard`` with ``MixedPrecisionPolicy(param_dtype=<low>)`` over a group that
  holds a kept norm hands that norm low-precision parameters, which the level promises
  to keep in fp32: the first forward raises ``RuntimeError`` naming the module and
  the dtype it was gathered in. Shard with this module's :func:`fully_shard`, or give
  each norm a group of its own with :func:`mixed_precision_policy` ``(model, kept=True)``.
* ``fully_shard`` before ``initialize``: ``initialize`` raises ``RuntimeError`` (it
  converts the bare model; sharding comes second).

Checkpoints: ``torch.distributed.checkpoint`` (``get_state_dict``/``set_state_dict``,
``save``/``load``) sees ordinary fp32 parameters and optimizer state, and resumes
exactly. Loss scaling: :class:`ampkit.GradScaler` agrees on overflows over the mesh the
gradients are sharded on (see :mod:`ampkit.scaling.distributed`).

Example:
    >>> import torch
    >>> import ampkit
    >>> from ampkit.fsdp import mixed_precision_policy
    >>> model = ampkit.initialize(torch.nn.Sequential(torch.nn.Linear(4, 4),
    ...                                               torch.nn.LayerNorm(4)),
    ...                           level="O2", dtype=torch.bfloat16)
    >>> mixed_precision_policy(model).param_dtype
    torch.bfloat16
    >>> kept = mixed_precision_policy(model, kept=True)
    >>> kept.param_dtype, kept.reduce_dtype, kept.output_dtype, kept.cast_forward_inputs
    (None, None, None, False)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn

from ampkit.common.module_selection import (
    ModuleSelector,
    parse_module_selectors,
    resolve_module_selectors,
    selects,
)
from ampkit.conversion import (
    OWN_PARAMETER_CASTS,
    ConversionConfig,
    get_conversion,
    kept_by_conversion,
)
from ampkit.conversion.parameter_owners import check_not_replaced, note_replaced, record_owners

__all__ = ["fully_shard", "mixed_precision_policy", "prepare_optimizer"]

def _converted_config(model: Any, function: str) -> ConversionConfig:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    config = get_conversion(model)
    record = getattr(model, "_ampkit_conversion", None)
    if config is None or getattr(record, "name", None) != "":
        raise ValueError(f"{function} takes the model ampkit.initialize (or "
                         f"ampkit.convert_model) converted, as a whole; call "
                         f"ampkit.initialize(model, level=..., dtype=...) on the bare fp32 "
                         f"model first")
    return config


def _splits_kept(config: ConversionConfig) -> bool:
    """Whether the kept-fp32 modules compute from parameters of another dtype than the
    rest, so that they cannot share an FSDP group with it."""
    return config.param_compute_dtype is not None or config.casts_parameters


def mixed_precision_policy(model: nn.Module, *, kept: bool = False) -> Any:
    """The ``torch.distributed.fsdp.MixedPrecisionPolicy`` for a group of a converted
    model: ``kept=True`` for a group of modules the level keeps in fp32 (norms) or of
    fp8 layers (which cast their fp32 weights to fp8 themselves), else for the rest.
    For sharding by hand; :func:`fully_shard` applies both.

    At O2 the rest all-gathers in the level's low-precision dtype and reduces gradients
    in fp32; kept groups stay fp32. At O0/O1 every group is fp32 (autocast casts per
    op); at O3 and in pure low-precision mode groups keep their parameters' own dtype.
    Inputs are never cast by FSDP: the model's own boundary casts them as the level says.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: ``model`` is not the root of a model ampkit converted.

    Example:
        >>> import torch
        >>> import ampkit
        >>> from ampkit.fsdp import mixed_precision_policy
        >>> net = ampkit.initialize(torch.nn.Linear(2, 2), level="O2", dtype="float16")
        >>> policy = mixed_precision_policy(net)
        >>> policy.param_dtype, policy.reduce_dtype
        (torch.float16, torch.float32)
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    config = _converted_config(model, "mixed_precision_policy")
    if not isinstance(kept, bool):
        raise TypeError(f"kept must be a bool, got {type(kept).__name__}")
    if kept or config.param_compute_dtype is None:
        return MixedPrecisionPolicy(cast_forward_inputs=False)
    return MixedPrecisionPolicy(param_dtype=config.param_compute_dtype,
                                reduce_dtype=torch.float32, cast_forward_inputs=False)


def _has_floating_params(module: nn.Module) -> bool:
    return any(p.is_floating_point() for p in module.parameters())


def _plan_groups(model: nn.Module, config: ConversionConfig,
                 blocks: tuple[ModuleSelector, ...]
                 ) -> list[tuple[nn.Module, list[nn.Module], bool]]:
    """``[(owner, fp32 modules it holds, whether the owner itself gathers fp32)]``:
    every block, innermost first, then the model. The fp32 modules are the outermost
    kept-fp32 modules and fp8 layers with floating parameters that lie in the owner and
    in no inner block. An fp8 layer computes from its fp32 parameters (it casts them to
    fp8 itself, or torchao's float8 all-gather does): a low-precision all-gather would
    round them twice, so it gathers in fp32 too, in the owner's fp32 group, or as a
    block of its own with the fp32 policy."""
    keep = resolve_module_selectors(model, config.keep_fp32_modules, "keep_fp32_modules")
    chosen = resolve_module_selectors(model, blocks, "blocks")
    split = _splits_kept(config)
    kept_of: dict[int, list[nn.Module]] = {id(model): []}
    fp32_owners = {id(model)} if selects(model, "", keep) else set()
    order: list[nn.Module] = []
    seen: set[int] = set()

    def walk(module: nn.Module, name: str, in_kept: bool, owner: nn.Module) -> None:
        if id(module) in seen:  # a module reachable twice is sharded where first found
            return
        seen.add(id(module))
        kept = in_kept or selects(module, name, keep) or kept_by_conversion(module, config)
        fp8 = not kept and bool(getattr(module, OWN_PARAMETER_CASTS, False))
        is_block = not kept and module is not model and selects(module, name, chosen)
        if (((kept and not in_kept) or (fp8 and not is_block)) and split
                and module is not model and _has_floating_params(module)):
            kept_of[id(owner)].append(module)
        if is_block:
            kept_of[id(module)] = []
            if fp8 and split:
                fp32_owners.add(id(module))
        inner_owner = module if is_block else owner
        for child_name, child in module.named_children():
            walk(child, f"{name}.{child_name}" if name else child_name, kept, inner_owner)
        if is_block:
            order.append(module)  # after its children: inner blocks are sharded first

    walk(model, "", False, model)
    order.append(model)
    return [(owner, kept_of[id(owner)], id(owner) in fp32_owners) for owner in order]


def fully_shard(model: nn.Module, *, blocks: Iterable[ModuleSelector] | ModuleSelector = (),
                **fsdp_kwargs: Any) -> nn.Module:
    """Apply ``torch.distributed.fsdp.fully_shard`` to a model ampkit converted, with
    the level's mixed precision (see the module doc), and return it.

    Groups, in the order they are sharded: for each of ``blocks`` (innermost first) the
    kept-fp32 modules and fp8 layers inside it, as one fp32 group, then the block
    itself (an fp8 layer listed as a block is an fp32 group of its own); then the kept
    modules outside every block, then the model. Each ``fully_shard`` group all-gathers
    its parameters before its forward and frees them after (``reshard_after_forward``),
    so list the modules you would shard one by one with native FSDP2 (transformer
    blocks, or the layers of a small network); with no ``blocks`` the whole model
    outside its norms is one group.

    Args:
        model: the root of a model converted by ``ampkit.initialize`` or
            ``ampkit.convert_model``, no part of it sharded yet.
        blocks: module selectors (classes, qualified names as in
            ``model.named_modules()``, or instances) of the modules to shard as groups
            of their own. Kept-fp32 modules matched are left in their fp32 group.
        **fsdp_kwargs: passed to every ``fully_shard`` call (``mesh``,
            ``reshard_after_forward``, ``offload_policy``, ``shard_placement_fn``,
            ``ignored_params``); not ``mp_policy``, which is the level's.

    Returns:
        ``model``, sharded in place (an ``FSDPModule``).

    Raises:
        TypeError: ``mp_policy`` given, or a bad ``blocks`` entry.
        ValueError: ``model`` is not the root of a converted model, or a block name or
            instance is not in it.
        RuntimeError: part of ``model`` is sharded already.

    Example:
        >>> import torch
        >>> import torch.distributed as dist
        >>> import ampkit
        >>> import ampkit.fsdp
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8),
        ...                             torch.nn.Linear(8, 2))
        >>> model = ampkit.initialize(model, level="O2", dtype=torch.bfloat16)
        >>> model = ampkit.fsdp.fully_shard(model, blocks=[torch.nn.Linear],
        ...                                 mesh=init_device_mesh("cpu", (1,)))
        >>> optimizer = torch.optim.AdamW(model.parameters())    # after sharding
        >>> type(model[0].weight).__name__, model[0].weight.dtype
        ('DTensor', torch.float32)
        >>> model(torch.rand(3, 4)).sum().backward()
        >>> optimizer.step()
        >>> dist.destroy_process_group()
    """
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    config = _converted_config(model, "ampkit.fsdp.fully_shard")
    if "mp_policy" in fsdp_kwargs:
        raise TypeError("ampkit.fsdp.fully_shard chooses mp_policy from the model's level "
                        "(see ampkit.fsdp.mixed_precision_policy); do not pass one")
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            where = f"its submodule {name!r}" if name else "model"
            raise RuntimeError(f"{where} is sharded already (fully_shard); "
                               f"ampkit.fsdp.fully_shard shards the whole converted model "
                               f"itself, so call it on a model no part of which is sharded")
    selected = parse_module_selectors(blocks, "blocks") or ()
    # Planned (and every selector checked) before anything is sharded.
    groups = _plan_groups(model, config, selected)
    low = mixed_precision_policy(model)
    fp32 = mixed_precision_policy(model, kept=True)
    # Where each parameter sits now, under the model's names: an optimizer built over
    # one that sharding replaces is refused at its first step (and by prepare_optimizer).
    record_owners(model)
    before = list(model.parameters())
    for owner, kept, owner_fp32 in groups:
        if kept:
            torch_fully_shard(kept if len(kept) > 1 else kept[0], mp_policy=fp32,
                              **fsdp_kwargs)
        torch_fully_shard(owner, mp_policy=fp32 if owner_fp32 else low, **fsdp_kwargs)
    note_replaced(before)
    return model


def prepare_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> Any:
    """The one call that readies an optimizer built over a converted model's
    parameters, sharded or not: in pure low precision (``master_weights="stochastic"``
    or ``"kahan"``) it makes ``optimizer`` pure
    (:class:`ampkit.pure.PureLowPrecisionOptimizer`, in place) with the
    rounding and ``rounding_seed`` that ``ampkit.initialize`` recorded on ``model``, so
    nothing given to ``initialize`` is repeated (``compile_step`` included); at the
    other levels it hands it back as it is. Where ``initialize`` had
    ``step_in_backward=True``, it also makes the optimizer step each parameter inside
    backward (:mod:`ampkit.step_in_backward`): under FSDP2 each sharded parameter
    steps on its reduce-scattered gradient shard. Build the optimizer after
    :func:`fully_shard`, over ``model.parameters()``.

    Returns:
        ``optimizer`` itself (made pure where the model trains purely; stepping in
        backward where ``initialize`` asked for it).

    Raises:
        TypeError: ``model`` is not a module, or ``optimizer`` not an optimizer.
        ValueError: ``model`` is not the root of a converted model, or the optimizer
            holds a parameter that is not the model's.
        RuntimeError: the optimizer was built before sharding (it holds parameters
            ``fully_shard`` has since replaced).

    Example:
        >>> import torch
        >>> import torch.distributed as dist
        >>> import ampkit
        >>> import ampkit.fsdp
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        >>> model = ampkit.initialize(model, level="O2", dtype=torch.bfloat16,
        ...                           master_weights="kahan", rounding_seed=3)
        >>> model = ampkit.fsdp.fully_shard(model, blocks=[torch.nn.Linear],
        ...                                 mesh=init_device_mesh("cpu", (1,)))
        >>> optimizer = ampkit.fsdp.prepare_optimizer(
        ...     model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        >>> type(optimizer).__name__, optimizer.param_groups[0]["rounding_seed"]
        ('PureLowPrecisionAdamW', 3)
        >>> model(torch.rand(3, 4)).float().sum().backward()
        >>> optimizer.step()
        >>> dist.destroy_process_group()
    """
    from ampkit.pure import pure_low_precision, pure_settings

    _converted_config(model, "ampkit.fsdp.prepare_optimizer")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    check_not_replaced(optimizer)  # built before sharding: the one refusal, named
    held = {id(p) for p in model.parameters()}
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) in held:
                continue
            raise ValueError(f"optimizer: param_groups[{g}] holds a parameter of shape "
                             f"{tuple(p.shape)} that is not one of model.parameters(); "
                             f"build the optimizer over this model's parameters")
    from ampkit.step_in_backward import (
        enable_step_in_backward,
        marked_step_in_backward,
        watch_models,
    )

    pure = pure_settings(model)
    in_backward = marked_step_in_backward(model)
    if in_backward:  # refused before anything changes
        from ampkit.step_in_backward import check_step_in_backward

        check_step_in_backward(optimizer)
    if pure is not None:
        from ampkit.pure.compiled_step import compiled_step_models

        rounding, seed = pure
        optimizer = pure_low_precision(optimizer, rounding, seed=seed,
                                       compile_step=compiled_step_models(model))
    if in_backward:
        enable_step_in_backward(optimizer)
        watch_models(optimizer, [model])
    return optimizer
