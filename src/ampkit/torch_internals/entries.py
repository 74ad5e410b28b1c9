"""The registry of ampkit's torch internals: :class:`Entry`, :data:`ENTRIES`, and the
error a failed check raises (see :mod:`ampkit.torch_internals`).

Example:
    >>> from ampkit.torch_internals.entries import ENTRIES
    >>> "dispatcher" in ENTRIES
    True
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch

__all__ = ["ENTRIES", "Entry", "TorchInternalsError", "Unavailable", "available", "check",
           "disable_broken", "fail", "register_entry", "resolve", "unavailable"]


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
    #: the names of :mod:`ampkit.torch_internals` that reach it: where the entry is
    #: missing or fails its check, each becomes an :class:`Unavailable` (or its fallback)
    provides: tuple[str, ...] = ()
    #: replacements that keep a feature working without the entry, by public means
    fallbacks: Mapping[str, Any] = field(default_factory=dict)


ENTRIES: dict[str, Entry] = {}
#: entry -> why it is unavailable on this torch (missing, or its check failed)
_BROKEN: dict[str, str] = {}


def register_entry(name: str, names: tuple[str, ...], need: str, public: str,
                   lazy: bool = False, provides: tuple[str, ...] = (),
                   fallbacks: Mapping[str, Any] | None = None,
                   ) -> Callable[[Callable[[], None]], Callable[[], None]]:
    def register(fn: Callable[[], None]) -> Callable[[], None]:
        ENTRIES[name] = Entry(name, names, need, public, fn, lazy, provides,
                              dict(fallbacks or {}))
        return fn
    return register


class Unavailable:
    """Stands where a torch internal's accessor would be on a torch that lacks the
    internal or where it failed its check: any use (a call, an attribute, ``isinstance``,
    a subclass, iteration, truth) raises :class:`TorchInternalsError` naming torch's
    version, the entry, the accessor and the public alternative. ``import ampkit`` and
    everything that does not need the entry keep working.

    Example:
        >>> from ampkit.torch_internals import TorchInternalsError, Unavailable
        >>> gone = Unavailable("schemas", "schemas_of")
        >>> try:
        ...     gone("aten::add")
        ... except TorchInternalsError as error:
        ...     "'schemas'" in str(error) and "schemas_of" in str(error)
        True
    """

    __slots__ = ("_entry", "_name")

    def __init__(self, entry: str, name: str) -> None:
        object.__setattr__(self, "_entry", entry)
        object.__setattr__(self, "_name", name)

    def _raise(self, *args: Any, **kwargs: Any) -> NoReturn:
        entry: str = object.__getattribute__(self, "_entry")
        name: str = object.__getattribute__(self, "_name")
        raise disabled(entry, name)

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)  # introspection (copy, inspect, doctest) looks
        self._raise()

    def __repr__(self) -> str:
        return (f"<unavailable torch internal {object.__getattribute__(self, '_entry')!r}: "
                f"{object.__getattribute__(self, '_name')}>")

    __call__ = __iter__ = __len__ = __contains__ = __getitem__ = _raise
    __instancecheck__ = __subclasscheck__ = __mro_entries__ = _raise
    __enter__ = _raise

    def __bool__(self) -> bool:
        self._raise()


def _reason(entry: str) -> str:
    return _BROKEN.get(entry, "is unavailable")


def disabled(entry: str, name: str) -> TorchInternalsError:
    """The error a use of ``name`` (an accessor of unavailable ``entry``) raises: names
    torch's version, the entry and its public alternative.

    Example:
        >>> from ampkit.torch_internals.entries import disabled
        >>> "public alternative" in str(disabled("schemas", "schemas_of"))
        True
    """
    known = ENTRIES.get(entry)
    names = ", ".join(known.names) if known else ""
    public = known.public if known else "none"
    return TorchInternalsError(
        f"ampkit: torch {torch.__version__}: {name} needs the torch internal {entry!r} "
        f"({names}), which {_reason(entry)}; what needs it is disabled on this torch "
        f"(the rest of ampkit works). The public alternative: {public}. Use a torch "
        f"release ampkit supports (docs/install.md) for this feature.")


def resolve(entry: str, name: str, get: Callable[[], Any]) -> Any:
    """``get()`` (which reads a private torch name), or an :class:`Unavailable` naming
    ``entry`` where this torch lacks it (the entry is then disabled at import).

    Example:
        >>> import torch
        >>> from ampkit.torch_internals.entries import resolve
        >>> resolve("norm_bases", "BatchNormBase", lambda: torch.nn.modules.batchnorm._BatchNorm)
        <class 'torch.nn.modules.batchnorm._BatchNorm'>
    """
    try:
        return get()
    except (AttributeError, ImportError) as error:
        _BROKEN.setdefault(entry, f"is missing ({type(error).__name__}: {error})")
        return Unavailable(entry, name)


def available(name: str) -> bool:
    """Whether entry ``name`` is usable on this torch (its import-time check passed).

    Example:
        >>> from ampkit.torch_internals import available
        >>> available("schemas")
        True
    """
    if name not in ENTRIES:
        raise ValueError(f"name: unknown torch internal {name!r}; name must be one of "
                         f"{sorted(ENTRIES)}")
    return name not in _BROKEN


def unavailable() -> dict[str, str]:
    """The entries this torch disabled, each with why (missing, or its check failed).

    Example:
        >>> from ampkit.torch_internals import unavailable
        >>> unavailable()
        {}
    """
    return dict(_BROKEN)


def disable_broken(package: Any) -> None:
    """Run the import-time checks; an entry that is missing or fails its check is
    disabled, not raised: its accessors (in ``package`` and in the module that defines
    them) become :class:`Unavailable` or the entry's fallbacks, and one RuntimeWarning
    names them. Called once, by ``ampkit.torch_internals``."""
    for entry in ENTRIES.values():
        if entry.lazy:
            continue
        if entry.name not in _BROKEN:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # torch's notices are not a failure
                    entry.check()
            except Exception as error:  # a missing name (AttributeError) or a behaviour
                _BROKEN[entry.name] = (f"failed its check ({type(error).__name__}: "
                                       f"{error})")
        if entry.name not in _BROKEN:
            continue
        home = sys.modules[entry.check.__module__]
        for name in entry.provides:
            stand_in = entry.fallbacks.get(name, Unavailable(entry.name, name))
            setattr(package, name, stand_in)
            setattr(home, name, stand_in)
        warnings.warn(f"ampkit: torch {torch.__version__}: the torch internal "
                      f"{entry.name!r} {_BROKEN[entry.name]}; disabled: "
                      f"{', '.join(entry.provides) or 'nothing'} (the rest of ampkit "
                      f"works)", RuntimeWarning, stacklevel=2)


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
    if name in _BROKEN:
        raise disabled(name, f"check({name!r})")
    ENTRIES[name].check()
