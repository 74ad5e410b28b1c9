"""``ampkit.mxnet``: MXNet's ``contrib.amp`` API on PyTorch.

``from mxnet.contrib import amp`` becomes ``import ampkit.mxnet as amp``; Gluon
``Trainer`` becomes a ``torch.optim.Optimizer`` and ``HybridBlock`` an ``nn.Module``.

===============================================  =========================================
MXNet                                            ampkit core
===============================================  =========================================
``amp_cast(data, dtype)``                        :func:`ampkit.amp_cast`
``amp_multicast(*data, num_outputs, ...)``       :func:`ampkit.amp_multicast`
``init(target_dtype, ...)``                      an :class:`ampkit.autocast` region with
                                                 the ``"mxnet-float16"`` /
                                                 ``"mxnet-bfloat16"`` preset (or the lists
                                                 given), kept open
``convert_model`` / ``convert_hybrid_block``     :func:`ampkit.convert_model` with that
                                                 policy, outputs cast to float32
``init_trainer`` / ``scale_loss`` / ``unscale``  :class:`ampkit.GradScaler` per optimizer
``LossScaler``                                   :class:`ampkit.GradScaler` with MXNet's
                                                 numbers: 2**16 start, 2**24 cap, window
                                                 2000, halving on overflow
===============================================  =========================================

What differs from MXNet, on purpose:

* :func:`init` opens its region in the *calling thread* (ampkit's regions are
  thread-local, like ``torch.autocast``); call it in each thread that runs the model.
  The region caches no weight casts (it never closes, and the weights change at every
  step), so a weight used by several ops is cast at each use.
  A second ``init`` with the same arguments does nothing, as in MXNet; one with other
  arguments is a ``RuntimeError`` (MXNet ignored it silently). :func:`deinit` (an
  ampkit extra) closes the region and allows a new ``init``.
* Op lists take MXNet's names (``"FullyConnected"``, ``"elemwise_add"``), torch's
  (``"linear"``), torch callables or ``nn.Module`` classes; an unknown name is a
  ``ValueError`` that suggests the closest known names.
* Conditional fp32 ops become separate torch ops: ``("Activation", "act_type",
  ["softrelu"])`` is ``softplus``; ``("LeakyReLU", "act_type", ["elu", "selu"])`` are
  ``elu`` and ``selu`` (see :data:`CONDITIONAL_OPS` for every known triple).
* :func:`convert_hybrid_block` returns a converted copy of the module, leaving the
  given one as it was (MXNet returns a new block); ``excluded_sym_names`` are qualified
  module names.
* Errors MXNet raised with ``assert`` are ``ValueError`` (bad value), ``TypeError``
  (bad type) or ``RuntimeError`` (wrong order of calls) here.

Example:
    >>> import torch
    >>> import ampkit.mxnet as amp
    >>> x = torch.ones(2)
    >>> amp.amp_cast(x, "float16").dtype, amp.amp_cast(x, "int32").dtype
    (torch.float16, torch.float32)
    >>> a, b = amp.amp_multicast(x.half(), x, num_outputs=2)
    >>> a.dtype, b.dtype
    (torch.float32, torch.float32)
"""

from __future__ import annotations

from ampkit.dialects.mxnet.casts import amp_cast, amp_multicast
from ampkit.dialects.mxnet.lists import (
    CONDITIONAL_OPS,
    list_conditional_fp32_ops,
    list_fp16_ops,
    list_fp32_ops,
    list_loss_output_functions,
    list_lp16_fp32_ops,
    list_lp16_ops,
    list_lp16_use_fp32_params,
    list_widest_type_cast,
)
from ampkit.dialects.mxnet.loss_scaler import LossScaler
from ampkit.dialects.mxnet.model_conversion import convert_hybrid_block, convert_model
from ampkit.dialects.mxnet.region import deinit, init
from ampkit.dialects.mxnet.trainer import init_trainer, scale_loss, unscale

__all__ = [
    "CONDITIONAL_OPS",
    "LossScaler",
    "amp_cast",
    "amp_multicast",
    "convert_hybrid_block",
    "convert_model",
    "deinit",
    "init",
    "init_trainer",
    "list_conditional_fp32_ops",
    "list_fp16_ops",
    "list_fp32_ops",
    "list_loss_output_functions",
    "list_lp16_fp32_ops",
    "list_lp16_ops",
    "list_lp16_use_fp32_params",
    "list_widest_type_cast",
    "scale_loss",
    "unscale",
]

# The scaler is pickled (inside a checkpoint) under the package's name, whichever file
# defines it, as it was when the dialect was one module.
LossScaler.__module__ = __name__
