"""The pure loss scales (DynamicLossScale, StaticLossScale), all_finite, ScaleSchedule."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ampkit
from ampkit.scaling import DynamicLossScale, ScaleSchedule, StaticLossScale, all_finite


def test_exported_from_the_top_level() -> None:
    assert ampkit.DynamicLossScale is DynamicLossScale
    assert ampkit.StaticLossScale is StaticLossScale


@settings(max_examples=25, deadline=None)
@given(finite=st.lists(st.booleans(), min_size=1, max_size=60),
       interval=st.integers(1, 5))
def test_dynamic_trajectory_equals_torch_update_kernel(finite: list[bool],
                                                       interval: int) -> None:
    ls = DynamicLossScale(2.0 ** 15, growth_interval=interval)
    scale, tracker = torch.tensor(2.0 ** 15), torch.tensor(0, dtype=torch.int32)
    for ok in finite:
        ls = ls.adjust(torch.tensor(ok))
        torch._amp_update_scale_(scale, tracker, torch.tensor(0.0 if ok else 1.0), 2.0, 0.5,
                                 interval)
        assert torch.equal(ls.loss_scale, scale)
        assert torch.equal(ls.growth_tracker, tracker)


def _mindspore_dynamic(scale: float, factor: float, window: int, finite: list[bool]
                       ) -> list[float]:
    """MindSpore's documented DynamicLossScaler rule, written out independently."""
    out, counter = [], 0
    for ok in finite:
        if ok:
            counter += 1
            if counter == window:
                scale, counter = scale * factor, 0
        else:
            scale, counter = max(1.0, scale / factor), 0
        out.append(scale)
    return out


def test_mindspore_rule_is_expressible() -> None:
    finite = [False] * 20 + [True] * 9 + [False, True, True, True]
    ls = DynamicLossScale(2.0 ** 10, growth_factor=2.0, backoff_factor=0.5,
                          growth_interval=3, min_scale=1.0)
    got = []
    for ok in finite:
        ls = ls.adjust(ok)
        got.append(float(ls.loss_scale))
    assert got == _mindspore_dynamic(2.0 ** 10, 2.0, 3, finite)
    assert min(got) == 1.0


def test_mxnet_cap() -> None:
    ls = DynamicLossScale(2.0 ** 23, growth_interval=2000, max_scale=2.0 ** 24)
    for _ in range(6000):
        ls = ls.adjust(True)
    assert float(ls.loss_scale) == 2.0 ** 24


def test_hysteresis_in_the_pure_object() -> None:
    ls = DynamicLossScale(8.0, hysteresis=2)
    seen = []
    for ok in (False, True, False, False, False):
        ls = ls.adjust(ok)
        seen.append((float(ls.loss_scale), int(ls.overflow_tracker)))
    assert seen == [(8.0, 1), (8.0, 0), (8.0, 1), (4.0, 0), (4.0, 1)]


def test_objects_are_immutable_and_adjust_returns_new_ones() -> None:
    ls = DynamicLossScale(4.0, growth_interval=1)
    new = ls.adjust(True)
    assert float(ls.loss_scale) == 4.0 and float(new.loss_scale) == 8.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        ls.loss_scale = torch.tensor(1.0)  # type: ignore[misc]
    static = StaticLossScale(128.0)
    assert static.adjust(False) is static and float(static.loss_scale) == 128.0


def test_scale_and_unscale_trees() -> None:
    ls = DynamicLossScale(2.0 ** 10)
    tree = {"a": torch.tensor([1.5, -2.0]), "b": [torch.tensor([3.0], dtype=torch.float16),
                                                  torch.tensor([7])], "c": None}
    scaled = ls.scale(tree)
    assert scaled["a"].tolist() == [1536.0, -2048.0]
    assert scaled["b"][0].dtype is torch.float16 and scaled["b"][0].item() == 3072.0
    assert scaled["b"][1] is tree["b"][1] and scaled["c"] is None  # integers untouched
    back = ls.unscale(scaled)
    assert back["a"].tolist() == [1.5, -2.0] and back["b"][0].item() == 3.0
    assert tree["a"].tolist() == [1.5, -2.0]  # inputs not modified


def test_unscale_uses_the_float64_reciprocal_like_torch() -> None:
    scale = 3.0 * 2.0 ** 10
    grads = torch.linspace(-1e4, 1e4, 101)
    ours = DynamicLossScale(scale).unscale(grads)
    theirs = grads.clone()
    torch._amp_foreach_non_finite_check_and_unscale_(
        [theirs], torch.zeros(()), torch.tensor(scale, dtype=torch.float64).reciprocal().float())
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize(("kwargs", "argument"), [
    ({"loss_scale": 0.0}, "loss_scale"),
    ({"loss_scale": math.nan}, "loss_scale"),
    ({"loss_scale": 2.0, "growth_factor": 1.0}, "growth_factor"),
    ({"loss_scale": 2.0, "backoff_factor": 1.0}, "backoff_factor"),
    ({"loss_scale": 2.0, "growth_interval": 0}, "growth_interval"),
    ({"loss_scale": 2.0, "hysteresis": 0}, "hysteresis"),
    ({"loss_scale": 0.5, "min_scale": 1.0}, "loss_scale"),
    ({"loss_scale": 2.0, "growth_tracker": -1}, "growth_tracker"),
    ({"loss_scale": torch.ones(2)}, "loss_scale"),
])
def test_dynamic_bad_input(kwargs: dict, argument: str) -> None:
    with pytest.raises(ValueError, match=argument):
        DynamicLossScale(**kwargs)


def test_static_bad_input_and_adjust_argument() -> None:
    for bad in (0.0, -1.0, math.inf):
        with pytest.raises(ValueError, match="loss_scale"):
            StaticLossScale(bad)
    with pytest.raises(TypeError, match="grads_finite"):
        DynamicLossScale(2.0).adjust("yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="grads_finite"):
        StaticLossScale(2.0).adjust(torch.ones(3, dtype=torch.bool))


def test_all_finite() -> None:
    assert all_finite([]).item() is True
    assert all_finite(torch.ones(3)).item() is True
    assert all_finite([torch.ones(2), {"x": torch.tensor([1.0, math.inf])}]).item() is False
    assert all_finite((torch.tensor([math.nan], dtype=torch.bfloat16),)).item() is False
    assert all_finite([torch.tensor([-math.inf], dtype=torch.float16)]).item() is False
    assert all_finite([torch.tensor([3]), None]).item() is True
    with pytest.raises(TypeError, match="tensors"):
        all_finite([torch.ones(1), "grad"])  # type: ignore[list-item]


def test_schedule_is_frozen_and_normalised() -> None:
    rule = ScaleSchedule(growth_factor=3, growth_interval=4)
    assert rule.growth_factor == 3.0 and isinstance(rule.growth_factor, float)
    with pytest.raises(dataclasses.FrozenInstanceError):
        rule.hysteresis = 2  # type: ignore[misc]
    assert ScaleSchedule().uses_native_rule
    assert not ScaleSchedule(hysteresis=2).uses_native_rule
    assert not ScaleSchedule(dynamic=False).uses_native_rule
