"""Deprecated alias: this module is now :mod:`ampkit.scaling.loss_scaling` (named for what
it holds). ``ampkit.scale_loss`` and ``ampkit.scaling``'s names are unchanged; importing
this path warns once (``DeprecationWarning``) and gives the new module's names (its
private ones too, looked up there on use)."""

from typing import Any

from ampkit._moved import moved_module
from ampkit.scaling.loss_scaling import *  # noqa: F403
from ampkit.scaling.loss_scaling import __all__  # noqa: F401

_moved = moved_module(__name__, "ampkit.scaling.loss_scaling")


def __getattr__(name: str) -> Any:
    return getattr(_moved, name)
