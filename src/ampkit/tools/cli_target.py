"""The user's own model on the command line: ``package.module:attribute`` references.

``ampkit compare`` and ``ampkit tune`` take their model, inputs and metric as
references of the form ``package.module:attribute`` (the attribute may be dotted:
``models:Net.small``), the way ``python -m``, ``accelerate launch`` and ``torchrun``
take a script:

* TARGET (:func:`load_model`, :func:`model_factory`): an ``nn.Module``, or a callable
  returning one (a class, a factory function);
* ``--inputs`` (:func:`inputs_factory`): a callable returning the forward's inputs (a
  tuple is the positional arguments; anything else is the one argument);
* ``--eval`` and ``--loss-fn`` (:func:`load_callable`): ``eval_fn(model) -> number``,
  ``loss_fn(output) -> scalar tensor``.

The module is imported with the current folder first on ``sys.path``, as ``python -m``
does, so a package next to the command is found without installing it.

A reference that does not import, names a missing attribute or an object of the wrong
kind, or a model without floating-point parameters, raises :class:`TargetError`, whose
message is one line: the command prints it and exits with status 2. An exception
raised *inside* the user's code (a factory that fails) is not caught: its traceback
points into that code.

Example:
    >>> from ampkit.tools.cli_target import load_callable
    >>> load_callable("math:sqrt", "--eval")(16.0)
    4.0
    >>> load_callable("math:pi", "--eval")
    Traceback (most recent call last):
    ...
    ampkit.tools.cli_target.TargetError: --eval 'math:pi' is a float, not a callable
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["TargetError", "inputs_factory", "load_callable", "load_model", "load_object",
           "model_factory"]


class TargetError(ValueError):
    """A ``package.module:attribute`` reference that cannot be used (a one-line message).

    Example:
        >>> from ampkit.tools.cli_target import TargetError, load_object
        >>> isinstance(TargetError("x"), ValueError)
        True
    """


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _kind(value: Any) -> str:
    name = type(value).__name__
    return f"an {name}" if name[:1].lower() in "aeiou" else f"a {name}"


def load_object(reference: str, option: str) -> Any:
    """The object ``reference`` (``package.module:attribute``) names.

    ``option`` names the command-line argument in errors (``TARGET``, ``--eval``).

    Raises:
        TargetError: a malformed reference, a module that does not import (whatever
            it raised, on one line), a missing attribute.

    Example:
        >>> from ampkit.tools.cli_target import load_object
        >>> load_object("os.path:join", "TARGET").__name__
        'join'
        >>> load_object("os.path", "TARGET")
        Traceback (most recent call last):
        ...
        ampkit.tools.cli_target.TargetError: TARGET must be package.module:attribute \
(e.g. mypkg.models:build_model), got 'os.path'
    """
    module_name, colon, attribute = reference.partition(":")
    parts = attribute.split(".")
    if not colon or not module_name.strip() or not all(p.isidentifier() for p in parts):
        raise TargetError(f"{option} must be package.module:attribute (e.g. "
                          f"mypkg.models:build_model), got {reference!r}")
    # ``python -m`` puts the current folder first; console scripts do not.
    here = os.getcwd()
    if here not in sys.path:
        sys.path.insert(0, here)
    try:
        value: Any = importlib.import_module(module_name)
    except Exception as error:  # the user's module: report whatever stopped its import
        raise TargetError(f"{option} {reference!r}: cannot import {module_name!r} "
                          f"(from {here} or sys.path): {_one_line(error)}") from None
    for depth, part in enumerate(parts):
        if not hasattr(value, part):
            owner = ".".join([module_name, *parts[:depth]]) if depth else module_name
            raise TargetError(f"{option} {reference!r}: {owner!r} has no attribute "
                              f"{part!r}")
        value = getattr(value, part)
    return value


def load_callable(reference: str, option: str) -> Callable[..., Any]:
    """The callable ``reference`` names (``--eval``, ``--loss-fn``).

    Raises:
        TargetError: as :func:`load_object`, or the object is not callable.

    Example:
        >>> from ampkit.tools.cli_target import load_callable
        >>> load_callable("builtins:len", "--eval")([1, 2])
        2
    """
    value = load_object(reference, option)
    if not callable(value):
        raise TargetError(f"{option} {reference!r} is {_kind(value)}, not a callable")
    return value


def model_factory(reference: str) -> Callable[[], Any]:
    """A function building the ``nn.Module`` TARGET names (the module itself, or what
    calling it returns), checked when called; the reference itself is checked now.

    Raises:
        TargetError: as :func:`load_object`, or TARGET is neither a module nor a
            callable; from the factory: TARGET returned something other than a module,
            or a model without floating-point parameters.

    Example:
        >>> from ampkit.tools.cli_target import model_factory
        >>> build = model_factory("torch.nn:Identity")
        >>> build()
        Traceback (most recent call last):
        ...
        ampkit.tools.cli_target.TargetError: TARGET 'torch.nn:Identity': the model has \
no floating-point parameters: there is nothing to run in low precision
    """
    import torch.nn as nn

    from ampkit.tools.compare import check_model

    value = load_object(reference, "TARGET")
    if not isinstance(value, nn.Module) and not callable(value):
        raise TargetError(f"TARGET {reference!r} is {_kind(value)}: it must be an "
                          f"nn.Module or a callable returning one")

    def build() -> Any:
        model = value if isinstance(value, nn.Module) else value()
        if not isinstance(model, nn.Module):
            raise TargetError(f"TARGET {reference!r} returned {_kind(model)}: it must "
                              f"return an nn.Module")
        try:
            check_model(model)
        except ValueError as error:
            raise TargetError(f"TARGET {reference!r}: the {error}") from None
        return model

    return build


def load_model(reference: str) -> Any:
    """The ``nn.Module`` TARGET names: :func:`model_factory`, called.

    Example:
        >>> from ampkit.tools.cli_target import load_model
        >>> load_model("torch.nn:Identity")
        Traceback (most recent call last):
        ...
        ampkit.tools.cli_target.TargetError: TARGET 'torch.nn:Identity': the model has \
no floating-point parameters: there is nothing to run in low precision
    """
    return model_factory(reference)()


def inputs_factory(reference: str) -> Callable[[], tuple[Any, ...]]:
    """A function returning the forward's positional arguments: what the callable
    ``reference`` returns (a tuple as it is, anything else as the one argument).

    Raises:
        TargetError: as :func:`load_callable`.

    Example:
        >>> from ampkit.tools.cli_target import inputs_factory
        >>> inputs_factory("builtins:tuple")()
        ()
    """
    make = load_callable(reference, "--inputs")

    def inputs() -> tuple[Any, ...]:
        value = make()
        return value if isinstance(value, tuple) else (value,)

    return inputs
