"""Shared tracing pieces of the tools: which module is running, which ops it calls.

* :class:`ModuleScope` keeps the qualified name of the innermost running module from
  forward pre/post hooks (the numerics checker and :func:`ampkit.compare` both use it),
  and can hand each module's inputs and outputs to callbacks.
* :class:`OpWatch` is a ``TorchFunctionMode`` that reports each call of a registered op
  (canonical names of :mod:`ampkit.registry`, the names policies list) with its
  arguments and result. It watches at the level the autocast engine works at, so what
  it names is exactly what a ``custom_black_list`` can move.

Example:
    >>> import torch
    >>> from ampkit.tools._tracing import ModuleScope, OpWatch
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
from typing import Any

import torch.nn as nn
from torch.overrides import TorchFunctionMode

__all__ = ["ModuleScope", "OpWatch"]

EnterHook = Callable[[str, nn.Module, Any], None]
ExitHook = Callable[[str, nn.Module, Any, Any], None]


class ModuleScope:
    """Context manager tracking the innermost running module of ``model`` by its
    qualified name (``""`` is the model itself), with optional callbacks on each
    module's entry (name, module, args) and exit (name, module, args, output).

    Example:
        >>> import torch
        >>> from ampkit.tools._tracing import ModuleScope
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
        >>> from ampkit.tools._tracing import OpWatch
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
        from ampkit.registry import op_name_of

        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = op_name_of(func)
        if name is not None:
            if self.with_func:
                self.callback(name, args, kwargs, out, func)
            else:
                self.callback(name, args, kwargs, out)
        return out
