"""torchao's ``Float8Linear`` as ampkit converts it: evaluation under
``torch.inference_mode()`` included.

torchao's float8 matmul casts its operands to its own tensor subclass (torchao's
``Float8TrainingTensor``). Under an autocast region (O2's, around the whole model) the
matmul's autocast casts that subclass to the region's dtype; with grad mode on or
under ``torch.no_grad()`` the cast reaches the subclass as an op torchao implements,
but under ``torch.inference_mode()`` it reaches it as ``aten.to.dtype``, which torchao
refuses (``NotImplementedError: attempting to run aten.to.dtype``).

So ampkit's fp8 layers run their forward, when called under inference mode, with
inference mode switched off and grad mode off (:func:`fp8_call`): exactly the
computation they run under ``torch.no_grad()`` (the same torchao code, the same casts,
scales and ``torch._scaled_mm``), so the output is the ``no_grad`` output bit for bit;
nothing is recorded for backward either way. The only difference a caller can see:
the layer's output is a normal tensor, not an inference tensor (the ops after it,
still under inference mode, make inference tensors again).

``initialize`` gives every ``Float8Linear`` it makes the class :func:`float8_linear_class`
(a subclass of torchao's, with the same name and everything else torchao's), in
place, as :mod:`ampkit.fp8.conv1d` does for Hugging Face's ``Conv1D``.

Example:
    >>> import torch
    >>> import ampkit
    >>> net = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)])
    >>> net = ampkit.initialize(net, level="O2", dtype=torch.bfloat16, fp8="tensorwise")
    >>> x = torch.randn(8, 32)
    >>> with torch.no_grad():
    ...     expected = net(x)
    >>> with torch.inference_mode():
    ...     got = net(x)
    >>> torch.equal(got, expected)
    True
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

__all__ = ["float8_linear_class", "fp8_call", "is_ampkit_float8_linear",
           "to_ampkit_float8_linear"]

_NAME = "Float8Linear"


def fp8_call(call: Callable[..., Any], *args: Any) -> Any:
    """``call(*args)``; under ``torch.inference_mode()``, with inference mode and grad
    mode off around it, so that torchao's float8 matmul runs as it does under
    ``torch.no_grad()`` (the same numbers, nothing recorded for backward). Inside
    ``torch.compile``'s tracing, the call as it is.

    Example:
        >>> import torch
        >>> from ampkit.fp8.linear import fp8_call
        >>> with torch.inference_mode():
        ...     fp8_call(lambda: (torch.is_inference_mode_enabled(),
        ...                       torch.is_grad_enabled()))
        (False, False)
    """
    # Traced by torch.compile: the call as it is (a compiled model already runs under
    # inference_mode, with the compiled no_grad numbers; no mode switch in the graph).
    if torch.compiler.is_compiling() or not torch.is_inference_mode_enabled():
        return call(*args)
    with torch.inference_mode(False), torch.no_grad():
        return call(*args)


def _forward(self: Any, input: torch.Tensor) -> torch.Tensor:
    from torchao.float8.float8_linear import Float8Linear

    # torchao's forward, as it is (named directly: torch.compile traces this frame)
    out: torch.Tensor = fp8_call(Float8Linear.forward, self, input)
    return out


@functools.cache
def float8_linear_class() -> type:
    """ampkit's ``Float8Linear``: torchao's, with a forward that also runs under
    ``torch.inference_mode()`` (:func:`fp8_call`). Made once (imports torchao);
    pickles by reference as ``ampkit.fp8.linear.Float8Linear``.

    Example:
        >>> from torchao.float8.float8_linear import Float8Linear
        >>> from ampkit.fp8.linear import float8_linear_class
        >>> cls = float8_linear_class()
        >>> issubclass(cls, Float8Linear), cls.__name__
        (True, 'Float8Linear')
    """
    from torchao.float8.float8_linear import Float8Linear

    return type(_NAME, (Float8Linear,), {
        "forward": _forward, "_ampkit_float8_linear": True, "__module__": __name__,
        "__qualname__": _NAME,
        "__doc__": "torchao's Float8Linear, evaluable under torch.inference_mode() "
                   "(ampkit)."})


def __getattr__(name: str) -> Any:
    # ``ampkit.fp8.linear.Float8Linear`` made on first use (pickle finds it here).
    if name == _NAME:
        return float8_linear_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def is_ampkit_float8_linear(module: Any) -> bool:
    """Whether ``module`` is a ``Float8Linear`` that :func:`to_ampkit_float8_linear`
    converted (FSDP2's subclass of it included).

    Example:
        >>> import torch
        >>> from ampkit.fp8.linear import is_ampkit_float8_linear
        >>> is_ampkit_float8_linear(torch.nn.Linear(2, 2))
        False
    """
    return any(klass.__dict__.get("_ampkit_float8_linear", False)
               for klass in type(module).__mro__)


def to_ampkit_float8_linear(module: nn.Module) -> None:
    """Give an exact torchao ``Float8Linear`` the class :func:`float8_linear_class`, in
    place: same object, parameters, ``state_dict`` and hooks.

    Raises:
        TypeError: ``module`` is not exactly torchao's ``Float8Linear``.

    Example:
        >>> import torch
        >>> from torchao.float8 import convert_to_float8_training
        >>> from ampkit.fp8.linear import to_ampkit_float8_linear
        >>> net = convert_to_float8_training(torch.nn.Sequential(torch.nn.Linear(16, 16)))
        >>> to_ampkit_float8_linear(net[0])
        >>> type(net[0]).__module__, type(net[0]).__name__
        ('ampkit.fp8.linear', 'Float8Linear')
        >>> to_ampkit_float8_linear(torch.nn.Linear(16, 16))
        Traceback (most recent call last):
        ...
        TypeError: to_ampkit_float8_linear takes a torchao Float8Linear, got Linear
    """
    from torchao.float8.float8_linear import Float8Linear

    if type(module) is not Float8Linear:
        raise TypeError(f"to_ampkit_float8_linear takes a torchao Float8Linear, got "
                        f"{type(module).__name__}")
    module.__class__ = float8_linear_class()
