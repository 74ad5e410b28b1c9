"""mypy's strict flags cover every module of ``src/ampkit``: the overrides
that name ampkit modules turn checks on, never off. (mypy itself runs in CI and in
each contributor's checks; this reads its configuration.)"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[2]
STRICT = ("disallow_untyped_defs", "disallow_incomplete_defs", "disallow_untyped_calls",
          "disallow_untyped_decorators", "disallow_any_generics", "warn_return_any",
          "no_implicit_reexport")


def _overrides() -> list[tuple[list[str], dict[str, str]]]:
    # (a regex: tomllib is Python 3.11's, and ampkit runs on 3.10)
    text = (ROOT / "pyproject.toml").read_text()
    blocks = re.findall(r"^\[\[tool\.mypy\.overrides\]\]\n(.*?)(?=^\[|\Z)", text, re.M | re.S)
    out = []
    for block in blocks:
        listed = re.search(r"^module = \[([^\]]*)\]", block, re.M)
        assert listed is not None, block
        settings = dict(re.findall(r"^(\w+) = (true|false)$", block, re.M))
        out.append((re.findall(r'"([^"]+)"', listed.group(1)), settings))
    return out


def test_every_ampkit_module_is_checked_strictly() -> None:
    overrides = _overrides()
    assert overrides, "no [[tool.mypy.overrides]] read"
    whole = [s for modules, s in overrides if "ampkit.*" in modules and "ampkit" in modules]
    assert len(whole) == 1
    assert {flag: whole[0].get(flag) for flag in STRICT} == dict.fromkeys(STRICT, "true")
    relaxed = {m: s for modules, s in overrides for m in modules
               if m.split(".")[0] == "ampkit" and "false" in s.values()}
    assert relaxed == {}
