"""Shared tracing pieces of the tools: which module is running, which ops it calls.

* :class:`ModuleScope` keeps the qualified name of the innermost running module from
  forward pre/post hooks (the numerics checker and :func:`ampkit.compare` both use it),
  and can hand each module's inputs and outputs to callbacks.
* :class:`OpWatch` is a ``TorchFunctionMode`` that reports each call of a registered op
  (canonical names of :mod:`ampkit.policies.registry`, the names policies list) with its
  arguments and result. It watches at the level the autocast engine works at, so what
  it names is exactly what a ``custom_black_list`` can move.
* :class:`DispatchRegion` is the base of the counters that watch below autocast and
  autograd (:mod:`~ampkit.tools.ops.op_stats`, :mod:`~ampkit.tools.ops.cast_traffic`): a region
  entered once, handing every aten call that ran inside it to ``_on_call``.

Example:
    >>> import torch
    >>> from ampkit.tools.ops.tracing import ModuleScope, OpWatch
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    >>> x, seen = torch.ones(1, 2), []
    >>> scope = ModuleScope(net)
    >>> with scope, OpWatch(lambda name, args, kwargs, out: seen.append(
    ...         (scope.current, name))):
    ...     _ = net(x)
    >>> seen
    [('0', 'linear'), ('1', 'relu')]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.nn as nn
from torch.overrides import TorchFunctionMode

from ampkit.torch_internals import TorchDispatchMode

__all__ = ["DispatchRegion", "ModuleScope", "OpWatch"]

EnterHook = Callable[[str, nn.Module, Any], None]
ExitHook = Callable[[str, nn.Module, Any, Any], None]


class ModuleScope:
    """Context manager tracking the innermost running module of ``model`` by its
    qualified name (``""`` is the model itself), with optional callbacks on each
    module's entry (name, module, args) and exit (name, module, args, output).

    Example:
        >>> import torch
        >>> from ampkit.tools.ops.tracing import ModuleScope
        >>> net = torch.nn.Sequential(torch.nn.Identity())
        >>> names = []
        >>> with ModuleScope(net, on_enter=lambda n, m, a: names.append(n)):
        ...     _ = net(torch.ones(1))
        >>> names
        ['', '0']
    """

    def __init__(self, model: nn.Module | None, *, on_enter: EnterHook | None = None,
                 on_exit: ExitHook | None = None) -> None:
        self.model = model
        self.on_enter = on_enter
        self.on_exit = on_exit
        self.stack: list[str] = []
        self._hooks: list[Any] = []

    @property
    def current(self) -> str | None:
        """The innermost running module's name, or ``None`` outside the model."""
        return self.stack[-1] if self.stack else None

    def __enter__(self) -> ModuleScope:
        if self.model is not None:
            for name, module in self.model.named_modules():
                self._hooks.append(module.register_forward_pre_hook(self._push(name)))
                self._hooks.append(module.register_forward_hook(self._pop(name)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.stack.clear()  # a forward that raised never ran its exit hooks

    def _push(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            self.stack.append(name)
            if self.on_enter is not None:
                self.on_enter(name, module, args)
        return hook

    def _pop(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self.stack:
                self.stack.pop()
            if self.on_exit is not None:
                self.on_exit(name, module, args, output)
        return hook


class OpWatch(TorchFunctionMode):
    """Calls ``callback(op_name, args, kwargs, output)`` (and ``func``, the function
    called, with ``with_func=True``) after every call of a registered op (canonical
    name) made while active; other calls pass unseen.

    Calls made by the callback itself are not watched (the mode is off inside it).

    Example:
        >>> import torch
        >>> from ampkit.tools.ops.tracing import OpWatch
        >>> x, names = torch.ones(2), []
        >>> with OpWatch(lambda name, *_: names.append(name)):
        ...     _ = torch.exp(x) + 1
        >>> names
        ['exp', 'add']
    """

    def __init__(self, callback: Callable[..., None], *, with_func: bool = False) -> None:
        super().__init__()
        self.callback = callback
        self.with_func = with_func  # also pass the called function (to call it again)

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        from ampkit.policies.registry import op_name_of

        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = op_name_of(func)
        if name is not None:
            if self.with_func:
                self.callback(name, args, kwargs, out, func)
            else:
                self.callback(name, args, kwargs, out)
        return out


_Region = TypeVar("_Region", bound="DispatchRegion")


class _DispatchMode(TorchDispatchMode):
    def __init__(self, region: DispatchRegion) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's base, unannotated
        self.region = region

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.region._on_call(func, args, kwargs, out)
        return out


class DispatchRegion:
    """Context manager, entered once, that hands every aten call run inside it (forward,
    backward and optimizer alike, of the thread that entered it) to ``_on_call``, which
    subclasses define.

    It watches in a ``TorchDispatchMode``, below autocast and autograd, so what it sees
    is what ran. Subclasses keep what ``_on_call`` sees; they can be read during and
    after the region. ``entered_twice`` is the message of the ``RuntimeError`` a second
    entry raises, and ``active`` the word for the state inside the region (``ready``
    before, ``finished`` after).

    Example:
        >>> import torch
        >>> from ampkit.tools.ops.tracing import DispatchRegion
        >>> class Names(DispatchRegion):
        ...     def __init__(self):
        ...         super().__init__("a Names region can be entered only once")
        ...         self.seen = []
        ...     def _on_call(self, func, args, kwargs, out):
        ...         self.seen.append(func.overloadpacket.__name__)
        >>> with Names() as names:
        ...     _ = torch.ones(2) * 2
        >>> names.seen
        ['ones', 'mul']
        >>> with names:
        ...     pass
        Traceback (most recent call last):
        ...
        RuntimeError: a Names region can be entered only once
    """

    def __init__(self, entered_twice: str, active: str = "counting") -> None:
        self._entered_twice = entered_twice
        self._active = active
        self._mode: _DispatchMode | None = None
        self._state = "ready"

    def _on_call(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                 out: Any) -> None:
        """Called after each aten call ``func(*args, **kwargs)`` that returned ``out``."""

    def __enter__(self: _Region) -> _Region:
        if self._state != "ready":
            raise RuntimeError(self._entered_twice)
        self._mode = _DispatchMode(self)
        self._mode.__enter__()  # type: ignore[no-untyped-call]  # torch's base, unannotated
        self._state = self._active
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._mode is not None
        self._mode.__exit__(*exc)  # type: ignore[no-untyped-call]  # torch's base, unannotated
        self._mode = None
        self._state = "finished"
