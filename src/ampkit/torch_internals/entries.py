"""The registry of ampkit's torch internals: :class:`Entry`, :data:`ENTRIES`, and the
error a failed check raises (see :mod:`ampkit.torch_internals`).

Example:
    >>> from ampkit.torch_internals.entries import ENTRIES
    >>> "dispatcher" in ENTRIES
    True
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["ENTRIES", "Entry", "TorchInternalsError", "check", "fail", "register_entry"]


class TorchInternalsError(RuntimeError):
    """A torch internal ampkit relies on is missing or no longer behaves as expected.

    Example:
        >>> from ampkit.torch_internals import TorchInternalsError
        >>> issubclass(TorchInternalsError, RuntimeError)
        True
    """


@dataclass(frozen=True)
class Entry:
    """One private torch name (or patched torch class) ampkit uses.

    Example:
        >>> from ampkit.torch_internals import ENTRIES
        >>> ENTRIES["compile_session"].names
        ('torch._guards.CompileContext',)
    """

    name: str
    #: the private names it covers, as written in torch
    names: tuple[str, ...]
    #: what ampkit needs it for
    need: str
    #: the public API that replaces it, where one exists (and why it is not used)
    public: str
    #: raises :class:`TorchInternalsError` where it is gone or behaves otherwise
    check: Callable[[], None]
    #: checked at first use, not at import (it imports torch._dynamo)
    lazy: bool = False


ENTRIES: dict[str, Entry] = {}


def register_entry(name: str, names: tuple[str, ...], need: str, public: str,
           lazy: bool = False) -> Callable[[Callable[[], None]], Callable[[], None]]:
    def register(fn: Callable[[], None]) -> Callable[[], None]:
        ENTRIES[name] = Entry(name, names, need, public, fn, lazy)
        return fn
    return register


def fail(entry: str, what: str) -> TorchInternalsError:
    """The error for ``entry`` (a key of :data:`ENTRIES`): names torch's version.

    Example:
        >>> from ampkit.torch_internals import fail
        >>> "compile_session" in str(fail("compile_session", "gone"))
        True
    """
    return TorchInternalsError(f"ampkit: torch {torch.__version__}: the torch internal "
                               f"{entry!r} ({', '.join(ENTRIES[entry].names)}) {what}")


def check(name: str) -> None:
    """Run entry ``name``'s check (raises :class:`TorchInternalsError`).

    Example:
        >>> from ampkit.torch_internals import check
        >>> check("compile_session")
    """
    if name not in ENTRIES:
        raise ValueError(f"name: unknown torch internal {name!r}; name must be one of "
                         f"{sorted(ENTRIES)}")
    ENTRIES[name].check()
