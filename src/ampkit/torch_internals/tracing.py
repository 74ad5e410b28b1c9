"""Trace time or run time, and torch.utils.checkpoint's recomputation: the torch
internals behind ampkit's regions (see :mod:`ampkit.torch_internals`).

Example:
    >>> from ampkit.torch_internals.tracing import compiling
    >>> compiling()
    False
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint

from ampkit.torch_internals.dynamo import skip_code
from ampkit.torch_internals.entries import (
    TorchInternalsError,
    disabled,
    fail,
    register_entry,
    resolve,
)

# -- trace time or run time -------------------------------------------------------------------

_CompileContext: Any = resolve("compile_session", "compiling",
                               lambda: importlib.import_module("torch._guards").CompileContext)

__all__ = ["check_compile_session_in_a_backend", "compiling", "compiling_here",
           "install_checkpoint_carry"]


def compiling() -> bool:
    """Whether torch.compile is tracing or compiling in this thread: dynamo's trace and
    everything that runs as Python during the compile session (AOTAutograd's trace of
    a graph, a backend), not a compiled graph running.

    ``torch.compiler.is_compiling()`` answers that from torch 2.13; on 2.11 and 2.12 it
    answers True only in code dynamo traces, False in what AOTAutograd runs while it
    traces (a region's graph node). The compile context dynamo holds for the whole
    session answers on every release, so both are asked.

    Example:
        >>> from ampkit.torch_internals import compiling
        >>> compiling()
        False
    """
    return torch.compiler.is_compiling() or _CompileContext.current_compile_id() is not None


def compiling_here() -> bool:
    """:func:`compiling` for this thread only: whether the code asking is traced by
    dynamo, or runs as Python inside a compile session of this thread (AOTAutograd's
    trace, a backend).

    ``torch.compiler.is_compiling()`` answers from a flag of the whole process that a
    compile session sets: while one thread compiles, code that another thread runs
    eagerly (a converted model's call under ``torch.compile(model)``, which runs as
    Python) would take itself for traced. Dynamo answers
    ``torch.compiler.is_dynamo_compiling()`` True in what it traces; for the rest of
    the session the flag must be set and the compile context, per thread, be this
    thread's.

    Example:
        >>> from ampkit.torch_internals import compiling_here
        >>> compiling_here()
        False
    """
    if torch.compiler.is_dynamo_compiling():
        return True
    # (both: the process's flag says a session is open somewhere; the context, that
    # it is this thread's)
    return torch.compiler.is_compiling() and _CompileContext.current_compile_id() is not None


# Called from a frame dynamo runs as plain Python (a converted model's call under
# torch.compile(model)), this function would be compiled as a frame of its own, where
# is_dynamo_compiling() is True: it runs as plain Python there (inlined, as ever, where
# compiled code calls it).
skip_code(compiling_here.__code__, recursive=True)


def _compiling_here_by_public_api() -> bool:
    """:func:`compiling_here` where the compile context is unavailable: the public flag,
    which another thread's compilation sets too."""
    return torch.compiler.is_compiling()


skip_code(_compiling_here_by_public_api.__code__, recursive=True)


def _compiling_by_public_api() -> bool:
    """:func:`compiling` where the compile context is unavailable: the public
    ``torch.compiler.is_compiling()`` covers the whole compile session from torch 2.13;
    before, it misses AOTAutograd's trace, so it answers only while nothing can be
    compiling (torch._dynamo not imported) and refuses otherwise."""
    if torch.compiler.is_compiling():
        return True
    if _SESSION_IS_PUBLIC or "torch._dynamo" not in sys.modules:
        return False
    raise disabled("compile_session", "an ampkit region under torch.compile")


#: torch.compiler.is_compiling() answers True for the whole compile session (2.13+)
_SESSION_IS_PUBLIC = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]
                           ) >= (2, 13)


@register_entry("compile_session", ("torch._guards.CompileContext",),
        "tell a region's graph node run while torch.compile traces (its frames are left "
        "at the end of the compilation) from one run by a compiled graph",
        "torch.compiler.is_compiling(), which covers the whole compile session only from "
        "torch 2.13 (the check is compiling(), both asked)",
        provides=("compiling", "compiling_here", "check_compile_session_in_a_backend"),
        fallbacks={"compiling": _compiling_by_public_api,
                   "compiling_here": _compiling_here_by_public_api})
def _check_compile_session() -> None:
    if not callable(getattr(_CompileContext, "current_compile_id", None)):
        raise fail("compile_session", "has no current_compile_id()")
    if _CompileContext.current_compile_id() is not None:
        raise fail("compile_session", "reports a compilation outside torch.compile")


def check_compile_session_in_a_backend() -> None:
    """The behavioural half of ``compile_session``: a backend (Python run inside the
    compile session, not traced) sees :func:`compiling` True. Imports torch._dynamo and
    compiles once (a second or more), so the test suite calls it, not ``import ampkit``.

    Example:
        >>> from ampkit.torch_internals import check_compile_session_in_a_backend
        >>> check_compile_session_in_a_backend()
    """
    seen: list[bool] = []

    def backend(gm: Any, example_inputs: Any) -> Any:
        seen.append(compiling())
        return gm

    compiled = torch.compile(lambda t: t + 1, backend=backend, dynamic=False)
    compiled(torch.zeros(2))
    if seen != [True]:
        raise fail("compile_session", f"is not set while a backend runs (saw {seen})")
    if compiling():
        raise fail("compile_session", "stays set after the compilation")


# -- torch.utils.checkpoint: the function it recomputes ------------------------------------------

#: checkpoint's non-reentrant generators, newest first: torch 2.14 calls the first, and
#: keeps the second as a shim for out-of-tree callers; earlier releases have the second
_GENERATORS = ("_checkpoint_without_reentrant_generator_impl",
               "_checkpoint_without_reentrant_generator")
_COMPOSABLE = "torch.distributed._composable.checkpoint_activation"


def _probe_fn(t: torch.Tensor) -> torch.Tensor:
    return t * 2


def _wrap_checkpoint(carry: Callable[[Callable[..., Any]], Callable[..., Any]],
                     hits: set[str]) -> Callable[[], None]:
    """Wrap every checkpoint internal that hands on the function to recompute; return
    the undo."""
    import torch.utils.checkpoint as cp

    undo: list[Callable[[], None]] = []
    for name in _GENERATORS:
        original = getattr(cp, name, None)
        if not callable(original):
            continue

        def generator(fn: Callable[..., Any], *args: Any, __name: str = name,
                      __original: Any = original, **kwargs: Any) -> Any:
            if fn is _probe_fn:
                hits.add(__name)
            return __original(carry(fn), *args, **kwargs)

        functools.update_wrapper(generator, original)
        # later importers find it in ``cp``; modules that imported it by name before
        # now (the composable checkpoint API) are pointed at it too
        for module in (cp, sys.modules.get(_COMPOSABLE)):
            if module is not None and getattr(module, name, None) is original:
                setattr(module, name, generator)
                undo.append(functools.partial(setattr, module, name, original))
    function: Any = getattr(cp, "CheckpointFunction", None)
    if isinstance(function, type) and issubclass(function, torch.autograd.Function):
        class CheckpointFunction(function):
            @staticmethod
            def forward(ctx: Any, run_function: Callable[..., Any],
                        preserve_rng_state: bool, *args: Any) -> Any:
                if run_function is _probe_fn:
                    hits.add("CheckpointFunction")
                return function.forward(ctx, carry(run_function), preserve_rng_state,
                                        *args)

        CheckpointFunction.__qualname__ = function.__qualname__
        cp.CheckpointFunction = CheckpointFunction  # type: ignore[misc]
        undo.append(functools.partial(setattr, cp, "CheckpointFunction", function))

    def undo_all() -> None:
        for step in reversed(undo):
            step()
    return undo_all


def _probe_checkpoint(reentrant: tuple[bool, ...]) -> None:
    """Checkpoint :func:`_probe_fn` (a forward only: the wrappers see the function when
    checkpoint hands it on)."""
    x = torch.zeros(1, requires_grad=True)
    with warnings.catch_warnings(), torch.enable_grad():
        warnings.simplefilter("ignore")
        for each in reentrant:
            # unwrapped: checkpoint() is wrapped in a dynamo-disable that imports
            # torch._dynamo (seconds) at its first call
            inspect.unwrap(torch.utils.checkpoint.checkpoint)(
                _probe_fn, x, use_reentrant=each, preserve_rng_state=False)


def _reached_from_checkpoint() -> set[str]:
    """The names of ``torch.utils.checkpoint``'s own functions and classes that
    ``checkpoint()`` calls, directly or through its module's other functions: read from
    their code, without running it."""
    cp = torch.utils.checkpoint
    reached: set[str] = set()
    todo: list[Any] = [cp.checkpoint]
    while todo:
        code = getattr(inspect.unwrap(todo.pop()), "__code__", None)
        codes = [code] if code is not None else []
        while codes:
            one = codes.pop()
            codes.extend(c for c in one.co_consts if hasattr(c, "co_names"))
            for name in one.co_names:
                found = cp.__dict__.get(name)
                if name not in reached and callable(found):
                    reached.add(name)
                    todo.append(found)
    return reached


def _live(carry: Callable[[Callable[..., Any]], Callable[..., Any]]) -> set[str]:
    hits: set[str] = set()
    undo = _wrap_checkpoint(carry, hits)
    # The reentrant variant by running it (cheap); the non-reentrant one imports
    # torch._dynamo when it runs (torch 2.13+), so it is run only where dynamo is loaded
    # already, else read from checkpoint's code. The test suite runs both.
    loaded = "torch._dynamo" in sys.modules
    try:
        _probe_checkpoint((True, False) if loaded else (True,))
    except Exception:
        undo()
        raise
    if not loaded:
        hits |= _reached_from_checkpoint() & set(_GENERATORS)
    missing = []
    if not hits & set(_GENERATORS):
        missing.append("the non-reentrant generator")
    if "CheckpointFunction" not in hits:
        missing.append("CheckpointFunction")
    if missing:
        undo()
        raise fail("checkpoint_recompute", f"is not what checkpoint() calls: "
                   f"{' and '.join(missing)} never saw the checkpointed function")
    return hits


def install_checkpoint_carry(carry: Callable[[Callable[..., Any]], Callable[..., Any]]
                             ) -> bool:
    """Have ``torch.utils.checkpoint.checkpoint`` (both variants) run ``carry(fn)``
    where it runs ``fn``, in the forward and in the recomputation. Checked by
    behaviour: a checkpointed call must reach the wrapped internals (the non-reentrant
    variant is read from checkpoint's code instead where running it would import
    torch._dynamo; ``check("checkpoint_recompute")`` runs both). Where it does
    not (a torch whose checkpoint calls other internals), everything is undone and a
    RuntimeWarning says checkpointed code recomputes without ampkit's policy.
    Returns whether it is installed. Call it once.

    Example:
        >>> from ampkit.torch_internals import install_checkpoint_carry
        >>> callable(install_checkpoint_carry)
        True
    """
    try:
        _live(carry)
    except TorchInternalsError as error:
        warnings.warn(f"{error}; checkpointed code recomputes without the ampkit policy",
                      RuntimeWarning, stacklevel=3)
        return False
    return True


@register_entry("checkpoint_recompute",
        ("torch.utils.checkpoint._checkpoint_without_reentrant_generator_impl",
         "torch.utils.checkpoint._checkpoint_without_reentrant_generator",
         "torch.utils.checkpoint.CheckpointFunction",
         "torch.distributed._composable.checkpoint_activation"),
        "bind the function checkpoint recomputes to the ampkit policy in effect at the "
        "checkpoint call, as torch does for native autocast state",
        "none: checkpoint's context_fn is the caller's argument (a library's checkpoint "
        "call cannot be given one), and wrapping checkpoint() itself misses callers that "
        "imported it by name (transformers does)", lazy=True)
def _check_checkpoint_recompute() -> None:
    undo_probe: list[Callable[[], None]] = []
    hits: set[str] = set()
    undo_probe.append(_wrap_checkpoint(lambda fn: fn, hits))
    try:
        _probe_checkpoint((True, False))
    finally:
        for step in undo_probe:
            step()
    if not hits & set(_GENERATORS) or "CheckpointFunction" not in hits:
        raise fail("checkpoint_recompute", f"is not what checkpoint() calls (reached: "
                   f"{sorted(hits)})")
