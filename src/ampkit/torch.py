"""``import ampkit.torch as amp``: ``torch.amp``'s API over ampkit; see
:mod:`ampkit.dialects.torch`."""

from ampkit.dialects.torch import *  # noqa: F403
from ampkit.dialects.torch import __all__  # noqa: F401
