"""The HTML report of :func:`ampkit.compare`: two plots and the tables, on one page.

Written with the pieces it shares with the demo's report (:mod:`ampkit.tools.pages`:
bare matplotlib figures, plots embedded as ``data:`` URIs, the same style sheet) and a
jinja2 template (``tools/pages/templates/compare.html.j2``, on the shared
``base.html.j2``; jinja2 comes with torch). Files (:data:`REPORT_FILES`):

* ``error_per_layer.png``: relative error of each leaf module's output (and inputs)
  along the network, with the threshold and where divergence starts;
* ``op_error_histogram.png``: a histogram of the error each op call added, per op;
* ``compare.html`` (``<table id="ranked-ops">``, ``id="modules"``, ``id="grads"``, and
  with ``fp8=`` ``id="fp8-layers"``);
* ``compare.json``: :meth:`~ampkit.tools.accuracy.compare.Comparison.to_json`.

Example:
    >>> import tempfile, torch
    >>> import ampkit
    >>> from ampkit.tools.accuracy.compare_report import write_comparison_report
    >>> c = ampkit.compare(torch.nn.Linear(2, 2), torch.ones(1, 2), precision="O3",
    ...                    dtype="bfloat16")
    >>> with tempfile.TemporaryDirectory() as out:
    ...     page = write_comparison_report(c, out)
    ...     sorted(p.name for p in page.parent.iterdir())
    ['compare.html', 'compare.json', 'error_per_layer.png', 'op_error_histogram.png']
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

import ampkit
from ampkit.tools.pages.html import check_output_dir, render_page
from ampkit.tools.pages.plotting import new_figure, png_data_uri, timestamp

__all__ = ["REPORT_FILES", "ComparisonView", "write_comparison_report"]

#: The files :func:`write_comparison_report` writes (and no others).
REPORT_FILES = ("compare.html", "compare.json", "error_per_layer.png", "op_error_histogram.png")

_FLOOR = 1e-12  # errors below this (exact ops) are drawn at it on log axes
_HISTOGRAM_OPS = 6  # ops named in the histogram; the others are pooled


# What the report reads of a comparison, as protocols: the report depends on these
# shapes only, so the results module (whose ``Comparison.write_report`` calls this one)
# is never imported here, not even for type checking.

class ErrorView(Protocol):
    """What the report reads of an error (an ``ErrorStats``)."""

    @property
    def max_rel(self) -> float: ...


class ModuleView(Protocol):
    """What the report reads of one module call (a ``ModuleError``)."""

    @property
    def module(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def call(self) -> int: ...
    @property
    def error(self) -> ErrorView: ...
    @property
    def input_rel(self) -> float: ...


class OpCallView(Protocol):
    """What the report reads of one op call (an ``OpError``)."""

    @property
    def op(self) -> str: ...
    @property
    def added(self) -> float: ...


class RankView(Protocol):
    """What the report reads of one ranked op (an ``OpRank``)."""

    @property
    def name(self) -> str: ...


class ComparisonView(Protocol):
    """What :func:`write_comparison_report` reads of its comparison: a
    :class:`~ampkit.tools.accuracy.comparison.Comparison` is one (the template reads
    further fields of it, as ``c``).

    Example:
        >>> import torch, ampkit
        >>> from ampkit.tools.accuracy.compare_report import ComparisonView
        >>> c: ComparisonView = ampkit.compare(torch.nn.Linear(2, 2), torch.ones(1, 2),
        ...                                    precision="O3", dtype="bfloat16")
        >>> c.dtype, c.threshold > 0
        ('torch.bfloat16', True)
    """

    @property
    def precision(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def threshold(self) -> float: ...
    @property
    def ops(self) -> Sequence[OpCallView]: ...
    @property
    def modules(self) -> Sequence[ModuleView]: ...
    @property
    def divergence(self) -> ModuleView | None: ...
    @property
    def first_divergent_op(self) -> Any: ...
    def ranked_ops(self) -> Sequence[RankView]: ...
    def to_json(self) -> str: ...


def _fmt(value: float) -> str:
    return f"{value:.3g}" if math.isfinite(value) else str(value)


def _leaf_modules(c: ComparisonView) -> list[ModuleView]:
    names = {m.module for m in c.modules}
    parents = {n.rsplit(".", 1)[0] if "." in n else "" for n in names if n}
    return [m for m in c.modules if m.module not in parents]


def _clip(value: float, floor: float = _FLOOR) -> float:
    if math.isnan(value):
        return math.nan
    return max(value, floor)


def _plot_layers(c: ComparisonView, path: Path) -> None:
    layers_figure(c).savefig(path)


#: Width of one leaf module's x label (rotated upright, two lines of small text) and the
#: widest the plot grows to; past that only every k-th leaf is labelled, so the labels
#: never overlap (a ViT has about 35 leaves, a GPT-2 about 75).
_LABEL_INCHES, _MAX_INCHES = 0.4, 16.0


def layers_figure(c: ComparisonView) -> Any:
    """The "Error along the network" plot: each leaf module's output and input error,
    in the order they ran; its x labels are upright and never overlap (the figure
    widens with the number of leaves, then labels every k-th one).

    Example:
        >>> import torch
        >>> import ampkit
        >>> from ampkit.tools.accuracy.compare_report import layers_figure
        >>> c = ampkit.compare(torch.nn.Sequential(torch.nn.Linear(2, 2)), torch.ones(1, 2),
        ...                    precision="O3", dtype="bfloat16")
        >>> len(layers_figure(c).axes[0].get_xticklabels())  # one leaf module
        1
    """
    leaves = _leaf_modules(c)
    fits = int(_MAX_INCHES / _LABEL_INCHES)
    every = max(1, math.ceil(len(leaves) / fits))
    fig = new_figure(max(8.0, min(_MAX_INCHES, _LABEL_INCHES * len(leaves))), 4.8)
    ax = fig.add_subplot()
    xs = range(len(leaves))
    floor = c.threshold / 1e4  # exact values are drawn here, not at 1e-12

    def clip(value: float) -> float:
        return _clip(value, floor)

    ax.plot(xs, [clip(m.error.max_rel) for m in leaves], marker="o", color="#d62728",
            label="output")
    ax.plot(xs, [clip(m.input_rel) for m in leaves], marker=".", linestyle="--",
            color="#1f77b4", label=f"inputs (exact: drawn at {floor:.0e})")
    ax.axhline(c.threshold, color="#777777", linewidth=0.8, linestyle=":",
               label=f"threshold {_fmt(c.threshold)}")
    div = c.divergence
    for i, m in enumerate(leaves):
        if div is not None and (m.module, m.call) == (div.module, div.call):
            ax.annotate("divergence starts", (i, clip(m.error.max_rel)),
                        xytext=(10, 10), textcoords="offset points",
                        arrowprops={"arrowstyle": "->"})
    labels = [(m.module or "(model)") + (f"#{m.call}" if m.call else "") + f"\n{m.kind}"
              for m in leaves]
    upright = len(labels) > 6
    ax.set_xticks(list(xs)[::every], labels[::every], rotation=90 if upright else 0,
                  ha="center", fontsize="small")
    ax.set_yscale("log")
    ax.set_ylabel("max relative error vs float32")
    ax.set_xlabel("leaf modules, in the order they ran" + (
        f" (one in {every} labelled)" if every > 1 else ""))
    ax.set_title(f"Error along the network: {c.precision} ({c.dtype})")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize="small")
    return fig


def _plot_histogram(c: ComparisonView, path: Path) -> None:
    ranked = [r.name for r in c.ranked_ops()[:_HISTOGRAM_OPS]]
    groups: dict[str, list[float]] = {name: [] for name in ranked}
    other: list[float] = []
    for r in c.ops:
        value = _clip(r.added)
        if math.isnan(value):
            continue
        value = math.log10(min(value, 1e6))  # Inf drawn at 1e6
        groups.get(r.op, other).append(value)
    if other:
        groups["other ops"] = other
    fig = new_figure(8.0, 4.0)
    ax = fig.add_subplot()
    if any(groups.values()):
        ax.hist(list(groups.values()), bins=24, stacked=True,
                label=[f"{name} ({len(values)} calls)" for name, values in groups.items()])
        ax.legend(fontsize="small")
    ax.set_xlabel(f"log10 of the relative error an op call added "
                  f"(exact calls at {math.log10(_FLOOR):.0f})")
    ax.set_ylabel("op calls")
    ax.set_title("Error added per op call, by op (ops ranked worst first)")
    fig.savefig(path)


def write_comparison_report(c: ComparisonView, out_dir: str | os.PathLike[str]) -> Path:
    """Write the plots, ``compare.html`` and ``compare.json`` into ``out_dir``
    (created if needed); return the HTML page's path. See the module docstring."""
    folder = check_output_dir(out_dir)
    layers, histogram = folder / "error_per_layer.png", folder / "op_error_histogram.png"
    _plot_layers(c, layers)
    _plot_histogram(c, histogram)
    meta = (f"{len(c.ops)} op calls and {len(c.modules)} module calls compared; "
            f"threshold {_fmt(c.threshold)}; torch {torch.__version__}, ampkit "
            f"{ampkit.__version__}; {timestamp()}.")
    figures = [
        {"id": "error-per-layer", "alt": "Relative error per layer", "uri": png_data_uri(layers)},
        {"id": "op-histogram", "alt": "Error added per op call", "uri": png_data_uri(histogram)},
    ]
    page = render_page("compare.html.j2", c=c, div=c.divergence, first=c.first_divergent_op,
                       ranked=c.ranked_ops(), figures=figures, meta=meta, fmt=_fmt)
    html_path = folder / "compare.html"
    html_path.write_text(page, encoding="utf-8")
    (folder / "compare.json").write_text(c.to_json() + "\n", encoding="utf-8")
    return html_path
