"""Model conversion: a precision level applied to a whole ``nn.Module``.

:func:`ampkit.convert_model` decides, module by module, where parameters live and in which
dtype each module computes, then installs casts at the few module boundaries where the
dtype changes, so every module receives inputs in the dtype its parameters have:

* **parameters** are stored in ``param_dtype`` (O3, pure low precision), except in
  the modules kept in fp32 (norms by default, or any module by type, qualified name
  or instance) and everything inside them. Floating buffers (rotary frequencies,
  masks, running statistics) keep their dtype unless ``cast_buffers`` asks for them
  to follow (apex's ``model.half()``); a BatchNorm or InstanceNorm that updates
  float32 running statistics then keeps float32 parameters as well, since torch's
  kernels refuse low-precision parameters next to float32 statistics (they take the
  low-precision activation as it is). An op mixing a float32 buffer into an activation
  follows torch's type promotion; with no policy region (O3), each module holding
  low-precision parameters then casts its floating inputs to their dtype, in models
  that keep such a buffer. Integer buffers and inputs (token ids,
  ``num_batches_tracked``) are never touched. A parameter shared by several modules
  (tied weights) stays one parameter, cast once.
* **the model's boundary**: floating inputs are cast to ``input_dtype``, the forward
  runs inside :class:`ampkit.autocast` with the level's policy when ``policy`` is set
  (O1, O2: "patch ops"), and floating outputs are cast to ``output_dtype``. Inputs and
  outputs may be tensors or any nesting of lists, tuples, dicts and dataclasses.
* **a kept-fp32 module's boundary**: inputs are cast to float32, autocast is off inside
  (so it really computes in fp32), and outputs are cast to ``kept_output_dtype``
  (O2: back to the low dtype, so the next module gets what its parameters have).
  Norms whose torch kernel computes in fp32 from a low-precision input and fp32
  parameters (:data:`MIXED_INPUT_NORMS`; LayerNorm on CPU through a function of
  :mod:`ampkit.conversion.norms`) take the low-precision activation as it is when the
  kept output dtype is low precision too: the same fp32 arithmetic, without an
  activation-sized copy each way.
* **what the conversion keeps in fp32 on its own** (:func:`kept_by_conversion`): a
  parametrization's list (``torch.nn.utils.parametrize``) when parameters are cast on
  use, which computes the weight from the fp32 ``original`` in fp32 and hands it on
  cast to the compute dtype; a sparse embedding at O2, whose sparse gradient cannot be
  cast. The legacy ``spectral_norm``/``weight_norm`` hooks on a module cast on use
  compute from its uncast fp32 parameters with autocast off, then cast the weight.
* **a module white list** (``low_precision_modules``, MindSpore's O1): only the listed
  modules compute in low precision (their inputs and their fp32 parameters are cast on
  the way in, by an autocast region that runs every op in ``compute_dtype``), and their
  floating outputs go back to float32; everything else is fp32.

Each boundary module (the model, the outermost kept and white-listed modules) gets a
subclass of its own class, with the same name, whose ``__call__`` runs the module's call
inside its boundary as one ``with``-like block: a ``KeyboardInterrupt`` leaves nothing
behind, and ``torch.compile`` traces it without a graph break. There is no Python work
per op beyond what ``ampkit.autocast`` itself does.
The model's class also runs its ``generate`` method (Hugging Face's, which calls an
encoder-decoder's encoder directly, outside the model's forward) inside the model's
region and one forward pass (:data:`ampkit.conversion.classes.ENTRY_METHODS`); any
other call of a submodule from outside the model's forward runs outside the boundary.

With ``param_compute_dtype`` set (O2) the parameters are not cast at all: they stay the
fp32 truth, the module's own ``nn.Parameter`` objects that the optimizer steps, and each
module outside the kept ones runs its forward with low-precision copies of its own
parameters, made on use and kept for one forward of the converted model
(:mod:`ampkit.conversion.parameter_casts`). Gradients reach the fp32 ``.grad`` through autograd.
Floating buffers are never cast at O2: an op that mixes one with low-precision
activations follows torch's type promotion, and the policy's region decides the rest.

Converting is done once: calling :func:`ampkit.convert_model` again on the same model with the
same settings returns it unchanged; different settings, or converting a module inside
(or around) an already-converted one, is a ``RuntimeError``, never a second cast.

The package, one concept a file: :mod:`~ampkit.conversion.config` (the config and the
record each converted module carries), :mod:`~ampkit.conversion.plan` (plan and apply),
:mod:`~ampkit.conversion.boundary` (a module's boundary: region, casts, graph keys),
:mod:`~ampkit.conversion.norms` (the kept norms and their low-precision-input kernels),
:mod:`~ampkit.conversion.classes` (the subclasses a converted module gets, and their
calls) and :mod:`~ampkit.conversion.reparametrize` (legacy spectral/weight norm hooks).
Import everything from ``ampkit.conversion``.

Example:
    >>> import torch
    >>> import ampkit
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8),
    ...                             torch.nn.Linear(8, 2))
    >>> model = ampkit.convert_model(model, "O2", torch.bfloat16)
    >>> [p.dtype for p in model.parameters()] == [torch.float32] * 6  # the truth: fp32
    True
    >>> model(torch.rand(3, 4)).dtype
    torch.float32
"""

from __future__ import annotations

from ampkit.common.lazy import lazy_exports
from ampkit.common.module_selection import ModuleSelector
from ampkit.conversion.boundary import ALL_LOW_PRECISION, Boundary, Region
from ampkit.conversion.classes import (
    cast_call,
    cast_inputs_hook,
    converted_call,
    input_cast_call,
    rebuild_converted,
)
from ampkit.conversion.config import (
    OWN_PARAMETER_CASTS,
    ConversionConfig,
    Record,
    get_conversion,
)
from ampkit.conversion.norms import (
    LOW_INPUT_LAYER_NORM_DEVICES,
    MIXED_INPUT_NORMS,
    NORM_MODULES,
)
from ampkit.conversion.plan import (
    ReportDtype,
    apply_conversion,
    check_not_wrapped,
    kept_by_conversion,
    prepare_conversion,
)
from ampkit.conversion.reparametrize import SpectralNormInFp32, WeightNormInFp32

__all__ = [
    "ALL_LOW_PRECISION",
    "LOW_INPUT_LAYER_NORM_DEVICES",
    "MIXED_INPUT_NORMS",
    "NORM_MODULES",
    "OWN_PARAMETER_CASTS",
    "ConversionConfig",
    "ModuleSelector",
    "apply_conversion",
    "check_not_wrapped",
    "get_conversion",
    "kept_by_conversion",
    "prepare_conversion",
]

# The package is the one place a pickled (or deep-copied) converted model names
# ampkit's objects by: the classes and functions its state refers to (the config,
# records, boundaries and their regions, state_dict hooks, legacy reparametrization
# hooks, the converted classes' calls and the function that rebuilds them) give
# ``ampkit.conversion`` as their module, whichever file of the package defines them,
# so moving a definition between files never breaks a pickle. The private spellings
# below are the names the single-file ``conversion.py`` pickled them under, so that
# pickles made before the split still load.
_PICKLED = (ConversionConfig, Record, Boundary, Region, ReportDtype, SpectralNormInFp32,
            WeightNormInFp32, converted_call, cast_call, input_cast_call,
            cast_inputs_hook, rebuild_converted)
for _named in _PICKLED:
    _named.__module__ = __name__
del _named
_Record, _Boundary, _Region, _ReportDtype = Record, Boundary, Region, ReportDtype
_SpectralNormInFp32, _WeightNormInFp32 = SpectralNormInFp32, WeightNormInFp32
_converted_call, _cast_call, _input_cast_call = converted_call, cast_call, input_cast_call
_cast_inputs_hook, _rebuild_converted = cast_inputs_hook, rebuild_converted

# The level table and the O2 parameter casts import this package, so it cannot import
# them: they are reachable as attributes (``ampkit.conversion.levels``) on first use.
# The O2 parameter casts' pickled objects are named by the package too (set in that
# module), and found here on first use.
_CASTS = "ampkit.conversion.parameter_casts"
__getattr__, __dir__ = lazy_exports(
    "ampkit.conversion",
    {name: _CASTS for name in ("CastParametersOnUse", "_load_begins", "_load_ends",
                               "_state_dict_begins", "truth_in_state_dict")},
    globals(), ["levels", "parameter_casts", "parameter_truth"])
