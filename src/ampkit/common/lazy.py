"""Lazy re-exports for package ``__init__`` files: a name is imported on first use.

Example:
    >>> from ampkit.common.lazy import lazy_exports
    >>> ns = {}
    >>> getattr_, dir_ = lazy_exports("demo", {"sqrt": "math"}, ns)
    >>> getattr_("sqrt")(9.0), "sqrt" in ns
    (3.0, True)
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any


def lazy_exports(package: str, table: Mapping[str, str], namespace: dict[str, Any],
                 submodules: Iterable[str] = ()
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """Module-level ``__getattr__`` and ``__dir__`` serving ``table`` (name -> module
    holding it) and ``submodules`` (names of ``package``'s own modules, imported as
    ``package.name``); a value found is stored in ``namespace`` (the package's globals)
    for next time.

    Without the submodules, ``import package`` followed by ``package.sub.f()`` fails
    until something happens to import ``package.sub``.

    Example:
        >>> from ampkit.common.lazy import lazy_exports
        >>> getattr_, dir_ = lazy_exports("json", {}, {}, submodules=["decoder"])
        >>> getattr_("decoder").__name__, "decoder" in dir_()
        ('json.decoder', True)
    """
    own = frozenset(submodules)

    def module_getattr(name: str) -> Any:
        if name in own:
            value = importlib.import_module(f"{package}.{name}")
        else:
            module = table.get(name)
            if module is None:
                raise AttributeError(f"module {package!r} has no attribute {name!r}")
            value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def module_dir() -> list[str]:
        return sorted(set(namespace) | set(table) | own)

    return module_getattr, module_dir
