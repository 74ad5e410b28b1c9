"""Where the tools live: subpackages by concept, no module left at an old path, the
console script and the HTML templates packaged from their place."""

import ast
import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "src" / "ampkit" / "tools"


def test_the_tools_room_holds_subpackages_not_prefixed_files():
    flat = sorted(p.name for p in TOOLS.glob("*.py"))
    assert flat == ["__init__.py"]
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
