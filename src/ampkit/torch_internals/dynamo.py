"""torch.compile's internals ampkit extends: the frame evaluator's per-code strategy,
and four dynamo/AOTAutograd classes patched when their module is first imported (so
``import ampkit`` does not import ``torch._dynamo``, over a second): the guard builder,
AOTAutograd's cache details, dynamo's graph-node decorators and the compile-end callback
handler (see :mod:`ampkit.torch_internals`).

Example:
    >>> from ampkit.torch_internals.dynamo import skip_code
    >>> skip_code((lambda: 0).__code__, recursive=True)
    True
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ampkit.torch_internals.entries import fail, register_entry

__all__ = ["after_compile", "dynamo_loaded", "in_graph", "install_compile_hooks",
           "skip_code"]


def dynamo_loaded() -> bool:
    """Whether ``torch._dynamo`` has been imported (until then nothing can compile).

    Example:
        >>> from ampkit.torch_internals.dynamo import dynamo_loaded
        >>> isinstance(dynamo_loaded(), bool)
        True
    """
    return "torch._dynamo" in sys.modules


# -- the frame evaluator ------------------------------------------------------------------------

def skip_code(code: Any, recursive: bool) -> bool:
    """Have dynamo's frame evaluator run frames of ``code`` as plain Python, and with
    ``recursive`` everything they call too (what ``torch.compiler.disable`` arranges,
    without importing torch._dynamo). False where this torch lacks the hook."""
    try:
        ef = torch._C._dynamo.eval_frame
        skip = ef._FrameAction.SKIP
        ef.set_code_exec_strategy(code, ef._FrameExecStrategy(
            skip, skip if recursive else ef._FrameAction.DEFAULT))
    except (AttributeError, RuntimeError, TypeError):
        return False
    return True


@register_entry("frame_strategy", ("torch._C._dynamo.eval_frame.set_code_exec_strategy",
                                   "torch._C._dynamo.eval_frame._FrameExecStrategy",
                                   "torch._C._dynamo.eval_frame._FrameAction"),
                "keep ampkit's bookkeeping and kernels out of dynamo's traces without "
                "importing torch._dynamo at import ampkit",
                "torch.compiler.disable, which imports torch._dynamo (over a second); "
                "used instead where this hook is missing", lazy=True)
def _check_frame_strategy() -> None:
    def plain() -> bool:
        return torch.compiler.is_compiling()

    if not skip_code(plain.__code__, recursive=True):
        raise fail("frame_strategy", "is gone (ampkit falls back to torch.compiler.disable)")
    if torch.compile(plain, backend="eager")():
        raise fail("frame_strategy", "did not make dynamo run a skipped frame as Python")


# -- patches of dynamo's classes ----------------------------------------------------------------

_token: Callable[[], Any] = lambda: None  # noqa: E731 - set by install_compile_hooks
_IN_GRAPH: list[Callable[..., None]] = []
_AFTER_COMPILE: list[Callable[[], None]] = []
#: what each patch did (the checks read it: a patch that is never called is no patch)
seen: set[str] = set()


def _patch_guards(module: Any) -> None:
    builder = module.GuardBuilder
    original = builder.GLOBAL_STATE
    if getattr(original, "_ampkit", False):
        return

    def global_state(self: Any, guard: Any) -> None:
        original(self, guard)
        seen.add("guard")
        token = _token()

        def check(_: Any, token: Any = token) -> bool:
            now = _token()
            return now is token or now == token

        self.guard_manager.root.add_lambda_guard(
            check, [f"ampkit: active policy == {token!r}"], None)

    global_state._ampkit = True  # type: ignore[attr-defined]
    builder.GLOBAL_STATE = global_state


def _patch_aot_cache(module: Any) -> None:
    details = module.AOTAutogradCacheDetails
    original = details.__init__
    if getattr(original, "_ampkit", False):
        return

    def init_with_policy(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        # The dynamo graph is the same under every policy; the traced casts are not.
        # The cache key is the hash of this object's fields, taken once it is built
        # (wrapping __init__, which every torch release has, rather than a helper
        # that only some have: torch 2.11/2.12 lack _record_runtime_state).
        seen.add("aot_cache")
        self.ampkit_policy = repr(_token())

    init_with_policy._ampkit = True  # type: ignore[attr-defined]
    details.__init__ = init_with_policy


def _patch_in_graph(module: Any) -> None:
    for fn in _IN_GRAPH:
        module.allow_in_graph(fn)
        torch.fx.node.has_side_effect(fn)


def _patch_callbacks(module: Any) -> None:
    # The handler's method, not a registered callback: torch._dynamo.reset() clears
    # those.
    handler = module.CompilationCallbackHandler
    original = handler.run_end_callbacks
    if getattr(original, "_ampkit", False):
        return

    def run_end_callbacks(self: Any, args: Any) -> None:
        try:
            original(self, args)
        finally:
            seen.add("compile_end")
            for fn in _AFTER_COMPILE:
                fn()

    run_end_callbacks._ampkit = True  # type: ignore[attr-defined]
    handler.run_end_callbacks = run_end_callbacks


_PATCHES: dict[str, Callable[[Any], None]] = {
    "torch._dynamo.guards": _patch_guards,
    "torch._functorch._aot_autograd.autograd_cache": _patch_aot_cache,
    "torch._dynamo.decorators": _patch_in_graph,
    "torch._dynamo.callback": _patch_callbacks,
}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Patches a module of ``_PATCHES`` right after it is first imported."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        patch = _PATCHES.get(fullname)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_patch(module: Any) -> None:
            exec_module(module)
            _apply(patch, module)

        loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


def _apply(patch: Callable[[Any], None], module: Any) -> None:
    try:
        patch(module)
    except AttributeError as error:  # a torch whose internals moved
        warnings.warn(f"ampkit: torch {torch.__version__}: cannot guard compiled graphs "
                      f"on the ampkit policy ({module.__name__}: {error}); a graph "
                      f"compiled under one ampkit policy may be reused under another: "
                      f"call torch._dynamo.reset() between policies", RuntimeWarning,
                      stacklevel=3)


_installed = False


def install_compile_hooks(token: Callable[[], Any]) -> None:
    """Make torch.compile guard on (and cache by) ``token()``, the calling thread's
    policy token: now for what is imported, on import for the rest. Idempotent.

    Example:
        >>> from ampkit.torch_internals.dynamo import install_compile_hooks
        >>> callable(install_compile_hooks)
        True
    """
    global _installed, _token
    _token = token
    if _installed:
        return
    _installed = True
    for name, patch in _PATCHES.items():
        module = sys.modules.get(name)
        if module is not None:
            _apply(patch, module)
    sys.meta_path.insert(0, _AfterImport())


def in_graph(fn: Callable[..., None]) -> None:
    """Have dynamo record calls of ``fn`` in its graphs as they are and keep them (they
    return nothing: their effect is on the thread's state), like
    ``torch.compiler.allow_in_graph`` with ``torch.fx.node.has_side_effect``: now if
    dynamo is loaded, else when it is.

    Example:
        >>> from ampkit.torch_internals.dynamo import in_graph
        >>> callable(in_graph)
        True
    """
    _IN_GRAPH.append(fn)
    module = sys.modules.get("torch._dynamo.decorators")
    if module is not None:
        _apply(_patch_in_graph, module)


def after_compile(fn: Callable[[], None]) -> None:
    """Call ``fn`` at the end of every compilation, failed ones included (dynamo's
    compile-end callback): now if dynamo is loaded, else when it is.

    Example:
        >>> from ampkit.torch_internals.dynamo import after_compile
        >>> callable(after_compile)
        True
    """
    _AFTER_COMPILE.append(fn)
    module = sys.modules.get("torch._dynamo.callback")
    if module is not None:
        _apply(_patch_callbacks, module)


@register_entry("compile_hooks", ("torch._dynamo.guards.GuardBuilder.GLOBAL_STATE",
                                  "torch._functorch._aot_autograd.autograd_cache."
                                  "AOTAutogradCacheDetails",
                                  "torch._dynamo.decorators.allow_in_graph",
                                  "torch._dynamo.callback.CompilationCallbackHandler"),
                "compiled graphs guard on the thread's ampkit policy and AOTAutograd's "
                "cache keys on it; a region's enter/exit are graph nodes; what an "
                "interrupted trace entered is left at the end of the compilation",
                "none for the guard and the cache key; torch.compiler.allow_in_graph "
                "(imports dynamo at call); no public compile-end callback that "
                "torch._dynamo.reset() keeps", lazy=True)
def _check_compile_hooks() -> None:
    if not _installed:
        raise fail("compile_hooks", "are not installed (import ampkit installs them)")
    import torch._dynamo.callback
    import torch._dynamo.guards
    import torch._functorch._aot_autograd.autograd_cache as cache

    if not getattr(cache.AOTAutogradCacheDetails.__init__, "_ampkit", False):
        raise fail("compile_hooks", "left AOTAutogradCacheDetails unpatched")
    seen.discard("guard")
    seen.discard("compile_end")
    torch._dynamo.reset()
    torch.compile(lambda t: t + 1, backend="eager")(torch.zeros(1))
    missing = {"guard", "compile_end"} - seen
    if missing:
        raise fail("compile_hooks", f"were not called by a compilation: {sorted(missing)}")
