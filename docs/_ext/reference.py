"""Where each public object of ampkit is documented: the one rule the site's build
(``docs/conf.py``) and its test (``tests/project/test_docs_site.py``) share.

An object is documented once, on the page of the module whose file defines it. Its
``__module__`` does not always say which that is: ``ampkit.conversion`` names its
classes after the package (so pickles survive a move between its files), and decorators
keep the name of the function they wrap. So the file is read off the code itself.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
import sys
from pathlib import Path
from typing import Any

import ampkit

_ROOT = Path(ampkit.__file__).resolve().parent.parent

#: The modules users import, each documented by its public names on a page of the API
#: reference (``docs/api``, directive ``ampkit-names``): the package, its tools, the
#: dialects under the names the guides import (``import ampkit.apex as amp``), FSDP2 and
#: the framework integrations. Every other module is an internal, listed apart.
PUBLIC_MODULES = ["ampkit", "ampkit.tools", "ampkit.fsdp", "ampkit.torch", "ampkit.apex",
                  "ampkit.paddle", "ampkit.mindspore", "ampkit.mxnet",
                  "ampkit.integrations.lightning", "ampkit.integrations.transformers",
                  "ampkit.integrations.accelerate"]


def _module_of_file(source: str | None) -> str | None:
    if source is None:
        return None
    path = Path(source).resolve()
    if not path.is_relative_to(_ROOT):
        return None
    parts = list(path.relative_to(_ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _class_file(cls: type) -> str | None:
    """The file of a method written in ``cls``'s body (unwrapped), or, for a class with
    none of its own (an enum, a dataclass, a class made by ``type()``), the file under
    its ``__module__`` whose source defines or assigns the name."""
    for value in vars(cls).values():
        function = inspect.unwrap(value) if inspect.isfunction(value) else None
        # (not a method a decorator generated: a dataclass's __init__ comes from
        # "<string>")
        if function is not None and function.__qualname__.startswith(
                f"{cls.__qualname__}.") and not function.__code__.co_filename.startswith("<"):
            return function.__code__.co_filename
    # ``class Name`` in the body, or a module-level assignment that makes it
    # (``Name = type(...)``, ``A, Name = make()``)
    name = re.escape(cls.__name__)
    pattern = re.compile(rf"^(?:class {name}\b|[\w, ]*\b{name}\b[\w, ]*=)", re.M)
    package = cls.__module__
    for name, module in sorted(sys.modules.items()):
        if name != package and not name.startswith(f"{package}."):
            continue
        source = getattr(module, "__file__", None)
        if source and pattern.search(Path(source).read_text()):
            return source
    return None


def defining_module(obj: Any) -> str | None:
    """The dotted name of the ampkit module whose file defines function or class
    ``obj`` (its ``__module__`` when that cannot be read, or when it lies outside
    ampkit)."""
    if inspect.isclass(obj):
        source = _class_file(obj)
    else:
        function = inspect.unwrap(obj) if inspect.isfunction(obj) else obj
        try:
            source = inspect.getsourcefile(function)
        except TypeError:
            source = None
    return _module_of_file(source) or getattr(obj, "__module__", None)


def public_modules() -> list[str]:
    """``ampkit`` and every module under it whose dotted name has no ``_`` part."""
    import pkgutil

    names = ["ampkit"]
    for info in pkgutil.walk_packages(ampkit.__path__, "ampkit."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            names.append(info.name)
    for name in names:
        importlib.import_module(name)
    return names
