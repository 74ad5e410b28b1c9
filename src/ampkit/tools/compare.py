"""Deprecated alias: this module moved to :mod:`ampkit.tools.accuracy.compare` (issue 38).
``ampkit.compare`` and ``ampkit.tools``' names are unchanged; importing this path warns
once (``DeprecationWarning``) and gives the moved module itself, every name included."""

import sys

from ampkit.tools._moved import moved_module

sys.modules[__name__] = moved_module(__name__, "ampkit.tools.accuracy.compare")

