"""The autograd engine's graph-task internals that the optimizer step inside backward
reads (see :mod:`ampkit.torch_internals`): which backward pass is running, and a
callback at its end.

Example:
    >>> import torch
    >>> from ampkit.torch_internals.autograd import at_backward_end, graph_task_id
    >>> seen = []
    >>> w = torch.nn.Parameter(torch.ones(1))
    >>> _ = w.register_post_accumulate_grad_hook(
    ...     lambda p: at_backward_end(lambda: seen.append("end")))
    >>> graph_task_id(), (w * 2).sum().backward(), seen
    (-1, None, ['end'])
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from ampkit.torch_internals.entries import fail, register_entry

__all__ = ["at_backward_end", "graph_task_id", "replace_clip_grads_with_norm"]


def graph_task_id() -> int:
    """The id of the backward pass (autograd graph task) running on this thread, or -1
    outside backward. A backward started inside another one (reentrant checkpointing)
    gets an id of its own."""
    task: int = torch._C._current_graph_task_id()
    return task


def at_backward_end(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the backward pass running now has finished every node,
    after its gradients are accumulated; never if the pass stops with an exception. Only
    inside backward."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


@register_entry("backward_pass", ("torch._C._current_graph_task_id",
                                  "torch.autograd.Variable._execution_engine.queue_callback"),
                "the optimizer step inside backward knows which backward pass a gradient "
                "hook belongs to and runs its end-of-pass work (parameters without a hook, "
                "a pass stopped by an exception) when the pass has finished",
                "none: torch's hooks are per tensor or per node; nothing public says when "
                "a whole backward pass has finished (FSDP2 uses the same callback)",
                provides=("graph_task_id", "at_backward_end"))
def _check_backward_pass() -> None:
    log: list[object] = []
    w = torch.nn.Parameter(torch.ones(1))

    def hook(p: torch.Tensor) -> None:
        log.append(graph_task_id())
        at_backward_end(lambda: log.append("end"))

    handle = w.register_post_accumulate_grad_hook(hook)
    try:
        if graph_task_id() != -1:
            raise fail("backward_pass", "gives a graph task outside backward")
        (w * 2).sum().backward()
    finally:
        handle.remove()
    if len(log) != 2 or not isinstance(log[0], int) or log[0] < 0 or log[1] != "end":
        raise fail("backward_pass", f"did not run the hook, then the end callback ({log})")


def replace_clip_grads_with_norm(make: Callable[[Callable[..., Any]], Callable[..., Any]],
                                 ) -> None:
    """Replace the scaling step that ``torch.nn.utils.clip_grad.clip_grad_norm_`` looks
    up by name at each call with ``make(original)``: a ``clip_grad_norm_`` bound before
    (``from torch.nn.utils import clip_grad_norm_``) then reaches the replacement."""
    module = torch.nn.utils.clip_grad
    module._clip_grads_with_norm_ = make(module._clip_grads_with_norm_)


@register_entry("clip_grad_norm_scaling", ("torch.nn.utils.clip_grad._clip_grads_with_norm_",),
                "torch's clip_grad_norm_ bound before the optimizer steps in backward (an "
                "import at the top of a script) refuses its parameters instead of "
                "reporting a norm of 0: it reaches this name at each call",
                "none: a function object bound by an import cannot be replaced; the "
                "public names in torch.nn.utils and torch.nn.utils.clip_grad are",
                provides=("replace_clip_grads_with_norm",),
                fallbacks={"replace_clip_grads_with_norm": lambda make: None})
def _check_clip_grad_norm_scaling() -> None:
    module = torch.nn.utils.clip_grad
    body = inspect.unwrap(module.clip_grad_norm_).__code__
    if ("_clip_grads_with_norm_" not in body.co_names
            or not callable(getattr(module, "_clip_grads_with_norm_", None))):
        raise fail("clip_grad_norm_scaling", "clip_grad_norm_ no longer calls "
                   "_clip_grads_with_norm_ from its module")
