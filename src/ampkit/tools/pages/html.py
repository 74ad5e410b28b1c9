"""Writing an HTML report, shared by the demo's (:mod:`ampkit.tools.demo.report`) and
compare's (:mod:`ampkit.tools.accuracy.compare_report`): the output folder, checked
before any work, and the page, rendered from the jinja2 templates in ``templates/``
(``base.html.j2`` holds the style both pages use).

Example:
    >>> from ampkit.tools.pages.html import render_page
    >>> render_page("base.html.j2").startswith("<!doctype html>")
    True
"""

from __future__ import annotations

import functools
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import jinja2

__all__ = ["check_output_dir", "render_page"]


def check_output_dir(path: str | os.PathLike[str], files: Iterable[str] = (), *,
                     overwrite: bool = True) -> Path:
    """Create the folder ``path`` (and its parents) if needed and check that a file can
    be written in it; with ``overwrite=False``, also that none of ``files`` is there
    already. Return the folder as a ``Path``.

    Raises:
        OSError: (the subclass the system raised; ``FileExistsError`` for files in the
            way) with a one-line message naming the folder.

    Example:
        >>> import os, tempfile
        >>> from ampkit.tools.pages.html import check_output_dir
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     check_output_dir(os.path.join(tmp, "a", "b")).is_dir()
        True
    """
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".ampkit-write-check-"):
            pass
    except OSError as error:
        reason = error.strerror or str(error)
        if isinstance(error, FileExistsError):
            reason = "a file of that name exists, and the report needs a folder"
        raise type(error)(f"cannot write the report to {str(folder)!r}: {reason}") \
            from error
    present = [name for name in files if (folder / name).exists()]
    if present and not overwrite:
        raise FileExistsError(
            f"cannot write the report to {str(folder)!r}: it already holds "
            f"{', '.join(present)}; pass --overwrite to replace "
            f"{'it' if len(present) == 1 else 'them'}, or choose another --out")
    return folder


@functools.cache
def _environment() -> jinja2.Environment:
    import jinja2

    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(Path(__file__).parent / "templates"),
        autoescape=True, undefined=jinja2.StrictUndefined, keep_trailing_newline=True)


def render_page(template: str, **context: Any) -> str:
    """Render one of the tools' HTML templates (``templates/<template>``; autoescaped,
    so text from results cannot inject markup).

    Example:
        >>> from ampkit.tools.pages.html import render_page
        >>> page = render_page("base.html.j2")
        >>> page.startswith("<!doctype html>"), "<style>" in page
        (True, True)
    """
    return _environment().get_template(template).render(**context)
