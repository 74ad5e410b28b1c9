"""How every dialect reports the core's errors: in its framework's words.

A dialect never checks again what the core checks. It calls the core inside
:func:`framework_errors`, which re-raises the core's ``ValueError`` and ``TypeError``
with the framework's argument names in place of ampkit's (apex's
``keep_batchnorm_fp32`` for ``keep_norms_fp32``, Paddle's ``incr_ratio`` for
``growth_factor``) and, where the framework raises another type for the same refusal,
as that type (apex refuses a nonsensical ``opt_level`` override with ``RuntimeError``).
The message is the core's; only the names change.

Example:
    >>> from ampkit.dialects._errors import framework_errors
    >>> with framework_errors(names={"growth_factor": "incr_ratio"}):
    ...     raise ValueError("growth_factor must be > 1, got 0.5")
    Traceback (most recent call last):
    ...
    ValueError: incr_ratio must be > 1, got 0.5
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping

__all__ = ["framework_errors"]


@contextlib.contextmanager
def framework_errors(names: Mapping[str, str] | None = None,
                     types: Mapping[type[Exception], type[Exception]] | None = None
                     ) -> Iterator[None]:
    """Re-raise a ``ValueError``/``TypeError`` from the block with ``names`` (ampkit's
    word -> the framework's, whole words only) replaced in its message and its type
    mapped by ``types`` (exact type first, then the first base it is an instance of).

    Example:
        >>> from ampkit.dialects._errors import framework_errors
        >>> with framework_errors(names={"level": "opt_level"},
        ...                       types={ValueError: RuntimeError}):
        ...     raise ValueError("level O1 keeps fp32 parameters")
        Traceback (most recent call last):
        ...
        RuntimeError: opt_level O1 keeps fp32 parameters
    """
    renames = dict(names or {})
    pattern = (re.compile(r"\b(" + "|".join(map(re.escape, sorted(renames, key=len,
                                                                  reverse=True))) + r")\b")
               if renames else None)
    try:
        yield
    except (ValueError, TypeError) as error:
        mapping = dict(types or {})
        new_type = mapping.get(type(error)) or next(
            (target for source, target in mapping.items() if isinstance(error, source)),
            type(error))
        message = str(error)
        if pattern is not None:
            message = pattern.sub(lambda m: renames[m.group(1)], message)
        if new_type is type(error) and message == str(error):
            raise
        raise new_type(message) from None
