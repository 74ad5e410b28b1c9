"""``import ampkit.paddle as amp``: ``paddle.amp``'s API over ampkit; see
:mod:`ampkit.dialects.paddle`."""

from ampkit.dialects.paddle import *  # noqa: F403
from ampkit.dialects.paddle import __all__  # noqa: F401
