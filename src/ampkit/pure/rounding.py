"""The rounding primitives of pure low-precision training: stochastic rounding of fp32
values to bf16, with random bits from a seeded hash of each element's position (no
generator: replicas and resumed runs draw the same bits; see "Random bits" in
:mod:`ampkit.pure`), Kahan-compensated rounding, and the element positions of a
DTensor shard within its whole parameter.

Example:
    >>> import torch

from ampkit import torch_internals
    >>> from ampkit.pure.rounding import Positions, round_stochastic_into
    >>> value = torch.full((4,), 1.0 + 2 ** -9)  # half-way between two bf16 numbers
    >>> out = torch.empty(4, dtype=torch.bfloat16)
    >>> round_stochastic_into([(out, value)], Positions(value), (0, 0, 0), 1 << 16)
    >>> sorted(set(out.tolist())) <= [1.0, 1.0078125]
    True
"""

from __future__ import annotations

import functools
import hashlib
import math
from typing import Any

import torch

from ampkit import torch_internals

__all__ = ["Positions", "is_dtensor", "local_tensor", "round_kahan", "round_stochastic_into",
           "stochastic_round"]

_LOW_MANTISSA = 1 << 16  # the fp32 bits below bf16's mantissa
_HIGH_MASK = -_LOW_MANTISSA  # 0xFFFF0000 as an int32

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


def is_dtensor(t: torch.Tensor) -> bool:
    cls = _dtensor_class()
    return cls is not None and isinstance(t, cls)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding ``t``'s elements on this process: ``t`` itself, or a DTensor's
    local shard (its own storage: writing into it writes into the DTensor)."""
    if is_dtensor(t):
        with torch.no_grad():
            return t.to_local()  # type: ignore[attr-defined]  # a DTensor
    return t


class Positions:
    """Where the elements of a (local) tensor sit in the whole parameter, for the hash.
    ``index(start, stop)`` gives the row-major positions of local flat elements
    ``start:stop``; ``tag`` is what else enters the key (the mesh coordinates of a shard
    whose positions are local ones)."""

    __slots__ = ("block_start", "global_shape", "large", "local_shape", "offset", "tag")

    def __init__(self, t: torch.Tensor) -> None:
        local = local_tensor(t)
        self.local_shape = tuple(local.shape)
        self.global_shape = tuple(t.shape)
        self.offset: tuple[int, ...] | None = None
        self.block_start: int | None = 0  # the local elements are one run of positions
        self.tag: tuple[int, ...] = ()
        self.large = math.prod(self.global_shape) > _U32
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


def round_stochastic_into(jobs: list[tuple[torch.Tensor, torch.Tensor]],
                           positions: Positions, key_parts: tuple[Any, ...],
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


def round_kahan(work: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Kahan-compensated rounding of an fp32 update (``work``: weight plus compensation,
    overwritten): ``(weight, compensation)``, the weight rounded to nearest bf16 and
    what that rounding lost, truncated toward zero (not rounded) to bf16's bits, so it
    stays within half an ulp of the weight and weight + compensation rounds back to
    the very same weight. The compensation is an fp32 tensor whose low 16 bits are
    zero: exact in bf16.

    Example:
        >>> import torch
        >>> from ampkit.pure.rounding import round_kahan
        >>> weight, lost = round_kahan(torch.tensor([1.0 + 2 ** -10]))
        >>> weight.item(), lost.item(), (weight.float() + lost).to(torch.bfloat16).item()
        (1.0, 0.0009765625, 1.0)
    """
    new = work.to(torch.bfloat16)
    lost = work.sub_(new).view(torch.int32).bitwise_and_(_HIGH_MASK).view(torch.float32)
    return new, lost

