"""Deprecated alias: this module moved to :mod:`ampkit.tools.accuracy.fp8_errors` (issue
49: measuring error is the accuracy tools' room, and the fp8 tools build on it). Importing
this path warns once (``DeprecationWarning``) and gives the moved module's names (its
private ones too, looked up there on use)."""

from typing import Any

from ampkit._moved import moved_module
from ampkit.tools.accuracy.fp8_errors import *  # noqa: F403
from ampkit.tools.accuracy.fp8_errors import __all__  # noqa: F401

_moved = moved_module(__name__, "ampkit.tools.accuracy.fp8_errors")


def __getattr__(name: str) -> Any:
    return getattr(_moved, name)
