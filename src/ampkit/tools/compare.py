"""Deprecated alias: this module moved to :mod:`ampkit.tools.accuracy.compare` (issue 38).
``ampkit.compare`` and ``ampkit.tools``' names are unchanged; importing this path warns
once (``DeprecationWarning``) and gives the moved module's names (its private ones
too, looked up there on use)."""

from typing import Any

from ampkit._moved import moved_module
from ampkit.tools.accuracy.compare import *  # noqa: F403
from ampkit.tools.accuracy.compare import __all__  # noqa: F401

_moved = moved_module(__name__, "ampkit.tools.accuracy.compare")


def __getattr__(name: str) -> Any:
    return getattr(_moved, name)
