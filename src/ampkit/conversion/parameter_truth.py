"""What a converted forward sees of its parameters, and where its edits go.

At O2 a module's forward computes with low-precision copies of its fp32 parameters
(:mod:`ampkit.conversion.parameter_casts`): while it runs, its ``_parameters`` hold the copies.
The fp32 parameters stay the truth, and these rules keep everything that is not the
forward's compute on the truth, as fp32 training would have it:

* **Forward pre-hooks run before the cast.** ampkit's cast is the last of a module's
  forward pre-hooks, whenever the user's were registered (before or after
  ``initialize``; :func:`~ampkit.conversion.parameter_casts.keep_cast_last` moves it back to the
  end when another is registered). A user's pre-hook sees the fp32 parameter, and an
  edit it makes (a constraint: ``m.weight.data.clamp_(-c, c)``) is made to the truth,
  which the copy is then made from.
* **An embedding's** ``max_norm`` **renormalises the truth.** ``nn.Embedding`` and
  ``nn.EmbeddingBag`` with ``max_norm`` renormalise the rows they look up, in place, in
  their forward: the only modules of ``torch.nn`` that edit their own parameters there.
  ampkit makes that edit on the fp32 weight, with torch's kernel, just before the cast
  (:meth:`~ampkit.conversion.parameter_casts.CastParametersOnUse.before_renorming`).
* **Any other in-place edit of a copy is refused.** An edit made inside ``forward``
  (``with torch.no_grad(): self.weight.mul_(0.5)``) lands on the copy. When the
  module's forward ends, a copy whose version counter moved and whose values are no
  longer the cast of its parameter raises ``RuntimeError`` naming the module and the
  parameter (:func:`~ampkit.conversion.parameter_casts.check_copies_unedited`). An edit through
  ``.data`` moves no version counter (``.data`` is a tensor with a counter of its own)
  and cannot be seen: make such edits in a forward pre-hook, where they reach the
  truth. The check is off under ``inference_mode`` (inference tensors have no version
  counter) and under ``torch.compile``.
* **Every read of a parameter by name or by walk gives the truth.** Called inside a
  converted forward (a regulariser over ``self.parameters()``, a checkpoint taken in
  a hook), ``parameters()``, ``named_parameters()``, ``get_parameter()`` and
  ``state_dict()`` give the fp32 parameters (``state_dict`` detached, or the
  parameters themselves with ``keep_vars=True``), also those of modules whose forward
  is running (:func:`truths`; the ``state_dict`` post-hook
  :func:`~ampkit.conversion.parameter_casts.truth_in_state_dict`); the gradient of what is
  computed from them reaches ``.grad`` directly. The same holds when another thread's
  forward is running. The one read that gives the copy is the attribute
  (``self.weight``) inside the module's own forward: that is the compute use the copy
  is for (read from another thread while the module's forward runs, it gives the copy
  too: read parameters across threads by name or walk). Under ``torch.compile``, and
  in a module whose class the conversion does not replace (a parametrized module, a
  class with a ``__call__`` of its own), ``parameters()`` and ``get_parameter()`` give
  what ``_parameters`` holds (``state_dict()`` still gives the truth).
* **One forward of a module at a time.** The copies sit in the module's own
  ``_parameters``, which every thread shares: a forward entered while another thread
  is inside the same module raises ``RuntimeError`` (a training thread and a serving
  thread need a converted model each, or O1).

Example:
    >>> import torch
    >>> import ampkit
    >>> class Net(torch.nn.Linear):
    ...     def forward(self, x):
    ...         self.seen = {p.dtype for p in self.parameters()}
    ...         return super().forward(x)
    >>> net = ampkit.initialize(Net(2, 2), level="O2", dtype="bfloat16")
    >>> _ = net(torch.ones(1, 2))
    >>> net.seen
    {torch.float32}
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ampkit.conversion.parameter_casts import truth_of

__all__ = ["truths"]


def truths(named: Iterator[tuple[str, Any]], remove_duplicate: bool = True
           ) -> Iterator[tuple[str, Any]]:
    """``named`` (``named_parameters()``'s pairs) with every low-precision copy of the
    running forward replaced by its fp32 parameter
    (:func:`~ampkit.conversion.parameter_casts.truth_of`; a parameter reached twice, through two
    copies, given once when ``remove_duplicate``).

    Example:
        >>> import torch
        >>> from ampkit.conversion.parameter_truth import truths
        >>> [n for n, _ in truths(torch.nn.Linear(1, 1).named_parameters())]
        ['weight', 'bias']
    """
    seen: set[int] = set()
    for name, tensor in named:
        param = truth_of(tensor)
        if remove_duplicate:
            if id(param) in seen:
                continue
            seen.add(id(param))
        yield name, param
