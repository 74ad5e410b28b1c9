"""One builder from a level to its properties and conversion: ``AmpConfig``,
``initialize``, ``convert_model``, the integrations and the level helpers all reach the
level table through :func:`ampkit.conversion.levels.build_level`, and the level's text is
parsed once per call."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
import torch.nn as nn

import ampkit
import ampkit.conversion.levels as levels
from ampkit.config import AmpConfig
from ampkit.conversion import get_conversion
from ampkit.conversion.levels import (
    BuiltLevel,
    Level,
    build_level,
    conversion_for_level,
    describe_levels,
    level_properties,
)
from ampkit.front_door import convert_model


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 2))


# (level, keep_norms_fp32, master_weights, cast_model_outputs, custom_black_list,
#  keep_fp32_modules) that every level accepts with bfloat16, and O2's other corners
_GRID = [
    *[(lvl, None, None, None, (), ()) for lvl in ("O0", "O1", "O2", "O3")],
    ("O1", None, None, "as_computed", ("gelu",), ("3",)),
    ("O2", False, None, None, ("gelu",), ("0",)),
    ("O2", True, False, torch.float16, (), ()),
    ("O2", None, "stochastic", None, ("softmax",), ()),
    ("O3", None, "kahan", "as_computed", (), ("1",)),
]


@pytest.mark.parametrize("row,dtype", [
    (row, dtype) for row in _GRID for dtype in (torch.bfloat16, torch.float16)
    if dtype is torch.bfloat16 or row[2] not in ("stochastic", "kahan")],  # bf16 only
    ids=str)
def test_the_config_initialize_and_convert_model_make_one_conversion(row, dtype):
    level, norms, master, outputs, black, keep = row
    settings: dict[str, Any] = dict(keep_norms_fp32=norms, master_weights=master,
                                    cast_model_outputs=outputs)
    if black:
        settings["custom_black_list"] = black
    if keep:
        settings["keep_fp32_modules"] = keep
    built = build_level(level, dtype, **settings)
    config = AmpConfig(level=level, dtype=dtype, **settings)
    assert config.level_conversion() == built
    by_keywords = ampkit.initialize(_net(), level=level, dtype=dtype, **settings)
    by_config = ampkit.initialize(_net(), config=config)
    direct = convert_model(_net(), level, dtype, **settings)
    for model in (by_keywords, by_config, direct):
        assert get_conversion(model) == built.conversion
    assert conversion_for_level(level, dtype, **settings) == built.conversion
    assert level_properties(level, dtype, **{k: v for k, v in settings.items()
                                             if k in levels.LEVEL_PROPERTY_NAMES}
                            ) == built.properties


def _callers_of_the_table(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The function that called the level table's private first step, per call."""
    seen: list[str] = []
    real = levels._properties

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(sys._getframe(1).f_code.co_name)
        return real(*args, **kwargs)

    monkeypatch.setattr(levels, "_properties", spy)
    return seen


def test_every_route_reaches_the_level_table_through_the_one_builder(monkeypatch):
    from ampkit.integrations._settings import AmpkitSettings
    from ampkit.policies.presets import get_policy

    seen = _callers_of_the_table(monkeypatch)
    config = AmpConfig("O2", "bfloat16", custom_black_list=["gelu"])
    config.level_conversion("cpu")
    AmpConfig("O2").level_conversion("cpu")  # dtype=None: built for the device
    ampkit.initialize(_net(), level="O2", dtype="bfloat16")
    ampkit.initialize(_net(), level="O1", dtype="bfloat16", policy=get_policy("torch"),
                      keep_fp32_modules=[nn.LayerNorm])  # in-memory values
    ampkit.initialize(_net(), level="O3", dtype="bfloat16", cast_buffers=True)  # apex's
    convert_model(_net(), "O2", "bfloat16")
    level_properties("O1")
    conversion_for_level("O3", "bfloat16")
    describe_levels("bfloat16")
    AmpkitSettings.build("O2", None, {"patch_ops": True}, owner="P").properties("cpu")
    assert len(seen) >= 14 and set(seen) == {"build_level"}, seen


def test_initialize_parses_the_levels_text_once(monkeypatch):
    from ampkit.policies.presets import get_policy

    texts: list[Any] = []
    real = Level.parse.__func__  # type: ignore[attr-defined]

    def spy(cls: type[Level], value: Any) -> Level:
        if not isinstance(value, Level):
            texts.append(value)
        return real(cls, value)

    monkeypatch.setattr(Level, "parse", classmethod(spy))
    ampkit.initialize(_net(), level="o2", dtype="bfloat16", keep_norms_fp32=False)
    assert texts == ["o2"]
    texts.clear()
    ampkit.initialize(_net(), level="O1", dtype="bfloat16", policy=get_policy("torch"))
    assert texts == ["O1"]


def test_the_builder_hands_back_properties_and_conversion_by_name():
    built = build_level("O2", "float16", keep_fp32_modules=["head"], loss_scale=64.0)
    assert isinstance(built, BuiltLevel) and isinstance(built, tuple)
    props, conversion = built
    assert props is built.properties and conversion is built.conversion
    assert props.level is Level.O2 and props.loss_scale == 64.0
    assert conversion.param_compute_dtype is torch.float16
    assert conversion.keep_fp32_modules[-1] == "head"


def test_an_empty_custom_list_is_no_list_at_a_level_that_patches_no_ops():
    # AmpConfig's default () and an explicit [] mean the same: nothing to cast
    assert (build_level("O3", "bfloat16", custom_white_list=[]).conversion
            == build_level("O3", "bfloat16").conversion)
    with pytest.raises(ValueError, match="patch_ops=False does not do; use level O1 or O2"):
        build_level("O3", "bfloat16", custom_white_list=["gelu"])


def test_the_builder_refuses_as_level_properties_does():
    with pytest.raises(TypeError, match=r"unknown level properties \['cast_model_typ'\]"):
        build_level("O2", cast_model_typ=torch.float16)
    with pytest.raises(TypeError, match=r"unknown level properties \['policy'\]"):
        level_properties("O2", policy="torch")  # a conversion setting is no property
    with pytest.raises(ValueError, match="level must be one of"):
        build_level("O5")


def test_the_level_has_one_builder_and_no_second_entry():
    for gone in ("conversion_of", "properties_of", "conversion_config"):
        assert not hasattr(levels, gone), gone
