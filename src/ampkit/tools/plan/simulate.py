"""The planner: each mode's training step run on fake tensors, counted.

For each mode, under a fake process group of ``world_size`` ranks (no communication;
this process plays rank 0) and inside a fake tensor mode (tensors with shapes, dtypes
and storages of their real size, and no data), :func:`plan`:

1. builds the step as a user would (:func:`ampkit.tools.plan.setup.build_step`: the
   model factory, ``ampkit.initialize`` with the mode's settings, the layout's
   sharding, the optimizer, the inputs factory);
2. runs one whole step, so that the optimizer's state and every lazily made buffer
   exist, as in any step after the first;
3. runs the measured step under :class:`ampkit.tools.plan.memory.LiveBytes`, which
   counts the bytes of every live tensor storage after every op.

A row holds, in bytes per rank: ``parameters`` (the storages of
``model.parameters()``: a shard with its padding under FSDP2), ``gradients`` (those of
the ``.grad`` tensors right after backward; ``0`` where the step runs inside backward),
``optimizer_state`` (every tensor in ``optimizer.state``, the step counters included),
``activations`` (what the forward leaves alive for backward: live bytes at the loss
less live bytes before the forward), ``peak`` (the step's high-water mark, from the
zeroed gradients to the optimizer step's end, plus ``layout_buffers``) and
``layout_buffers`` (DistributedDataParallel's gradient buckets, which its C++ reducer
allocates where no simulation sees them). A mode that ampkit refuses in that layout has
``None`` everywhere and a ``note`` that starts with ``refused:`` and gives ampkit's
reason; one whose ops cannot run on fake tensors says ``not simulated:`` and why.

Example:
    >>> import torch
    >>> import ampkit
    >>> report = ampkit.plan(lambda: torch.nn.Linear(256, 256),
    ...                      lambda: torch.randn(32, 256), modes=["fp32", "O3"])
    >>> [(r["mode"], r["parameters"], r["optimizer_state"]) for r in report.rows]
    [('fp32', 263168, 526344), ('O3', 131584, 263176)]
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ampkit.tools.plan.memory import LiveBytes, storage_bytes
from ampkit.tools.plan.report import ROW_KEYS, Plan
from ampkit.tools.plan.setup import (
    MODES,
    FactoryError,
    Step,
    build_step,
    check_parallel,
    takes_batch,
)
from ampkit.torch_internals import fake_tensor_mode, tree_leaves

__all__ = ["fake_world", "largest_batch", "measure_step", "plan"]

_AMPKIT_ROOT = Path(__file__).resolve().parents[2]
_PLANNER_ROOT = Path(__file__).resolve().parent


def _check_layout(parallel: str, world_size: int, shard_size: int | None) -> None:
    check_parallel(parallel)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if parallel == "none" and world_size != 1:
        raise ValueError(f"world_size={world_size} with parallel='none': one process holds "
                         f"the whole model; choose parallel='ddp', 'fsdp2' or 'hsdp' for "
                         f"{world_size} ranks")
    if parallel == "hsdp":
        if shard_size is None or shard_size < 1 or world_size % shard_size:
            raise ValueError(f"parallel='hsdp' needs shard_size, the ranks that shard one "
                             f"replica, dividing world_size={world_size}; got "
                             f"{shard_size!r}")
    elif shard_size is not None:
        raise ValueError(f"shard_size is for parallel='hsdp' only, got parallel={parallel!r}")


@contextlib.contextmanager
def fake_world(parallel: str, world_size: int, shard_size: int | None = None
               ) -> Iterator[Any]:
    """A fake process group of ``world_size`` ranks for ``parallel`` (this process is
    rank 0; collectives move nothing), and the layout's device mesh (``None`` for
    ``none`` and ``ddp``); the group is destroyed on exit. Refused where a process group
    is already initialized: the planner never replaces the user's.

    Example:
        >>> from ampkit.tools.plan.simulate import fake_world
        >>> with fake_world("fsdp2", 64) as mesh:
        ...     mesh.size()
        64
    """
    import torch.distributed as dist

    _check_layout(parallel, world_size, shard_size)
    if parallel == "none":
        yield None
        return
    if dist.is_initialized():
        raise RuntimeError("ampkit.plan runs its own fake process group and a process "
                           "group is already initialized here; plan outside the training "
                           "job (before init_process_group, or in its own process)")
    dist.init_process_group("fake", rank=0, world_size=world_size)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        if parallel == "fsdp2":
            yield init_device_mesh("cpu", (world_size,))
        elif parallel == "hsdp":
            assert shard_size is not None
            yield init_device_mesh("cpu", (world_size // shard_size, shard_size),
                                   mesh_dim_names=("replicate", "shard"))
        else:
            yield None
    finally:
        dist.destroy_process_group()


def _why(error: BaseException) -> str:
    """A row's note for a mode that did not run: ampkit's own refusal, or what kept it
    from running on fake tensors."""
    frames = traceback.extract_tb(error.__traceback__)
    raised_in = Path(frames[-1].filename).resolve() if frames else None
    text = " ".join(str(error).split()) or type(error).__name__
    if (raised_in is not None and raised_in.is_relative_to(_AMPKIT_ROOT)
            and not raised_in.is_relative_to(_PLANNER_ROOT)):
        return f"refused: {text}"
    return f"not simulated: {type(error).__name__}: {text}"


def _state_tensors(optimizer: torch.optim.Optimizer) -> list[Any]:
    return [leaf for state in optimizer.state.values() for leaf in tree_leaves(state)]


def measure_step(step: Step, live: LiveBytes) -> dict[str, int]:
    """Run ``step`` once more under ``live`` (entered by the caller, after a first step
    made the optimizer's state) and return the row's numbers.

    Example:
        >>> import torch
        >>> from ampkit.tools.plan.memory import LiveBytes
        >>> from ampkit.tools.plan.setup import build_step
        >>> from ampkit.tools.plan.simulate import measure_step
        >>> with LiveBytes() as live:
        ...     step = build_step("fp32", "none", lambda: torch.nn.Linear(8, 8),
        ...                       lambda: torch.ones(4, 8))
        ...     step.run()
        ...     row = measure_step(step, live)
        >>> row["parameters"], row["gradients"]
        (288, 288)
    """
    params = list(step.model.parameters())
    step.optimizer.zero_grad(set_to_none=True)
    live.reset_peak()
    start = live.total()
    loss = step.forward()
    activations = live.total() - start
    loss.backward()
    gradients = storage_bytes(p.grad for p in params)
    if not step.in_backward:
        step.optimizer.step()
    del loss
    return {
        "parameters": storage_bytes(params),
        "gradients": gradients,
        "optimizer_state": storage_bytes(_state_tensors(step.optimizer), exclude=params),
        "activations": activations,
        "layout_buffers": step.layout_bytes,
        "peak": live.peak + step.layout_bytes,
    }


def _plan_mode(mode: str, parallel: str, mesh: Any, model_factory: Callable[[], nn.Module],
               inputs_factory: Callable[..., Any], **options: Any) -> dict[str, Any]:
    row: dict[str, Any] = dict.fromkeys(ROW_KEYS)
    row["mode"] = mode
    try:
        fake = fake_tensor_mode(allow_real_inputs=True)
        step = build_step(mode, parallel, model_factory, inputs_factory, mesh=mesh,
                          fake=fake, **options)
        with fake, LiveBytes(fake_scalar_reads=True) as live:
            # what the set-up made and holds (its temporaries are gone)
            live.watch([*step.model.parameters(), *step.model.buffers(),
                        *tree_leaves(step.inputs)])
            step.run()
            row.update(measure_step(step, live))
            del step
    except FactoryError as failed:  # the user's code: theirs to read, as it raised
        assert failed.__cause__ is not None
        raise failed.__cause__ from None
    except Exception as error:
        row["note"] = _why(error)
    return row


def plan(model_factory: Callable[[], nn.Module], inputs_factory: Callable[..., Any], *,
         world_size: int = 1, parallel: str = "none", modes: Sequence[str] | None = None,
         optimizer: str | Callable[..., torch.optim.Optimizer] = "adamw",
         device_policy: str = "cuda", batch: int | None = None,
         loss_fn: Callable[[Any], torch.Tensor] | None = None,
         blocks: Callable[[nn.Module], list[nn.Module]] | None = None,
         shard_size: int | None = None) -> Plan:
    """Size one training step per rank for each precision mode, by running it on fake
    tensors through ampkit's own conversion: nothing of the model's size is allocated.

    Args:
        model_factory: builds the fp32 model (called inside the fake mode, once per
            mode: build it from scratch, do not return a model made outside).
        inputs_factory: returns the forward's inputs (a tuple: positional arguments; a
            dict: keywords; else the one argument); called with ``batch=`` when
            ``batch`` is given.
        world_size: ranks of the simulated job.
        parallel: ``"none"``, ``"ddp"``, ``"fsdp2"`` or ``"hsdp"`` (with
            ``shard_size``); ``"fsdp2+tp"`` is refused (not supported yet).
        modes: among :data:`ampkit.tools.plan.setup.MODES` (default: all).
        optimizer: ``"adamw"``, ``"adam"``, ``"sgd"`` or a callable building one from
            the parameters.
        device_policy: whose autocast lists apply: ``"cuda"`` (default: the device
            being planned for, applied on this CPU by ampkit's engine) or ``"cpu"``.
        batch: passed to ``inputs_factory`` as ``batch=`` when not ``None``.
        loss_fn: ``output -> loss``; default :func:`ampkit.tools.plan.setup.default_loss`.
        blocks: ``model -> modules`` FSDP2 shards one by one; default
            :func:`ampkit.tools.plan.setup.default_blocks`.
        shard_size: with ``hsdp``, the ranks sharding one replica.

    Returns:
        a :class:`ampkit.tools.plan.report.Plan`, whose ``rows`` are dicts (bytes per
        rank; see :mod:`ampkit.tools.plan.simulate`).

    Example:
        >>> import torch
        >>> import ampkit
        >>> report = ampkit.plan(lambda: torch.nn.Linear(1024, 1024),
        ...                      lambda: torch.randn(8, 1024), world_size=4,
        ...                      parallel="fsdp2", modes=["O2"])
        >>> report.rows[0]["parameters"]  # a quarter of 4,198,400 bytes, per rank
        1049600
    """
    _check_layout(parallel, world_size, shard_size)
    chosen = list(MODES if modes is None else modes)
    if isinstance(modes, str) or not chosen:
        raise ValueError(f"modes must be a non-empty list of {', '.join(MODES)}, "
                         f"got {modes!r}")
    unknown = [m for m in chosen if m not in MODES]
    if unknown:
        raise ValueError(f"modes: unknown {unknown}; choose from {', '.join(MODES)}")
    if not callable(model_factory) or isinstance(model_factory, nn.Module):
        raise TypeError("model_factory must be a callable that builds the model (it runs "
                        "inside the fake mode), not a model")
    if not callable(inputs_factory):
        raise TypeError(f"inputs_factory must be callable, got "
                        f"{type(inputs_factory).__name__}")
    if batch is not None and not takes_batch(inputs_factory):
        raise ValueError("batch is given but inputs_factory takes no batch argument")
    options = {"optimizer": optimizer, "device_policy": device_policy, "batch": batch,
               "loss_fn": loss_fn, "blocks": blocks}
    rows = []
    with fake_world(parallel, world_size, shard_size) as mesh:
        for mode in chosen:
            rows.append(_plan_mode(mode, parallel, mesh, model_factory, inputs_factory,
                                   **options))
    return Plan(world_size=world_size, parallel=parallel, device_policy=device_policy,
                optimizer=optimizer if isinstance(optimizer, str) else getattr(
                    optimizer, "__name__", type(optimizer).__name__),
                batch=batch, rows=tuple(rows))


def largest_batch(model_factory: Callable[[], nn.Module], inputs_factory: Callable[..., Any],
                  mode: str, device_memory: int, *, limit: int = 1 << 20,
                  **plan_options: Any) -> int:
    """The largest ``batch`` (given to ``inputs_factory``) whose planned peak fits in
    ``device_memory`` bytes for ``mode``, by doubling then bisection (the peak grows
    with the batch); ``0`` where not even a batch of one fits. ``plan_options`` are
    :func:`plan`'s keywords.

    Example:
        >>> import torch
        >>> from ampkit.tools.plan.simulate import largest_batch
        >>> largest_batch(lambda: torch.nn.Linear(8, 8),
        ...               lambda batch: torch.randn(batch, 8), "fp32", 4000)
        44
    """
    if not takes_batch(inputs_factory):
        raise ValueError("largest_batch: inputs_factory takes no batch argument")

    def fits(batch: int) -> bool:
        row = plan(model_factory, inputs_factory, modes=[mode], batch=batch,
                   **plan_options).rows[0]
        if row["peak"] is None:
            raise ValueError(f"largest_batch: mode {mode!r} did not run: {row['note']}")
        return bool(row["peak"] <= device_memory)

    if not fits(1):
        return 0
    good, bad = 1, 2
    while bad <= limit and fits(bad):
        good, bad = bad, bad * 2
    if bad > limit:
        return good
    while bad - good > 1:
        middle = (good + bad) // 2
        good, bad = (middle, bad) if fits(middle) else (good, middle)
    return good
