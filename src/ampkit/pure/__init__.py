"""Pure low-precision training: the bf16 parameters are the truth, with no fp32 copies.

In this mode (``master_weights="stochastic" | "kahan"``) parameters and optimizer
state stay bf16 between steps. Dropping fp32 copies saves memory (AdamW: 6 bytes per
parameter between steps instead of fp32's 12). But updates rounded to nearest stall:
``w + lr * update`` rounds back to ``w`` whenever the update is below half a bf16 ulp
(bf16 keeps 8 significant bits, so about 0.4% of ``|w|``).
:class:`PureLowPrecisionOptimizer` applies each update with one of these roundings:

* ``"stochastic"``: stochastic rounding (Zamirai et al., "Revisiting BFloat16
  Training", 2020). The fp32 result rounds up with probability equal to its distance
  from the bf16 value below, so the rounding is unbiased and small updates survive on
  average.
* ``"kahan"``: Kahan-compensated summation. A bf16 compensation per parameter (the
  optimizer state ``"kahan_compensation"``) keeps what rounding the weight to nearest
  lost, and is added back before the next update. It is truncated to bf16, so weight +
  compensation always rounds back to the weight. This costs 2 more bytes per parameter.
* ``"nearest"``: round to nearest. This is the baseline that stalls, kept for
  comparisons only.

**How a step works.** The parameters are never replaced and their ``.data`` is never
reassigned. The autograd graph, DDP's hooks on each parameter and FSDP2's sharded
parameters all keep seeing the same tensors. For each chunk of parameters, taking at
most ``chunk_bytes`` of fp32 working memory at a time, each bf16 parameter with a
gradient gets an fp32 *working* ``nn.Parameter``: the weight (plus its compensation),
with an fp32 copy of its gradient and fp32 copies of its optimizer state (moments,
momentum). These stand in for the bf16 parameter in ``param_groups`` and ``state``
while the optimizer's *own* step runs. Any ``torch.optim`` optimizer works this way,
foreach and fused variants included, since they see ordinary fp32 tensors, DTensors
included. Where an ``Adam``/``AdamW`` group leaves the implementation to torch
(``foreach`` and ``fused`` both ``None``) on the CPU, the working copies are stepped by
torch's fused kernel rather than the per-parameter loop torch would pick there, on
copies padded so that no element's bits depend on how its parameter is cut: the same
update, which may differ from the loop in the last fp32 bit (``foreach=False`` keeps
the loop; see :mod:`ampkit.pure.fused`). The results are then rounded back into the
bf16 parameter's own storage (``copy_``, in place). The copies in and the roundings
back of a chunk run as multi-tensor ops (``torch._foreach_*``), one call per device
for all its tensors.
The weight is rounded by the chosen rounding. The optimizer state
is rounded stochastically (``"stochastic"`` and ``"kahan"``) or to nearest
(``"nearest"``). The state is rounded stochastically even with Kahan because rounding
to nearest stalls moments too: AdamW's ``v = 0.999 v + 0.001 g**2`` rounds back to
``v`` unless ``g**2`` differs from ``v`` by about twice ``v``. Parameters that are not
bf16 (norms kept in fp32) are stepped as they are. Scalar state (the step count,
NAdam's ``mu_product``, ASGD's ``eta``/``mu``) follows from the step count and the
hyper-parameters, so it stays fp32 and exact. Entries that are not tensors (LBFGS's
history lists) stay as the optimizer made them. Step hooks run once per step and see
whole parameter groups, as with any torch optimizer; the chunks are invisible to them.

**Random bits.** Stochastic rounding never reads torch's global RNG. Each parameter's
elements are cut into blocks of 65,536 positions; before a block is rounded, a
generator of the parameter's device is seeded with a hash of ``(rounding_seed, the
parameter's index in the optimizer, the number of rounded updates that parameter has
had, the block)`` and draws 16 bits per element for the weight and for each
per-element state entry (in the order of their names). So:

* a run is bit for bit reproducible from the seed, and a resumed run continues bit for
  bit (the seed and the counts are in the optimizer's ``state_dict``);
* a parameter's bits do not depend on the other parameters (whether they stepped, how
  the step was chunked: ``chunk_bytes`` changes no bit);
* every replica of a parameter (DDP ranks; HSDP's replicate dimension) draws the same
  bits and the replicas stay equal, whatever each rank's global RNG does;
* for a DTensor (FSDP2's ``fully_shard``) sharded with ``Shard``/``Replicate``
  placements, a shard draws the blocks holding its elements and takes their bits at
  the elements' positions in the *whole* parameter, so a sharded run rounds exactly
  like an unsharded one (a contiguous ``Shard(0)`` shard draws at most one block more
  than it holds; other placements draw the span their elements cover). For other
  placements (``_StridedShard``: FSDP2 over tensor parallelism), the positions are the
  local ones and the shard's mesh coordinates enter the hash: replicas still agree and
  shards draw different bits, but a sharded run no longer rounds like an unsharded one;
* the bits come from the device's generator (CPU: Mersenne Twister; CUDA: Philox), so
  a CPU and a CUDA run draw different bits; each is reproducible on its own.

``rounding_seed`` is a hyper-parameter of each parameter group (``None`` means 0), and
the count is the per-parameter state entry ``"rounding_step"``. Both are part of
``optimizer.state_dict()``, and so of Distributed Checkpoint's, so a resumed run
continues bit for bit.

**Checkpoints.** The model's ``state_dict`` holds its bf16 parameters, the truth. The
Kahan compensation is ordinary optimizer state: it saves, loads and (under FSDP2)
shards with the optimizer. The compensation belongs to the weight the step left. So a
weight changed by anything but this optimizer's step gets its compensation dropped at
the next step. That covers ``model.load_state_dict``, ``p.copy_`` and anything else
that bumps the parameter's version counter, and ``p.data = ...``. In-place edits
*through* ``p.data`` bypass the version counter: after one, the old compensation (less
than half a bf16 ulp of the old weight) is added once. Loading the optimizer's
``state_dict`` takes the saved compensations as they are. ``torch.save``, pickle and
``copy.deepcopy`` of the optimizer (alone or with its model) keep the rounding, the
state and the counts, so the copy trains bit for bit like the original.

**Skipped steps and closures.** A step that is not taken leaves the parameters and the
state exactly as they were. A step is not taken when a loss scaler skipped it, or when
``found_inf`` != 0 was handed to the step. A pure optimizer tells loss scalers that it
does not take ``grad_scale``/``found_inf``, even when the inner optimizer is fused. The
scaler then unscales the gradients itself and skips the call on an overflow (one host
sync per step). A closure handed to ``step`` is called once, before the update, at the
current weights, as ``torch.optim.SGD``/``AdamW`` do. Optimizers whose step *requires*
a closure (``torch.optim.LBFGS``) evaluate it again at weights they try. Those steps
run on all parameters at once, not in chunks. Before each evaluation, the weights tried
are rounded to nearest into the model's parameters; after it, the model's gradients
are handed to the working parameters.

**Memory (AdamW).** Between steps, 6 bytes per parameter with ``"stochastic"`` (bf16
weight and two bf16 moments) and 8 with ``"kahan"``, against 12 for fp32. Gradients
take 2 bytes. During the step, one chunk at a time holds fp32 working copies: 16 bytes
per element, plus the inner step's temporaries. Stochastic rounding adds its noise a
group of 262,144 elements at a time. A chunk is at least one whole parameter, except
with the element-wise torch optimizers (SGD, Adam, AdamW, NAdam, RAdam, Adamax,
Adagrad, RMSprop): they step a contiguous parameter larger than the budget in slices of
the budget's size (from 262,144 to 1,048,576 elements, whole blocks of the random
stream), each with the step count and state the parameter had before the step, which
gives the same result bit for bit. With other optimizers the largest parameter sets
the floor. The optimizer keeps the slices' working copies and the noise's buffers from
one step to the next (:meth:`PureLowPrecisionOptimizer.kept_scratch`): memory handed
back to the system at the end of a step would be faulted in again at the next, which
doubled a small model's step on the CPU. That is a constant, not per parameter: per
device, 4 bytes per element of one slice for the weight, the gradient and each
per-element state entry (AdamW: 16 MiB at most, 20 with amsgrad, plus 256 bytes per
intra-op thread and copy where the CPU's fused kernel pads them), and for the noise 2
bytes per element of one group for each rounded tensor and 4 more (AdamW: 2.5 MiB, 3
with amsgrad).

float16 is refused: pure fp16 would need loss scaling on every update and has little
range.

The package: :mod:`~ampkit.pure.optimizer` (the optimizer wrapper),
:mod:`~ampkit.pure.rounding` (stochastic rounding's hash, Kahan's compensation, DTensor
positions) and :mod:`~ampkit.pure.models` (what ``initialize`` records about the models
and the first-step check). Import everything from ``ampkit.pure``; a pickle that names
its former module path loads through :mod:`ampkit.common.unpickling`.

Example:
    >>> import torch
    >>> from ampkit.pure import PureLowPrecisionOptimizer
    >>> w = torch.nn.Parameter(torch.ones(1000, dtype=torch.bfloat16))
    >>> opt = PureLowPrecisionOptimizer(torch.optim.SGD([w], lr=1e-4), "stochastic",
    ...                                 seed=0)
    >>> for _ in range(10):
    ...     w.grad = torch.ones_like(w)
    ...     opt.step()
    >>> w.dtype, round(w.float().mean().item(), 3)  # round-to-nearest would stay at 1.0
    (torch.bfloat16, 0.999)
"""

from __future__ import annotations

from ampkit.common.lazy import lazy_exports
from ampkit.pure.models import mark_pure_models, pure_low_precision, pure_settings
from ampkit.pure.optimizer import (
    PURE_ROUNDINGS,
    PureLowPrecisionOptimizer,
    PureState,
    check_pure_optimizer,
    optimizer_class_name,
    pure_rounding,
    rebuild_pure,
)
from ampkit.pure.rounding import stochastic_round

__all__ = [
    "PURE_ROUNDINGS",
    "PureLoadPlanner",
    "PureLowPrecisionOptimizer",
    "check_pure_optimizer",
    "mark_pure_models",
    "optimizer_class_name",
    "pure_low_precision",
    "pure_settings",
    "pure_rounding",
    "stochastic_round",
]

# Distributed Checkpoint's planner imports torch.distributed.checkpoint (about a
# second): only when it is first used.
__getattr__, __dir__ = lazy_exports("ampkit.pure",
                                    {"PureLoadPlanner": "ampkit.pure.checkpoint"},
                                    globals(), ["checkpoint", "compiled_step"])

# A pickled (or deep-copied) pure optimizer names these: the package is their module,
# whichever file defines them (the optimizer classes made per torch class take it too).
for _named in (PureLowPrecisionOptimizer, PureState, rebuild_pure):
    _named.__module__ = __name__
del _named
