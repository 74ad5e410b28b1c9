"""One container walk (ampkit.common.containers): every layer sees inside a dataclass, a
namedtuple and a dict alike. Measured before: on a dataclass, ``all_finite`` raised
TypeError, ``eligible_dtypes`` returned ``set()`` and ``cast_tree`` cast inside it."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, namedtuple

import torch

import ampkit
from ampkit.common.containers import iter_leaves, iter_tensors, map_tensors
from ampkit.engine.casting import cast_tree, eligible_dtypes
from ampkit.engine.function_patching import CastRule, cast_function
from ampkit.scaling.grad_scaler import GradScaler
from ampkit.scaling.overflow import all_finite

BF16, FP32 = torch.bfloat16, torch.float32
Pair = namedtuple("Pair", "first second")


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    extra: dict


def _output(value: float = 1.0) -> Output:
    return Output(torch.full((2,), value), {"aux": [torch.ones(1, dtype=BF16)]})


def test_walk_order_and_types():
    tree = [Pair(1, {"k": 2}), OrderedDict(a=3), _output(), "n"]
    leaves = list(iter_leaves(tree))
    assert leaves[:3] == [1, 2, 3] and leaves[-1] == "n" and len(leaves) == 6
    assert [t.dtype for t in iter_tensors(tree)] == [FP32, BF16]
    out = map_tensors(tree, lambda t: t * 2)
    assert type(out[0]) is Pair and type(out[1]) is OrderedDict
    assert isinstance(out[2], Output) and out[2].logits.tolist() == [2.0, 2.0]


def test_all_finite_looks_inside_a_dataclass():
    assert bool(all_finite(_output()))
    assert not bool(all_finite(_output(float("inf"))))


def test_eligible_dtypes_looks_inside_a_dataclass():
    assert eligible_dtypes(_output(), "cpu") == {FP32, BF16}
    assert eligible_dtypes(Pair(torch.ones(1), None), "cpu") == {FP32}


def test_cast_tree_casts_inside_a_dataclass():
    out = cast_tree(_output(), BF16)
    assert isinstance(out, Output) and out.logits.dtype is BF16


def test_grad_scaler_scales_inside_a_dataclass_and_a_dict():
    scaler = GradScaler("cpu", init_scale=4.0)
    out = scaler.scale(_output())
    assert out.logits.tolist() == [4.0, 4.0]
    assert out.extra["aux"][0].dtype is BF16 and out.extra["aux"][0].item() == 4.0
    assert scaler.scale({"loss": torch.ones(1)})["loss"].item() == 4.0


def test_cast_function_sees_tensors_inside_a_dataclass():
    seen = []

    @cast_function(CastRule.FP32)
    def head(out: Output) -> None:
        seen.append(out.extra["aux"][0].dtype)

    with ampkit.autocast("cpu", BF16):
        head(_output())
    assert seen == [FP32]
