"""``import ampkit.apex as amp``: apex's ``amp`` API over ampkit; see
:mod:`ampkit.dialects.apex`."""

from ampkit.dialects.apex import *  # noqa: F403
from ampkit.dialects.apex import __all__  # noqa: F401
from ampkit.dialects.apex.state import amp_state as _amp_state  # noqa: F401  (apex scripts read it)
