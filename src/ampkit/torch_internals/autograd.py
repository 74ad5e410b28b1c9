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

from collections.abc import Callable

import torch

from ampkit.torch_internals.entries import fail, register_entry

__all__ = ["at_backward_end", "graph_task_id"]


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
