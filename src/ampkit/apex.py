"""``import ampkit.apex as amp``: apex's ``amp`` API over ampkit; see
:mod:`ampkit.dialects.apex`."""

from ampkit.dialects.apex import *  # noqa: F403
from ampkit.dialects.apex import (  # noqa: F401  (apex scripts read _amp_state)
    __all__,
    _amp_state,
)
