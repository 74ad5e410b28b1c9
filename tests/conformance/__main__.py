"""``python -m tests.conformance [--all] [pytest options]``: run the conformance matrix.

Without ``--all`` it runs the CI subset; with it, every cell (``--conformance-all``).
Other arguments go to pytest as they are (``-x``, ``-k gpt2``, ``-n 2``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    everything = "--all" in args
    args = [a for a in args if a != "--all"]
    folder = str(Path(__file__).resolve().parent)
    return int(pytest.main([folder, "-p", "no:randomly", "-q",
                            *(["--conformance-all"] if everything else []), *args]))


if __name__ == "__main__":
    raise SystemExit(main())
