"""Casting: MXNet-style cast ops, nested-structure casts and the weight-cast cache.

Everything in ampkit that changes a tensor's dtype goes through this module:

* :func:`amp_cast` / :func:`amp_multicast`: MXNet's AMP cast ops. They only ever cast
  between a low-precision float (float16/bfloat16) and float32; any other input or
  target dtype passes through untouched, so they are safe to sprinkle anywhere.
* :func:`cast_tree`: casts the floating tensors inside nested lists, tuples,
  namedtuples, dicts and dataclasses (module inputs and outputs).
* :func:`cast_op_args` and :class:`WeightCastCache`: the autocast engine's casts,
  with native autocast's eligibility rule and its cache of casted fp32 weights.
* :func:`copy_serves`: when a kept low-precision copy may stand for its source.

**Two caches, one rule.** ampkit keeps low-precision copies of fp32 parameters in two
places, and both follow one rule: a copy lives for one outermost pass, and within it
serves a use only as :func:`copy_serves` says. :class:`WeightCastCache` is the autocast
engine's (O1, regions): its pass is the outermost ``ampkit.autocast`` region, whose
lifetime the engine owns. ``ampkit.conversion.parameter_casts`` is O2's: its pass is the outermost
forward of a converted model (or a ``reuse_casts`` block), whose lifetime the model's
boundary owns. They stay two stores because the passes are two: at O2 a region runs
inside the forward and sees only the copies already swapped in (low precision, never
cached again), while an O1 region may span many forwards and an optimizer step
(a training loop inside one ``with``), so the region's cache also keys each copy by
the weight's version counter and dtype, where a forward (which no step can happen
inside) keys only by the parameter.

All casts are ``Tensor.to``, so they are differentiable and gradients flow back in the
source tensor's dtype.

Example:
    >>> import torch
    >>> from ampkit.engine.casting import amp_cast, amp_multicast
    >>> amp_cast(torch.ones(2), torch.float16).dtype
    torch.float16
    >>> amp_cast(torch.ones(2, dtype=torch.float64), torch.float16).dtype  # not low<->fp32
    torch.float64
    >>> [t.dtype for t in amp_multicast(torch.ones(1, dtype=torch.float16), torch.ones(1))]
    [torch.float32, torch.float32]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from ampkit import torch_internals
from ampkit.common.arguments import FLOAT_DTYPES, LOW_PRECISION, parse_dtype
from ampkit.common.containers import iter_tensors, map_tensors

__all__ = [
    "WeightCastCache",
    "amp_cast",
    "copy_serves",
    "amp_multicast",
    "cast_op_args",
    "cast_tree",
    "eligible_dtypes",
    "is_eligible",
    "map_floating",
    "promote_dtype",
    "widest_float_dtype",
]

T = TypeVar("T")

_LOW = LOW_PRECISION
_AMP_FLOATS = FLOAT_DTYPES


def amp_cast(data: T, dtype: torch.dtype | str) -> T:
    """Cast ``data`` to ``dtype`` only if both are among float16/bfloat16/float32 and
    exactly one of them is float32; anything else is returned unchanged.

    ``data`` that is not a tensor (a number, ``None``) passes through too.

    Example:
        >>> import torch
        >>> from ampkit.engine.casting import amp_cast
        >>> amp_cast(torch.ones(1, dtype=torch.bfloat16), "float32").dtype
        torch.float32
        >>> amp_cast(torch.ones(1, dtype=torch.int64), "float16").dtype
        torch.int64
    """
    target = parse_dtype(dtype, accept=None)
    if not isinstance(data, torch.Tensor):
        return data
    src = data.dtype
    if src is target or src not in _AMP_FLOATS or target not in _AMP_FLOATS:
        return data
    if torch.float32 not in (src, target):  # float16 <-> bfloat16 is not an AMP cast
        return data
    return data.to(target)  # type: ignore[return-value]


def widest_float_dtype(dtypes: Any, *, narrow: bool = False) -> torch.dtype | None:
    """The widest (or, with ``narrow``, narrowest) of the AMP float dtypes given.

    float16 and bfloat16 together widen to float32 (each loses values of the other);
    they have no narrowest, which is a ``ValueError``.

    Example:
        >>> import torch
        >>> from ampkit.engine.casting import widest_float_dtype
        >>> widest_float_dtype([torch.bfloat16, torch.float32])
        torch.float32
        >>> widest_float_dtype([torch.bfloat16, torch.float32], narrow=True)
        torch.bfloat16
    """
    present: set[torch.dtype] = {d for d in dtypes if d in _AMP_FLOATS}
    if not present:
        return None
    low = present & set(_LOW)
    if narrow:
        if len(low) > 1:
            raise ValueError("cast_narrow: inputs mix float16 and bfloat16, which have no "
                             "narrowest common type; cast one of them first")
        return low.pop() if low else torch.float32
    if torch.float32 in present or len(low) > 1:
        return torch.float32
    return low.pop()


def amp_multicast(*data: Any, cast_narrow: bool = False) -> tuple[Any, ...]:
    """Cast all float16/bfloat16/float32 inputs to the widest such type present
    (the narrowest with ``cast_narrow``); other inputs pass through.

    Example:
        >>> import torch
        >>> from ampkit.engine.casting import amp_multicast
        >>> a, b = amp_multicast(torch.ones(1), torch.ones(1, dtype=torch.float16),
        ...                      cast_narrow=True)
        >>> a.dtype, b.dtype
        (torch.float16, torch.float16)
    """
    target = widest_float_dtype((d.dtype for d in data if isinstance(d, torch.Tensor)),
                                narrow=cast_narrow)
    if target is None:
        return tuple(data)
    return tuple(amp_cast(d, target) for d in data)


def map_floating(obj: T, fn: Callable[[torch.Tensor], torch.Tensor]) -> T:
    """Apply ``fn`` to every floating tensor inside ``obj`` (nested lists, tuples,
    namedtuples, dicts, dataclasses), rebuilding the containers; everything else,
    integer and boolean tensors included, is returned as it is.

    Example:
        >>> import torch
        >>> from ampkit.engine.casting import map_floating
        >>> map_floating((torch.ones(1), torch.ones(1, dtype=torch.long), "tag"),
        ...              lambda t: t * 2)
        (tensor([2.]), tensor([1]), 'tag')
    """
    return map_tensors(obj, lambda t: fn(t) if t.is_floating_point() else t)


def cast_tree(obj: T, dtype: torch.dtype,
              predicate: Callable[[torch.Tensor], bool] | None = None) -> T:
    """Cast every floating tensor inside ``obj`` (nested lists, tuples, namedtuples,
    dicts, dataclasses) to ``dtype``; ``predicate`` narrows which tensors are cast.

    Integer and boolean tensors (token ids, masks) are never cast.

    Example:
        >>> import torch
        >>> from ampkit.engine.casting import cast_tree
        >>> out = cast_tree({"x": torch.ones(1), "ids": torch.ones(1, dtype=torch.long)},
        ...                 torch.bfloat16)
        >>> out["x"].dtype, out["ids"].dtype
        (torch.bfloat16, torch.int64)
    """
    def cast(t: torch.Tensor) -> torch.Tensor:
        if t.dtype is dtype or (predicate is not None and not predicate(t)):
            return t
        return t.to(dtype)

    return map_floating(obj, cast)


# -- the autocast engine's casts ---------------------------------------------------------

def is_eligible(t: Any, device_type: str) -> bool:
    """Native autocast's eligibility: a floating tensor on the autocast device, not
    float64.

    Example:
        >>> import torch
        >>> from ampkit.engine.casting import is_eligible
        >>> is_eligible(torch.ones(1), "cpu"), is_eligible(torch.ones(1).double(), "cpu")
        (True, False)
    """
    return (isinstance(t, torch.Tensor) and t.is_floating_point()
            and t.dtype is not torch.float64 and _on_device(t, device_type))


def copy_serves(copy: torch.Tensor, dtype: torch.dtype, source: torch.Tensor,
                grad_mode: bool) -> bool:
    """Whether a low-precision ``copy`` of ``source`` kept for the current pass may stand
    for it in a use that wants ``dtype`` with grad mode ``grad_mode``: the one validity
    rule of ampkit's cast caches (see the module doc). The copy must be in that dtype,
    and a use that builds a graph through a source that requires grad needs a copy with
    autograd history back to it: a copy made under ``no_grad`` or ``inference_mode``
    serves only uses that build no graph.

    Example:
        >>> import torch
        >>> from ampkit.engine.casting import copy_serves
        >>> w = torch.ones(2, requires_grad=True)
        >>> with torch.no_grad():
        ...     flat = w.to(torch.bfloat16)
        >>> copy_serves(flat, torch.bfloat16, w, grad_mode=False), copy_serves(
        ...     flat, torch.bfloat16, w, grad_mode=True)
        (True, False)
    """
    return copy.dtype is dtype and (copy.requires_grad or not grad_mode
                                    or not source.requires_grad)


class WeightCastCache:
    """Low-precision copies of fp32 leaf tensors that require grad (the weights),
    kept for one outermost autocast region, as native autocast does (one of ampkit's
    two cast caches: see the module doc; :func:`copy_serves` is their rule).

    A weight used by several ops in one forward pass is then cast once, and all uses
    share one autograd node, so its gradient is accumulated once.

    A cast is kept only when it carries autograd history back to the weight: casts made
    under ``torch.no_grad()`` or ``torch.inference_mode()`` are used once and never
    stored, so a later forward with gradients on (the same region, the same layer: a
    target network, teacher features, EMA targets) casts again and the weight gets its
    gradient. A stored cast is reused only while the weight's version counter is
    unchanged: an in-place update (an optimizer step, ``w.copy_()`` under ``no_grad``)
    makes the next use cast again.

    Example:
        >>> import torch
        >>> from ampkit.engine.casting import WeightCastCache
        >>> cache = WeightCastCache()
        >>> w = torch.ones(2, requires_grad=True)
        >>> cache.cast(w, torch.bfloat16) is cache.cast(w, torch.bfloat16)
        True
        >>> with torch.no_grad():
        ...     cache.cast(w, torch.float16).grad_fn is None, len(cache)
        (True, 1)
    """

    __slots__ = ("_casts",)

    def __init__(self) -> None:
        # (id(tensor), dtype) -> (tensor, version, cast). The tensor is held so its id
        # stays unique while the entry lives.
        self._casts: dict[tuple[int, torch.dtype],
                          tuple[torch.Tensor, int, torch.Tensor]] = {}

    def cast(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``t.to(dtype)``, cached when ``t`` is an fp32 leaf that requires grad (see the
        class example)."""
        if not (t.requires_grad and t.is_leaf and t.dtype is torch.float32) or \
                torch_internals.is_view(t):
            return t.to(dtype)
        key = (id(t), dtype)
        hit = self._casts.get(key)
        if hit is not None and hit[0] is t and hit[1] == torch_internals.tensor_version(t):
            # A cast with history serves no_grad / inference_mode uses as well.
            return hit[2]
        out = t.to(dtype)
        # Kept only when it serves every later use of the region, those that build a
        # graph included (made with grad mode on, outside inference_mode): a hit then
        # needs no grad-mode check.
        if copy_serves(out, dtype, t, grad_mode=True):
            self._casts[key] = (t, torch_internals.tensor_version(t), out)
        return out

    def clear(self) -> None:
        """Forget every cached cast (at the end of the outermost region)."""
        self._casts.clear()

    def __len__(self) -> int:
        return len(self._casts)


def _on_device(t: torch.Tensor, device_type: str) -> bool:
    # t.is_cpu / t.is_cuda are cheap attribute reads; t.device builds an object.
    if device_type == "cpu":
        return t.is_cpu
    if device_type == "cuda":
        return t.is_cuda
    return t.device.type == device_type


def _cast_one(a: Any, dtype: torch.dtype, device_type: str,
              cache: WeightCastCache | None) -> Any:
    if isinstance(a, torch.Tensor):
        src = a.dtype
        if (src is dtype or src is torch.float64 or not a.is_floating_point()
                or not _on_device(a, device_type)):
            return a
        if cache is not None and dtype is not torch.float32:
            return cache.cast(a, dtype)
        return a.to(dtype)
    if isinstance(a, list | tuple) and a and any(isinstance(v, torch.Tensor) for v in a):
        return type(a)([_cast_one(v, dtype, device_type, cache) for v in a])
    return a


def cast_op_args(args: tuple[Any, ...], kwargs: dict[str, Any], dtype: torch.dtype,
                 device_type: str, cache: WeightCastCache | None
                 ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Cast an op's eligible tensor arguments (and tensors in list/tuple arguments)
    to ``dtype``; used by the autocast engine on the ops it intercepts (hot path).

    Example:
        >>> import torch
        >>> from ampkit.engine.casting import cast_op_args
        >>> args, _ = cast_op_args((torch.ones(1), [torch.ones(1)], 3), {}, torch.float16,
        ...                        "cpu", None)
        >>> args[0].dtype, args[1][0].dtype, args[2]
        (torch.float16, torch.float16, 3)
    """
    args = tuple([_cast_one(a, dtype, device_type, cache) for a in args])
    if kwargs:
        kwargs = {k: _cast_one(v, dtype, device_type, cache) for k, v in kwargs.items()}
    return args, kwargs


def eligible_dtypes(obj: Any, device_type: str) -> set[torch.dtype]:
    """The dtypes of the autocast-eligible tensors inside ``obj`` (nested lists, tuples,
    namedtuples, dicts, dataclasses).

    Example:
        >>> import torch
        >>> from ampkit.engine.casting import eligible_dtypes
        >>> sorted(map(str, eligible_dtypes([torch.ones(1), {"b": torch.ones(1).half()},
        ...                                  torch.ones(1).double()], "cpu")))
        ['torch.float16', 'torch.float32']
    """
    return {t.dtype for t in iter_tensors(obj) if is_eligible(t, device_type)}


def promote_dtype(args: tuple[Any, ...], kwargs: dict[str, Any],
                  device_type: str) -> torch.dtype | None:
    """The dtype a promote op runs in: the widest eligible floating input, or ``None``
    when the inputs already agree (nothing to cast).

    Example:
        >>> import torch
        >>> from ampkit.engine.casting import promote_dtype
        >>> promote_dtype(([torch.ones(1), torch.ones(1, dtype=torch.bfloat16)],), {},
        ...               "cpu")
        torch.float32
    """
    seen = eligible_dtypes((args, kwargs), device_type)
    if len(seen) < 2:
        return None
    return widest_float_dtype(seen)
