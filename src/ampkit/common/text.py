"""Plain-text tables: the one helper every ``table()`` of the tools renders with; and
the one way the tools make values strict-JSON safe (:func:`finite_or_none`).

Column widths come from the cells, so a long op name (``scaled_dot_product_attention``)
widens its column instead of breaking the alignment. The tools' ``table()`` methods
return plain strings with no optional dependency; the command line draws the same
tables with rich (:class:`TextTable` holds a table's content for both).

Example:
    >>> from ampkit.common.text import text_table
    >>> print(text_table(("op", "calls"), [("scaled_dot_product_attention", 1), ("mm", 12)]))
    op                            calls
    scaled_dot_product_attention      1
    mm                               12
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["TextTable", "finite_or_none", "text_table"]


@dataclasses.dataclass(frozen=True)
class TextTable:
    """A table's content, drawn as plain text by :meth:`text` (what the tools'
    ``table()`` methods return) or with rich by the command line
    (:func:`ampkit.tools.cli.args.rich_table`): the two show the same cells.

    Example:
        >>> from ampkit.common.text import TextTable
        >>> print(TextTable(("op", "calls"), (("mm", "12"),)).text())
        op  calls
        mm     12
    """

    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    #: one letter per column, ``"l"`` or ``"r"``; default: the first left, the others right
    align: str | None = None

    @classmethod
    def of(cls, columns: Sequence[object], rows: Iterable[Sequence[object]],
           align: str | None = None) -> TextTable:
        """A table of ``str()`` of each cell (checked as :func:`text_table` checks).

        Example:
            >>> from ampkit.common.text import TextTable
            >>> TextTable.of(("op", "calls"), [("mm", 12)]).rows
            (('mm', '12'),)
        """
        table = cls(tuple(str(c) for c in columns),
                    tuple(tuple(str(cell) for cell in row) for row in rows), align)
        table.text()  # the checks: one cell per column, a valid align
        return table

    def alignment(self) -> str:
        """One letter per column, ``"l"`` or ``"r"``.

        Example:
            >>> from ampkit.common.text import TextTable
            >>> TextTable(("op", "calls", "where"), ()).alignment()
            'lrr'
        """
        return self.align or "l" + "r" * (len(self.columns) - 1)

    def text(self) -> str:
        """The table as aligned plain text (:func:`text_table`).

        Example:
            >>> from ampkit.common.text import TextTable
            >>> TextTable(("op",), (("mm",),)).text().splitlines()
            ['op', 'mm']
        """
        return text_table(self.columns, self.rows, align=self.alignment())


def text_table(columns: Sequence[str], rows: Iterable[Sequence[object]], *,
               align: str | None = None, footer: Sequence[object] | None = None,
               separator: str = "  ", rules: bool = False) -> str:
    """Format ``rows`` under ``columns`` as aligned text.

    Args:
        columns: the column titles.
        rows: one sequence of cells per row (``str()`` of each cell is shown).
        align: one letter per column, ``"l"`` (left) or ``"r"`` (right); default:
            the first column left, the others right.
        footer: a last row (a total), set off by a rule when ``rules`` is true.
        separator: between two columns.
        rules: draw a rule under the titles (and above ``footer``), made of ``-``
            with ``+`` where ``separator`` has ``|``.

    Raises:
        ValueError: a row or ``align`` whose length is not the number of columns, or
            an ``align`` letter other than ``l`` and ``r``.

    Example:
        >>> from ampkit.common.text import text_table
        >>> print(text_table(("Op", "Calls"), [("mul", 1)], footer=("Total", 1),
        ...                  separator=" | ", rules=True))
        Op    | Calls
        ------+------
        mul   |     1
        ------+------
        Total |     1
    """
    titles = tuple(str(c) for c in columns)
    body = [tuple(str(cell) for cell in row) for row in rows]
    tail = [] if footer is None else [tuple(str(cell) for cell in footer)]
    align = align or "l" + "r" * (len(titles) - 1)
    if len(align) != len(titles) or set(align) - {"l", "r"}:
        raise ValueError(f"align must have one letter 'l' or 'r' per column "
                         f"({len(titles)}), got {align!r}")
    for row in (*body, *tail):
        if len(row) != len(titles):
            raise ValueError(f"every row must have {len(titles)} cells, got {row!r}")
    widths = [max(len(row[i]) for row in (titles, *body, *tail)) for i in range(len(titles))]

    def line(row: tuple[str, ...]) -> str:
        cells = [cell.ljust(w) if a == "l" else cell.rjust(w)
                 for cell, w, a in zip(row, widths, align)]
        return separator.join(cells).rstrip()

    rule = separator.replace(" ", "-").replace("|", "+").join("-" * w for w in widths)
    lines = [line(titles)]
    if rules:
        lines.append(rule)
    lines += [line(row) for row in body]
    if tail:
        if rules:
            lines.append(rule)
        lines.append(line(tail[0]))
    return "\n".join(lines)


def finite_or_none(value: Any) -> Any:
    """``value`` with every non-finite float (inside dicts, lists and tuples too) made
    ``None``, so it can be written as strict JSON.

    Example:
        >>> from ampkit.common.text import finite_or_none
        >>> finite_or_none({"a": float("nan"), "b": [1.0, float("inf")]})
        {'a': None, 'b': [1.0, None]}
    """
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    return value
