"""``ampkit.apex``: NVIDIA apex's ``amp`` API (removed from apex in 2025) on ampkit.

``from apex import amp`` becomes ``import ampkit.apex as amp``; the rest of an apex
script stays as it is. Unlike apex it runs on CPU too, and in bfloat16: pass
``cast_model_type=torch.bfloat16`` (O2, O3) or ``dtype=torch.bfloat16`` (any level).

apex's opt_level table, kept as apex defined it:

=====  ===============  =====================  ===================  ==============  ==========
level  cast_model_type  patch_torch_functions  keep_batchnorm_fp32  master_weights  loss_scale
=====  ===============  =====================  ===================  ==============  ==========
O0     float32          False                  None                 False           1.0
O1     None             True                   None                 None            "dynamic"
O2     float16          False                  True                 True            "dynamic"
O3     float16          False                  False                False           1.0
=====  ===============  =====================  ===================  ==============  ==========

======================================  =================================================
apex                                    ampkit core
======================================  =================================================
``initialize(...)``                     :func:`ampkit.initialize` with the table above
                                        (``keep_batchnorm_fp32`` keeps BatchNorm only;
                                        O2 does not patch ops, as in apex); O1 casts by
                                        the ``"apex-O1"`` preset
``init(...)`` and its handle            an ``"apex-O1"`` :class:`ampkit.autocast` region
(the pre-1.0 API, apex's O1)            open until ``handle._deactivate()``;
                                        ``handle.scale_loss``/``wrap_optimizer``:
                                        :func:`ampkit.scale_loss` with their own scalers
``scale_loss(loss, optimizers, ...)``   :func:`ampkit.scale_loss`
``master_params(optimizer)``            the optimizer's own fp32 parameters
``state_dict()`` / ``load_state_dict``  ``ampkit.scaling.loss_scaling_state_dict`` / ``load_…``
``register_{half,float,promote}_``      :func:`ampkit.engine.function_patching.register_function`
``function(module, name)``
``disable_casts()``                     ``ampkit.autocast(device, enabled=False)``
``_amp_state``                          a view of the above under apex's names
                                        (``loss_scalers[i].loss_scale()``, ...)
======================================  =================================================

O1 is apex's own O1: the ``"apex-O1"`` preset (:data:`ampkit.policies.presets.APEX_O1`) holds
apex's lists (``functional_overrides``, ``torch_overrides``, ``tensor_overrides``,
the RNNs and RNN cells), on every device. Inside its regions, as in apex,
``F.binary_cross_entropy``/``nn.BCELoss`` refuse a low-precision input
(``NotImplementedError``; ``init(allow_banned=True)`` runs them in float32) and the
in-place versions of float32-list ops (``x.exp_()``, ...) refuse a low-precision tensor.
These refusals act in ``"apex-O1"`` regions only, while an apex handle is active (from
``init`` or an O1 ``initialize``, until ``handle._deactivate()``).

Optimizer wrappers that keep the optimizer they wrap as ``.optim`` (apex's
``apex.parallel.LARC``) are accepted wherever an optimizer is: the core works on the
optimizer inside, and the wrapper is returned as given. ``cast_model_type=False``
leaves the model's parameters as they are (for the fp32 model ampkit takes, that is
float32).

What differs from apex, on purpose:

* O1 casts inside the models' forward passes (apex patched torch globally); ``init``'s
  region is the calling thread's. An O1 model hands its floating outputs back in fp32
  (the core O1's rule), so a loss computed outside it, which apex's patched loss
  functions (``FP32_FUNCS``) computed in fp32, is fp32 here too.
* A static loss scale (``loss_scale=1.0`` at O0/O3, or any number) skips a step whose
  gradients hold inf/NaN, where apex wrote them into the weights.
* ``register_*_function`` work whenever they are called, before or after
  ``initialize``, inside any autocast region.
* ``load_state_dict`` refuses a state with a different number of loss scalers (apex
  printed a warning and loaded a part).
* Overrides apex refuses but ampkit can carry out are accepted and carried out:
  ``master_weights=False`` at O1, ``patch_torch_functions=True`` at O2 (ops then cast by
  apex's O1 lists).
* ``_amp_state.allow_incoming_model_not_fp32 = True`` lets a model that is not fp32
  past apex's own check. Where the level casts no parameter (O1, or
  ``cast_model_type=False``) it is then taken as it is
  (float16 parameters stay float16 and the optimizer steps them, with no fp32 master:
  ampkit keeps no hidden copies); otherwise the core refuses it, with its reason,
  wherever a level casts or patches it.

Errors are apex's: a nonsensical override, an unknown ``opt_level``, a model that is not
fp32 (or already wrapped in DataParallel/DDP) and ``scale_loss`` before ``initialize``
raise ``RuntimeError``. The core's refusals arrive in apex's words (``opt_level``,
``keep_batchnorm_fp32``, ``patch_torch_functions``) and type, through
:func:`ampkit.dialects._errors.framework_errors`, the one way every dialect translates.

Example:
    >>> import torch
    >>> import ampkit.apex as amp
    >>> model = torch.nn.Linear(4, 2)
    >>> optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    >>> model, optimizer = amp.initialize(model, optimizer, opt_level="O2",
    ...                                   cast_model_type=torch.bfloat16, verbosity=0)
    >>> loss = model(torch.rand(3, 4)).sum()
    >>> with amp.scale_loss(loss, optimizer) as scaled_loss:
    ...     scaled_loss.backward()
    >>> optimizer.step()
    >>> model.weight.dtype, [p.dtype for p in amp.master_params(optimizer)]
    (torch.float32, [torch.float32, torch.float32])
"""

from __future__ import annotations

from ampkit.dialects.apex.frontend import initialize
from ampkit.dialects.apex.functions import (
    disable_casts,
    float_function,
    half_function,
    promote_function,
    register_float_function,
    register_half_function,
    register_promote_function,
)
from ampkit.dialects.apex.handle import AmpHandle, NoOpHandle, init, scale_loss
from ampkit.dialects.apex.opt_levels import OPT_LEVELS, Properties
from ampkit.dialects.apex.optimizers import OptimWrapper, master_params
from ampkit.dialects.apex.state import amp_state, load_state_dict, state_dict

__all__ = [
    "OPT_LEVELS",
    "AmpHandle",
    "NoOpHandle",
    "OptimWrapper",
    "Properties",
    "disable_casts",
    "float_function",
    "half_function",
    "init",
    "initialize",
    "load_state_dict",
    "master_params",
    "promote_function",
    "register_float_function",
    "register_half_function",
    "register_promote_function",
    "scale_loss",
    "state_dict",
]

#: apex's ``amp._amp_state`` (its own spelling, underscore included), which apex scripts
#: read: the same object as ``amp_state``.
_amp_state = amp_state
