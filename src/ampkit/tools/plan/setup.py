"""One training step of one precision mode under one parallel layout, set up the way a
user sets it up with ampkit (the same calls, in the same order), on whatever tensors
the factories make: fake ones for the planner (:mod:`ampkit.tools.plan.simulate`),
real ones for a measured run.

The modes (:data:`MODES`), all in bfloat16:

========================================  =================================================
``fp32``                                  no ampkit: float32 parameters, ops and state
``bf16-autocast``                         no ampkit: native ``torch.autocast`` around the
                                          forward and the loss
``O1`` / ``O2`` / ``O3``                  ``initialize(level=...)``
``pure-stochastic`` / ``pure-kahan``      ``initialize(level="O2", master_weights=...)``
``pure-stochastic+step-in-backward``      the same with ``step_in_backward=True``
``fp8``                                   ``initialize(level="O2", fp8="tensorwise")``
========================================  =================================================

The layouts (:data:`LAYOUTS`): ``none`` (one process), ``ddp`` (the model as it is on
every rank; DistributedDataParallel's gradient buckets are added by
:func:`ddp_bucket_bytes`, because its C++ reducer needs real data), ``fsdp2``
(``ampkit.fsdp.fully_shard`` over the blocks, then the optimizer, made pure by
``ampkit.fsdp.prepare_optimizer`` where the mode is pure; native ``fully_shard`` for
``fp32`` and ``bf16-autocast``), ``hsdp`` (the same on a 2-D mesh, replicas x
shards).

Example:
    >>> from ampkit.tools.plan.setup import MODES, settings_of
    >>> MODES[:3], settings_of("pure-kahan")
    (('fp32', 'bf16-autocast', 'O1'), {'level': 'O2', 'master_weights': 'kahan'})
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn

from ampkit.torch_internals import tree_leaves

__all__ = ["LAYOUTS", "MODES", "OPTIMIZERS", "FactoryError", "Step", "build_step",
           "check_parallel", "cuda_lists_policy", "ddp_bucket_bytes", "default_blocks",
           "default_loss", "settings_of", "takes_batch"]

#: The precision modes, in the order a plan lists them.
MODES: tuple[str, ...] = (
    "fp32", "bf16-autocast", "O1", "O2", "O3", "pure-stochastic", "pure-kahan",
    "pure-stochastic+step-in-backward", "fp8")

#: The parallel layouts.
LAYOUTS: tuple[str, ...] = ("none", "ddp", "fsdp2", "hsdp")


def check_parallel(parallel: str) -> None:
    """Raise ``ValueError`` unless ``parallel`` is one of :data:`LAYOUTS`; for
    ``"fsdp2+tp"`` say that it is not supported yet, and why.

    Example:
        >>> from ampkit.tools.plan.setup import check_parallel
        >>> check_parallel("fsdp2+tp")
        Traceback (most recent call last):
        ...
        ValueError: parallel='fsdp2+tp' is not supported yet by ampkit.plan: ...
    """
    if parallel in LAYOUTS:
        return
    accepted = ", ".join(repr(layout) for layout in LAYOUTS)
    if parallel == "fsdp2+tp":
        # a tensor-parallel plan is per model (which Linear is split by columns, which
        # by rows); the planner has none to apply yet, and a plan that guessed one
        # would size a layout the user does not run
        raise ValueError(f"parallel='fsdp2+tp' is not supported yet by ampkit.plan: it "
                         f"does not apply a tensor-parallel plan. Accepted values: "
                         f"{accepted}; plan FSDP2 over the data-parallel degree alone "
                         f"(world_size divided by the TP degree) for the sharded state")
    raise ValueError(f"parallel must be one of {accepted}, got {parallel!r}")

#: The optimizers a plan may name (or pass a callable: parameters -> optimizer).
OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3),
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9),
}

_SETTINGS: dict[str, dict[str, Any]] = {
    "O1": {"level": "O1"},
    "O2": {"level": "O2"},
    "O3": {"level": "O3"},
    "pure-stochastic": {"level": "O2", "master_weights": "stochastic"},
    "pure-kahan": {"level": "O2", "master_weights": "kahan"},
    "pure-stochastic+step-in-backward": {"level": "O2", "master_weights": "stochastic",
                                         "step_in_backward": True},
    "fp8": {"level": "O2", "fp8": "tensorwise"},
}


def settings_of(mode: str) -> dict[str, Any] | None:
    """The ``initialize`` keywords of ``mode`` (besides ``dtype``); ``None`` for the
    modes that do not use ampkit (``fp32``, ``bf16-autocast``).

    Example:
        >>> from ampkit.tools.plan.setup import settings_of
        >>> settings_of("O2"), settings_of("fp32")
        ({'level': 'O2'}, None)
    """
    if mode not in MODES:
        raise ValueError(f"modes: unknown mode {mode!r}; choose from {', '.join(MODES)}")
    found = _SETTINGS.get(mode)
    return None if found is None else dict(found)


def cuda_lists_policy() -> Any:
    """CUDA autocast's lists as an ampkit policy that applies on any device: the ops
    native autocast registers for CUDA run in bfloat16, except CUDA's float32 list
    (:func:`ampkit.policies.registry.autocast_fp32_ops`) and its promote list; every other op
    keeps its inputs' dtype. With it a plan computed on the CPU casts what a CUDA
    device would, which CPU autocast's own lists do not (it runs softmax in bfloat16).

    Example:
        >>> from ampkit.tools.plan.setup import cuda_lists_policy
        >>> p = cuda_lists_policy()
        >>> p.rule_for("linear"), p.rule_for("softmax"), p.rule_for("cat")
        ('lower', 'fp32', 'promote')
    """
    from ampkit.policies.policy import Policy
    from ampkit.policies.registry import all_op_names, autocast_fp32_ops, native_op_names

    known = all_op_names()
    # CUDA autocast's promote policy (aten/src/ATen/autocast_mode.cpp), where torch has it
    promote = frozenset({"addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot",
                         "grid_sampler", "index_put", "tensordot", "scatter_add", "cat",
                         "stack", "index_copy"}) & known
    fp32 = autocast_fp32_ops()
    lower = (native_op_names("cuda") & known) - fp32 - promote
    return Policy("cuda-lists", torch.bfloat16, lower_precision_ops=lower, fp32_ops=fp32,
                  promote_ops=promote, unlisted="keep",
                  description="CUDA autocast's lists, applied on any device (ampkit.plan)")


def default_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 shards one by one when the plan is not told: the entries of
    every ``nn.ModuleList`` (a transformer's layers), else the model's children that
    hold parameters.

    Example:
        >>> import torch
        >>> from ampkit.tools.plan.setup import default_blocks
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
        >>> [type(b).__name__ for b in default_blocks(net)]
        ['Linear']
    """
    found = [child for module in model.modules() if isinstance(module, nn.ModuleList)
             for child in module]
    if found:
        return found
    return [child for child in model.children()
            if any(True for _ in child.parameters())]


def default_loss(output: Any) -> torch.Tensor:
    """The loss a plan backpropagates when not given one: the output's ``loss`` where
    it has one (transformers' models given labels), else the sum of the means of its
    floating-point tensors, in float32.

    Example:
        >>> import torch
        >>> from ampkit.tools.plan.setup import default_loss
        >>> default_loss((torch.ones(2, 2), torch.zeros(3, dtype=torch.long)))
        tensor(1.)
    """
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    leaves = [t for t in tree_leaves(output)
              if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not leaves:
        raise ValueError("the model's output holds no floating-point tensor to "
                         "backpropagate from; pass loss_fn")
    total = leaves[0].float().mean()
    for t in leaves[1:]:
        total = total + t.float().mean()
    return total


def ddp_bucket_bytes(model: nn.Module) -> int:
    """The bytes of DistributedDataParallel's gradient buckets on each rank: one flat
    buffer per bucket, which together hold one element per element of every parameter
    that requires a gradient, in the parameter's dtype (no padding between them). They
    live as long as the DDP module, beside the gradients themselves
    (``gradient_as_bucket_view=False``, the default).

    Example:
        >>> import torch
        >>> from ampkit.tools.plan.setup import ddp_bucket_bytes
        >>> ddp_bucket_bytes(torch.nn.Linear(4, 3))
        60
    """
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


class FactoryError(Exception):
    """The user's model or inputs factory raised (its exception is the ``__cause__``):
    the planner passes that on instead of making a row of it."""


def _call_inputs(inputs_factory: Callable[..., Any], batch: int | None) -> Any:
    try:
        return inputs_factory() if batch is None else inputs_factory(batch=batch)
    except Exception as error:
        raise FactoryError("inputs_factory") from error


def takes_batch(inputs_factory: Callable[..., Any]) -> bool:
    """Whether ``inputs_factory`` takes a ``batch`` keyword (a plan can then search
    the largest batch that fits).

    Example:
        >>> from ampkit.tools.plan.setup import takes_batch
        >>> takes_batch(lambda batch=8: batch), takes_batch(lambda: 1)
        (True, False)
    """
    try:
        parameters = inspect.signature(inputs_factory).parameters
    except (TypeError, ValueError):
        return False
    return "batch" in parameters or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


@dataclasses.dataclass
class Step:
    """A model, its optimizer and inputs, ready for :meth:`run`."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    inputs: Any
    loss_fn: Callable[[Any], torch.Tensor]
    region: Callable[[], contextlib.AbstractContextManager[Any]]
    in_backward: bool
    #: bytes the layout holds that no tensor of the simulation shows (DDP's buckets)
    layout_bytes: int = 0

    def forward(self) -> torch.Tensor:
        """The forward and the loss."""
        with self.region():
            if isinstance(self.inputs, tuple):
                output = self.model(*self.inputs)
            elif isinstance(self.inputs, dict):
                output = self.model(**self.inputs)
            else:
                output = self.model(self.inputs)
            loss = self.loss_fn(output)
        return loss

    def finish(self, loss: torch.Tensor) -> None:
        """Backward and the optimizer step (inside backward where the mode steps
        there)."""
        loss.backward()
        if not self.in_backward:
            self.optimizer.step()

    def run(self) -> None:
        """One whole step: zero the gradients, forward, backward, step."""
        self.optimizer.zero_grad(set_to_none=True)
        self.finish(self.forward())


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield


def build_step(mode: str, parallel: str, model_factory: Callable[[], nn.Module],
               inputs_factory: Callable[..., Any], *, mesh: Any = None,
               optimizer: str | Callable[..., torch.optim.Optimizer] = "adamw",
               device_policy: str = "cuda", batch: int | None = None,
               loss_fn: Callable[[Any], torch.Tensor] | None = None,
               blocks: Callable[[nn.Module], list[nn.Module]] | None = None,
               fake: Any = None) -> Step:
    """Build ``mode`` under ``parallel`` as a user would with ampkit: the model, ampkit's
    conversion, the layout's wrapping, the optimizer, the inputs (``inputs_factory``,
    given ``batch=`` when ``batch`` is not ``None``). ``mesh`` is the device mesh of
    ``fsdp2`` (1-D) or ``hsdp`` (2-D); DDP itself is not wrapped around the model (see
    the module doc), the caller wraps it on real ranks.

    ``fake``: a fake tensor mode that takes real (meta) inputs, to build inside. Under
    FSDP2 the model is built, converted and sharded on the meta device first and given
    fake CPU storages after (``to_empty``), as large models are initialised: sharding
    cuts every parameter into one view per rank, which on fake tensors costs far more
    than on meta ones (at 1,024 ranks, minutes for an 8B model).

    Errors that ampkit raises (a refusal) propagate unchanged.

    Example:
        >>> import torch
        >>> from ampkit.tools.plan.setup import build_step
        >>> step = build_step("O2", "none", lambda: torch.nn.Linear(4, 4),
        ...                   lambda: torch.ones(2, 4))
        >>> step.run()
        >>> step.model.weight.dtype, sorted(step.optimizer.state[step.model.weight])
        (torch.float32, ['exp_avg', 'exp_avg_sq', 'step'])
    """
    import ampkit

    settings = settings_of(mode)
    check_parallel(parallel)
    if device_policy not in ("cuda", "cpu"):
        raise ValueError(f"device_policy must be 'cuda' or 'cpu', got {device_policy!r}")
    make_optimizer = OPTIMIZERS.get(optimizer) if isinstance(optimizer, str) else optimizer
    if make_optimizer is None:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)} or a callable "
                         f"taking the parameters, got {optimizer!r}")
    sharded = parallel in ("fsdp2", "hsdp")

    def inside() -> contextlib.AbstractContextManager[Any]:
        return fake if fake is not None else contextlib.nullcontext()

    try:
        with (torch.device("meta") if fake is not None and sharded else inside()):
            model = model_factory()
    except Exception as error:
        raise FactoryError("model_factory") from error
    if not isinstance(model, nn.Module):
        raise TypeError(f"model_factory must return an nn.Module, got "
                        f"{type(model).__name__}")
    policy = cuda_lists_policy() if device_policy == "cuda" else None
    region: Callable[[], contextlib.AbstractContextManager[Any]] = _nothing
    if mode == "bf16-autocast":
        device_type = "cpu" if fake is not None else next(
            (p.device.type for p in model.parameters()), "cpu")
        if policy is None:
            def region() -> contextlib.AbstractContextManager[Any]:
                return torch.autocast(device_type, torch.bfloat16)
        else:
            cuda_policy = policy

            def region() -> contextlib.AbstractContextManager[Any]:
                return ampkit.autocast(device_type, policy=cuda_policy)
    keywords: dict[str, Any] = {}
    if settings is not None:
        keywords = dict(settings, dtype=torch.bfloat16)
        if policy is not None and settings["level"] != "O3":  # O3 casts every op
            keywords["policy"] = policy
    if not sharded:
        if parallel == "ddp" and keywords.get("step_in_backward"):
            # DDP refuses it at the first gradient hook; the plan never wraps DDP
            # (above), so it asks ampkit for that refusal before converting
            from ampkit.step_in_backward import check_step_in_backward

            check_step_in_backward(None, held_by="DistributedDataParallel")
        with inside():
            opt = make_optimizer(model.parameters())
            if settings is not None:
                model, opt = ampkit.initialize(model, opt, **keywords)
    else:
        in_backward = False
        if settings is not None:
            in_backward = keywords.pop("step_in_backward", False)
            model = ampkit.initialize(model, **keywords)
            import ampkit.fsdp

            # chosen once converted: fp8 replaces its Linear layers
            chosen = (blocks or default_blocks)(model)
            ampkit.fsdp.fully_shard(model, blocks=chosen, mesh=mesh)
        else:
            from torch.distributed.fsdp import fully_shard

            for block in (blocks or default_blocks)(model):
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        with inside():
            if fake is not None:
                model.to_empty(device="cpu")
            opt = make_optimizer(model.parameters())
            if settings is not None:
                opt = ampkit.fsdp.prepare_optimizer(model, opt)
            if in_backward:
                from ampkit.step_in_backward import (
                    enable_step_in_backward,
                    steps_in_backward,
                )

                if not steps_in_backward(opt):
                    opt = enable_step_in_backward(opt)
    from ampkit.step_in_backward import steps_in_backward

    with inside():
        inputs = _call_inputs(inputs_factory, batch)
    return Step(model, opt, inputs, loss_fn or default_loss, region, steps_in_backward(opt),
                ddp_bucket_bytes(model) if parallel == "ddp" else 0)
