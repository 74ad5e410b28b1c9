"""Deprecated alias: this module moved to :mod:`ampkit.tools.ops.fp8_casts` (issue 49:
watching casts as they run is the op tools' room, which the numerics checker uses it
from). Importing this path warns once (``DeprecationWarning``) and gives the moved
module's names (its private ones too, looked up there on use)."""

from typing import Any

from ampkit._moved import moved_module
from ampkit.tools.ops.fp8_casts import *  # noqa: F403
from ampkit.tools.ops.fp8_casts import __all__  # noqa: F401

_moved = moved_module(__name__, "ampkit.tools.ops.fp8_casts")


def __getattr__(name: str) -> Any:
    return getattr(_moved, name)
