"""``ampkit.mindspore``: ``mindspore.amp``'s API on PyTorch.

``from mindspore import amp`` becomes ``import ampkit.mindspore as amp``; a ``Cell``
becomes an ``nn.Module``, ``mstype.float16`` becomes ``torch.float16`` (the strings
``"float16"`` / ``"bfloat16"`` work too).

The built-in lists of the seed, in torch terms (:func:`get_white_list`,
:func:`get_black_list`):

* white list: cells ``Conv1d/2d/3d`` → ``nn.Conv1d/2d/3d``, ``Conv1d/2d/3dTranspose`` →
  ``nn.ConvTranspose1d/2d/3d``, ``Dense`` → ``nn.Linear``, ``LSTMCell``, ``RNNCell``,
  ``GRUCell`` → torch's; ops ``Conv2D``, ``Conv3D``, ``Conv2DTranspose``,
  ``Conv3DTranspose`` → ``F.conv2d``, ``F.conv3d``, ``F.conv_transpose2d``,
  ``F.conv_transpose3d``; ``MatMul`` → ``torch.matmul``; ``BatchMatMul`` →
  ``torch.bmm``; ``PReLU`` → ``F.prelu``; ``ReLU`` → ``F.relu``; ``Ger`` → ``torch.outer``;
* black list: ``BatchNorm1d/2d/3d``, ``LayerNorm`` → torch's.

The levels, as the seed defines them (parameters stay float32 at every level, as in
MindSpore: they are cast where they are used):

====  =====================================================================================
O0    unchanged
O1    white-list modules and ops compute in ``dtype`` from inputs and parameters cast on
      the way in; their outputs go back to float32 (white ops: cast by the next op, and
      at the network's output); everything else float32
O2    everything in ``dtype`` except the black-list modules, which compute in float32 and
      hand their outputs back in ``dtype``; the network's output is float32
O3    everything in ``dtype``, norms included; the network's output is float32
auto  ops by MindSpore 2.3's auto lists (preset ``"mindspore-auto"``): white ops in
      ``dtype``, black ops in float32, promote ops in the widest input type, the rest
      in their inputs' dtype; outputs as computed (a plain function works too)
====  =====================================================================================

============================================  ==============================================
MindSpore                                     ampkit core
============================================  ==============================================
``auto_mixed_precision`` /                    :func:`ampkit.convert_model` with a
``custom_mixed_precision``                    :class:`~ampkit.conversion.ConversionConfig`:
                                              module white list (O1), kept-fp32 modules (O2),
                                              an all-low-precision policy (O2, O3), the
                                              auto lists or both custom lists as a policy
``build_train_network``                       the above, then a training step driven by
                                              :class:`ampkit.GradScaler`
``DynamicLossScaler`` / ``StaticLossScaler``  :class:`ampkit.DynamicLossScale` /
                                              :class:`ampkit.StaticLossScale` (floor 1)
``all_finite``                                :func:`ampkit.scaling.all_finite`
============================================  ==============================================

Example:
    >>> import torch
    >>> import ampkit.mindspore as amp
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    >>> net = amp.auto_mixed_precision(net, "O2", torch.bfloat16)
    >>> net[0].weight.dtype, net(torch.rand(2, 4)).dtype
    (torch.float32, torch.float32)
    >>> amp.auto_mixed_precision(torch.nn.Linear(2, 2), "O4")
    Traceback (most recent call last):
    ...
    ValueError: amp_level must be one of ['O0', 'O1', 'O2', 'O3', 'auto'], got 'O4'
"""

from __future__ import annotations

from ampkit.dialects.mindspore.loss_scalers import DynamicLossScaler, StaticLossScaler, all_finite
from ampkit.dialects.mindspore.managers import (
    DynamicLossScaleManager,
    FixedLossScaleManager,
    LossScaleManager,
)
from ampkit.dialects.mindspore.mixed_precision import (
    auto_mixed_precision,
    custom_mixed_precision,
    get_black_list,
    get_white_list,
)
from ampkit.dialects.mindspore.train_network import build_train_network

__all__ = [
    "DynamicLossScaleManager",
    "DynamicLossScaler",
    "FixedLossScaleManager",
    "LossScaleManager",
    "StaticLossScaler",
    "all_finite",
    "auto_mixed_precision",
    "build_train_network",
    "custom_mixed_precision",
    "get_black_list",
    "get_white_list",
]

# The scalers and managers are pickled (inside a checkpoint) under the package's name,
# whichever file defines them, as they were when the dialect was one module.
for _named in (StaticLossScaler, DynamicLossScaler, LossScaleManager, FixedLossScaleManager,
               DynamicLossScaleManager):
    _named.__module__ = __name__
del _named
