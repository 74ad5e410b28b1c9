"""Every code block of the README and of ``docs/*.md`` runs as written on the CPU, and
every ``ampkit ...`` command they show runs (or, where it holds a placeholder such as
TARGET, is accepted by the command line's parser).

* ``python`` blocks run in this process, each in an empty temporary folder. A
  ``print(...)`` line whose comment starts with a value (``# torch.float16``,
  ``# ['exp']: ...``) must print exactly that value. On a machine with CUDA every
  Python block runs a second time on the GPU: its ``"cpu"`` becomes ``"cuda"`` and it
  runs under ``with torch.device("cuda")``, and it must print the same.
* ``bash`` (``sh``, ``shell``, ``console``) blocks run with ``bash -e`` in an empty
  temporary folder, with this interpreter's ``bin/`` (where ``ampkit`` and ``python``
  are) first on ``PATH``.
* ``ampkit ...`` commands written inline in the prose run the same way; one with a
  placeholder (an upper-case word such as ``TARGET`` or ``FN``, ``<...>`` or ``...``)
  is parsed instead.
* ``text`` blocks and blocks without a language are output or messages, not code.

A block that needs what CI's CPU machine does not have is marked in the markdown by an
HTML comment on the line before it, ``<!-- not run by tests/project/test_readme.py: needs ...
-->``; only those are skipped, with that reason.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from conftest import DEVICES

ROOT = Path(__file__).parents[2]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
_MARK = re.compile(r"<!--\s*not run by tests/project/test_readme\.py:\s*(.*?)\s*-->\s*$", re.S)
_PYTHON, _SHELL, _OUTPUT = {"python", "py"}, {"bash", "sh", "shell", "console"}, {"text", ""}
# A block using ampkit.integrations.X runs where X's framework is installed (CI installs
# them with the test extra).
_FRAMEWORKS = {"lightning": ["lightning"], "transformers": ["transformers", "accelerate"],
               "accelerate": ["accelerate"]}
_VALUE_COMMENT = re.compile(r"^\s*print\(.*\)\s+#\s+((?:torch\.|\[)[^:]*)")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    language: str
    code: str
    skip: str | None  # the marker's reason

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _blocks() -> list[Block]:
    blocks = []
    for path in DOCS:
        text = path.read_text()
        for match in _FENCE.finditer(text):
            before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
            mark = _MARK.search(before)
            blocks.append(Block(path, text.count("\n", 0, match.start()) + 1,
                                match.group(1).lower(), match.group(2),
                                mark.group(1) if mark else None))
    return blocks


BLOCKS = _blocks()
PYTHON_BLOCKS = [b for b in BLOCKS if b.language in _PYTHON]
SHELL_BLOCKS = [b for b in BLOCKS if b.language in _SHELL]


def _inline_commands() -> list[tuple[str, str]]:
    """(where, command) for each ``ampkit ...`` code span of the prose."""
    found = []
    for path in DOCS:
        prose = _FENCE.sub("", path.read_text())
        for command in re.findall(r"`(ampkit [^`]+)`", prose):
            found.append((str(path.relative_to(ROOT)), command))
    return found


_PLACEHOLDER = re.compile(r"^(?:[A-Z][A-Z_]+|.*<.*|.*\.\.\..*)$")


def _has_placeholder(argv: list[str]) -> bool:
    return any(_PLACEHOLDER.match(arg) for arg in argv)


def _expected_prints(code: str) -> list[str | None]:
    """One entry per print line: the promised value, or None for prose comments."""
    expected = []
    for line in code.splitlines():
        if line.lstrip().startswith("print("):
            m = _VALUE_COMMENT.match(line)
            expected.append(m.group(1).strip() if m else None)
    return expected


def _skip_if_marked(block: Block) -> None:
    if block.skip is not None:
        pytest.skip(f"marked in {block.name}: {block.skip}")


def _shell_env() -> dict[str, str]:
    bin_dir = os.path.dirname(sys.executable)
    return {**os.environ, "PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", "")]),
            "OMP_NUM_THREADS": "1"}


def test_the_docs_have_blocks_of_each_kind_and_only_known_languages() -> None:
    assert len(PYTHON_BLOCKS) >= 10 and len(SHELL_BLOCKS) >= 3
    assert any(v is not None for b in PYTHON_BLOCKS for v in _expected_prints(b.code))
    unknown = [(b.name, b.language) for b in BLOCKS
               if b.language not in _PYTHON | _SHELL | _OUTPUT]
    assert unknown == []
    # a marker says why, and only for what CI's machine lacks
    assert all(b.skip.startswith("needs ") for b in BLOCKS if b.skip is not None)
    assert all(b.skip is None for b in BLOCKS if b.language in _OUTPUT)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=[b.name for b in PYTHON_BLOCKS])
def test_python_block_runs(block: Block, device: str, tmp_path: Path,
                           monkeypatch: pytest.MonkeyPatch) -> None:
    _skip_if_marked(block)
    code = block.code
    for integration in re.findall(r"ampkit\.integrations\.(\w+)", code):
        for framework in _FRAMEWORKS.get(integration, []):
            pytest.importorskip(framework)
    monkeypatch.chdir(tmp_path)  # blocks that write files write them here
    if device != "cpu":
        code = code.replace('"cpu"', f'"{device}"')
    out = io.StringIO()
    with contextlib.redirect_stdout(out), torch.device(device):
        exec(compile(code, block.name, "exec"), {"__name__": "__readme__"})
    printed = out.getvalue().splitlines()
    expected = _expected_prints(code)
    assert len(printed) == len(expected)
    for got, want in zip(printed, expected, strict=True):
        if want is not None:
            assert got == want


@pytest.mark.parametrize("block", SHELL_BLOCKS, ids=[b.name for b in SHELL_BLOCKS])
def test_shell_block_runs(block: Block, tmp_path: Path) -> None:
    _skip_if_marked(block)
    result = subprocess.run(["bash", "-e", "-c", block.code], cwd=tmp_path, env=_shell_env(),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{block.name}:\n{block.code}\n{result.stderr[-3000:]}"
    assert "Traceback" not in result.stderr


def _ran_in_blocks() -> set[str]:
    return {" ".join(shlex.split(line.split(" #")[0])) for b in SHELL_BLOCKS
            for line in b.code.splitlines() if line.startswith("ampkit ")}


_INLINE = sorted({command for _, command in _inline_commands()})


@pytest.mark.parametrize("command", _INLINE)
def test_inline_ampkit_command_works(command: str, tmp_path: Path) -> None:
    from ampkit.tools.cli import build_parser

    parser = build_parser()
    argv = shlex.split(command)[1:]
    if len(argv) == 1:
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args([argv[0], "--help"])
        assert exit_info.value.code == 0, f"`{command}` is not a command"
        try:
            parser.parse_args(argv)
        except SystemExit:
            return  # the name of a command that needs arguments (``ampkit compare``)
    if _has_placeholder(argv):
        try:  # the options and choices it names are real
            parser.parse_args([a if not _PLACEHOLDER.match(a) else "x:y" for a in argv])
        except SystemExit as exit_info:
            pytest.fail(f"`{command}`: the parser refuses it (status {exit_info.code})")
        return
    if " ".join(argv) in {" ".join(shlex.split(c)[1:]) for c in _ran_in_blocks()}:
        return  # a code block runs it already
    result = subprocess.run([sys.executable, "-m", "ampkit", *argv], cwd=tmp_path,
                            env=_shell_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"`{command}`:\n{result.stderr[-3000:]}"


# -- names ----------------------------------------------------------------------------------

_IMPORT_LINE = re.compile(r"^\s*(?:from|import)\s+ampkit[\w.]*.*$", re.M)


def _dotted_names() -> list[str]:
    """Every ``ampkit.x.y`` the README and docs name outside import statements."""
    names: set[str] = set()
    for path in DOCS:
        text = _IMPORT_LINE.sub("", path.read_text())
        names.update(re.findall(r"\bampkit(?:\.[A-Za-z_]\w*)+", text))
    return sorted(names)


def test_every_documented_name_resolves_after_a_plain_import() -> None:
    from ampkit.integrations import EXTRAS

    # A framework integration is imported by name, never reached as an attribute.
    names = [n for n in _dotted_names()
             if not any(n.startswith(f"ampkit.integrations.{x}") for x in EXTRAS)]
    assert "ampkit.tools.count_casts" in names and "ampkit.describe_levels" in names
    # A public name must be reachable by attribute from a plain ``import ampkit``; a
    # private one (docs/state.md's stores) is not for users to reach, so it resolves
    # from its module imported by name, which still catches a stale or misspelt row.
    code = ("import functools, importlib, json, sys, ampkit\n"
            "bad = []\n"
            "for name in json.loads(sys.argv[1]):\n"
            "    parts = name.split('.')\n"
            "    private = next((i for i, p in enumerate(parts)\n"
            "                    if p.startswith('_') and not p.endswith('__')), None)\n"
            "    try:\n"
            "        if private is None:\n"
            "            functools.reduce(getattr, parts[1:], ampkit)\n"
            "        else:\n"
            "            module = importlib.import_module('.'.join(parts[:private]))\n"
            "            functools.reduce(getattr, parts[private:], module)\n"
            "    except (AttributeError, ImportError) as e:\n"
            "        bad.append(f'{name}: {e}')\n"
            "print(json.dumps(bad))\n")
    result = subprocess.run([sys.executable, "-c", code, json.dumps(names)],
                            capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(result.stdout) == []
