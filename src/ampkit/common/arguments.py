"""Argument parsing shared by every layer: dtype names, device types, counts and scales.

One parser per kind of argument, with one error wording: the exception names the
argument, lists the values it accepts and shows what it got. ``ValueError`` for a bad
value; ``TypeError`` where the type is wrong (counts and scales; a dtype's error is
always a ``ValueError``, as ``torch``'s own dtype errors are).

- :func:`parse_dtype`: a ``torch.dtype`` or its name (``"float16"``, ``"fp16"``,
  ``"half"``, ``"bfloat16"``, ``"bf16"``, ``"float32"``, ``"fp32"``, ``"float"``, ...,
  an optional ``"torch."`` prefix, numpy dtypes), checked against the dtypes the caller
  accepts.
- :func:`default_device_type` / :func:`parse_device_type`: ``"cuda"`` when available,
  else ``"cpu"``; a device given as ``None``, a string or a ``torch.device``.
- :func:`positive_int`, :func:`positive_number`: counts and scales.
- :func:`parse_loss_scale`: ``"dynamic"``, a static scale or ``None``.

Dialects that must keep their framework's wording catch the ``ValueError`` and reword
it; they never re-check.
"""

from __future__ import annotations

import difflib
import math
import numbers
import sys
import warnings
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any, Literal, overload

import torch

__all__ = [
    "DEPRECATED_NAMES",
    "FLOAT_DTYPES",
    "LOW_PRECISION",
    "canonical_names",
    "default_device_type",
    "did_you_mean",
    "dtype_names",
    "parse_device_type",
    "parse_dtype",
    "parse_loss_scale",
    "non_negative_number",
    "positive_int",
    "positive_number",
]

#: The low-precision dtypes a policy may compute in.
LOW_PRECISION: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
#: The floating dtypes mixed precision moves between.
FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32)

# Short names the ML frameworks use besides torch's own attribute names ("float16",
# "half", "float", "double", ...), which are looked up on ``torch`` itself.
_ALIASES: dict[str, torch.dtype] = {
    "fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32,
    "fp64": torch.float64,
}
# Names shown in errors, per dtype, in this order.
_SHOWN: dict[torch.dtype, tuple[str, ...]] = {
    torch.float16: ("float16", "fp16", "half"),
    torch.bfloat16: ("bfloat16", "bf16"),
    torch.float32: ("float32", "fp32", "float"),
    torch.float64: ("float64", "fp64", "double"),
}


def did_you_mean(name: str, known: Iterable[str], n: int = 3) -> str:
    """``"; did you mean 'a', 'b'?"`` for the names in ``known`` closest to ``name``
    (``""`` when none is close): the one wording of every "unknown name" error.

    Example:
        >>> from ampkit.common.arguments import did_you_mean
        >>> did_you_mean("sofmax", ["softmax", "linear"])
        "; did you mean 'softmax'?"
        >>> did_you_mean("zzz", ["softmax"])
        ''
    """
    close = difflib.get_close_matches(name, sorted(known), n=n, cutoff=0.6)
    return f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""


def dtype_names(accept: Iterable[torch.dtype]) -> list[str]:
    """The names :func:`parse_dtype` accepts for ``accept`` (canonical name first).

    Example:
        >>> import torch
        >>> from ampkit.common.arguments import dtype_names
        >>> dtype_names([torch.bfloat16])
        ['bfloat16', 'bf16']
    """
    names: list[str] = []
    for dtype in accept:
        names.extend(_SHOWN.get(dtype, (str(dtype).removeprefix("torch."),)))
    return names


def _lookup(value: Any, aliases: bool) -> torch.dtype | None:
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and not aliases:
        found = getattr(torch, value, None)
        return found if isinstance(found, torch.dtype) and str(found) == f"torch.{value}" \
            else None
    if isinstance(value, str):
        # any case, as the command line takes them: torch's dtype names are lower case
        key = value.strip().lower().removeprefix("torch.")
        if key in _ALIASES:
            return _ALIASES[key]
        found = getattr(torch, key, None)
        return found if isinstance(found, torch.dtype) else None
    # numpy spellings (np.float16, np.dtype("int8")); numpy is only looked at when the
    # caller has imported it, so ampkit does not need it.
    numpy = sys.modules.get("numpy")
    if numpy is not None and (isinstance(value, numpy.dtype) or (
            isinstance(value, type) and issubclass(value, numpy.generic))):
        found = getattr(torch, numpy.dtype(value).name, None)
        return found if isinstance(found, torch.dtype) else None
    return None


def _one_of(choices: list[str], allow_none: bool) -> str:
    if allow_none:
        return "None or one of " + ", ".join(choices)
    if len(choices) == 2:
        return " or ".join(choices)
    return "one of " + ", ".join(choices)


@overload
def parse_dtype(value: Any, argument: str = ..., *,
                accept: Iterable[torch.dtype] | None = ...,
                allow_none: Literal[False] = ..., aliases: bool = ...) -> torch.dtype: ...
@overload
def parse_dtype(value: Any, argument: str = ..., *,
                accept: Iterable[torch.dtype] | None = ...,
                allow_none: bool, aliases: bool = ...) -> torch.dtype | None: ...
def parse_dtype(value: Any, argument: str = "dtype", *,
                accept: Iterable[torch.dtype] | None = LOW_PRECISION,
                allow_none: bool = False, aliases: bool = True) -> torch.dtype | None:
    """Check and normalise a dtype given as a ``torch.dtype``, a name or a numpy dtype.

    Args:
        value: the argument's value.
        argument: its name, for the error.
        accept: the dtypes the caller accepts (default: float16 and bfloat16); ``None``
            accepts every torch dtype.
        allow_none: ``None`` is accepted (and returned).
        aliases: names other than torch's canonical ones (``"fp16"``, ``"half"``,
            ``"torch.float16"``) are accepted; a dialect whose framework refuses them
            passes ``False``.

    Raises:
        ValueError: ``value`` names no accepted dtype; the message names ``argument``
            and lists the accepted dtypes and their names.

    Example:
        >>> import torch
        >>> from ampkit.common.arguments import FLOAT_DTYPES, parse_dtype
        >>> parse_dtype("bf16"), parse_dtype("fp32", accept=FLOAT_DTYPES)
        (torch.bfloat16, torch.float32)
        >>> parse_dtype("fp32", "param_dtype")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: param_dtype must be torch.float16 or torch.bfloat16 (or their ...), got 'fp32'
    """
    if value is None and allow_none:
        return None
    accepted = None if accept is None else tuple(accept)
    dtype = _lookup(value, aliases)
    if dtype is not None and (accepted is None or dtype in accepted):
        return dtype
    if accepted is None:
        shown = dtype_names((*FLOAT_DTYPES, torch.float64))
        choices = f"a torch.dtype or one of {shown}"
        what = f"None or {choices}" if allow_none else choices
        raise ValueError(f"{argument} must be {what} (or another torch dtype's name), "
                         f"got {value!r}")
    listed = _one_of([f"torch.{str(d).removeprefix('torch.')}" for d in accepted], allow_none)
    names = ", ".join(repr(n) for n in (dtype_names(accepted) if aliases else
                                        [str(d).removeprefix("torch.") for d in accepted]))
    raise ValueError(f"{argument} must be {listed} (or their names: {names}), got {value!r}")


def default_device_type() -> str:
    """The device type a ``None`` device means: ``"cuda"`` when CUDA is available,
    else ``"cpu"``.

    Example:
        >>> import torch
        >>> from ampkit.common.arguments import default_device_type
        >>> default_device_type() == ("cuda" if torch.cuda.is_available() else "cpu")
        True
    """
    return "cuda" if torch.cuda.is_available() else "cpu"


def parse_device_type(value: Any, argument: str = "device") -> str:
    """The device type of ``value``: ``None`` (:func:`default_device_type`), a device
    string (``"cuda:1"``) or a ``torch.device``.

    Example:
        >>> from ampkit.common.arguments import parse_device_type
        >>> parse_device_type("cpu"), parse_device_type(torch.device("cpu"))
        ('cpu', 'cpu')
    """
    if value is None:
        return default_device_type()
    if isinstance(value, torch.device):
        return value.type
    if isinstance(value, str):
        try:
            return torch.device(value).type
        except RuntimeError:
            pass
    raise ValueError(f"{argument} must be None (cuda if available, else cpu), a device type "
                     f"such as 'cuda' or 'cpu', or a torch.device; got {value!r}")


def positive_int(value: Any, argument: str) -> int:
    """``value`` as an int if it is an integer >= 1 (a count), else raise
    (``TypeError`` for a non-integer, ``ValueError`` for a bad value).

    Example:
        >>> from ampkit.common.arguments import positive_int
        >>> positive_int(3, "num_losses")
        3
        >>> positive_int(0, "num_losses")
        Traceback (most recent call last):
        ...
        ValueError: num_losses must be an int >= 1, got 0
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{argument} must be an int >= 1, got {type(value).__name__} "
                        f"{value!r}")
    if value < 1:
        raise ValueError(f"{argument} must be an int >= 1, got {value!r}")
    return int(value)


def positive_number(value: Any, argument: str) -> float:
    """``value`` as a float if it is a real number that is finite and > 0, else raise
    (``TypeError`` for a non-number, ``ValueError`` for a bad value).

    Example:
        >>> from ampkit.common.arguments import positive_number
        >>> positive_number(2 ** 16, "init_scale")
        65536.0
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{argument} must be a positive finite number, "
                        f"got {type(value).__name__} {value!r}")
    number = float(value)
    if not math.isfinite(number) or number <= 0.0:
        raise ValueError(f"{argument} must be a positive finite number, got {value!r}")
    return number


def non_negative_number(value: Any, argument: str) -> float:
    """``value`` as a float if it is a real number that is finite and >= 0 (a tolerance),
    else raise (``TypeError`` for a non-number, ``ValueError`` for a bad value).

    Example:
        >>> from ampkit.common.arguments import non_negative_number
        >>> non_negative_number(0, "tolerance")
        0.0
        >>> non_negative_number(-1, "tolerance")
        Traceback (most recent call last):
        ...
        ValueError: tolerance must be a finite number >= 0, got -1
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{argument} must be a finite number >= 0, "
                        f"got {type(value).__name__} {value!r}")
    number = float(value)
    if not math.isfinite(number) or number < 0.0:
        raise ValueError(f"{argument} must be a finite number >= 0, got {value!r}")
    return number


@overload
def parse_loss_scale(value: Any, argument: str = ..., *,
                     allow_none: Literal[True] = ...) -> str | float | None: ...
@overload
def parse_loss_scale(value: Any, argument: str = ..., *,
                     allow_none: Literal[False]) -> str | float: ...
def parse_loss_scale(value: Any, argument: str = "loss_scale", *,
                     allow_none: bool = True) -> str | float | None:
    """A loss-scale setting: ``"dynamic"``, a positive finite number (a static scale,
    returned as a float) or, where allowed, ``None`` (no loss scaling).

    Example:
        >>> from ampkit.common.arguments import parse_loss_scale
        >>> parse_loss_scale("dynamic"), parse_loss_scale(128)
        ('dynamic', 128.0)
        >>> parse_loss_scale(0)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: loss_scale must be 'dynamic', a positive finite number ... got 0
    """
    if (value is None and allow_none) or (isinstance(value, str) and value == "dynamic"):
        return value
    if (isinstance(value, numbers.Real) and not isinstance(value, bool)
            and math.isfinite(value) and float(value) > 0):
        return float(value)
    choices = ("'dynamic', a positive finite number (a static scale) or None (no loss "
               "scaling)" if allow_none else "'dynamic' or a positive finite number (a "
               "static scale)")
    raise ValueError(f"{argument} must be {choices}, got {value!r}")


#: Names a setting was also taken under, each mapped to its one name now. They still
#: work, with a ``FutureWarning`` naming the one to use (:func:`canonical_names`).
#: ``min_scale``/``max_scale`` are the names: ``ampkit.GradScaler``, its schedule and
#: ``AmpConfig`` take them; ``min_loss_scale``/``max_loss_scale`` are apex's, which
#: ``ampkit.apex.initialize`` keeps. ``keep_batchnorm_fp32`` and
#: ``patch_torch_functions`` are apex's names of ``keep_norms_fp32`` and ``patch_ops``.
DEPRECATED_NAMES: Mapping[str, str] = MappingProxyType({
    "min_loss_scale": "min_scale", "max_loss_scale": "max_scale",
    "keep_batchnorm_fp32": "keep_norms_fp32", "patch_torch_functions": "patch_ops"})


def canonical_names(options: Mapping[str, Any], owner: str, stacklevel: int = 2
                    ) -> dict[str, Any]:
    """``options`` with each name of :data:`DEPRECATED_NAMES` replaced by its one name,
    and a ``FutureWarning`` naming it (Python shows it once per line that calls;
    ``stacklevel`` as ``warnings.warn``'s, counted from the caller).

    Raises:
        ValueError: both names of one setting given (``None`` counts as not given).

    Example:
        >>> import warnings
        >>> from ampkit.common.arguments import canonical_names
        >>> with warnings.catch_warnings(record=True) as seen:
        ...     warnings.simplefilter("always")
        ...     canonical_names({"min_loss_scale": 1.0}, "initialize")
        {'min_scale': 1.0}
        >>> str(seen[0].message)
        'initialize: min_loss_scale is deprecated; pass min_scale (the same setting)'
    """
    out = dict(options)
    for old, new in DEPRECATED_NAMES.items():
        if old not in out:
            continue
        if out.get(new) is not None:
            raise ValueError(f"{owner}: {old} and {new} are the same setting; pass {new}")
        warnings.warn(f"{owner}: {old} is deprecated; pass {new} (the same setting)",
                      FutureWarning, stacklevel=stacklevel + 1)
        out[new] = out.pop(old)
    return out
