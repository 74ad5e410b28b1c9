"""What :func:`ampkit.plan` returns: a :class:`Plan`, its table, JSON and HTML page.

Example:
    >>> from ampkit.tools.plan.report import Plan, format_bytes
    >>> row = {"mode": "O2", "parameters": 4 << 30, "gradients": 4 << 30,
    ...        "optimizer_state": 8 << 30, "activations": 3 << 30, "layout_buffers": 0,
    ...        "peak": 21 << 30, "note": None}
    >>> p = Plan(world_size=8, parallel="fsdp2", device_policy="cuda", optimizer="adamw",
    ...          batch=None, rows=(row,))
    >>> p.fits(20 << 30), p.fits(24 << 30), format_bytes(21 << 30)
    ([], ['O2'], '21.00 GiB')
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from ampkit.common.text import TextTable

__all__ = ["NUMBER_KEYS", "ROW_KEYS", "Plan", "format_bytes", "parse_bytes"]

#: A row's numbers, in bytes per rank.
NUMBER_KEYS: tuple[str, ...] = ("parameters", "gradients", "optimizer_state", "activations",
                                "layout_buffers", "peak")
#: Every key of a row.
ROW_KEYS: tuple[str, ...] = ("mode", *NUMBER_KEYS, "note")

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def format_bytes(value: int | None) -> str:
    """Bytes in GiB, MiB or KiB with two decimals (``-`` for ``None``).

    Example:
        >>> from ampkit.tools.plan.report import format_bytes
        >>> format_bytes(1536), format_bytes(None)
        ('1.50 KiB', '-')
    """
    if value is None:
        return "-"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(value) >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value} B"


def parse_bytes(text: str) -> int:
    """A memory size written ``80GiB``, ``80 GB``, ``1.5TiB`` or a number of bytes.

    Example:
        >>> from ampkit.tools.plan.report import parse_bytes
        >>> parse_bytes("80GiB"), parse_bytes("1.5 kB"), parse_bytes("512")
        (85899345920, 1500, 512)
    """
    found = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = found.group(2).lower() if found else ""
    if found is None or unit not in _UNITS:
        raise ValueError(f"a memory size such as 80GiB, 40GB or 1024 (bytes); got {text!r}")
    return int(float(found.group(1)) * _UNITS[unit])


@dataclasses.dataclass(frozen=True)
class Plan:
    """A plan: per mode, the bytes one rank holds in one training step (see
    :mod:`ampkit.tools.plan.simulate` for what each number counts).

    Example:
        >>> from ampkit.tools.plan.report import Plan
        >>> Plan(world_size=1, parallel="none", device_policy="cuda", optimizer="adamw",
        ...      batch=None, rows=()).to_dict()["parallel"]
        'none'
    """

    world_size: int
    parallel: str
    device_policy: str
    optimizer: str
    batch: int | None
    rows: tuple[dict[str, Any], ...]

    def fits(self, device_memory: int) -> list[str]:
        """The modes whose peak is at most ``device_memory`` bytes."""
        return [r["mode"] for r in self.rows
                if r["peak"] is not None and r["peak"] <= device_memory]

    def text_table(self) -> TextTable:
        """The rows as a table (sizes in GiB/MiB; a mode that did not run shows its
        note)."""
        columns = ("mode", "parameters", "gradients", "optimizer state", "activations",
                   "peak", "note")
        rows = []
        for r in self.rows:
            cells = [r["mode"], *(format_bytes(r[k]) for k in
                                  ("parameters", "gradients", "optimizer_state",
                                   "activations", "peak"))]
            note = r["note"] or (f"DDP buckets {format_bytes(r['layout_buffers'])}"
                                 if r["layout_buffers"] else "")
            rows.append((*cells, note))
        return TextTable.of(columns, rows)

    def title(self) -> str:
        """One line: the layout, ranks, optimizer and device policy."""
        batch = "" if self.batch is None else f", batch {self.batch}"
        return (f"per-rank memory of one training step: {self.parallel}, {self.world_size} "
                f"rank{'s' if self.world_size != 1 else ''}, {self.optimizer}, "
                f"{self.device_policy} autocast lists{batch}")

    def table(self) -> str:
        """:meth:`title` and the table as plain text."""
        return f"{self.title()}\n{self.text_table().text()}"

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready data."""
        return {"world_size": self.world_size, "parallel": self.parallel,
                "device_policy": self.device_policy, "optimizer": self.optimizer,
                "batch": self.batch, "rows": [dict(r) for r in self.rows]}

    def to_json(self) -> str:
        """:meth:`to_dict` as JSON text."""
        return json.dumps(self.to_dict(), indent=2)

    def html(self, *, device_memory: int | None = None,
             largest: dict[str, int] | None = None) -> str:
        """A self-contained HTML page: the table and a stacked bar per mode
        (parameters, gradients, optimizer state, activations, the rest of the peak), in
        inline SVG; ``device_memory`` draws a line where the device ends."""
        from ampkit.tools.pages.html import render_page

        parts = ("parameters", "gradients", "optimizer_state", "activations")
        colors = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8c8c8c")
        ran = [r for r in self.rows if r["peak"] is not None]
        top = max([r["peak"] for r in ran] + [device_memory or 0, 1])
        width, bar, gap, left = 640.0, 22.0, 10.0, 250.0
        bars = []
        for i, r in enumerate(ran):
            x, y = left, 30.0 + i * (bar + gap)
            pieces = [r[k] for k in parts]
            pieces.append(max(r["peak"] - sum(pieces), 0))
            rects = []
            for value, color, name in zip(pieces, colors, (*parts, "other at peak")):
                w = (width - left - 20) * value / top
                rects.append({"x": round(x, 2), "w": round(w, 2), "color": color,
                              "title": f"{r['mode']}: {name} {format_bytes(value)}"})
                x += w
            bars.append({"y": y, "label": r["mode"], "rects": rects,
                         "peak": format_bytes(r["peak"])})
        line = None
        if device_memory is not None:
            line = {"x": round(left + (width - left - 20) * device_memory / top, 2),
                    "label": format_bytes(device_memory)}
        table = self.text_table()
        return render_page(
            "plan.html.j2", title=self.title(), columns=table.columns, rows=table.rows,
            bars=bars, legend=list(zip((*parts, "other at peak"), colors)),
            height=40 + len(ran) * (bar + gap), width=width, bar=bar, line=line,
            fits=None if device_memory is None else self.fits(device_memory),
            largest=largest)
