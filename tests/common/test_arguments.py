"""One parser per kind of argument (ampkit.common.arguments): every layer that takes a dtype, a
device, a count or a loss scale accepts the same spellings and words its errors alike."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ampkit.common.arguments import (
    FLOAT_DTYPES,
    default_device_type,
    parse_device_type,
    parse_dtype,
    parse_loss_scale,
    positive_int,
)
from ampkit.conversion import ConversionConfig
from ampkit.conversion.levels import level_properties
from ampkit.policies.policy import Policy, as_dtype
from ampkit.scaling.loss_scaling import configure_loss_scaling

FP16, BF16, FP32 = torch.float16, torch.bfloat16, torch.float32


@pytest.mark.parametrize("name", ["fp32", "float32", "float", "torch.float32"])
def test_fp32_names_mean_float32_for_levels_and_conversion_alike(name):
    # Measured disagreement: level_properties took "fp32", ConversionConfig raised.
    props = level_properties("O2", BF16, cast_model_type=name, master_weights=False)
    assert props.cast_model_type is FP32
    assert ConversionConfig(param_dtype=name).param_dtype is FP32


@pytest.mark.parametrize(("name", "dtype"), [
    ("fp16", FP16), ("half", FP16), ("float16", FP16), ("torch.float16", FP16),
    ("bf16", BF16), ("bfloat16", BF16), (np.float16, FP16), (np.dtype("float16"), FP16),
    # any case, as the command line has always taken them (and AmpConfig now too)
    ("BF16", BF16), ("BFloat16", BF16), ("Half", FP16), ("Torch.Float16", FP16),
])
def test_low_precision_aliases_are_the_same_everywhere(name, dtype):
    assert parse_dtype(name) is dtype
    assert as_dtype(name) is dtype
    assert Policy("p", name).dtype is dtype
    assert ConversionConfig(compute_dtype=name).compute_dtype is dtype


def test_one_error_wording_names_the_argument_and_the_accepted_values():
    with pytest.raises(ValueError) as low:
        parse_dtype("fp32", "compute_dtype")
    assert str(low.value) == ("compute_dtype must be torch.float16 or torch.bfloat16 (or "
                              "their names: 'float16', 'fp16', 'half', 'bfloat16', 'bf16'), "
                              "got 'fp32'")
    with pytest.raises(ValueError) as floats:
        parse_dtype("int8", "param_dtype", accept=FLOAT_DTYPES, allow_none=True)
    assert str(floats.value).startswith(
        "param_dtype must be None or one of torch.float16, torch.bfloat16, torch.float32 "
        "(or their names: 'float16', 'fp16', 'half', 'bfloat16', 'bf16', 'float32', 'fp32',")
    # The same wording from the layers that parse through it.
    for make in (lambda: ConversionConfig(compute_dtype="fp32"),
                 lambda: level_properties("O1", "fp32")):
        with pytest.raises(ValueError, match=r"torch\.bfloat16 \(or their names: 'float16', "
                                             r"'fp16', 'half', 'bfloat16', 'bf16'\), got 'fp32'"):
            make()


def test_none_only_where_allowed():
    assert parse_dtype(None, allow_none=True) is None
    with pytest.raises(ValueError, match=r"dtype must be torch\.float16"):
        parse_dtype(None)
    with pytest.raises(ValueError, match=r"dtype must be a torch\.dtype or one of"):
        parse_dtype("float8", accept=None)
    assert parse_dtype("int8", accept=None) is torch.int8


def test_device_types():
    assert parse_device_type("cpu") == "cpu"
    assert parse_device_type(torch.device("cpu")) == "cpu"
    assert parse_device_type(None) == default_device_type()
    with pytest.raises(ValueError, match=r"device must be None .* got 'gpu'"):
        parse_device_type("gpu")


def test_counts():
    assert positive_int(2, "n") == 2
    with pytest.raises(ValueError, match="n must be an int >= 1, got 0"):
        positive_int(0, "n")
    with pytest.raises(TypeError, match="n must be an int >= 1, got bool True"):
        positive_int(True, "n")


@pytest.mark.parametrize("value", [0, -1.0, float("inf"), "static", True])
def test_loss_scale_is_refused_alike_by_levels_and_multi_loss(value):
    wording = (r"loss_scale must be 'dynamic', a positive finite number \(a static scale\) "
               r"or None \(no loss scaling\)")
    with pytest.raises(ValueError, match=wording):
        parse_loss_scale(value)
    with pytest.raises(ValueError, match=wording):
        level_properties("O1", BF16, loss_scale=value)
    with pytest.raises(ValueError, match=wording):
        configure_loss_scaling(value)
