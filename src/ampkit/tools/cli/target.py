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

A reference that does not import, names a missing attribute (with the closest names:
"did you mean"), or an object of the wrong kind, or a model without floating-point
parameters, raises :class:`TargetError`, whose message is one line: the command prints
it and exits with status 2. So does an exception raised *inside* the user's code (a
factory, the inputs function, ``--eval``, ``--loss-fn``, the model's forward), or a
value of the wrong kind returned by it: :class:`UserCodeError` names the function, the
exception and the line of the user's code it came from (:func:`call_user`,
:func:`forward_error`).

Example:
    >>> from ampkit.tools.cli.target import load_callable
    >>> load_callable("math:sqrt", "--eval")(16.0)
    4.0
    >>> load_callable("math:pi", "--eval")
    Traceback (most recent call last):
    ...
    ampkit.tools.cli.target.TargetError: --eval 'math:pi' is a float, not a callable
"""

from __future__ import annotations

import importlib
import os
import sys
import sysconfig
import traceback
from collections.abc import Callable
from pathlib import Path
from types import CodeType, TracebackType
from typing import Any

from ampkit.common.arguments import did_you_mean

__all__ = ["TargetError", "UserCodeError", "call_user", "forward_error", "inputs_factory",
           "load_callable", "load_model", "load_object", "model_factory", "user_function"]


class TargetError(ValueError):
    """A ``package.module:attribute`` reference that cannot be used (a one-line message).

    Example:
        >>> from ampkit.tools.cli.target import TargetError, load_object
        >>> isinstance(TargetError("x"), ValueError)
        True
    """


class UserCodeError(TargetError):
    """The user's own code raised, or returned a value of the wrong kind (a one-line
    message naming the function and the exception; the exception is the
    ``__cause__``).

    Example:
        >>> from ampkit.tools.cli.target import TargetError, UserCodeError
        >>> issubclass(UserCodeError, TargetError)
        True
    """


def _library_roots() -> tuple[str, ...]:
    # Code that is not the user's: ampkit, torch, and Python's own library.
    import torch

    import ampkit

    roots = {str(Path(ampkit.__file__).parent), str(Path(torch.__file__).parent)}
    roots.update(sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib"))
    return tuple(os.path.join(root, "") for root in roots)


def _user_line(tb: TracebackType | None) -> str:
    """`` (at FILE:LINE)`` of the innermost frame of ``tb`` in the user's code (not in
    ampkit, torch or Python's library), or ``""``; FILE relative to the current folder
    when it is under it."""
    roots = _library_roots()
    frames = [f for f in traceback.extract_tb(tb)
              if not f.filename.startswith(roots) and not f.filename.startswith("<")]
    if not frames:
        return ""
    where = frames[-1]
    name = where.filename
    here = os.path.join(os.getcwd(), "")
    if name.startswith(here):
        name = name[len(here):]
    return f" (at {name}:{where.lineno})"


def call_user(what: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, where ``fn`` is the user's code: whatever it raises becomes a
    :class:`UserCodeError` naming ``what`` (``"TARGET 'mymodels:build'"``), the
    exception and the user's line it came from.

    Example:
        >>> from ampkit.tools.cli.target import call_user
        >>> call_user("--eval 'm:f'", int, "x")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ampkit.tools.cli.target.UserCodeError: --eval 'm:f' raised ValueError: invalid ...
    """
    try:
        return fn(*args)
    except UserCodeError:
        raise
    # the user's code: any exception is theirs to read; sys.exit() in a factory or a
    # metric would otherwise end the command with its status and no report or message
    except (Exception, SystemExit) as error:
        raise UserCodeError(f"{what} raised {_one_line(error)}"
                            f"{_user_line(error.__traceback__)}") from error


def _forward_codes(model: Any) -> dict[CodeType, str]:
    codes: dict[CodeType, str] = {}
    for module in model.modules():
        code = getattr(type(module).forward, "__code__", None)
        if isinstance(code, CodeType):
            codes.setdefault(code, f"{type(module).__name__}.forward")
    return codes


def forward_error(error: BaseException, model: Any, target: str) -> UserCodeError | None:
    """A :class:`UserCodeError` for ``error`` when it was raised inside the forward of
    one of ``model``'s modules (the user's model, run by ampkit), else ``None`` (an
    error of ampkit's own, which keeps its traceback). A :class:`UserCodeError` in the
    chain of causes (one :func:`call_user` made) is returned as it is.

    Example:
        >>> import torch
        >>> from ampkit.tools.cli.target import forward_error
        >>> net = torch.nn.Linear(2, 2)
        >>> try:
        ...     net(torch.ones(3))
        ... except RuntimeError as error:
        ...     print(forward_error(error, net, "m:net"))  # doctest: +ELLIPSIS
        the forward of TARGET 'm:net' (Linear.forward) raised RuntimeError: ...
    """
    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, UserCodeError):
            return cause
        cause = cause.__cause__
    codes = _forward_codes(model)
    inside = [frame.f_code for frame, _ in traceback.walk_tb(error.__traceback__)
              if frame.f_code in codes]
    if not inside:
        return None
    # the innermost forward of the user's own classes names it best (torch's
    # Linear.forward is where a bad shape lands, not what the user wrote)
    roots = _library_roots()
    own = [code for code in inside if not code.co_filename.startswith(roots)]
    name = codes[(own or inside)[-1]]
    found = UserCodeError(f"the forward of TARGET {target!r} ({name}) raised "
                          f"{_one_line(error)}{_user_line(error.__traceback__)}")
    found.__cause__ = error
    return found


def _one_line(error: BaseException) -> str:
    """``Type: message`` on one line; a message that cannot be made into text (its
    ``__str__`` raising) is said so, rather than raising in the middle of the report."""
    try:
        text = " ".join(str(error).split())
    except Exception as unprintable:  # the user's __str__: any exception is possible
        text = f"<message not printable: str() raised {type(unprintable).__name__}>"
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
        >>> from ampkit.tools.cli.target import load_object
        >>> load_object("os.path:join", "TARGET").__name__
        'join'
        >>> load_object("os.path", "TARGET")
        Traceback (most recent call last):
        ...
        ampkit.tools.cli.target.TargetError: TARGET must be package.module:attribute \
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
            known = [n for n in dir(value) if not n.startswith("_")]
            raise TargetError(f"{option} {reference!r}: {owner!r} has no attribute "
                              f"{part!r}{did_you_mean(part, known)}")
        value = getattr(value, part)
    return value


def load_callable(reference: str, option: str) -> Callable[..., Any]:
    """The callable ``reference`` names (``--eval``, ``--loss-fn``).

    Raises:
        TargetError: as :func:`load_object`, or the object is not callable.

    Example:
        >>> from ampkit.tools.cli.target import load_callable
        >>> load_callable("builtins:len", "--eval")([1, 2])
        2
    """
    value = load_object(reference, option)
    if not callable(value):
        raise TargetError(f"{option} {reference!r} is {_kind(value)}, not a callable")
    function: Callable[..., Any] = value
    return function


def user_function(reference: str, option: str,
                  returns: tuple[Callable[[Any], bool], str] | None = None
                  ) -> Callable[..., Any]:
    """The callable ``reference`` names (:func:`load_callable`), wrapped so that what
    it raises is a :class:`UserCodeError` (:func:`call_user`), and, with ``returns``
    (``(accept, expected)``), so is a returned value ``accept`` refuses.

    Example:
        >>> from ampkit.tools.cli.target import user_function
        >>> f = user_function("builtins:str", "--eval", (lambda v: isinstance(v, float),
        ...                                              "a number"))
        >>> f(1.5)  # doctest: +NORMALIZE_WHITESPACE
        Traceback (most recent call last):
        ...
        ampkit.tools.cli.target.UserCodeError: --eval 'builtins:str' returned a str: it must
        return a number
    """
    fn = load_callable(reference, option)
    what = f"{option} {reference!r}"

    def call(*args: Any) -> Any:
        value = call_user(what, fn, *args)
        if returns is not None and not returns[0](value):
            raise UserCodeError(f"{what} returned {_kind(value)}: it must return "
                                f"{returns[1]}")
        return value

    return call


def model_factory(reference: str) -> Callable[[], Any]:
    """A function building the ``nn.Module`` TARGET names (the module itself, or what
    calling it returns), checked when called; the reference itself is checked now.

    Raises:
        TargetError: as :func:`load_object`, or TARGET is neither a module nor a
            callable; from the factory: TARGET returned something other than a module,
            or a model without floating-point parameters.

    Example:
        >>> from ampkit.tools.cli.target import model_factory
        >>> build = model_factory("torch.nn:Identity")
        >>> build()
        Traceback (most recent call last):
        ...
        ampkit.tools.cli.target.TargetError: TARGET 'torch.nn:Identity': the model has \
no floating-point parameters: there is nothing to run in low precision
    """
    import torch.nn as nn

    from ampkit.tools.accuracy.compare import check_model

    value = load_object(reference, "TARGET")
    if not isinstance(value, nn.Module) and not callable(value):
        raise TargetError(f"TARGET {reference!r} is {_kind(value)}: it must be an "
                          f"nn.Module or a callable returning one")

    def build() -> Any:
        model = (value if isinstance(value, nn.Module)
                 else call_user(f"TARGET {reference!r}", value))
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
        >>> from ampkit.tools.cli.target import load_model
        >>> load_model("torch.nn:Identity")
        Traceback (most recent call last):
        ...
        ampkit.tools.cli.target.TargetError: TARGET 'torch.nn:Identity': the model has \
no floating-point parameters: there is nothing to run in low precision
    """
    return model_factory(reference)()


def inputs_factory(reference: str) -> Callable[[], tuple[Any, ...]]:
    """A function returning the forward's positional arguments: what the callable
    ``reference`` returns (a tuple as it is, anything else as the one argument).

    Raises:
        TargetError: as :func:`load_callable`; when called, an empty tuple (no inputs:
            the forward would be called with none).

    Example:
        >>> from ampkit.tools.cli.target import inputs_factory
        >>> inputs_factory("builtins:list")()
        ([],)
        >>> inputs_factory("builtins:tuple")()
        Traceback (most recent call last):
        ...
        ampkit.tools.cli.target.UserCodeError: --inputs 'builtins:tuple' returned an empty \
tuple: it must return the forward's inputs (a tuple of its positional arguments, or the \
one argument)
    """
    make = load_callable(reference, "--inputs")

    def inputs() -> tuple[Any, ...]:
        value = call_user(f"--inputs {reference!r}", make)
        if isinstance(value, tuple) and not value:
            raise UserCodeError(
                f"--inputs {reference!r} returned an empty tuple: it must return the "
                f"forward's inputs (a tuple of its positional arguments, or the one "
                f"argument)")
        return value if isinstance(value, tuple) else (value,)

    return inputs
