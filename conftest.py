"""Collection rule for the doctests under ``src/ampkit`` (``--doctest-modules``).

``ampkit.integrations.<framework>`` raises ImportError on import when its framework is
not installed, by design; its doctests are skipped then instead of failing collection.
CI installs the frameworks (the ``test`` extra), so there they run.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

# integration module -> the packages it imports
_NEEDS = {"lightning.py": ("lightning",), "accelerate.py": ("accelerate",),
          "transformers.py": ("transformers", "accelerate")}
_INTEGRATIONS = Path(__file__).parent / "src" / "ampkit" / "integrations"


def pytest_ignore_collect(collection_path: Path, config: object) -> bool | None:
    if collection_path.parent != _INTEGRATIONS:
        return None
    needs = _NEEDS.get(collection_path.name, ())
    if any(importlib.util.find_spec(name) is None for name in needs):
        return True
    return None
