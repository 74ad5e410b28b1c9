"""One version number: ``pyproject.toml``'s, which ``ampkit.__version__`` reports and the
changelog's newest release heading names."""

from __future__ import annotations

import re
from pathlib import Path

import ampkit

ROOT = Path(__file__).parents[2]


def test_the_version_is_the_same_in_pyproject_the_package_and_the_changelog() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    declared = re.search(r'^version = "([^"]+)"$', pyproject, re.M)
    assert declared is not None
    released = re.findall(r"^## \[(\d[^\]]*)\] - \d{4}-\d{2}-\d{2}$",
                          (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert released, "CHANGELOG.md names no release"
    assert ampkit.__version__ == declared.group(1) == released[0]


def test_the_changelog_keeps_an_unreleased_section_above_the_releases() -> None:
    text = (ROOT / "CHANGELOG.md").read_text()
    headings = re.findall(r"^## \[([^\]]+)\]", text, re.M)
    assert headings[0] == "Unreleased" and len(headings) >= 2
