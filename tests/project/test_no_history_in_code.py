"""No project history in the code: no text file under ``src/`` or ``tests/`` names one of
the project's issues by number. Why a line is the way it is belongs in the line itself
(what behaviour, which contract); when and where it was decided belongs in git and the
CHANGELOG.

Upstream references stay welcome, written as the address a reader can open:
``https://github.com/<owner>/<repo>/issues/<n>`` (or ``/pull/<n>``). A number after the
word for an issue anywhere else, or after ``#`` in the ways trackers are cited, or a
project wave by number, is flagged with its file and line.

The examples below are assembled from pieces so that this file passes its own check.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
SCANNED = ("src", "tests")

_ISSUE = "iss" + "ue"
#: A project reference: the word for an issue (or issues) followed by a number, with at
#: most a space, ``#``, ``-``, ``_`` or ``(`` between, or a line break (a comment's ``#``
#: included) when the sentence wraps; a tracker's ``#n`` after a word that cites one, or
#: in parentheses; a wave of the project by number. A URL's ``/issues/<n>`` has a ``/``
#: between and so never matches.
HISTORY = re.compile(
    rf"\b{_ISSUE}s?(?:[ \t#_(-]*|[ \t]*\n[ \t]*(?:#[ \t]*)?)\d+"
    r"|\b(?:see|PR|pull|fix(?:es|ed)?|close[sd]?|resolve[sd]?|bug|ticket)[ \t]*#\d+"
    r"|\(#\d+\)"
    r"|\bwave[ \t_-]?\d+",
    re.IGNORECASE,
)


def _text_files() -> list[Path]:
    """Every text file under ``src/`` and ``tests/``: no ``__pycache__``, no hidden tool
    caches (``.pytest_cache``, ``.mypy_cache``), no build metadata (``*.egg-info``), no
    binary (a NUL byte, or bytes that are not UTF-8)."""
    files = []
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*")):
            parts = path.relative_to(ROOT).parts
            if not path.is_file() or any(
                    p == "__pycache__" or p.startswith(".") or p.endswith(".egg-info")
                    for p in parts):
                continue
            data = path.read_bytes()
            if b"\0" in data:
                continue
            try:
                data.decode("utf-8")
            except UnicodeDecodeError:
                continue
            files.append(path)
    return files


def history_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of each line where a match of :data:`HISTORY` starts."""
    lines = text.splitlines()
    found = []
    for match in HISTORY.finditer(text):
        number = text.count("\n", 0, match.start()) + 1
        found.append((number, lines[number - 1].strip()))
    return found


@pytest.mark.parametrize("text", [
    f"O1 hands back fp32 ({_ISSUE} 46)",
    f"{_ISSUE.title()} 22: custom ops in lists",
    f"the {_ISSUE}-34/41 cases",
    f'Policy("{_ISSUE}35-mine")',
    f"{_ISSUE}s 22 and 24",
    f"{_ISSUE} #34",
    f"{_ISSUE} (34)",
    f"PyTorch {_ISSUE} 44511",
    f"torch {_ISSUE} #127176",
    f"take no kernel since {_ISSUE}\n    35 (native's computes them)",
    f"# which take no kernel since {_ISSUE}\n# 35",
    "see #" + "34 for why",
    "the order (#" + "12)",
    "wave " + "5 " + _ISSUE,
])
def test_the_pattern_flags_each_form_of_a_project_reference(text: str) -> None:
    assert history_lines(text), text


@pytest.mark.parametrize("text", [
    f"https://github.com/pytorch/pytorch/{_ISSUE}s/127176",
    "https://github.com/pytorch/pytorch/pull/44511",
    f"it {_ISSUE}s torch's own FutureWarning",
    f"a TuneWarning is {_ISSUE}d. 3 trials",
    f'"{_ISSUE.title()}s", "Changelog"',
    'color="#1f77b4"; stroke="#000"; color: #222;',
    "f\"{value:#04x}\"",
    "&#8211;",
    "a tissue 3 cells thick",
])
def test_the_pattern_allows_urls_and_ordinary_words(text: str) -> None:
    assert not history_lines(text), history_lines(text)


def test_no_project_history_in_src_or_tests() -> None:
    files = _text_files()
    assert any(p.name == "__init__.py" for p in files) and Path(__file__) in files
    flagged = [f"{path.relative_to(ROOT)}:{number}: {line}"
               for path in files
               for number, line in history_lines(path.read_text(encoding="utf-8"))]
    assert not flagged, (
        "project history in the code (say why in the line; the history goes in git and "
        "the CHANGELOG; an upstream reference is written as its URL):\n"
        + "\n".join(flagged))
