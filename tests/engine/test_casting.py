"""amp_cast / amp_multicast (MXNet semantics) and nested casting."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import pytest
import torch

import ampkit
from ampkit.engine.casting import WeightCastCache, cast_tree

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64


@pytest.mark.parametrize(("src", "dst", "expected"), [
    (F32, F16, F16), (F32, BF16, BF16), (F16, F32, F32), (BF16, F32, F32),
    (F16, F16, F16), (F32, F32, F32),
    (F16, BF16, F16), (BF16, F16, BF16),  # low <-> low is not an AMP cast
    (F64, F16, F64), (F32, F64, F32), (F16, F64, F16),  # float64 never involved
    (torch.int64, F16, torch.int64), (torch.int32, F32, torch.int32),
    (torch.uint8, F32, torch.uint8), (F32, torch.int8, F32), (F16, torch.int32, F16),
])
def test_amp_cast_only_between_low_precision_and_fp32(src: torch.dtype, dst: torch.dtype,
                                                      expected: torch.dtype) -> None:
    x = torch.arange(4).to(src)
    out = ampkit.amp_cast(x, dst)
    assert out.dtype == expected
    if expected == src:
        assert out is x  # passed through untouched, not copied
    else:
        assert torch.equal(out, x.to(dst))


def test_amp_cast_accepts_dtype_names_and_rejects_unknown() -> None:
    assert ampkit.amp_cast(torch.ones(1), "float16").dtype == F16
    assert ampkit.amp_cast(torch.ones(1), "bfloat16").dtype == BF16
    with pytest.raises(ValueError, match=r"dtype must be a torch.dtype or one of"):
        ampkit.amp_cast(torch.ones(1), "float8")
    assert ampkit.amp_cast(3.0, "float16") == 3.0  # non-tensors pass through


def test_amp_cast_is_differentiable() -> None:
    x = torch.rand(3, requires_grad=True)
    (ampkit.amp_cast(x, F16).float() * 2).sum().backward()
    assert x.grad.dtype == F32
    assert torch.equal(x.grad, torch.full((3,), 2.0))


def test_amp_multicast_widest_and_narrowest() -> None:
    h, b, f, d, i = (torch.ones(2, dtype=t) for t in (F16, BF16, F32, F64, torch.int64))
    assert [t.dtype for t in ampkit.amp_multicast(h, f, i)] == [F32, F32, torch.int64]
    assert [t.dtype for t in ampkit.amp_multicast(h, f, cast_narrow=True)] == [F16, F16]
    assert [t.dtype for t in ampkit.amp_multicast(h, h)] == [F16, F16]
    assert [t.dtype for t in ampkit.amp_multicast(b, d)] == [BF16, F64]  # fp64 untouched
    assert [t.dtype for t in ampkit.amp_multicast(h, b)] == [F32, F32]
    with pytest.raises(ValueError, match="cast_narrow"):
        ampkit.amp_multicast(h, b, cast_narrow=True)
    assert ampkit.amp_multicast(i, 2) == (i, 2)


def test_amp_multicast_is_differentiable() -> None:
    a = torch.rand(2, requires_grad=True)
    b = torch.rand(2, dtype=F16, requires_grad=True)
    x, y = ampkit.amp_multicast(a, b)
    (x * y).sum().backward()
    assert a.grad.dtype == F32 and b.grad.dtype == F16
    torch.testing.assert_close(b.grad, a.detach().half())


class Pair(NamedTuple):
    x: torch.Tensor
    ids: torch.Tensor


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    extra: dict


def test_cast_tree_nested_structures() -> None:
    tree = [Pair(torch.ones(1), torch.ones(1, dtype=torch.long)),
            Out(torch.ones(1), {"h": (torch.ones(1), "tag"), "n": 3})]
    out = cast_tree(tree, BF16)
    assert isinstance(out[0], Pair) and out[0].x.dtype == BF16
    assert out[0].ids.dtype == torch.long
    assert isinstance(out[1], Out) and out[1].logits.dtype == BF16
    assert out[1].extra["h"][0].dtype == BF16 and out[1].extra["h"][1] == "tag"
    assert out[1].extra["n"] == 3
    assert tree[1].logits.dtype == F32  # the input is not modified


def test_weight_cache_only_caches_leaf_fp32_weights() -> None:
    cache = WeightCastCache()
    w = torch.ones(2, requires_grad=True)
    act = torch.ones(2)  # no grad: an activation, never cached
    assert cache.cast(act, BF16) is not cache.cast(act, BF16)
    assert cache.cast(w, BF16) is cache.cast(w, BF16)
    half = cache.cast(w, F16)
    assert half.dtype == F16  # another dtype: another cast, kept beside the first
    assert cache.cast(w, BF16).dtype == BF16 and cache.cast(w, F16) is half
    assert len(cache) == 2
    cache.clear()
    assert len(cache) == 0
