"""Levels O0-O3: the property table, overrides and the refused combinations."""

import pytest
import torch

import ampkit
from ampkit.conversion.levels import (
    LEVEL_PROPERTY_NAMES,
    Level,
    LevelProperties,
    MasterWeights,
    default_dtype,
    describe_levels,
    level_properties,
)

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
MW32, NO = MasterWeights.FP32, MasterWeights.NONE  # apex's master_weights True / False

# The README / DESIGN.md level table, written out by hand:
# (cast_model_type, keep_norms_fp32, master_weights, loss_scale, patch_ops, outputs)
TABLE = {
    (Level.O0, FP16): (FP32, None, NO, None, False, None),
    (Level.O1, FP16): (None, None, NO, "dynamic", True, FP32),
    (Level.O2, FP16): (FP16, True, MW32, "dynamic", True, FP32),
    (Level.O3, FP16): (FP16, False, NO, None, False, FP32),
    (Level.O0, BF16): (FP32, None, NO, None, False, None),
    (Level.O1, BF16): (None, None, NO, None, True, FP32),  # bf16: no loss scaling
    (Level.O2, BF16): (BF16, True, MW32, None, True, FP32),
    (Level.O3, BF16): (BF16, False, NO, None, False, FP32),
}


@pytest.mark.parametrize(("level", "dtype"), list(TABLE))
def test_default_properties_match_the_table(level, dtype):
    props = level_properties(level.value, dtype)
    got = tuple(getattr(props, name) for name in LEVEL_PROPERTY_NAMES)
    assert got == TABLE[level, dtype]
    assert props.level is level and props.dtype is dtype


def test_public_names_come_from_this_module():
    assert ampkit.Level is Level
    assert ampkit.LevelProperties is LevelProperties
    assert ampkit.level_properties is level_properties


@pytest.mark.parametrize("spelling", ["O2", "o2", " O2 ", Level.O2])
def test_level_spellings(spelling):
    assert Level.parse(spelling) is Level.O2


@pytest.mark.parametrize("bad", ["O4", "", "02", 2, None])
def test_unknown_level_lists_the_accepted_ones(bad):
    with pytest.raises(ValueError, match=r"level must be one of \['O0', 'O1', 'O2', 'O3'\]"):
        level_properties(bad, BF16)


@pytest.mark.parametrize("bad", [torch.float32, torch.float64, "int8", "fp8"])
def test_unknown_dtype_lists_the_accepted_ones(bad):
    with pytest.raises(ValueError, match=r"dtype must be torch.float16 or torch.bfloat16"):
        level_properties("O2", bad)


def test_dtype_none_is_the_device_autocast_default():
    assert level_properties("O2", None, device_type="cpu").dtype is BF16
    assert default_dtype("cpu") is BF16
    assert default_dtype("cuda") is FP16
    assert level_properties("O2", None, device_type="cuda").cast_model_type is FP16


def test_overrides_replace_defaults_and_none_keeps_them():
    props = level_properties("O2", FP16, loss_scale=128, keep_norms_fp32=False,
                             cast_model_outputs="bfloat16", master_weights=None)
    assert props.loss_scale == 128.0 and isinstance(props.loss_scale, float)
    assert props.keep_norms_fp32 is False
    assert props.cast_model_outputs is BF16
    assert props.master_weights is MW32  # None keeps the level default, as in apex
    assert level_properties("O2", BF16, patch_ops=False).patch_ops is False
    assert level_properties("O3", BF16, master_weights=True).master_weights is MW32
    assert level_properties("O1", FP16, cast_model_type=torch.float32).cast_model_type is FP32


@pytest.mark.parametrize(("level", "overrides", "message"), [
    ("O1", {"cast_model_type": FP16}, "O1 keeps fp32 parameters"),
    ("O1", {"cast_model_type": BF16}, "O1 keeps fp32 parameters"),
    ("O1", {"keep_norms_fp32": True}, "keep_norms_fp32 must be None"),
    ("O1", {"keep_norms_fp32": False}, "keep_norms_fp32 must be None"),
    ("O1", {"master_weights": True}, "nothing for master_weights to copy"),
    ("O0", {"patch_ops": True}, "use level O1"),
    ("O3", {"patch_ops": True}, "use level O2"),
    ("O0", {"cast_model_type": FP16}, "level O0 trains in float32"),
    ("O0", {"master_weights": True}, "needs low-precision parameters"),
])
def test_nonsensical_overrides_are_refused_with_an_explanation(level, overrides, message):
    with pytest.raises(ValueError, match=message):
        level_properties(level, FP16, **overrides)


@pytest.mark.parametrize("level", ["O2", "O3"])
@pytest.mark.parametrize("cast", [FP32, False])
def test_fp32_or_as_given_parameters_with_master_weights_are_their_own_truth(level, cast):
    """apex accepts O2 with cast_model_type=float32 (or False) plus master weights; with
    the parameters as the truth there is nothing to copy."""
    props = level_properties(level, FP16, cast_model_type=cast, master_weights=True)
    assert props.cast_model_type is cast and not props.casts_parameters


def test_fp32_parameters_at_o2_are_fine_without_master_weights():
    props = level_properties("O2", BF16, cast_model_type=FP32, master_weights=False)
    assert props.cast_model_type is FP32 and not props.casts_parameters


@pytest.mark.parametrize(("name", "value", "error", "message"), [
    ("loss_scale", 0, ValueError, "loss_scale must be 'dynamic', a positive finite"),
    ("loss_scale", -1.0, ValueError, "loss_scale must be"),
    ("loss_scale", float("inf"), ValueError, "loss_scale must be"),
    ("loss_scale", "static", ValueError, "loss_scale must be"),
    ("loss_scale", True, ValueError, "loss_scale must be"),
    ("cast_model_type", torch.float64, ValueError, "cast_model_type must be None"),
    ("cast_model_outputs", "int8", ValueError, "cast_model_outputs must be None"),
    ("keep_norms_fp32", "yes", TypeError, "keep_norms_fp32 must be True, False or None"),
    ("patch_ops", 1, TypeError, "patch_ops must be True, False or None"),
])
def test_bad_property_values(name, value, error, message):
    with pytest.raises(error, match=message):
        level_properties("O2", FP16, **{name: value})


def test_unknown_override_names_it_and_lists_the_accepted():
    with pytest.raises(TypeError, match=r"unknown level properties \['opt_level'\]; "
                                        r"accepted: \['cast_model_type'"):
        level_properties("O2", FP16, opt_level="O1")


def test_properties_are_immutable():
    props = level_properties("O2", FP16)
    with pytest.raises(AttributeError):
        props.master_weights = False


def test_describe_prints_every_property():
    text = level_properties("O2", FP16).describe()
    assert text.splitlines() == [
        "level O2 (low-precision dtype float16)",
        "  cast_model_type     float16",
        "  keep_norms_fp32     True",
        "  master_weights      True",
        "  loss_scale          dynamic",
        "  patch_ops           True",
        "  cast_model_outputs  float32",
    ]


def test_describe_levels_is_the_whole_table():
    lines = describe_levels(BF16).splitlines()
    assert lines[0] == ("| level | cast_model_type | keep_norms_fp32 | master_weights | "
                        "loss_scale | patch_ops | cast_model_outputs |")
    assert lines[2:] == [
        "| O0 | float32 | None | False | None | False | None |",
        "| O1 | None | None | False | None | True | float32 |",
        "| O2 | bfloat16 | True | True | None | True | float32 |",
        "| O3 | bfloat16 | False | False | None | False | float32 |",
        "| O2 | bfloat16 | True | stochastic | None | True | float32 |",
        "| O2 | bfloat16 | True | kahan | None | True | float32 |",
    ]
    assert len(describe_levels(torch.float16).splitlines()) == 6  # no pure fp16 rows
