"""The install page shows the CPU-only install: torch from PyTorch's CPU wheel index,
with NumPy (whose absence makes torch warn on every ``ampkit`` command), and says why
NumPy is not one of ampkit's own dependencies."""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).parents[2]


def test_install_page_has_the_cpu_only_command_with_numpy() -> None:
    text = (ROOT / "docs" / "install.md").read_text(encoding="utf-8")
    assert "## On a CPU-only machine" in text
    section = text[text.index("## On a CPU-only machine"):text.index("## Tested on")]
    command = next(line for line in section.splitlines() if line.startswith("python3 -m venv"))
    assert "torch==2.13.0 numpy --index-url https://download.pytorch.org/whl/cpu" in command
    assert "Failed to initialize NumPy" in section


def test_numpy_stays_out_of_the_runtime_dependencies_as_the_page_says() -> None:
    # ampkit's own code never imports numpy; the page says so and why it is installed
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert not any(d.startswith("numpy") for d in project["dependencies"])
    imports = [path for path in (ROOT / "src" / "ampkit").rglob("*.py")
               if "import numpy" in path.read_text(encoding="utf-8")]
    assert imports == []
