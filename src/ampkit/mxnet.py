"""``import ampkit.mxnet as amp``: MXNet's ``contrib.amp`` API over ampkit; see
:mod:`ampkit.dialects.mxnet`."""

from ampkit.dialects.mxnet import *  # noqa: F403
from ampkit.dialects.mxnet import __all__  # noqa: F401
