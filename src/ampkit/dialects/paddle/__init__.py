"""``ampkit.paddle``: ``paddle.amp``'s API on PyTorch.

``paddle.amp.auto_cast`` becomes ``ampkit.paddle.auto_cast`` (and so on); Paddle's
tensors and layers become torch's. Op names may be Paddle's (``conv2d``, ``matmul_v2``,
``elementwise_add``, ``softmax_with_cross_entropy``, ``lookup_table_v2``, ...) or
torch's (``linear``, ``add``, a callable, an ``nn.Module`` class).

=============================  ===========================================================
Paddle                         ampkit core
=============================  ===========================================================
``auto_cast(level='O1')``      :class:`ampkit.autocast` with the ``"paddle-O1"`` preset:
                               white list low precision, black list float32, every other
                               op float32 if any input is float32, else low precision
``auto_cast(level='OD')``      preset ``"paddle-OD"``: only the white list low precision
``auto_cast(level='O2')``      preset ``"paddle-O2"`` (``use_promote=True``: like O1 with
                               only the extra black list in float32) or
                               ``"paddle-O2-no-promote"`` (everything low precision
                               except the extra black list)
``decorate(level='O2')``       :func:`ampkit.convert_model`: fp32 parameters (the
                               truth), layers compute with low-precision copies
                               made on use; BatchNorm and, for float16, LayerNorm fp32
``GradScaler``                 :class:`ampkit.GradScaler` with Paddle's names (and, as
                               in Paddle 3, torch's), a scale floor of 1 and
                               ``decr_every_n_nan_or_inf`` as hysteresis
``get_autocast_dtype``,        the innermost region of the thread
``is_autocast_enabled``        (:func:`ampkit.engine.regions.innermost_region_dtype`)
``is_float16_supported``,      the machine's device
``is_bfloat16_supported``      (:func:`ampkit.common.device_support.device_supports_dtype`)
=============================  ===========================================================

Custom lists follow Paddle's rule: an op put in the white list leaves the black list
and the other way round; an op in both custom lists is a ``ValueError``. The lists are
those of Paddle's ``python/paddle/amp/amp_lists.py`` (see ``docs/migration.md``).

Devices: Paddle's region casts on its global place (``paddle.set_device``), where its
tensors are created too. torch's counterpart is the default device, so
``auto_cast()`` casts ops on ``torch.get_default_device()`` (the CPU unless
``torch.set_default_device`` says otherwise), whether or not CUDA is present; a model
moved with ``.cuda()`` needs ``auto_cast(device_type="cuda")``.

As in Paddle, ``nn.Linear``/``F.linear`` run Paddle's own ``linear`` op, on none of the
lists (not ``matmul_v2``): float32 at OD, and at O1/O2 promoted to the widest input
(float32 with float32 weights). ``GradScaler.scale`` after a bfloat16 ``auto_cast``
turns a dynamic scaler off (Paddle's global AMP dtype, recorded by each ``auto_cast``
region on entry). ``white_list()``/``black_list()`` are Paddle's default lists.

What differs from Paddle, on purpose: ``auto_cast`` and ``GradScaler`` work on CPU too
(Paddle's scaler disables itself off the GPU); ``decorate``'s ``state_dict`` holds the
exact fp32 master values (cast to ``save_dtype`` when given); bfloat16 uses float16's
lists.

Example:
    >>> import torch
    >>> import ampkit.paddle as amp
    >>> conv = torch.nn.Conv2d(3, 2, 3, bias=False)
    >>> data = torch.rand(10, 3, 32, 32)
    >>> with amp.auto_cast():
    ...     conv(data).dtype
    torch.float16
    >>> with amp.auto_cast(custom_black_list={"conv2d"}):
    ...     conv(data).dtype
    torch.float32
"""

from __future__ import annotations

from ampkit.dialects.paddle.grad_scaler import GradScaler
from ampkit.dialects.paddle.model_decoration import decorate
from ampkit.dialects.paddle.region import (
    auto_cast,
    black_list,
    get_autocast_cpu_dtype,
    get_autocast_dtype,
    get_autocast_gpu_dtype,
    is_autocast_enabled,
    is_bfloat16_supported,
    is_float16_supported,
    white_list,
)

__all__ = [
    "GradScaler",
    "auto_cast",
    "black_list",
    "decorate",
    "get_autocast_cpu_dtype",
    "get_autocast_dtype",
    "get_autocast_gpu_dtype",
    "is_autocast_enabled",
    "is_bfloat16_supported",
    "is_float16_supported",
    "white_list",
]

# The scaler is pickled (inside a checkpoint) under the package's name, whichever file
# defines it, as it was when the dialect was one module.
GradScaler.__module__ = __name__
