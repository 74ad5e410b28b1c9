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

import warnings

from ampkit.pure import (
    PURE_ROUNDINGS,
    PureLowPrecisionOptimizer,
    PureState,
    check_pure_optimizer,
    mark_pure_models,
    optimizer_class_name,
    pure_low_precision,
    pure_rounding,
    pure_settings,
    rebuild_pure,
    stochastic_round,
)

__all__ = [
    "PURE_ROUNDINGS",
    "PureLowPrecisionOptimizer",
    "check_pure_optimizer",
    "mark_pure_models",
    "optimizer_class_name",
    "pure_low_precision",
    "pure_settings",
    "pure_rounding",
    "stochastic_round",
]

# The names pickles of pure optimizers made before the rename refer to.
_Pure, _rebuild_pure = PureState, rebuild_pure

# Module code runs once per process, so this warns once, naming the new path.
warnings.warn("ampkit.master_weights_pure is deprecated: import from ampkit.pure "
              "(pure low-precision training) instead; pickles that name the old module "
              "still load, and save under the new one", DeprecationWarning, stacklevel=2)
