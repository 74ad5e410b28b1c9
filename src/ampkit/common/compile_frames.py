"""Keeping ampkit's bookkeeping out of ``torch.compile``'s traces, without importing
``torch._dynamo`` (which ``import ampkit`` must not pay for: over a second).

Dynamo's frame evaluator can be told, per code object, to run a frame as plain Python
(and, optionally, everything it calls): what ``torch.compiler.disable`` arranges when it
is called. Every helper here degrades to doing nothing where a torch build lacks the hook.

Example:
    >>> from ampkit.common.compile_frames import not_traced
    >>> @not_traced
    ... def bookkeeping(x):
    ...     return x + 1
    >>> bookkeeping(1)
    2
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from ampkit import torch_internals

__all__ = ["not_traced", "skip_frame_only", "skip_recursively"]

F = TypeVar("F", bound=Callable[..., Any])


def skip_recursively(code: Any) -> bool:
    """Tell dynamo's frame evaluator, without importing ``torch._dynamo``, to run frames of
    ``code`` and everything they call as plain Python: what ``torch.compiler.disable``
    arranges at call time (:func:`ampkit.torch_internals.skip_code`). False where this
    torch build lacks the hook."""
    return torch_internals.skip_code(code, recursive=True)


def not_traced(fn: F) -> F:
    """``torch.compiler.disable(fn)`` without importing ``torch._dynamo``.

    Dynamo must not trace ampkit's own bookkeeping (thread-local state, rule tables).
    ``torch.compiler.disable`` at class definition imports ``torch._dynamo`` (and sympy,
    onnx, ...) with ``import ampkit``: over a second. The same effect, import-free: the
    wrapper carries the marker dynamo reads when it meets a call (it does not inline a
    disabled function: a graph break) and its code is registered with the frame
    evaluator as skipped, it and what it calls (so the call, run eagerly, is not
    compiled as a frame of its own). Where this torch lacks that hook, the real
    ``torch.compiler.disable`` is applied on first use once ``torch._dynamo`` is loaded
    (until then nothing can be compiling).
    """
    disabled: Callable[..., Any] | None = None

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        nonlocal disabled
        if skipped or not torch_internals.dynamo_loaded():
            return fn(*args, **kwargs)
        if disabled is None:
            disabled = torch.compiler.disable(fn)
        return disabled(*args, **kwargs)

    skipped = skip_recursively(wrapper.__code__)  # type: ignore[attr-defined]
    if skipped:
        torch_internals.mark_dynamo_disabled(wrapper)
    return wrapper  # type: ignore[return-value]


def skip_frame_only(code: Any) -> None:
    """Have dynamo run frames of ``code`` as plain Python but compile the frames they
    call (no-op where this torch lacks the hook)."""
    torch_internals.skip_code(code, recursive=False)
