"""Old module paths kept as deprecated aliases after a module moved (``ampkit.pure``,
once ``ampkit.master_weights_pure``; ``ampkit.tools``' subpackages): importing one warns
once and hands back the module's new home, whose names the alias serves.

Example:
    >>> import warnings
    >>> from ampkit._moved import moved_module
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     moved_module("old.path", "json").__name__
    'json'
    >>> str(caught[0].message)
    'old.path is deprecated: it moved to json (same names); import it from there'
"""

from __future__ import annotations

import importlib
import warnings
from types import ModuleType

__all__ = ["moved_module"]


def moved_module(old: str, new: str) -> ModuleType:
    """Warn (``DeprecationWarning``, pointed at the user's import line rather than at
    importlib) that module ``old`` moved to ``new``, and return ``new``, whose names the
    alias serves. An alias module runs once per process, so it warns once."""
    # 3: past this function and the alias module to the importing line (warnings
    # already skips importlib's own frames).
    warnings.warn(f"{old} is deprecated: it moved to {new} (same names); import it "
                  f"from there", DeprecationWarning, stacklevel=3)
    return importlib.import_module(new)
