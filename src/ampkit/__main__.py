"""``python -m ampkit``: the ``ampkit`` command line (see :mod:`ampkit.tools.cli`)."""

import sys

from ampkit.tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
