"""The ``fp8=`` argument: which torchao float8 recipe the eligible Linears train with.

``fp8`` is ``None`` (off), one of the recipe names torchao's
``Float8LinearConfig.from_recipe_name`` knows (:data:`FP8_RECIPES`), or a
``torchao.float8.Float8LinearConfig`` built by hand (for options no recipe name
carries, such as ``enable_fsdp_float8_all_gather=True``). :func:`parse_fp8` checks the
value without importing torchao, so a configuration can be validated where torchao is
not installed; :func:`float8_linear_config` turns it into torchao's config and is where
a missing torchao becomes an ``ImportError`` that names the extra (``ampkit[fp8]``).

Example:
    >>> from ampkit.fp8 import parse_fp8
    >>> parse_fp8("RowWise"), parse_fp8(None)
    ('rowwise', None)
    >>> parse_fp8("e4m3")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: fp8 must be None, a torchao Float8LinearConfig or one of [...], got 'e4m3'
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import Any

import torch

from ampkit import torch_internals

__all__ = ["FP8_EXTRA", "FP8_RECIPES", "TORCHAO_TESTED", "check_fp8_device",
           "cpu_scaled_mm_takes_rowwise_scales", "float8_linear_config", "parse_fp8",
           "recipe_name", "require_torchao", "uses_rowwise_scales"]

#: The recipe names ``fp8=`` accepts: torchao's ``Float8LinearRecipeName`` values.
#: ``tensorwise``: one scale per tensor; ``rowwise``: one scale per row, power-of-two
#: scales; ``rowwise_with_gw_hp``: rowwise, with the weight gradient's matmul left in
#: high precision (the most accurate of the three).
FP8_RECIPES: tuple[str, ...] = ("tensorwise", "rowwise", "rowwise_with_gw_hp")

#: The pip extra that installs torchao at the release ampkit's fp8 was tested with.
FP8_EXTRA = "ampkit[fp8]"

#: The torchao minor release ampkit's fp8 support is tested with (pinned by the extra).
TORCHAO_TESTED = "0.18"

_CONFIG_CLASS = "Float8LinearConfig"


def _is_float8_config(value: Any) -> bool:
    # Recognised by class, without importing torchao for the common string case.
    cls = type(value)
    return cls.__name__ == _CONFIG_CLASS and cls.__module__.startswith("torchao.")


def parse_fp8(value: Any) -> Any:
    """Check an ``fp8=`` value and return its canonical form: ``None``, a recipe name
    from :data:`FP8_RECIPES` (lower case), or the ``Float8LinearConfig`` given.

    Does not import torchao, so it also validates configurations on machines without
    it (:func:`float8_linear_config` needs it).

    Raises:
        ValueError: an unknown recipe name (the accepted ones are listed).
        TypeError: neither ``None``, a string nor a torchao ``Float8LinearConfig``.

    Example:
        >>> from ampkit.fp8 import parse_fp8
        >>> parse_fp8(" tensorwise ")
        'tensorwise'
    """
    if value is None or _is_float8_config(value):
        return value
    if isinstance(value, str):
        name = value.strip().lower()
        if name in FP8_RECIPES:
            return name
        raise ValueError(f"fp8 must be None, a torchao Float8LinearConfig or one of "
                         f"{list(FP8_RECIPES)}, got {value!r}")
    raise TypeError(f"fp8 must be None, a recipe name (one of {list(FP8_RECIPES)}) or a "
                    f"torchao.float8.Float8LinearConfig, got {type(value).__name__}")


def recipe_name(fp8: Any) -> str:
    """A short name for a parsed ``fp8`` value, for reports: the recipe name, or
    ``"custom"`` for a ``Float8LinearConfig``.

    Example:
        >>> from ampkit.fp8 import recipe_name
        >>> recipe_name("rowwise")
        'rowwise'
    """
    fp8 = parse_fp8(fp8)
    if fp8 is None:
        raise ValueError("fp8 is None: no recipe")
    return fp8 if isinstance(fp8, str) else "custom"


def require_torchao() -> ModuleType:
    """``torchao.float8``, or an ``ImportError`` that names the extra to install.

    Example:
        >>> from ampkit.fp8 import require_torchao
        >>> require_torchao().__name__
        'torchao.float8'
    """
    try:
        return importlib.import_module("torchao.float8")
    except ImportError as err:
        raise ImportError(f"fp8= trains Linear layers in float8 through torchao, which is "
                          f"not installed: pip install '{FP8_EXTRA}' (torchao "
                          f"{TORCHAO_TESTED}.x, the release ampkit is tested with)"
                          ) from err


def float8_linear_config(fp8: Any) -> Any:
    """torchao's ``Float8LinearConfig`` for a (parsed or raw) ``fp8`` value.

    Raises:
        ImportError: torchao is not installed (names the extra ``ampkit[fp8]``).
        ValueError, TypeError: as :func:`parse_fp8`; ``None`` is a ValueError here.

    Example:
        >>> from ampkit.fp8 import float8_linear_config
        >>> cfg = float8_linear_config("rowwise")
        >>> cfg.cast_config_weight.scaling_granularity.value
        'axiswise'
    """
    fp8 = parse_fp8(fp8)
    if fp8 is None:
        raise ValueError("fp8 is None: there is no float8 config to build")
    float8 = require_torchao()
    if isinstance(fp8, str):
        return float8.Float8LinearConfig.from_recipe_name(fp8)
    return fp8


def uses_rowwise_scales(config: Any) -> bool:
    """Whether a torchao ``Float8LinearConfig`` scales any of its casts per row
    (``rowwise``, ``rowwise_with_gw_hp``), which ``torch._scaled_mm`` must support.

    Example:
        >>> from ampkit.fp8.recipe import float8_linear_config, uses_rowwise_scales
        >>> uses_rowwise_scales(float8_linear_config("tensorwise"))
        False
    """
    casts = (config.cast_config_input, config.cast_config_weight,
             config.cast_config_grad_output, config.cast_config_input_for_grad_weight,
             config.cast_config_weight_for_grad_input,
             config.cast_config_grad_output_for_grad_weight)
    return any(c is not None and c.scaling_granularity.value == "axiswise" for c in casts)


@functools.cache
def cpu_scaled_mm_takes_rowwise_scales() -> bool:
    """Whether this torch's CPU ``torch._scaled_mm`` takes per-row scales (torch 2.12
    and later; torch 2.11's CPU kernel takes one scale per tensor only). Probed once,
    on a 16 x 16 product.

    Example:
        >>> from ampkit.fp8.recipe import cpu_scaled_mm_takes_rowwise_scales
        >>> isinstance(cpu_scaled_mm_takes_rowwise_scales(), bool)
        True
    """
    a = torch.zeros(16, 16).to(torch.float8_e4m3fn)
    try:
        torch_internals.scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16),
                         out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


def check_fp8_device(fp8: Any, device_type: str | None) -> None:
    """Refuse, before anything changes, a per-row recipe on a CPU whose
    ``torch._scaled_mm`` takes per-tensor scales only (it would fail at the first
    forward). Needs torchao; ``fp8`` is a parsed value or a config.

    Raises:
        RuntimeError: naming the recipe, this torch and what works instead.

    Example:
        >>> from ampkit.fp8.recipe import check_fp8_device
        >>> check_fp8_device("tensorwise", "cpu")  # every torch's CPU kernel takes it
    """
    if device_type != "cpu" or cpu_scaled_mm_takes_rowwise_scales():
        return
    if uses_rowwise_scales(float8_linear_config(fp8)):
        raise RuntimeError(
            f"fp8={recipe_name(fp8)!r} scales per row, but this torch's "
            f"({torch.__version__}) CPU torch._scaled_mm takes one scale per tensor only; "
            f"use fp8='tensorwise' on CPU, or torch >= 2.12")
