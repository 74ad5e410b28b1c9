"""Deprecated: the former name of :mod:`ampkit.pure` (pure low-precision training), kept
so that imports and pickles made before the rename keep working. Importing it warns
once (``DeprecationWarning``); import from ``ampkit.pure`` instead.

Example:
    >>> import warnings
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore", DeprecationWarning)
    ...     from ampkit.master_weights_pure import PureLowPrecisionOptimizer
    >>> import ampkit.pure
    >>> PureLowPrecisionOptimizer is ampkit.pure.PureLowPrecisionOptimizer
    True
"""

from __future__ import annotations

from typing import Any

from ampkit._moved import moved_module
from ampkit.pure import *  # noqa: F403
from ampkit.pure import __all__  # noqa: F401
from ampkit.pure.optimizer import PureState, rebuild_pure

# The names pickles of pure optimizers made before the rename refer to.
_Pure, _rebuild_pure = PureState, rebuild_pure

# Module code runs once per process, so this warns once, naming the new path.
_moved = moved_module(__name__, "ampkit.pure")


def __getattr__(name: str) -> Any:
    return getattr(_moved, name)
