"""apex's optimization properties and its opt_level table (``O0``-``O3``), and apex's
spellings of ``initialize``'s overrides, parsed; which combinations make sense is the
core's to say, in :func:`ampkit.dialects.apex.frontend.initialize`.

Example:
    >>> from ampkit.dialects.apex.opt_levels import OPT_LEVELS, apply_overrides
    >>> apply_overrides("O2", {"loss_scale": "128"}).loss_scale
    128.0
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ampkit.common.arguments import parse_dtype, parse_loss_scale

__all__ = ["MODEL_DTYPES", "OPT_LEVELS", "Properties", "apply_overrides", "bool_override",
           "dtype_override", "loss_scale_override"]

#: The dtypes ``cast_model_type``, ``cast_model_outputs`` and ``dtype`` accept.
MODEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclasses.dataclass(frozen=True)
class Properties:
    """apex's optimization properties (``amp._amp_state.opt_properties``), immutable.

    Example:
        >>> from ampkit.apex import OPT_LEVELS
        >>> OPT_LEVELS["O2"].master_weights, OPT_LEVELS["O3"].loss_scale
        (True, 1.0)
    """

    opt_level: str
    cast_model_type: torch.dtype | bool | None
    patch_torch_functions: bool
    keep_batchnorm_fp32: bool | None
    master_weights: bool | None
    loss_scale: str | float
    cast_model_outputs: torch.dtype | None = None
    enabled: bool = True

    def describe(self) -> str:
        """The properties, one per line, as apex prints them.

        Example:
            >>> from ampkit.apex import OPT_LEVELS
            >>> print(OPT_LEVELS["O0"].describe().splitlines()[0])
            cast_model_type        : torch.float32
        """
        return "\n".join(f"{f.name:<22} : {getattr(self, f.name)}"
                         for f in dataclasses.fields(self) if f.name != "opt_level")


#: apex's opt_level table.
OPT_LEVELS: dict[str, Properties] = {
    "O0": Properties("O0", torch.float32, False, None, False, 1.0),
    "O1": Properties("O1", None, True, None, None, "dynamic"),
    "O2": Properties("O2", torch.float16, False, True, True, "dynamic"),
    "O3": Properties("O3", torch.float16, False, False, False, 1.0),
}


def dtype_override(value: Any, argument: str) -> torch.dtype:
    return parse_dtype(value, argument, accept=MODEL_DTYPES)


def bool_override(value: Any, argument: str) -> bool:
    # apex accepts the strings "True"/"False" (as they come from argparse).
    if isinstance(value, bool):
        return value
    if value == "True":
        return True
    if value == "False":
        return False
    raise ValueError(f"{argument} must be True, False (or 'True'/'False') or None, got "
                     f"{value!r}")


def loss_scale_override(value: Any) -> str | float:
    # apex also takes a number's string (as it comes from argparse).
    number = value
    if isinstance(value, str) and value != "dynamic":
        try:
            number = float(value)
        except ValueError:
            pass
    try:
        return parse_loss_scale(number, allow_none=False)
    except ValueError:  # apex's wording
        raise ValueError(f"loss_scale must be 'dynamic' or a positive number, got "
                         f"{value!r}") from None


def apply_overrides(opt_level: str, overrides: dict[str, Any]) -> Properties:
    """apex's spellings of the overrides, parsed; which combinations make sense is the
    core's to say (``ampkit.conversion.levels``), in :func:`initialize`."""
    changes: dict[str, Any] = {}
    for name, value in overrides.items():
        if value is None:
            continue
        if name == "cast_model_type":
            # False: apex's "leave the model as it is" (falsy: nothing is cast).
            changes[name] = False if value is False else dtype_override(value, name)
        elif name in ("patch_torch_functions", "keep_batchnorm_fp32", "master_weights"):
            changes[name] = bool_override(value, name)
        elif name == "loss_scale":
            changes[name] = loss_scale_override(value)
        elif name == "cast_model_outputs":
            changes[name] = dtype_override(value, name)
    return dataclasses.replace(OPT_LEVELS[opt_level], **changes)
