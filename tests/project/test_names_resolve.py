"""No name anywhere that does not exist: every name ``dir(ampkit)`` and
``ampkit.__all__`` list, and every dotted ``ampkit.x.y`` that the package's own source
(docstrings, comments, messages) or the benchmarks name, resolves.

The README's and ``docs/``'s names are checked by ``test_readme.py``, after a plain
``import ampkit``; here a name may also be reached by importing its module, as the
source's own cross-references (``:mod:`ampkit.conversion.parameter_casts```) mean it.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

import ampkit
from ampkit.common.unpickling import MOVED_MODULES

ROOT = Path(__file__).parents[2]
_DOTTED = re.compile(r"(?<![\w.])ampkit(?:\.[A-Za-z_]\w*)+")
_IMPORT = re.compile(r"^\s*(?:from|import)\s+ampkit[\w.]*.*$", re.M)


def _resolve(dotted: str) -> object:
    """The object ``dotted`` names: its longest importable module prefix, then
    attributes. ``AttributeError``/``ModuleNotFoundError`` when it names nothing."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as error:
            if error.name is None or not dotted.startswith(error.name):
                raise  # the module exists but needs something missing: a real failure
            continue
        for attribute in parts[cut:]:
            obj = getattr(obj, attribute)
        return obj
    raise ModuleNotFoundError(dotted)


def _named_in(paths: list[Path]) -> dict[str, str]:
    """dotted name -> the first file:line that names it (import lines excluded)."""
    found: dict[str, str] = {}
    for path in paths:
        text = _IMPORT.sub("", path.read_text())
        for match in _DOTTED.finditer(text):
            name = match.group(0).rstrip(".")
            line = text.count("\n", 0, match.start()) + 1
            found.setdefault(name, f"{path.relative_to(ROOT)}:{line}")
    return found


def test_every_name_in_dir_and_all_resolves() -> None:
    names = sorted(set(dir(ampkit)) | set(ampkit.__all__))
    assert "initialize" in names and "tools" in names
    broken = []
    for name in names:
        try:
            getattr(ampkit, name)
        except (AttributeError, ImportError) as error:
            broken.append(f"ampkit.{name}: {error}")
    assert broken == []


SOURCES = sorted((ROOT / "src" / "ampkit").rglob("*.py")) + sorted(
    (ROOT / "benchmarks").glob("*.py"))
# The old module paths the unpickling table names are gone on purpose;
# tests/common/test_unpickling.py checks that each is gone and has a home.
_GONE = tuple(MOVED_MODULES)
NAMED = {name: where for name, where in _named_in(SOURCES).items()
         if not any(name == old or name.startswith(old + ".") for old in _GONE)}


def test_the_walk_finds_the_sources_names() -> None:
    # the scan itself works: names known to be written in the sources are found
    assert {"ampkit.conversion.parameter_casts", "ampkit.autocast",
            "ampkit.initialize"} <= set(NAMED)
    assert len(NAMED) > 100
    assert "ampkit.master_weights_pure" in _named_in(SOURCES)  # the table is read too


@pytest.mark.parametrize("name", sorted(NAMED))
def test_every_name_the_source_writes_resolves(name: str) -> None:
    try:
        _resolve(name)
    except (AttributeError, ModuleNotFoundError) as error:
        pytest.fail(f"{name} (named at {NAMED[name]}) does not exist: {error}")


def test_no_text_but_the_unpickling_table_names_a_gone_path() -> None:
    # A gone path written anywhere else tells the reader it still works (as an alias,
    # say); only the table that loads old pickles, and the changelog, may name one.
    texts = [p for p in SOURCES if p.name != "unpickling.py"] + sorted(
        (ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
    stale = {}
    for name, where in _named_in(texts).items():
        if any(name == old or name.startswith(old + ".") for old in _GONE):
            try:
                _resolve(name)  # ampkit.tools.list_usage is a gone module and a function
            except (AttributeError, ModuleNotFoundError):
                stale[name] = where
    assert stale == {}
