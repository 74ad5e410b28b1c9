"""Sphinx configuration of ampkit's documentation site.

Build it with ``python -m sphinx -W --keep-going -b html docs docs/_build/html`` (the
``docs`` extra installs what it needs). The guides are the Markdown files beside this
one, read by MyST. The API reference documents the public names by the paths users
import them by (docs/api/*.md, the ``ampkit-names`` directive of ``_ext/public_api.py``,
its list of modules in ``_ext/reference.py``); the internals are generated apart
(autosummary, recursive over the package), so a renamed internal module needs no edit.
"""

from __future__ import annotations

import inspect
import shutil
import sys
from pathlib import Path
from typing import Any

from sphinx.application import Sphinx
from sphinx.domains.python import PythonDomain

import ampkit

sys.path.insert(0, str(Path(__file__).parent / "_ext"))
from reference import PUBLIC_MODULES, defining_module, public_modules

project = "ampkit"
author = "the ampkit authors"
copyright = "2026, the ampkit authors"
release = ampkit.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "public_api",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "README.md"]
templates_path = ["_templates"]

# Markdown: fenced blocks stay code blocks; headings get anchors so that guides can link
# to a section of another guide.
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# The reference: every public module, each listing the names in its ``__all__``. Its
# pages are generated into api/_generated at each build; the folder is emptied first,
# so a module that moved leaves no stale page behind (autosummary never deletes one).
shutil.rmtree(Path(__file__).parent / "api" / "_generated", ignore_errors=True)
autosummary_generate = True
autosummary_imported_members = False
# imported-members: a constant whose class lives elsewhere (a `Policy` preset) counts as
# "imported" to autodoc; the hook below still documents each function and class once
autodoc_default_options = {"members": True, "undoc-members": True, "imported-members": True,
                           "show-inheritance": True}
autodoc_member_order = "bysource"


def _module_data() -> dict[str, list[str]]:
    """module -> the constants its ``__all__`` names (not functions, classes or modules),
    each given an entry of its own on the module's page (autosummary lists only those
    with a doc comment)."""
    data: dict[str, list[str]] = {}
    for name in public_modules():
        module = sys.modules[name]
        data[name] = [n for n in getattr(module, "__all__", ()) if not n.startswith("_")
                      and not inspect.isclass(getattr(module, n))
                      and not inspect.isroutine(getattr(module, n))
                      and not inspect.ismodule(getattr(module, n))]
    return data


# The public modules are documented by their public names (docs/api, public_api.py);
# the internals' pages leave them out.
autosummary_context = {
    "module_data": _module_data(),
    "public_api": PUBLIC_MODULES,
    "not_listed": [name for name in PUBLIC_MODULES
                   if not hasattr(sys.modules[name], "__path__")],
}
autodoc_typehints = "description"
# fully qualified: a short name such as `autocast` would match several targets
autodoc_typehints_format = "fully-qualified"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# "Attributes:" sections as fields of the class, so a dataclass field is not described twice
napoleon_use_ivar = True
# The optional frameworks the integrations and fp8 import are installed by the test and
# docs extras; nothing is mocked, so the reference shows what the code really is.

# Signatures show annotations as the source writes them (postponed evaluation), so a
# short name that two modules define (``autocast``: the engine's and ampkit.torch's)
# finds two link targets; the page is right either way, only the link is ambiguous.
suppress_warnings = ["ref.python"]

html_theme = "furo"
html_title = f"ampkit {release}"
html_static_path: list[str] = []


def _skip_reexport(app: Sphinx, what: str, name: str, obj: Any, skip: bool,
                   options: Any) -> bool | None:
    """Document each object once, on the page of the module that defines it.

    ``ampkit``, ``ampkit.tools`` and the dialects' import names re-export names from
    the modules that define them; documenting them twice would give Sphinx two targets
    for one name (and torch's own re-exported objects would bring torch's docstrings).
    A module-level member defined in another ampkit module is left to that module, and
    torch's own objects to torch's documentation; constants and type aliases (whose
    ``__module__`` is ``builtins`` or ``typing``) are documented where they are named.
    """
    if what != "module" or skip:
        return None
    if not (inspect.isclass(obj) or inspect.isroutine(obj)):
        return None  # a constant: its ``__module__``, if any, is its class's
    if getattr(obj, "__name__", name) != name:
        return None  # a second name (``check_scale_value = positive_number``): here
    defined_in = defining_module(obj)
    documenting = getattr(app.env, "temp_data", {}).get("autodoc:module")
    if defined_in is None or documenting is None or defined_in == documenting:
        return None
    if defined_in.split(".")[0] in ("ampkit", "torch"):
        return True
    return None


def _no_type_docstring(app: Sphinx, what: str, name: str, obj: Any, options: Any,
                       lines: list[str]) -> None:
    """A constant without a doc comment would show its type's docstring (``dict``'s,
    ``tuple``'s): its entry shows none instead."""
    if what in ("data", "attribute") and not inspect.isclass(obj):
        own = inspect.getdoc(type(obj)) or ""
        if "\n".join(lines).strip() == own.strip():
            lines.clear()


#: Where the README's links point (pyproject's [project.urls]: the guides on the
#: repository's hosting site), so that they work on the package's index page too.
README_DOCS_URL = "https://github.com/ampkit/ampkit/blob/main/docs/"


def _readme_links_in_site(app: Sphinx, relative_path: Path, parent_docname: str,
                          content: list[str]) -> None:
    """The README, included as the site's front page, links to the guides on the
    hosting site; on the site itself those links go to its own pages (``docs/X.md``,
    which the include's ``relative-docs`` makes site-relative)."""
    if relative_path.name == "README.md":
        content[0] = content[0].replace(README_DOCS_URL, "docs/")


#: The pages of ``import ampkit``'s own names, and of the internals (autosummary's).
PUBLIC_FRONT_PAGE = "api/ampkit"
INTERNALS_PAGES = "api/_generated/"


def search_priority(docname: str, priority: int) -> int:
    """The search's rank of an object documented on ``docname`` (Sphinx's priorities:
    0 important, 1 normal, 2 unimportant, -1 not searchable): ``import ampkit``'s
    names first, the internals last, so that a search for ``initialize`` or
    ``GradScaler`` finds the names users import before the modules that define them
    and before the dialects' look-alikes."""
    if priority < 0:
        return priority
    if docname.startswith(INTERNALS_PAGES):
        return 2
    if docname == PUBLIC_FRONT_PAGE:
        return 0
    return priority


class RankedPythonDomain(PythonDomain):
    """Sphinx's Python domain, its objects ranked for the search by
    :func:`search_priority`."""

    def get_objects(self) -> Any:
        for name, shown, kind, docname, anchor, priority in super().get_objects():
            yield name, shown, kind, docname, anchor, search_priority(docname, priority)


def setup(app: Sphinx) -> None:
    app.add_domain(RankedPythonDomain, override=True)
    app.connect("include-read", _readme_links_in_site)
    app.connect("autodoc-skip-member", _skip_reexport)
    app.connect("autodoc-process-docstring", _no_type_docstring)
