"""Small pieces the HTML reports share (the demo's :mod:`ampkit.tools.demo.report` and
:mod:`ampkit.tools.accuracy.compare_report`): a bare matplotlib figure, a PNG as a
``data:`` URI for embedding, and the time stamp a page is signed with.

Example:
    >>> from ampkit.tools.pages.plotting import timestamp
    >>> len(timestamp()) >= len("2026-01-01 00:00")
    True
"""

from __future__ import annotations

import base64
import datetime
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["new_figure", "png_data_uri", "timestamp"]


def new_figure(width: float = 8.0, height: float = 4.5) -> Figure:
    """A bare matplotlib ``Figure`` of ``width`` x ``height`` inches at 100 dpi.

    Example:
        >>> from ampkit.tools.pages.plotting import new_figure
        >>> new_figure(2.0, 1.0).get_size_inches().tolist()
        [2.0, 1.0]
    """
    from matplotlib.figure import Figure

    # A bare Figure (no pyplot): no global state, no GUI backend, safe in threads.
    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def png_data_uri(path: Path) -> str:
    """The PNG file at ``path`` as a ``data:`` URI (for an ``<img src>``).

    Example:
        >>> import tempfile
        >>> from pathlib import Path
        >>> from ampkit.tools.pages.plotting import png_data_uri
        >>> with tempfile.TemporaryDirectory() as out:
        ...     png = Path(out) / "x.png"
        ...     _ = png.write_bytes(b"PNG")
        ...     png_data_uri(png)
        'data:image/png;base64,UE5H'
    """
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode("ascii")


def timestamp() -> str:
    """The local time, to the minute, with its zone (``2026-11-24 17:20 UTC``).

    Example:
        >>> from ampkit.tools.pages.plotting import timestamp
        >>> timestamp()[4], timestamp()[13]
        ('-', ':')
    """
    return datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
