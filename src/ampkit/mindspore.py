"""``import ampkit.mindspore as amp``: ``mindspore.amp``'s API over ampkit; see
:mod:`ampkit.dialects.mindspore`."""

from ampkit.dialects.mindspore import *  # noqa: F403
from ampkit.dialects.mindspore import __all__  # noqa: F401
