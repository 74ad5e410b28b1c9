"""The rounding primitives of pure low-precision training: stochastic rounding of fp32
values to bf16 over many tensors at once, with random bits from generators reseeded per
block of each parameter from a hash of the optimizer's seed, the parameter, its step
and the block (replicas and resumed runs draw the same bits, whatever the chunking; see
"Random bits" in :mod:`ampkit.pure`), Kahan-compensated rounding, and the element
positions of a DTensor shard within its whole parameter.

Example:
    >>> import torch
    >>> from ampkit.pure.rounding import Positions, round_stochastic
    >>> value = torch.full((4,), 1.0 + 2 ** -9)  # half-way between two bf16 numbers
    >>> out = torch.empty(4, dtype=torch.bfloat16)
    >>> round_stochastic([(Positions(value), (0, 0, 0), [out], [value])])
    >>> sorted(set(out.tolist())) <= [1.0, 1.0078125]
    True
"""

from __future__ import annotations

import functools
import hashlib
import math
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeGuard

import torch

from ampkit import torch_internals

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["BLOCK", "Positions", "Scratch", "draw_noise", "is_dtensor", "local_tensor",
           "nearest_bits",
           "round_kahan", "round_kahan_foreach", "round_stochastic", "stochastic_round"]

_LOW_MANTISSA = 1 << 16  # the fp32 bits below bf16's mantissa
_HIGH_MASK = -_LOW_MANTISSA  # 0xFFFF0000 as an int32


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
    draws its bits from a hash of its seed, the step and the element (see
    :mod:`ampkit.pure`). Values that bf16 holds exactly, infinities and NaNs come back
    unchanged.

    Raises:
        TypeError: ``value`` is not float32.

    Example:
        >>> import torch
        >>> from ampkit.pure import stochastic_round
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


# DTensor support (FSDP2)

@functools.cache
def _dtensor_class() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a build without torch.distributed
        return None
    return DTensor


def is_dtensor(t: torch.Tensor) -> TypeGuard[DTensor]:
    cls = _dtensor_class()
    return cls is not None and isinstance(t, cls)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding ``t``'s elements on this process: ``t`` itself, or a DTensor's
    local shard (its own storage: writing into it writes into the DTensor)."""
    if is_dtensor(t):
        with torch.no_grad():
            return t.to_local()
    return t


class Positions:
    """Where the elements of a (local) tensor sit in the whole parameter, for the hash.
    ``index(start, stop)`` gives the row-major positions of local flat elements
    ``start:stop``; ``tag`` is what else enters the key (the mesh coordinates of a shard
    whose positions are local ones)."""

    __slots__ = ("block_start", "global_shape", "local_shape", "offset", "tag")

    def __init__(self, t: torch.Tensor) -> None:
        local = local_tensor(t)
        self.local_shape = tuple(local.shape)
        self.global_shape = tuple(t.shape)
        self.offset: tuple[int, ...] | None = None
        self.block_start: int | None = 0  # the local elements are one run of positions
        self.tag: tuple[int, ...] = ()
        if local is t:
            return
        from torch.distributed.tensor import Replicate, Shard

        dt: Any = t  # a DTensor
        placements = tuple(dt.placements)
        shape, offset = torch_internals.local_shape_and_offset(dt)
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


BLOCK = 1 << 16  # elements of a parameter drawn from one seeded block of the stream
_generators = threading.local()  # per thread (autograd's device threads run hooks)


def _generator(device: torch.device) -> torch.Generator:
    """This thread's generator for ``device``: reseeded before every block, so sharing it
    between optimizers and parameters changes no bits."""
    cache: dict[torch.device, torch.Generator] = _generators.__dict__.setdefault(
        "by_device", {})
    g = cache.get(device)
    if g is None:
        g = cache[device] = torch.Generator(device=device)
    return g


def _fields(positions: Positions, key_parts: tuple[Any, ...], jobs: int,
            device: torch.device) -> Iterator[tuple[int, torch.Tensor]]:
    """The noise of a local tensor, piece by piece: ``(first local flat element, int16
    fields shaped (jobs, piece length))``; signed, so each needs 2**15 added.

    The whole parameter's elements are cut into blocks of ``BLOCK`` positions; block
    ``b`` draws ``jobs`` x its length x 16 bits, as full-range int64s, from the device's
    generator seeded with a hash of ``(key_parts, shard tag, b)``: job ``j`` takes the
    ``j``-th run of 16-bit fields. Only the blocks holding local elements are drawn, and
    whole, so an element's bits depend on nothing but the key and its position: not on
    the chunking, the other parameters, nor the sharding. Contiguous positions come one
    block at a time; scattered ones (a shard of a dimension other than the first) are
    gathered from the blocks they span, in one piece."""
    n = math.prod(positions.local_shape)
    total = math.prod(positions.global_shape) if not positions.tag else n
    if positions.block_start is not None:
        first, index = positions.block_start, None
        last = first + n
    else:
        index = positions.index(0, n, device)
        first = int(index.min()) if n else 0
        last = int(index.max()) + 1 if n else 0
    base = first // BLOCK * BLOCK
    spanned = None if index is None else torch.empty(
        (jobs, last - base), dtype=torch.int16, device=device)
    g = _generator(device)
    for lo in range(base, last, BLOCK):
        length = min(lo + BLOCK, total) - lo  # the block's, whatever this shard holds
        words = _key(*key_parts, *positions.tag, lo // BLOCK)
        g.manual_seed(words[0] | words[1] << 32)
        raw = torch.empty(-(-jobs * length // 4), dtype=torch.int64, device=device)
        raw.random_(-(1 << 63), None, generator=g)  # all 64 bits
        fields = raw.view(torch.int16)[:jobs * length].view(jobs, length)
        start, stop = max(lo, first), min(lo + length, last)
        if spanned is None:
            yield start - first, fields[:, start - lo:stop - lo]
        else:
            spanned[:, lo - base:stop - base] = fields[:, :stop - lo]
    if spanned is not None and index is not None:
        yield 0, spanned.index_select(1, index - base)


def draw_noise(positions: Positions, key_parts: tuple[Any, ...], jobs: int,
               device: torch.device) -> torch.Tensor:
    """The noise :func:`round_stochastic` adds for ``jobs`` tensors of one parameter's
    local elements: int32 in ``[0, 2**16)``, shaped ``(jobs, *local shape)`` (see
    ``_fields`` for how the bits are drawn). The same on every run and replica on
    one device type; CPU and CUDA generators differ."""
    n = math.prod(positions.local_shape)
    out = torch.empty((jobs, n), dtype=torch.int32, device=device)
    for start, fields in _fields(positions, key_parts, jobs, device):
        out[:, start:start + fields.shape[1]] = fields
    return out.add_(1 << 15).view(jobs, *positions.local_shape)


def _truncate_pairs(outs: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    """Copy each fp32 ``value`` truncated to bf16 (its high 16 bits) into ``out``; the
    values are overwritten. The high half is shifted down in place (arithmetically:
    the result fits int16 exactly, sign included), then narrowed into the outputs'
    bits with one multi-tensor copy, which is byte-order free and about half the cost
    of copying every other bf16 of the values (measured on an AVX2 CPU)."""
    if not outs:
        return
    for value in values:
        value.view(torch.int32).bitwise_right_shift_(16)
    torch_internals.foreach_copy_([out.view(torch.int16) for out in outs],
                         [value.view(torch.int32) for value in values])


#: One parameter's stochastic roundings: its positions, its key, the bf16 outputs and
#: the fp32 values (overwritten), each shaped like the parameter's local tensor.
StochasticJob = tuple[Positions, tuple[Any, ...], list[torch.Tensor], list[torch.Tensor]]

#: Where the rounding takes its scratch from: ``scratch(name, numel, dtype, device)``
#: gives a tensor of at least ``numel`` elements whose contents do not matter (a pure
#: optimizer's :class:`~ampkit.pure.step.Workspace`, kept from one step to the next).
Scratch = Callable[[str, int, torch.dtype, torch.device], torch.Tensor]


def _fresh(name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Scratch nobody keeps: a new tensor."""
    del name
    return torch.empty(numel, dtype=dtype, device=device)
# Positions of one parameter whose noise is drawn and added at a time. The optimizer
# keeps its buffers between steps (10 bytes per position with three jobs: 2.5 MiB);
# groups of one block (0.6 MiB) made the 10M-parameter AdamW step 5-10% slower
# (measured on the AVX2 CPU).
_GROUP = 1 << 18
_TOP_BITS = -0x7FFF7FFF7FFF8000  # 0x8000 in each 16-bit field of an int64


def _add_noise(positions: Positions, key_parts: tuple[Any, ...],
               words: list[torch.Tensor], scratch: Scratch = _fresh) -> None:
    """Add 2**15 plus the noise of ``_fields`` (signed int16 fields) to ``words``, the
    int32 bit patterns of one parameter's flat local values (one per job): a noise in
    ``[0, 2**16)``.

    The same bits as ``_fields``, with fewer passes and torch calls: up to ``_GROUP``
    positions of blocks are drawn into one buffer, block after block; flipping each
    field's top bit there and reading it unsigned gives field + 2**15, widened into an
    int32 buffer with one copy per job and run of blocks (a 2-D view: blocks x
    positions, the job's fields being every ``jobs``-th row of a block's), then added.
    Both buffers come from ``scratch``."""
    jobs = len(words)
    n = words[0].numel()
    device = words[0].device
    if positions.block_start is None or n == 0:  # scattered positions: one gathered piece
        for start, fields in _fields(positions, key_parts, jobs, device):
            for word, noise in zip(words, fields):
                piece = word[start:start + noise.shape[0]]
                piece.add_(1 << 15)  # first 2**15: no signed overflow for any non-NaN
                piece.add_(noise)
        return
    first = positions.block_start
    last = first + n
    total = math.prod(positions.global_shape) if not positions.tag else n
    base = first // BLOCK * BLOCK
    span = min(_GROUP, -(-(last - base) // BLOCK) * BLOCK)  # positions per group
    extent = min(-(-last // BLOCK) * BLOCK, total) - base  # the drawn blocks' positions
    raw = scratch("noise", -(-jobs * min(span, extent) // 4), torch.int64, device)
    buffer = raw.view(torch.uint16)
    wide = scratch("widened noise", min(span, n), torch.int32, device)
    g = _generator(device)
    for group in range(base, last, span):
        # (local start, local stop, the fields: jobs x positions, or blocks x jobs x
        # positions for a run of whole blocks)
        runs: list[tuple[int, int, torch.Tensor]] = []
        whole: list[int] = []  # the group's blocks that are whole and wholly local
        drawn = 0
        for lo in range(group, min(group + span, last), BLOCK):
            length = min(lo + BLOCK, total) - lo  # the block's, whatever this holds
            words_key = _key(*key_parts, *positions.tag, lo // BLOCK)
            g.manual_seed(words_key[0] | words_key[1] << 32)
            at = (lo - group) * jobs  # where the block's fields start in the buffer
            drawn = at // 4 + -(-jobs * length // 4)
            raw[at // 4:drawn].random_(-(1 << 63), None, generator=g)
            start, stop = max(lo, first), min(lo + length, last)
            if length == BLOCK and start == lo and stop == lo + BLOCK:
                whole.append(lo)
            else:
                fields = buffer[at:at + jobs * length].view(jobs, length)
                runs.append((start - first, stop - first, fields[:, start - lo:stop - lo]))
        if whole:  # consecutive: only the first and last blocks can be partial
            k, lo = len(whole), whole[0]
            at = (lo - group) * jobs
            runs.append((lo - first, lo - first + k * BLOCK,
                         buffer[at:at + k * jobs * BLOCK].view(k, jobs, BLOCK)))
        # field + 2**15 is the field with its top bit flipped, read unsigned
        raw[:drawn].bitwise_xor_(_TOP_BITS)
        for a, b, fields in runs:
            for j, word in enumerate(words):
                noise = fields[j] if fields.dim() == 2 else fields[:, j]
                widened = wide[:b - a].view(noise.shape)
                widened.copy_(noise)
                word[a:b].view(noise.shape).add_(widened)


def round_stochastic(params: list[StochasticJob], scratch: Scratch = _fresh) -> None:
    """Round the fp32 values of many parameters (all on one device) stochastically into
    their bf16 outputs: add the noise of ``_fields`` below bf16's mantissa, then
    truncate. The bit pattern is sign-magnitude, so negative values round
    symmetrically. The passes that need no noise run over whole tensors with
    multi-tensor ops; the noise is drawn for a bounded group of positions of one
    parameter at a time and added at once, so it never takes more than a few MiB.
    NaNs stay NaN (their payload's carry could otherwise make them infinities or
    zeros). The noise's buffers come from ``scratch`` (:data:`Scratch`; new tensors
    by default)."""
    later: list[tuple[torch.Tensor, torch.Tensor]] = []
    flats: list[torch.Tensor] = []
    targets: list[torch.Tensor] = []
    noised: list[tuple[Positions, tuple[Any, ...], list[torch.Tensor]]] = []
    for positions, key, outs, values in params:
        mine = [v.contiguous().view(-1) for v in values]  # row-major: i is position i
        for out in outs:
            if out.is_contiguous():
                targets.append(out.view(-1).view(torch.int16))
            else:
                flat_out = torch.empty(out.numel(), dtype=torch.bfloat16,
                                       device=out.device)
                later.append((out, flat_out))
                targets.append(flat_out.view(torch.int16))
        flats.extend(mine)
        noised.append((positions, key, [flat.view(torch.int32) for flat in mine]))
    live = [v for v in flats if v.numel()]
    if live:
        nan = bool(torch.stack(torch_internals.foreach_max(live)).isnan().any())
        kept = [(out, v.isnan(), v[v.isnan()]) for out, v in zip(targets, flats)] if nan \
            else []
        bits = [v.view(torch.int32) for v in live]
        for positions, key, words in noised:
            _add_noise(positions, key, words, scratch)
        for b in bits:  # the high half, shifted down arithmetically: it fits int16
            b.bitwise_right_shift_(16)
        # narrowed into the bf16 outputs' bits
        torch_internals.foreach_copy_([t for t, v in zip(targets, flats) if v.numel()], bits)
        for out, mask, original in kept:
            out.view(torch.bfloat16)[mask] = original.to(torch.bfloat16)
    for out, target in later:
        out.copy_(target.view(out.shape))


def nearest_bits(value: torch.Tensor) -> torch.Tensor:
    """``value`` (fp32) rounded to the nearest bf16 (ties to even), as an fp32 tensor
    whose low 16 bits are zero, computed with integer ops on the bit pattern: add
    ``0x7FFF`` plus the lowest kept bit, then truncate. The same numbers as
    ``value.to(torch.bfloat16)``, infinities and overflow to infinity included; NaNs
    stay NaN. Under ``torch.compile`` a float round trip ``value.to(bf16).float()``
    may be fused away (inductor keeps the fp32 value), so code that needs what the
    rounding lost uses this form.

    Example:
        >>> import torch
        >>> from ampkit.pure.rounding import nearest_bits
        >>> x = torch.tensor([1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -(1.0 + 2 ** -10)])
        >>> torch.equal(nearest_bits(x), x.to(torch.bfloat16).float())
        True
    """
    bits = value.view(torch.int32)
    kept_low = torch.bitwise_right_shift(bits, 16).bitwise_and(1)
    rounded = (bits + kept_low + 0x7FFF).bitwise_and(_HIGH_MASK).view(torch.float32)
    # A NaN's payload could carry into the sign or the exponent: keep the NaN itself.
    return torch.where(value.isnan(), value, rounded)


def _truncated(value: torch.Tensor) -> torch.Tensor:
    """``value``'s high 16 bits (fp32 truncated toward zero to bf16's bits)."""
    return value.view(torch.int32).bitwise_and(_HIGH_MASK).view(torch.float32)


def round_kahan_foreach(outs: list[torch.Tensor], values: list[torch.Tensor],
                        compensations: list[torch.Tensor]) -> None:
    """:func:`round_kahan` over many tensors on one device at once: each fp32 value
    (weight plus compensation, overwritten) rounded to nearest into its bf16 ``out``,
    what that lost truncated into its bf16 compensation.

    Under ``torch.compile`` the rounding is done on the bits (:func:`nearest_bits`),
    which inductor cannot fuse away; eagerly, by torch's vectorized conversion. The
    two give the same bits.

    Example:
        >>> import torch
        >>> from ampkit.pure.rounding import round_kahan_foreach
        >>> out, comp = torch.empty(1, dtype=torch.bfloat16), torch.empty(1, dtype=torch.bfloat16)
        >>> round_kahan_foreach([out], [torch.tensor([1.0 + 2 ** -10])], [comp])
        >>> out.item(), comp.item()
        (1.0, 0.0009765625)
    """
    if torch.compiler.is_compiling():
        for out, value, comp in zip(outs, values, compensations):
            new = nearest_bits(value)
            out.copy_(new)  # exact: the low 16 bits are zero
            comp.copy_(_truncated(value - new))
        return
    torch_internals.foreach_copy_(outs, values)
    for value, out in zip(values, outs):
        # per tensor: torch's multi-tensor subtraction of a bf16 from an fp32 list takes
        # a slow path on CPU (measured 1.9x the loop)
        value.sub_(out)
    _truncate_pairs(compensations, values)


def round_kahan(work: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Kahan-compensated rounding of an fp32 update (``work``: weight plus compensation,
    overwritten): ``(weight, compensation)``, the weight rounded to nearest bf16 and
    what that rounding lost, truncated toward zero (not rounded) to bf16's bits, so it
    stays within half an ulp of the weight and weight + compensation rounds back to
    the very same weight. The compensation is an fp32 tensor whose low 16 bits are
    zero: exact in bf16. Under ``torch.compile`` it gives the same bits (see
    :func:`round_kahan_foreach`).

    Example:
        >>> import torch
        >>> from ampkit.pure.rounding import round_kahan
        >>> weight, lost = round_kahan(torch.tensor([1.0 + 2 ** -10]))
        >>> weight.item(), lost.item(), (weight.float() + lost).to(torch.bfloat16).item()
        (1.0, 0.0009765625, 1.0)
    """
    if torch.compiler.is_compiling():
        rounded = nearest_bits(work)
        lost = work.sub_(rounded).view(torch.int32).bitwise_and_(_HIGH_MASK)
        return rounded.to(torch.bfloat16), lost.view(torch.float32)
    new = work.to(torch.bfloat16)
    lost = work.sub_(new).view(torch.int32).bitwise_and_(_HIGH_MASK).view(torch.float32)
    return new, lost
