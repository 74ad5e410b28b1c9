"""The seeds' own AMP APIs, as thin translation layers over the ampkit core.

Each dialect keeps one framework's names, parameters, defaults, accepted values and
errors, and maps them onto the core (policies, ``ampkit.autocast``, model conversion,
master weights, loss scaling). A dialect has no numerics of its own: where one needed
a behaviour, the core grew it.

=====================  ==========================================  =====================
import                 replaces                                    dialect module
=====================  ==========================================  =====================
``ampkit.torch``       ``torch.autocast``, ``torch.amp.GradScaler``  :mod:`.torch`
``ampkit.apex``        ``from apex import amp``                    :mod:`.apex`
``ampkit.paddle``      ``paddle.amp``                              :mod:`.paddle`
``ampkit.mindspore``   ``mindspore.amp``                           :mod:`.mindspore`
``ampkit.mxnet``       ``mxnet.contrib.amp``                       :mod:`.mxnet`
=====================  ==========================================  =====================

The table from each framework's call to the dialect call and the core call it maps to
is ``docs/migration.md``.

Example:
    >>> import torch
    >>> import ampkit.paddle as amp
    >>> a, b = torch.rand(2, 3), torch.rand(2, 3)
    >>> with amp.auto_cast(custom_white_list={"elementwise_add"}):
    ...     (a + b).dtype
    torch.float16
"""
