"""Every Python code block in the README runs as written, and prints what it says.

A ``print(...)`` line whose comment starts with a value (``# torch.float16``,
``# ['exp']: ...``) must print exactly that value.

On a machine with CUDA every block runs a second time on the GPU: its ``"cpu"`` becomes
``"cuda"`` and it runs under ``with torch.device("cuda")``, so the tensors and models it
creates live there (the way a GPU user would write it), and it must print the same.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest
import torch

from conftest import DEVICES

README = Path(__file__).parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
# A block using ampkit.integrations.X runs where X's framework is installed (CI installs
# them with the test extra).
_FRAMEWORKS = {"lightning": ["lightning"], "transformers": ["transformers", "accelerate"],
               "accelerate": ["accelerate"]}
_VALUE_COMMENT = re.compile(r"^\s*print\(.*\)\s+#\s+((?:torch\.|\[)[^:]*)")


def _expected_prints(code: str) -> list[str | None]:
    """One entry per print line: the promised value, or None for prose comments."""
    expected = []
    for line in code.splitlines():
        if line.lstrip().startswith("print("):
            m = _VALUE_COMMENT.match(line)
            expected.append(m.group(1).strip() if m else None)
    return expected


def test_readme_has_python_examples() -> None:
    assert len(BLOCKS) >= 4
    assert any(v is not None for b in BLOCKS for v in _expected_prints(b))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_block_runs(code: str, device: str, tmp_path: Path,
                           monkeypatch: pytest.MonkeyPatch) -> None:
    for integration in re.findall(r"ampkit\.integrations\.(\w+)", code):
        for framework in _FRAMEWORKS.get(integration, []):
            pytest.importorskip(framework)
    monkeypatch.chdir(tmp_path)  # blocks that write files write them here
    if device != "cpu":
        code = code.replace('"cpu"', f'"{device}"')
    out = io.StringIO()
    with contextlib.redirect_stdout(out), torch.device(device):
        exec(compile(code, str(README), "exec"), {"__name__": "__readme__"})
    printed = out.getvalue().splitlines()
    expected = _expected_prints(code)
    assert len(printed) == len(expected)
    for got, want in zip(printed, expected, strict=True):
        if want is not None:
            assert got == want


_DOCS = [README, *sorted((README.parent / "docs").glob("*.md"))]
_IMPORT_LINE = re.compile(r"^\s*(?:from|import)\s+ampkit[\w.]*.*$", re.M)


def _dotted_names() -> list[str]:
    """Every ``ampkit.x.y`` the README and docs name outside import statements."""
    names: set[str] = set()
    for path in _DOCS:
        text = _IMPORT_LINE.sub("", path.read_text())
        names.update(re.findall(r"\bampkit(?:\.[A-Za-z_]\w*)+", text))
    return sorted(names)


def test_every_documented_name_resolves_after_a_plain_import() -> None:
    import json
    import subprocess
    import sys

    from ampkit.integrations import EXTRAS

    # A framework integration is imported by name, never reached as an attribute.
    names = [n for n in _dotted_names()
             if not any(n.startswith(f"ampkit.integrations.{x}") for x in EXTRAS)]
    assert "ampkit.tools.count_casts" in names and "ampkit.levels.describe_levels" in names
    code = ("import functools, json, sys, ampkit\n"
            "bad = []\n"
            "for name in json.loads(sys.argv[1]):\n"
            "    try:\n"
            "        functools.reduce(getattr, name.split('.')[1:], ampkit)\n"
            "    except AttributeError as e:\n"
            "        bad.append(f'{name}: {e}')\n"
            "print(json.dumps(bad))\n")
    result = subprocess.run([sys.executable, "-c", code, json.dumps(names)],
                            capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(result.stdout) == []
