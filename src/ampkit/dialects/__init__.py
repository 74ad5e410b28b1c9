"""The seeds' own AMP APIs, as thin translation layers over the ampkit core.

Each dialect keeps one framework's names, parameters, defaults, accepted values and
errors, and maps them onto the core (policies, ``ampkit.autocast``, model conversion,
master weights, loss scaling). A dialect has no numerics of its own: where one needed
a behaviour, the core grew it.

====================  ============================================  =================
import                replaces                                      dialect module
====================  ============================================  =================
``ampkit.torch``      ``torch.autocast``, ``torch.amp.GradScaler``  :mod:`.torch`
``ampkit.apex``       ``from apex import amp``                      :mod:`.apex`
``ampkit.paddle``     ``paddle.amp``                                :mod:`.paddle`
``ampkit.mindspore``  ``mindspore.amp``                             :mod:`.mindspore`
``ampkit.mxnet``      ``mxnet.contrib.amp``                         :mod:`.mxnet`
====================  ============================================  =================

The table from each framework's call to the dialect call and the core call it maps to
is ``docs/migration.md``.

Errors: a dialect never checks again what the core checks. It calls the core inside
:func:`ampkit.dialects._errors.framework_errors`, which re-raises the core's
``ValueError``/``TypeError`` with the framework's argument names (and, where the
framework raises another type for the same refusal, as that type: apex's
``RuntimeError``). What a dialect checks itself is what only its framework refuses
(apex's opt_level spelling, Paddle's levels ``O0``/``OD``).

Devices, on a machine with CUDA as on one without:

* ``ampkit.torch``: ``autocast`` takes ``device_type`` (required, as in torch);
  ``GradScaler``'s ``device`` defaults to CUDA when available, but its scale lives on
  the device of the first loss it scales, so CPU training works either way.
* ``ampkit.apex`` and ``ampkit.mindspore``: conversion and O1 regions follow the
  device of the model's parameters (and of the forward's inputs); ``disable_casts``
  covers every device present. apex's legacy ``amp.init()`` (no model) casts on CUDA
  when available, else the CPU (``device_type=`` picks).
* ``ampkit.paddle`` (``auto_cast``) and ``ampkit.mxnet`` (``init``): their frameworks
  cast on a global place or context, so ``device_type=None`` is torch's default device
  (``torch.get_default_device()``: the CPU unless ``torch.set_default_device`` changed
  it), not "CUDA when available". A model on the CPU is cast on a CUDA machine too; a
  model moved with ``.cuda()`` needs ``device_type="cuda"``.

Example:
    >>> import torch
    >>> import ampkit.paddle as amp
    >>> a, b = torch.rand(2, 3), torch.rand(2, 3)
    >>> with amp.auto_cast(custom_white_list={"elementwise_add"}):
    ...     (a + b).dtype
    torch.float16
"""
