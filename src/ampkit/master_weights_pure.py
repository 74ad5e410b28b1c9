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
included. The results are then rounded back into the bf16 parameter's own storage
(``copy_``, in place). The weight is rounded by the chosen rounding. The optimizer state
is rounded stochastically (``"stochastic"`` and ``"kahan"``) or to nearest
(``"nearest"``). The state is rounded stochastically even with Kahan because rounding
to nearest stalls moments too: AdamW's ``v = 0.999 v + 0.001 g**2`` rounds back to
``v`` unless ``g**2`` differs from ``v`` by about twice ``v``. Parameters that are not
bf16 (norms kept in fp32) are stepped as they are. Scalar state (the step count,
NAdam's ``mu_product``, ASGD's ``eta``/``mu``) follows from the step count and the
hyper-parameters, so it stays fp32 and exact. Entries that are not tensors (LBFGS's
history lists) stay as the optimizer made them. Step hooks run once per step and see
whole parameter groups, as with any torch optimizer; the chunks are invisible to them.

**Random bits.** Stochastic rounding uses no generator. The random bits of an element
are a hash of ``(rounding_seed, the parameter's index in the optimizer, the number of
rounded updates that parameter has had, the names of the tensors rounded with it: the
weight and its state entries, the element's position)``; each tensor takes 16 of them.
So:

* every replica of a parameter (DDP ranks; HSDP's replicate dimension) draws the same
  bits and the replicas stay equal, whatever each rank's global RNG does;
* torch's global RNG is never read nor advanced;
* a parameter's bits do not depend on the other parameters (whether they stepped, how
  the step was chunked), nor on the device: a CPU and a CUDA run draw the same bits
  (their fp32 updates may still differ in the last bit);
* for a DTensor (FSDP2's ``fully_shard``) sharded with ``Shard``/``Replicate``
  placements, the position is the element's position in the *whole* parameter. A
  sharded run therefore rounds exactly like an unsharded one. For other placements
  (``_StridedShard``: FSDP2 over tensor parallelism), the position is the local one and
  the shard's mesh coordinates enter the hash: replicas still agree and shards draw
  different bits, but a sharded run no longer rounds like an unsharded one.

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
per element, plus the inner step's temporaries. Stochastic rounding adds about 30 bytes
per element for a slice of the tensor being rounded: max(2**16, chunk budget / 64)
elements, so at most about half the chunk budget. A chunk is at least one whole
parameter, so the largest parameter sets the floor.

float16 is refused: pure fp16 would need loss scaling on every update and has little
range.

Example:
    >>> import torch
    >>> from ampkit.master_weights_pure import PureLowPrecisionOptimizer
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

import functools
import hashlib
import inspect
import math
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

from ampkit.levels import PURE_MASTER_WEIGHTS

__all__ = [
    "PURE_ROUNDINGS",
    "PureLowPrecisionOptimizer",
    "check_pure_optimizer",
    "mark_pure_models",
    "optimizer_class_name",
    "pure_low_precision",
    "pure_settings",
    "pure_rounding",
    "stochastic_round",
]

#: The rounding modes :class:`PureLowPrecisionOptimizer` accepts: the pure modes
#: ``initialize``'s ``master_weights`` takes (:data:`ampkit.levels.PURE_MASTER_WEIGHTS`,
#: spelled once there), and ``"nearest"``, the stalling baseline.
PURE_ROUNDINGS: tuple[str, ...] = (*PURE_MASTER_WEIGHTS, "nearest")

_COMP = "kahan_compensation"  # per-parameter optimizer state: the Kahan compensation
_COUNT = "rounding_step"  # per-parameter optimizer state: rounded updates so far
_SEED = "rounding_seed"  # a hyper-parameter of every parameter group
_OWN_STATE = (_COMP, _COUNT)  # state of this mode, which the inner optimizer never sees
_SD_KEY = "ampkit_pure_low_precision"  # the optimizer state_dict entry of this mode
_LOW_MANTISSA = 1 << 16  # the fp32 bits below bf16's mantissa
_HIGH_MASK = -_LOW_MANTISSA  # 0xFFFF0000 as an int32
_MIN_SLICE = 1 << 16  # the fewest elements rounded stochastically at once

# The element hash works on uint32 values held in int64 tensors. Its multipliers are
# below 2**31, so no product of a 32-bit value overflows int64. Signed overflow has no
# defined result in torch's kernels, so none may happen.
_U32 = 0xFFFFFFFF
_MIX1 = 0x7FEB352D
_MIX2 = 0x31848BAB


def _mix32(h: torch.Tensor, scratch: torch.Tensor) -> None:
    """A 32-bit integer finalizer (xor-shift-multiply), in place on ``h`` (``scratch``:
    a buffer like ``h``, so that no step allocates)."""
    for shift, multiplier in ((16, _MIX1), (15, _MIX2)):
        h.bitwise_xor_(torch.bitwise_right_shift(h, shift, out=scratch))
        h.mul_(multiplier).bitwise_and_(_U32)
    h.bitwise_xor_(torch.bitwise_right_shift(h, 16, out=scratch))


def _hash32(index: torch.Tensor, key: tuple[int, ...], large: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """32 pseudo-random bits per element (int64 in ``[0, 2**32)``), a function of the
    element positions ``index`` (int64, non-negative; overwritten) and ``key[:2]`` only:
    two rounds of mixing with a key word injected before each. ``large``: positions may
    reach 2**32, so their high bits enter the second round. Returns the bits and a
    scratch buffer like them."""
    high = index >> 32 if large else None
    h = index.bitwise_and_(_U32).bitwise_xor_(key[0])
    scratch = torch.empty_like(h)
    _mix32(h, scratch)
    if high is not None:
        h.bitwise_xor_(high)
    h.bitwise_xor_(key[1])
    _mix32(h, scratch)
    return h, scratch


def _key(*parts: Any, words: int = 2) -> tuple[int, ...]:
    """``words`` 32-bit keys derived from ``parts`` (ints and strings), identical on
    every process and platform."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=4 * words).digest()
    return tuple(int.from_bytes(digest[i:i + 4], "little") for i in range(0, 4 * words, 4))


def _round_with(value: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """``value`` (fp32) rounded to bf16 stochastically with ``noise`` (int32 in
    ``[0, 2**16)``): add the noise below bf16's mantissa, then truncate the low 16 bits.
    The bit pattern is sign-magnitude, so negative values round symmetrically."""
    noise = noise.add_(value.view(torch.int32)).bitwise_and_(_HIGH_MASK)
    rounded = noise.view(torch.float32)
    # NaN payloads in the low bits would truncate to inf; keep NaNs NaN.
    rounded = torch.where(value.isnan(), value, rounded)
    return rounded.to(torch.bfloat16)  # exact: the low 16 bits are zero


def stochastic_round(value: torch.Tensor, generator: torch.Generator | None = None
                     ) -> torch.Tensor:
    """``value`` (fp32) rounded to bfloat16 stochastically: up with probability equal to
    its distance from the bf16 number below (in units of the gap), so the expected
    result is ``value`` itself.

    The 16 random bits per element come from ``generator`` (torch's default generator
    when ``None``), which advances. The pure optimizer does not use this function: it
    draws its bits from a hash of its seed, the step and the element (see the module
    docstring). Values that bf16 holds exactly, infinities and NaNs come back unchanged.

    Raises:
        TypeError: ``value`` is not float32.

    Example:
        >>> import torch
        >>> from ampkit.master_weights_pure import stochastic_round
        >>> g = torch.Generator().manual_seed(0)
        >>> x = torch.full((10000,), 1.0 + 2 ** -10)  # a quarter of the way to 1 + 2**-7
        >>> r = stochastic_round(x, g)
        >>> r.dtype, sorted(r.unique().tolist()), round(r.float().mean().item(), 3)
        (torch.bfloat16, [1.0, 1.0078125], 1.001)
    """
    if value.dtype is not torch.float32:
        raise TypeError(f"stochastic_round takes a float32 tensor, got {value.dtype}")
    noise = torch.randint(0, _LOW_MANTISSA, value.shape, dtype=torch.int32,
                          device=value.device, generator=generator)
    return _round_with(value, noise)


# -- DTensor support (FSDP2) ----------------------------------------------------------------

@functools.cache
def _dtensor_class() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a build without torch.distributed
        return None
    return DTensor


def _is_dtensor(t: torch.Tensor) -> bool:
    cls = _dtensor_class()
    return cls is not None and isinstance(t, cls)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding ``t``'s elements on this process: ``t`` itself, or a DTensor's
    local shard (its own storage: writing into it writes into the DTensor)."""
    if _is_dtensor(t):
        with torch.no_grad():
            return t.to_local()  # type: ignore[attr-defined]  # a DTensor
    return t


class _Positions:
    """Where the elements of a (local) tensor sit in the whole parameter, for the hash.
    ``index(start, stop)`` gives the row-major positions of local flat elements
    ``start:stop``; ``tag`` is what else enters the key (the mesh coordinates of a shard
    whose positions are local ones)."""

    __slots__ = ("block_start", "global_shape", "large", "local_shape", "offset", "tag")

    def __init__(self, t: torch.Tensor) -> None:
        local = _local(t)
        self.local_shape = tuple(local.shape)
        self.global_shape = tuple(t.shape)
        self.offset: tuple[int, ...] | None = None
        self.block_start: int | None = 0  # the local elements are one run of positions
        self.tag: tuple[int, ...] = ()
        self.large = math.prod(self.global_shape) > _U32
        if local is t:
            return
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        dt: Any = t  # a DTensor
        placements = tuple(dt.placements)
        shape, offset = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh,
                                                              placements)
        if (all(type(pl) in (Shard, Replicate) for pl in placements)
                and tuple(shape) == self.local_shape):
            self.offset = tuple(offset)
            if self.local_shape[1:] == self.global_shape[1:]:  # FSDP2's Shard(0)
                self.block_start = offset[0] * math.prod(self.global_shape[1:]) \
                    if self.global_shape else 0
            else:
                self.block_start = None
        else:  # local positions; the shard's coordinates tell shards apart
            coordinate = dt.device_mesh.get_coordinate() or []
            self.tag = tuple(c for c, pl in zip(coordinate, placements)
                             if not isinstance(pl, Replicate))

    def index(self, start: int, stop: int, device: torch.device) -> torch.Tensor:
        if self.block_start is not None:
            return torch.arange(self.block_start + start, self.block_start + stop,
                                dtype=torch.int64, device=device)
        assert self.offset is not None
        rest = torch.arange(start, stop, dtype=torch.int64, device=device)
        out = torch.zeros_like(rest)
        stride = 1
        for dim in range(len(self.local_shape) - 1, -1, -1):
            size = self.local_shape[dim]
            coord = rest % size if dim else rest
            out.add_((coord + self.offset[dim]) * stride)
            if dim:
                rest = rest // size
            stride *= self.global_shape[dim]
        return out


def _round_stochastic_into(jobs: list[tuple[torch.Tensor, torch.Tensor]],
                           positions: _Positions, key_parts: tuple[Any, ...],
                           slice_elements: int) -> None:
    """Round fp32 local tensors stochastically into bf16 local tensors of the same shape
    (``jobs``: ``(out, value)`` pairs, all shaped like the parameter), with the bits of
    ``key_parts`` and the elements' positions. Each element's hash gives 32 bits: the
    first job takes the high 16, the second the low 16; every further pair gets 32 new
    bits from one more mixing round of the last ones with another key word.
    ``slice_elements`` at a time (the hash's temporaries take about 30 bytes each)."""
    key = _key(*key_parts, *positions.tag, words=1 + (len(jobs) + 1) // 2)
    work = []
    for out, value in jobs:
        flat = value.contiguous().view(-1)  # row-major: flat index i is position i
        direct = out.is_contiguous()
        target = out.view(-1) if direct else torch.empty(
            flat.numel(), dtype=torch.bfloat16, device=flat.device)
        work.append((out, flat, target, direct))
    n = work[0][1].numel()
    device = work[0][1].device
    for start in range(0, n, slice_elements):
        stop = min(n, start + slice_elements)
        h, scratch = _hash32(positions.index(start, stop, device), key, positions.large)
        for j, (_, flat, target, _) in enumerate(work):
            if j % 2 == 0 and j:
                _mix32(h.bitwise_xor_(key[1 + j // 2]), scratch)
            if j % 2 == 0:
                noise = torch.bitwise_right_shift(h, 16, out=scratch)
            else:
                noise = torch.bitwise_and(h, 0xFFFF, out=scratch)
            target[start:stop].copy_(_round_with(flat[start:stop], noise.to(torch.int32)))
    for out, _, target, direct in work:
        if not direct:
            out.copy_(target.view(out.shape))


def _check_rounding(rounding: Any) -> str:
    if not isinstance(rounding, str) or rounding not in PURE_ROUNDINGS:
        raise ValueError(f"rounding must be one of {list(PURE_ROUNDINGS)}, got {rounding!r}")
    return rounding


def _check_no_float16(params: Any) -> None:
    for p in params:
        if isinstance(p, torch.Tensor) and p.dtype is torch.float16:
            raise ValueError("pure low-precision training takes bfloat16 "
                             "parameters; float16 has too little range for "
                             "optimizer state and updates: use fp32 parameters "
                             "(master_weights=True) for float16")


def _needs_closure(optimizer: Any) -> bool:
    """Whether the optimizer's step requires a closure (LBFGS): such a step evaluates
    the closure again at weights it tries."""
    try:
        closure = inspect.signature(_inner_step(type(optimizer))).parameters.get("closure")
    except (TypeError, ValueError):  # no signature to read: assume the common case
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


def _inner_step(cls: type) -> Callable[..., Any]:
    """The step of the optimizer class a pure class was made from (or ``cls``'s own),
    without torch's wrapper that runs the step hooks: the pure step runs them once
    around all chunks, with every parameter group whole, instead of once per chunk."""
    if issubclass(cls, PureLowPrecisionOptimizer):
        cls = cls.__bases__[1]
    step = cls.step  # type: ignore[attr-defined]  # an optimizer class
    if getattr(step, "hooked", False) and hasattr(step, "__wrapped__"):
        step = step.__wrapped__
    return step


def _check_seed(seed: Any, name: str) -> None:
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise TypeError(f"{name} must be an int or None, got {seed!r}")


def check_pure_optimizer(optimizer: Any, rounding: str = "stochastic", *,
                         seed: Any = None, seed_name: str = "seed") -> None:
    """Raise the error :class:`PureLowPrecisionOptimizer` would raise for these
    arguments, without changing anything (``ampkit.initialize`` checks every optimizer
    before converting the models; ``seed_name`` is the argument's name there).

    Raises:
        TypeError: ``optimizer`` is not an optimizer; ``seed`` not an int.
        ValueError: an unknown ``rounding``, a float16 parameter, or an optimizer
            already pure with another rounding.

    Example:
        >>> import torch
        >>> from ampkit.master_weights_pure import check_pure_optimizer
        >>> w = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
        >>> check_pure_optimizer(torch.optim.SGD([w], lr=0.1), "kahan")  # fine: None
        >>> check_pure_optimizer(torch.optim.SGD([w], lr=0.1), "kahan", seed=0.5)
        Traceback (most recent call last):
        ...
        TypeError: seed must be an int or None, got 0.5
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    rounding = _check_rounding(rounding)
    _check_seed(seed, seed_name)
    existing = pure_rounding(optimizer)
    if existing is not None:
        if existing != rounding:
            raise ValueError(f"this optimizer already trains in pure low precision with "
                             f"rounding={existing!r}, not {rounding!r}")
        return
    for group in optimizer.param_groups:
        _check_no_float16(group["params"])


class _Pure:
    """What a pure optimizer keeps besides torch's own ``param_groups`` and ``state``:
    its rounding and chunk budget (pickled with it), and, with Kahan, each parameter's
    :func:`_fingerprint` as the last step left it (not pickled: a copy's parameters are
    new tensors, and a compensation without a record is taken as it is)."""

    __slots__ = ("chunk_bytes", "rounding", "slice_elements", "versions")

    def __init__(self, rounding: str, chunk_bytes: int | None) -> None:
        self.rounding = rounding
        self.chunk_bytes = chunk_bytes
        self.versions: WeakIdKeyDictionary = WeakIdKeyDictionary()
        # elements rounded stochastically at once in the current step: a share of the
        # chunk budget, so the hash's temporaries stay within a fraction of a chunk
        self.slice_elements = _MIN_SLICE

    def __getstate__(self) -> dict[str, Any]:
        return {"rounding": self.rounding, "chunk_bytes": self.chunk_bytes}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["rounding"], state["chunk_bytes"])  # type: ignore[misc]


def _chunks(params: list[torch.Tensor], budget: int) -> Iterator[list[torch.Tensor]]:
    """Consecutive runs of ``params`` whose fp32 working copies (weight, gradient and
    up to two moments: 16 bytes per element) stay within ``budget`` bytes (a parameter
    larger than the budget is a chunk of its own)."""
    chunk: list[torch.Tensor] = []
    used = 0
    for p in params:
        size = 16 * p.numel()
        if chunk and used + size > budget:
            yield chunk
            chunk, used = [], 0
        chunk.append(p)
        used += size
    if chunk:
        yield chunk


def _stored_low(key: str, value: Any, param: torch.Tensor) -> bool:
    """Whether an optimizer state entry of a bf16 parameter is stored in bf16:
    per-element state (moments, momentum: the parameter's shape). The step count and
    scalar state that follows from it and the hyper-parameters (NAdam's ``mu_product``,
    ASGD's ``eta``) stay fp32 and exact. State of other shapes (LBFGS's flat direction
    and gradient over all parameters) stays as the optimizer made it: LBFGS's curvature
    pairs are differences of such vectors, which bf16 would swamp. This mode's own
    entries are kept their own way."""
    return (key != "step" and key not in _OWN_STATE and isinstance(value, torch.Tensor)
            and value.is_floating_point() and value.dim() > 0
            and value.shape == param.shape)


def _as_saved(value: Any, device: torch.device) -> Any:
    """A checkpoint's state entry as it was saved (tensors copied onto ``device``, in
    their saved dtype; also inside lists), where torch would cast it to the parameter's
    dtype."""
    if isinstance(value, torch.Tensor):
        return value.to(device=device, copy=True)
    if isinstance(value, list | tuple):
        return type(value)(_as_saved(v, device) for v in value)
    return value


def _working_copy(value: Any) -> Any:
    """What the inner optimizer sees of a state entry: an fp32 copy of a bf16 tensor, a
    copy of any other tensor or list (so a step that fails changes nothing), else the
    value itself."""
    if isinstance(value, torch.Tensor):
        if value.dtype is torch.bfloat16:
            return value.to(torch.float32, copy=True)
        return value.clone()
    if isinstance(value, list):
        return list(value)
    return value


def _stand_in(opt: Any, p: torch.Tensor) -> nn.Parameter:
    """An fp32 working parameter for the bf16 parameter ``p``: its weight (plus the Kahan
    compensation), an fp32 copy of its gradient, and fp32 copies of its state under the
    working parameter's key in ``opt.state``."""
    pure: _Pure = opt._ampkit_pure
    state = opt.state
    own = state.get(p, {})
    work = p.detach().to(torch.float32, copy=True)
    comp = own.get(_COMP)
    if comp is not None:
        seen = pure.versions.get(p)
        if pure.rounding != "kahan" or (seen is not None and seen != _fingerprint(p)):
            # Changed since the last step (a load, an edit): the compensation belonged
            # to the weight that step left.
            del own[_COMP]
        else:
            work.add_(comp)
    w = nn.Parameter(work)
    if p.grad is not None:
        w.grad = p.grad.to(torch.float32, copy=True)
    state[w] = {k: _working_copy(v) for k, v in own.items() if k not in _OWN_STATE}
    return w


def _round_back(opt: Any, p: torch.Tensor, w: nn.Parameter, seed: int, index: int) -> None:
    """Round the working parameter ``w`` and its state back into ``p``'s own storage
    and ``p``'s state (in place where the bf16 tensors exist)."""
    pure: _Pure = opt._ampkit_pure
    state = opt.state
    results = state.pop(w, None)
    own = state[p]
    count = own.get(_COUNT, 0)
    work = _local(w.detach())
    target = _local(p.detach())
    jobs: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # stochastic roundings
    if pure.rounding == "stochastic":
        jobs.append(("", target, work))
    elif pure.rounding == "nearest":
        target.copy_(work)
    else:
        new = work.to(torch.bfloat16)
        # What rounding lost, truncated toward zero (not rounded) to bf16: it then stays
        # within half an ulp of the weight, so weight + compensation rounds back to the
        # very same weight.
        lost = work.sub_(new).view(torch.int32).bitwise_and_(_HIGH_MASK).view(torch.float32)
        comp = own.get(_COMP)
        if comp is None or comp.shape != p.shape or comp.dtype is not torch.bfloat16:
            comp = own[_COMP] = torch.zeros_like(p.detach())
        _local(comp).copy_(lost)
        target.copy_(new)
    if results is not None:
        for k, v in results.items():
            if _stored_low(k, v, p) and v.dtype is torch.float32:
                old = own.get(k)
                if (not isinstance(old, torch.Tensor) or old.dtype is not torch.bfloat16
                        or old.shape != v.shape or type(old) is not type(v)):
                    old = torch.empty_like(v, dtype=torch.bfloat16)
                if pure.rounding == "nearest":
                    _local(old).copy_(_local(v))
                else:
                    jobs.append((k, _local(old), _local(v)))
                own[k] = old
            else:
                own[k] = v
        for k in [k for k in own if k not in results and k not in _OWN_STATE]:
            del own[k]
    if jobs:  # one hash for all (they have the parameter's shape, see _stored_low)
        _round_stochastic_into([(out, value) for _, out, value in jobs], _Positions(p),
                               (seed, index, count, *(name for name, _, _ in jobs)),
                               pure.slice_elements)
    own[_COUNT] = count + 1
    if pure.rounding == "kahan":
        pure.versions[p] = _fingerprint(p)


def _fingerprint(p: torch.Tensor) -> tuple[int, int]:
    """What changes when ``p`` is changed by anything but the step: its version counter
    (bumped by in-place ops such as ``load_state_dict``'s ``copy_``) and its storage
    (``p.data = ...``). In-place edits through ``p.data`` change neither."""
    return p._version, _local(p.detach()).data_ptr()


@functools.cache
def _pure_class(base: type) -> type:
    """``base`` with :class:`PureLowPrecisionOptimizer`'s methods in front
    (``PureLowPrecisionAdamW``, ...), one per optimizer class. Pickle and
    ``copy.deepcopy`` rebuild it from ``base`` (see ``__reduce_ex__``)."""
    return type(f"PureLowPrecision{base.__name__}", (PureLowPrecisionOptimizer, base),
                {"__module__": __name__})


def _rebuild_pure(base: type) -> Any:
    """An empty pure ``base`` optimizer; copy/pickle then calls ``__setstate__``."""
    return object.__new__(_pure_class(base))


class PureLowPrecisionOptimizer:
    """Make a torch optimizer train bf16 parameters with bf16 state, in place.

    ``PureLowPrecisionOptimizer(opt, rounding, seed=...)`` returns ``opt`` itself, now
    also an instance of this class. Its class becomes a subclass of both, so
    ``isinstance(opt, torch.optim.AdamW)`` holds. LR schedulers (made before or after),
    ``state_dict`` and every other reference to ``opt`` keep working, and ``opt`` pickles
    by naming its original class. ``param_groups`` keep the model's bf16 parameters, and
    ``state`` stays keyed by them, stored in bf16. See the module docstring for how a
    step rounds. Tested with AdamW (for-loop, foreach, fused), SGD with momentum, NAdam,
    ASGD and LBFGS. Any ``torch.optim`` optimizer whose state is per-parameter tensors
    works the same way.

    Args:
        optimizer: a ``torch.optim.Optimizer`` over bf16 (and possibly fp32)
            parameters.
        rounding: ``"stochastic"``, ``"kahan"`` or ``"nearest"`` (see
            :data:`PURE_ROUNDINGS`).
        seed: the stochastic rounding's seed, stored as the hyper-parameter
            ``"rounding_seed"`` of every parameter group (and of groups added later).
            ``None`` means 0. It is never drawn from torch's RNG: replicas must agree.
        chunk_bytes: the most fp32 working memory one chunk of a step may take.
            ``None``: a sixteenth of what the whole optimizer would take (about one
            byte per parameter on top of the 6-8 held). A parameter larger than the
            budget is a chunk of its own: its working copies (16 bytes per element)
            are the floor of the step's extra memory.

    ``add_param_group`` refuses float16 parameters too.

    Raises:
        TypeError: ``optimizer`` is not an optimizer, or ``seed`` or ``chunk_bytes``
            not an int.
        ValueError: an unknown ``rounding`` (the accepted ones are listed), a float16
            parameter, or an optimizer already made pure with another rounding.
        RuntimeError: ``optimizer.step`` was replaced on the instance by something
            other than an LR scheduler.

    Example:
        >>> import torch
        >>> from ampkit.master_weights_pure import PureLowPrecisionOptimizer
        >>> model = torch.nn.Linear(4, 2).to(torch.bfloat16)
        >>> opt = PureLowPrecisionOptimizer(torch.optim.AdamW(model.parameters()), "kahan",
        ...                                 seed=0)
        >>> model(torch.ones(1, 4, dtype=torch.bfloat16)).sum().backward()
        >>> opt.step()
        >>> sorted(opt.state[model.weight]), opt.state[model.weight]["exp_avg"].dtype
        (['exp_avg', 'exp_avg_sq', 'kahan_compensation', 'rounding_step', 'step'], \
torch.bfloat16)
    """

    _ampkit_pure: _Pure

    def __new__(cls, optimizer: torch.optim.Optimizer, rounding: str = "stochastic", *,
                seed: int | None = None, chunk_bytes: int | None = None) -> Any:
        check_pure_optimizer(optimizer, rounding, seed=seed)
        if chunk_bytes is not None and (not isinstance(chunk_bytes, int)
                                        or isinstance(chunk_bytes, bool) or chunk_bytes <= 0):
            raise TypeError(f"chunk_bytes must be a positive int or None, got "
                            f"{chunk_bytes!r}")
        if pure_rounding(optimizer) is not None:  # already pure, with this rounding
            return optimizer
        patched = optimizer.__dict__.get("step")
        if patched is not None and not getattr(patched, "_wrapped_by_lr_sched", False):
            raise RuntimeError("optimizer.step was replaced on this optimizer instance; "
                               "make the optimizer pure before patching its step")
        seed = 0 if seed is None else seed
        object.__setattr__(optimizer, "_ampkit_pure", _Pure(rounding, chunk_bytes))
        # Loss scalers hand fused optimizers found_inf and let them skip on the device;
        # here the rounding would still run. Make scalers unscale, check and skip the
        # call instead, so a skipped step changes nothing at all.
        optimizer._step_supports_amp_scaling = False  # type: ignore[attr-defined]
        optimizer.defaults[_SEED] = seed  # what add_param_group fills in
        for group in optimizer.param_groups:
            group[_SEED] = seed
        with torch.no_grad():  # state made before: store it in bf16 from now on
            for p, state in optimizer.state.items():
                if p.dtype is torch.bfloat16:
                    for k, v in state.items():
                        if _stored_low(k, v, p) and v.dtype is torch.float32:
                            state[k] = v.to(torch.bfloat16)
        optimizer.__class__ = _pure_class(type(optimizer))  # type: ignore[arg-type]
        if patched is not None:  # an LR scheduler's wrapper bound to the old class
            ref = weakref.ref(optimizer)

            def step(*args: Any, **kwargs: Any) -> Any:
                opt = ref()
                assert opt is not None
                opt._opt_called = True  # type: ignore[attr-defined]  # the scheduler's flag
                return type(opt).step(opt, *args, **kwargs)

            step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
            optimizer.step = step  # type: ignore[method-assign]
        return optimizer

    def __init__(self, optimizer: torch.optim.Optimizer, rounding: str = "stochastic", *,
                 seed: int | None = None, chunk_bytes: int | None = None) -> None:
        # Everything happened in __new__, which returns the optimizer itself.
        pass

    # -- parameter groups and copies ---------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's ``add_param_group``, refusing float16 parameters; the group's
        ``rounding_seed`` defaults to the optimizer's.

        Example:
            >>> import torch
            >>> from ampkit.master_weights_pure import PureLowPrecisionOptimizer
            >>> w = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
            >>> opt = PureLowPrecisionOptimizer(torch.optim.SGD([w], lr=0.1), "kahan",
            ...                                 seed=5)
            >>> opt.add_param_group({"params": [torch.nn.Parameter(
            ...     torch.ones(2, dtype=torch.bfloat16))], "lr": 0.01})
            >>> [g["rounding_seed"] for g in opt.param_groups]
            [5, 5]
        """
        if isinstance(param_group, dict):
            params = param_group.get("params")
            if params is not None and not isinstance(params, torch.Tensor | set):
                params = list(params)  # a generator is read once: hand torch the list
                param_group = {**param_group, "params": params}
            _check_no_float16([params] if isinstance(params, torch.Tensor)
                              else params or [])
            _check_seed(param_group.get(_SEED), _SEED)
        super().add_param_group(param_group)  # type: ignore[misc]

    def __reduce_ex__(self, protocol: Any) -> Any:
        # copy.deepcopy and pickle: rebuild through the optimizer's own class (the pure
        # subclass is made at run time, so pickle cannot look it up by name).
        base = type(self).__bases__[1]
        return _rebuild_pure, (base,), self.__getstate__()

    def __getstate__(self) -> dict[str, Any]:
        # torch's optimizer pickles only defaults, state and param_groups (the seed is
        # in the last two, the counts in state); a copy must also round the same way.
        state = super().__getstate__()  # type: ignore[misc]
        state["_ampkit_pure"] = self._ampkit_pure
        state["_step_supports_amp_scaling"] = False
        return state

    # -- one step ---------------------------------------------------------------------

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """Run the optimizer's own step on fp32 working parameters, chunk by chunk, and
        round the results back into the bf16 parameters and state (see the module
        docstring).

        ``kwargs`` go to the optimizer's own step. ``found_inf`` != 0 (from a loss
        scaler) skips the step and changes nothing. A closure is called once, before
        the update, unless the optimizer's step requires one (LBFGS), which then
        evaluates it at the weights it tries.

        Example:
            >>> import torch
            >>> from ampkit.master_weights_pure import PureLowPrecisionOptimizer
            >>> w = torch.nn.Parameter(torch.ones(1, dtype=torch.bfloat16))
            >>> opt = PureLowPrecisionOptimizer(torch.optim.SGD([w], lr=1e-3), "kahan")
            >>> for _ in range(3):
            ...     w.grad = torch.ones_like(w)
            ...     opt.step()
            >>> comp = opt.state[w]["kahan_compensation"]
            >>> w.item(), round(w.item() + comp.item(), 4)  # weight + what it lost: 0.997
            (0.99609375, 0.997)
        """
        inner = _inner_step(type(self))
        loss = None
        if closure is not None and not _needs_closure(self):
            with torch.enable_grad():
                loss = closure()
            closure = None
        found_inf = kwargs.get("found_inf", getattr(self, "found_inf", None))
        if isinstance(found_inf, torch.Tensor) and bool(found_inf.item() != 0):
            return loss  # an overflow: nothing may change
        groups = self.param_groups  # type: ignore[attr-defined]
        # The lists themselves are refilled in place: optimizers may hold them (LBFGS).
        lists = [g["params"] for g in groups]
        saved = [list(ps) for ps in lists]
        # each parameter's (index in the optimizer, its group's seed): the hash's key
        default = self.defaults.get(_SEED, 0)  # type: ignore[attr-defined]
        where = {id(p): (i, seed) for i, (p, seed) in enumerate(
            (p, g.get(_SEED, default)) for g, ps in zip(groups, saved) for p in ps)}
        pure = self._ampkit_pure
        budget = pure.chunk_bytes
        if budget is None:
            budget = sum(16 * p.numel() for ps in saved for p in ps) // 16
        pure.slice_elements = max(_MIN_SLICE, budget // 64)
        try:
            if closure is not None:  # LBFGS: one pass over everything, closure re-run
                return self._step_all(inner, closure, lists, saved, where, kwargs)
            for i in range(len(groups)):
                active = [p for p in saved[i] if p.grad is not None]
                for chunk in _chunks(active, budget):
                    pairs = self._stand_ins(chunk)
                    try:
                        working = [w for _, w in pairs]
                        for j, ps in enumerate(lists):
                            ps[:] = working if j == i else []
                        inner(self, **kwargs)
                        self._round_all(pairs, where)
                    finally:
                        self._discard(pairs)
        finally:
            for ps, original in zip(lists, saved):
                ps[:] = original
        return loss

    def _stand_ins(self, params: list[torch.Tensor]) -> list[tuple[torch.Tensor, Any]]:
        """``(parameter, what the inner step sees)``: a working fp32 parameter for each
        bf16 one, the parameter itself for any other."""
        with torch.no_grad():
            return [(p, _stand_in(self, p) if p.dtype is torch.bfloat16 else p)
                    for p in params]

    def _round_all(self, pairs: list[tuple[torch.Tensor, Any]],
                   where: dict[int, tuple[int, int]]) -> None:
        with torch.no_grad():
            for p, w in pairs:
                if w is not p:
                    index, seed = where[id(p)]
                    _round_back(self, p, w, seed, index)

    def _discard(self, pairs: list[tuple[torch.Tensor, Any]]) -> None:
        for p, w in pairs:
            if w is not p:
                self.state.pop(w, None)  # type: ignore[attr-defined]

    def _step_all(self, inner: Callable[..., Any], closure: Callable[[], Any],
                  lists: list[list[Any]], saved: list[list[Any]],
                  where: dict[int, tuple[int, int]], kwargs: dict[str, Any]) -> Any:
        """A step that evaluates ``closure`` at weights it tries (LBFGS): every
        parameter at once. Before each evaluation the working weights are rounded to
        nearest into the model's parameters, and the groups hold the model's parameters
        while the closure runs (its ``zero_grad`` must clear their gradients); after it
        the model's gradients are handed to the working parameters."""
        pairs = self._stand_ins([p for ps in saved for p in ps])
        low = [(p, w) for p, w in pairs if w is not p]
        working = iter(w for _, w in pairs)
        stand_ins = [[next(working) for _ in original] for original in saved]

        def swap(to: list[list[Any]]) -> None:
            for ps, new in zip(lists, to):
                ps[:] = new

        def evaluate() -> Any:
            with torch.no_grad():
                for p, w in low:
                    _local(p.detach()).copy_(_local(w.detach()))
            swap(saved)  # the closure's zero_grad() must reach the model's gradients
            try:
                loss = closure()
            finally:
                swap(stand_ins)
            with torch.no_grad():
                for p, w in low:
                    w.grad = None if p.grad is None else p.grad.to(torch.float32,
                                                                   copy=True)
            return loss

        try:
            swap(stand_ins)
            loss = inner(self, evaluate, **kwargs)
            self._round_all(pairs, where)
        finally:
            self._discard(pairs)
        return loss

    # -- checkpoints ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """torch's ``state_dict`` (with each parameter's ``rounding_step`` and, with
        Kahan, ``kahan_compensation``; each group's ``rounding_seed``) plus this mode's
        rounding, which ``load_state_dict`` checks.

        Example:
            >>> import torch
            >>> from ampkit.master_weights_pure import PureLowPrecisionOptimizer
            >>> w = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
            >>> opt = PureLowPrecisionOptimizer(torch.optim.SGD([w], lr=0.1), seed=7)
            >>> sd = opt.state_dict()
            >>> sd["param_groups"][0]["rounding_seed"], sd["ampkit_pure_low_precision"]
            (7, {'rounding': 'stochastic'})
        """
        out = super().state_dict()  # type: ignore[misc]
        out[_SD_KEY] = {"rounding": self._ampkit_pure.rounding}
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load torch's ``state_dict``, keeping scalar state in fp32 and taking the
        groups' ``rounding_seed`` from it, so a resumed run continues bit for bit. A
        Kahan compensation is kept only by a Kahan optimizer, from a checkpoint that is
        not marked as another rounding's (Distributed Checkpoint drops the mark).

        Raises:
            ValueError: the checkpoint was saved with another rounding.

        Example:
            >>> import torch
            >>> from ampkit.master_weights_pure import PureLowPrecisionOptimizer
            >>> w = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
            >>> opt = PureLowPrecisionOptimizer(torch.optim.SGD([w], lr=0.1), seed=7)
            >>> sd = opt.state_dict()
            >>> other = PureLowPrecisionOptimizer(torch.optim.SGD([w], lr=0.1), seed=1)
            >>> other.load_state_dict(sd); other.param_groups[0]["rounding_seed"]
            7
        """
        state_dict = dict(state_dict)
        extra = state_dict.pop(_SD_KEY, None)
        pure = self._ampkit_pure
        saved_rounding = None if extra is None else extra.get("rounding")
        if saved_rounding is not None and saved_rounding != pure.rounding:
            raise ValueError(f"the checkpoint was saved with rounding="
                             f"{saved_rounding!r}; this optimizer uses "
                             f"rounding={pure.rounding!r}")
        if pure.rounding != "kahan" and any(
                isinstance(s, dict) and _COMP in s
                for s in state_dict.get("state", {}).values()):
            # Without Kahan a compensation would never be updated nor used: drop it.
            state_dict["state"] = {k: {n: v for n, v in s.items() if n != _COMP}
                                   for k, s in state_dict["state"].items()}
        super().load_state_dict(state_dict)  # type: ignore[misc]
        pure.versions = WeakIdKeyDictionary()  # the loaded compensations count as saved
        seed = self.defaults.get(_SEED, 0)  # type: ignore[attr-defined]
        for group in self.param_groups:  # type: ignore[attr-defined]
            group.setdefault(_SEED, seed)  # a checkpoint of a plain optimizer has none
        # torch casts every floating state entry to the parameter's dtype; here only
        # per-element state is bf16 (see _stored_low): take the rest from the
        # checkpoint again, as saved (copied: never the checkpoint's own tensors).
        saved = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]  # type: ignore[attr-defined]
        for key, p in zip(saved, params):
            if p.dtype is not torch.bfloat16 or p not in self.state:  # type: ignore[attr-defined]
                continue
            for k, v in state_dict["state"].get(key, {}).items():
                if k not in ("step", *_OWN_STATE) and not _stored_low(k, v, p):
                    self.state[p][k] = _as_saved(v, p.device)  # type: ignore[attr-defined]


# The step hooks (and the profiler's record) run once around the whole pure step, as
# torch's wrapper runs them around any optimizer's step; marked hooked so that
# Optimizer.__setstate__ (copy.deepcopy, unpickling) does not wrap it again.
PureLowPrecisionOptimizer.step = torch.optim.Optimizer.profile_hook_step(  # type: ignore[method-assign]
    PureLowPrecisionOptimizer.step)
PureLowPrecisionOptimizer.step.hooked = True  # type: ignore[attr-defined]
PureLowPrecisionOptimizer._step_supports_amp_scaling = False  # type: ignore[attr-defined]


def pure_rounding(optimizer: torch.optim.Optimizer) -> str | None:
    """The rounding ``optimizer`` applies updates with, or ``None`` when it is not a
    :class:`PureLowPrecisionOptimizer`.

    Example:
        >>> import torch
        >>> from ampkit.master_weights_pure import PureLowPrecisionOptimizer, pure_rounding
        >>> w = torch.nn.Parameter(torch.ones(1, dtype=torch.bfloat16))
        >>> opt = torch.optim.SGD([w], lr=0.1)
        >>> pure_rounding(opt), pure_rounding(PureLowPrecisionOptimizer(opt, "kahan"))
        (None, 'kahan')
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    pure = optimizer.__dict__.get("_ampkit_pure")
    return None if pure is None else pure.rounding


class _PureRecord:
    """What ``initialize`` recorded about a parameter it made pure: the rounding, the
    seed, and where the parameter sits (its module, weakly, and its name there), so
    that a step can tell whether the model still holds it."""

    __slots__ = ("module", "name", "qualified", "rounding", "seed")

    def __init__(self, rounding: str, seed: int, module: nn.Module, name: str,
                 qualified: str) -> None:
        self.rounding = rounding
        self.seed = seed
        self.module = weakref.ref(module)
        self.name = name  # in its module
        self.qualified = qualified  # in the model

    def replaced_by_shard(self, p: torch.Tensor) -> bool:
        """The model now holds a sharded parameter where ``p`` was (FSDP2's
        ``fully_shard`` replaced it)."""
        module = self.module()
        now = None if module is None else module._parameters.get(self.name)
        return now is not None and now is not p and _is_dtensor(now) and not _is_dtensor(p)


# parameters of models initialize() made pure -> their _PureRecord: an optimizer built
# over them later must be pure too, and must step what the model holds (see
# _check_pure_at_first_step); models themselves -> (rounding, seed)
_PURE_PARAMS: WeakIdKeyDictionary = WeakIdKeyDictionary()
_PURE_MODELS: WeakIdKeyDictionary = WeakIdKeyDictionary()
_PURE_CHECKED: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_pure_hook: Any = None


def _check_pure_at_first_step(optimizer: torch.optim.Optimizer, args: Any,
                              kwargs: Any) -> None:
    # A global optimizer step pre-hook, deciding once per optimizer, at its first step
    # (before anything changed). Two wrong orders would train wrongly with no error:
    # an optimizer built before fully_shard steps tensors the model no longer uses
    # (nothing trains), and a plain optimizer over parameters of a model trained purely
    # rounds every update to nearest (small updates stall).
    if optimizer in _PURE_CHECKED:
        return
    name = optimizer_class_name(optimizer)
    plain = "_ampkit_pure" not in optimizer.__dict__
    for group in optimizer.param_groups:
        for p in group["params"]:
            found: _PureRecord | None = _PURE_PARAMS.get(p)
            if found is not None and found.replaced_by_shard(p):
                raise RuntimeError(
                    f"this {name} steps parameter {found.qualified!r} as it was before "
                    f"fully_shard replaced it with a sharded DTensor parameter (the "
                    f"optimizer was built first), so its steps would change nothing the "
                    f"model uses. Build the optimizer after sharding, with the one "
                    f"call that makes it train as ampkit.initialize set the model up: "
                    f"optimizer = ampkit.fsdp.prepare_optimizer(model, "
                    f"torch.optim.{name}(model.parameters(), ...))")
    if plain:
        _check_not_plain(optimizer, name)
    _PURE_CHECKED.add(optimizer)


def _check_not_plain(optimizer: torch.optim.Optimizer, name: str) -> None:
    # What pure models hold now, beside what initialize recorded: sharding (torch's
    # fully_shard too) replaces their parameters with new ones.
    held = {id(p): settings for model, settings in list(_PURE_MODELS.items())
            for p in model.parameters() if p.dtype is torch.bfloat16}
    for group in optimizer.param_groups:
        for p in group["params"]:
            found = _PURE_PARAMS.get(p)
            settings = (found.rounding, found.seed) if found is not None else held.get(id(p))
            if settings is None:
                continue
            rounding, seed = settings
            if _is_dtensor(p):
                fix = (f"Under FSDP2 build it with the one call that reads the rounding "
                       f"and seed from the model: optimizer = ampkit.fsdp."
                       f"prepare_optimizer(model, torch.optim.{name}(model.parameters(), "
                       f"...))")
            else:
                fix = (f"Make it pure before its first step: pass it to "
                       f"ampkit.initialize(model, optimizer, ...) with the same settings, "
                       f"or optimizer = ampkit.master_weights_pure."
                       f"PureLowPrecisionOptimizer(optimizer, {rounding!r}, seed={seed})")
            raise RuntimeError(
                f"this {name} steps bf16 parameters of a model that ampkit.initialize "
                f"set up with master_weights={rounding!r}, but it is a plain "
                f"optimizer: its steps would round every update to nearest, and small "
                f"updates would be lost. {fix}")


def optimizer_class_name(optimizer: torch.optim.Optimizer) -> str:
    """The name of the torch optimizer class ``optimizer`` was built as (a pure one's
    ``PureLowPrecisionAdamW`` is ``"AdamW"``), for messages that show its constructor.

    Example:
        >>> import torch
        >>> from ampkit.master_weights_pure import (PureLowPrecisionOptimizer,
        ...                                         optimizer_class_name)
        >>> w = torch.nn.Parameter(torch.ones(1, dtype=torch.bfloat16))
        >>> optimizer_class_name(PureLowPrecisionOptimizer(torch.optim.AdamW([w])))
        'AdamW'
    """
    cls = type(optimizer)
    if issubclass(cls, PureLowPrecisionOptimizer):
        cls = cls.__bases__[1]
    return cls.__name__


def mark_pure_models(models: list[nn.Module], rounding: str, seed: int | None) -> None:
    """Record that ``models`` train purely with ``rounding`` and ``seed``: an optimizer
    built over their parameters later, and never made pure, raises ``RuntimeError``
    at its first step instead of training with updates rounded to nearest; so does an
    optimizer over parameters that FSDP2's ``fully_shard`` has since replaced.
    :func:`pure_settings` reads the record back (``ampkit.fsdp`` does).

    Example:
        >>> import torch
        >>> from ampkit.master_weights_pure import mark_pure_models
        >>> model = torch.nn.Linear(2, 2).to(torch.bfloat16)
        >>> mark_pure_models([model], "kahan", 0)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> model(torch.ones(1, 2, dtype=torch.bfloat16)).sum().backward()
        >>> opt.step()
        Traceback (most recent call last):
        ...
        RuntimeError: this SGD steps bf16 parameters of a model that ...
    """
    global _pure_hook
    rounding = _check_rounding(rounding)
    _check_seed(seed, "seed")
    seed = 0 if seed is None else seed
    for model in models:
        _PURE_MODELS[model] = (rounding, seed)
        for prefix, module in model.named_modules():
            for name, p in module._parameters.items():
                if p is not None and p.dtype is torch.bfloat16:
                    _PURE_PARAMS[p] = _PureRecord(rounding, seed, module, name,
                                                  f"{prefix}.{name}" if prefix else name)
    if _pure_hook is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _pure_hook = register_optimizer_step_pre_hook(_check_pure_at_first_step)


def pure_settings(model: nn.Module) -> tuple[str, int] | None:
    """``(rounding, seed)`` of a model that ``ampkit.initialize`` set up for pure
    low-precision training (``master_weights="stochastic"`` or ``"kahan"``), else
    ``None``: what an optimizer built for it later must use.

    Example:
        >>> import torch
        >>> import ampkit
        >>> from ampkit.master_weights_pure import pure_settings
        >>> model = ampkit.initialize(torch.nn.Linear(2, 2), level="O2", dtype="bfloat16",
        ...                           master_weights="kahan", rounding_seed=4)
        >>> pure_settings(model), pure_settings(torch.nn.Linear(2, 2))
        (('kahan', 4), None)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    settings: tuple[str, int] | None = _PURE_MODELS.get(model)
    return settings


def pure_low_precision(models: nn.Module | list[nn.Module] | tuple[nn.Module, ...],
                       optimizer: torch.optim.Optimizer, rounding: str, *,
                       seed: int | None = None) -> Any:
    """Make ``optimizer`` pure (:class:`PureLowPrecisionOptimizer`); what
    ``ampkit.initialize(..., master_weights="stochastic" | "kahan")`` does. The models
    need nothing: their ``state_dict`` holds their bf16 parameters, and the Kahan
    compensation is optimizer state. Calling it again on the same optimizer changes
    nothing.

    Raises:
        TypeError: ``models`` is not a module or a list/tuple of modules (and the
            errors of :class:`PureLowPrecisionOptimizer`).

    Example:
        >>> import torch
        >>> import ampkit
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        >>> model, opt = ampkit.initialize(model, opt, level="O2", dtype=torch.bfloat16,
        ...                                master_weights="stochastic", rounding_seed=0)
        >>> model[0].weight.dtype, type(opt).__name__
        (torch.bfloat16, 'PureLowPrecisionAdamW')
        >>> model(torch.rand(2, 4)).sum().backward(); opt.step()
        >>> opt.state[model[0].weight]["exp_avg"].dtype
        torch.bfloat16
    """
    listed = [models] if isinstance(models, nn.Module) else models
    if not isinstance(listed, list | tuple) or not all(
            isinstance(m, nn.Module) for m in listed):
        raise TypeError(f"models must be an nn.Module or a list/tuple of them, got "
                        f"{type(models).__name__}")
    rounding = _check_rounding(rounding)
    if pure_rounding(optimizer) == rounding:
        return optimizer
    return PureLowPrecisionOptimizer(optimizer, rounding, seed=seed)
