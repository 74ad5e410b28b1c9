"""Where the tools live (issue 38): subpackages by concept, the old paths of the two
public commands' modules kept as deprecated aliases, the console script and the HTML
templates packaged from their new place."""

import ast
import importlib
import re
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "src" / "ampkit" / "tools"


def _import_old(name):
    # Import statements, as a user writes them (the warning should point here).
    if name == "compare":
        import ampkit.tools.compare as module
    else:
        import ampkit.tools.tune as module
    return module


@pytest.mark.parametrize("name", ["compare", "tune"])
def test_old_module_paths_warn_once_and_serve_the_moved_modules_names(monkeypatch, name):
    monkeypatch.delitem(sys.modules, f"ampkit.tools.{name}", raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old, again = _import_old(name), _import_old(name)
    new = importlib.import_module(f"ampkit.tools.accuracy.{name}")
    assert again is old
    assert new.__all__ and all(getattr(old, n) is getattr(new, n) for n in new.__all__)
    private = next(n for n in vars(new) if n.startswith("_") and not n.startswith("__"))
    assert getattr(old, private) is getattr(new, private)
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(deprecations) == 1
    assert f"ampkit.tools.accuracy.{name}" in str(deprecations[0].message)
    # Pointed at the importer (this file; pytest's import hook when pytest collected the
    # alias's doctests first), not at ampkit's own lines.
    assert not deprecations[0].filename.startswith(str(ROOT / "src"))
    assert callable(getattr(old, name))  # ampkit.tools.compare.compare, as before


def test_the_tools_room_holds_subpackages_not_prefixed_files():
    flat = sorted(p.name for p in TOOLS.glob("*.py"))
    assert flat == ["__init__.py", "compare.py", "tune.py"]
    packages = sorted(p.parent.name for p in TOOLS.glob("*/__init__.py"))
    assert packages == ["accuracy", "cli", "demo", "fp8", "ops", "pages", "plan"]


def test_console_script_and_templates_are_packaged_from_the_new_place():
    # Read with re, not tomllib: the project supports Python 3.10.
    text = (ROOT / "pyproject.toml").read_text()
    script = re.search(r'^\[project\.scripts\]\nampkit = "(.+)"$', text, re.M)
    module, _, attr = script.group(1).partition(":")
    assert callable(getattr(importlib.import_module(module), attr))
    data = re.search(r"^\[tool\.setuptools\.package-data\]\nampkit = (\[.*\])$", text, re.M)
    globs = ast.literal_eval(data.group(1))
    packaged = {p for g in globs for p in (ROOT / "src" / "ampkit").glob(g)}
    templates = set((TOOLS / "pages" / "templates").glob("*.j2"))
    assert {"base.html.j2", "compare.html.j2", "demo.html.j2"} <= {p.name for p in templates}
    assert templates <= packaged


@pytest.mark.parametrize(("old", "new"), [
    ("ampkit.tools.fp8.errors", "ampkit.tools.accuracy.fp8_errors"),
    ("ampkit.tools.fp8.casts", "ampkit.tools.ops.fp8_casts"),
])
def test_fp8_tools_moved_down_to_the_rooms_they_measure_with(monkeypatch, old, new):
    # issue 49: tools/fp8 builds on accuracy/ and ops/, so the modules those rooms used
    # moved into them; the old paths warn once and serve the same objects.
    monkeypatch.delitem(sys.modules, old, raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module, again = importlib.import_module(old), importlib.import_module(old)
    moved = importlib.import_module(new)
    assert again is module
    assert moved.__all__ and all(getattr(module, n) is getattr(moved, n)
                                 for n in moved.__all__)
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(deprecations) == 1 and new in str(deprecations[0].message)
