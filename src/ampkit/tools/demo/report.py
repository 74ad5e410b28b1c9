"""The demo's report folder: PNG plots, one self-contained HTML page, and JSON.

:func:`write_report` writes, for a :class:`~ampkit.tools.demo.run.DemoResult`:

* ``loss_curves.png``: the training loss of every run (moving average) and, below, each
  run's difference from the fp32 run's loss, step by step; runs that trained
  bit-identically are drawn once, under one label (``O1-bf16 = O2-bf16``);
* ``accuracy.png``: the test accuracy of every run on an axis zoomed to the values,
  each labelled with its difference from fp32 in points;
* ``loss_scale.png``: the loss scale over the steps of the runs that scale their loss
  (float16 runs; only when there are some);
* ``pure_bf16.png``: the pure-bf16 curves, when the demo trained them;
* ``report.html``: one page (the jinja2 template ``tools/pages/templates/demo.html.j2``) with the
  summary table (``<table id="results">``, one row per run), which runs trained
  bit-identically and why (:func:`identical_runs`), the plots embedded as ``data:``
  URIs (the file can be mailed on its own), the code the O2 run used, and each run's
  op-call table;
* ``results.json``: everything above as data (non-finite numbers as ``null``).

It writes those names only (:func:`report_file_names`) and deletes nothing.

:func:`summary_table` is the table the CLI prints and the page shows.

Example (:func:`write_report` runs the demo and writes these):
    >>> from ampkit.tools.demo.run import DemoSettings, demo_configurations
    >>> from ampkit.tools.demo.report import report_file_names
    >>> report_file_names(DemoSettings(configurations=demo_configurations(["fp32"])))
    ('loss_curves.png', 'accuracy.png', 'report.html', 'results.json')
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ampkit import torch_internals
from ampkit.common.text import finite_or_none
from ampkit.tools.pages.html import check_output_dir, render_page
from ampkit.tools.pages.plotting import new_figure, png_data_uri, timestamp

if TYPE_CHECKING:
    from ampkit.tools.demo.run import DemoResult, DemoSettings, RunResult

__all__ = ["IdenticalRuns", "ReportFiles", "SummaryTable", "identical_runs", "report_data",
           "report_file_names", "summary_table", "write_report"]

#: Bumped when a key of ``results.json`` changes meaning or goes away.
JSON_SCHEMA_VERSION = 1

_NO_SCALER = "-"
_REFERENCE = "fp32"


@dataclasses.dataclass(frozen=True)
class SummaryTable:
    """Column titles and formatted rows, one row per run."""

    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]


def _format_bytes(count: int) -> str:
    if count >= 2**20:
        return f"{count / 2**20:.2f} MiB"
    return f"{count / 2**10:.0f} KiB"


def _format_scale(scale: float | None) -> str:
    if scale is None:
        return _NO_SCALER
    if scale >= 1 and float(scale).is_integer():
        return f"{scale:,.0f}"
    return f"{scale:g}"


def _reference_run(result: DemoResult) -> RunResult | None:
    return next((run for run in result.runs if run.name == _REFERENCE), None)


def _points(difference: float) -> str:
    """An accuracy difference in points, signed (``-0.22``, ``+0.00``)."""
    return f"{100 * difference:+.2f}"


def summary_table(result: DemoResult) -> SummaryTable:
    """The results as text cells. Samples per second are shown on CUDA only (on the CPU
    they only restate the time per step); "vs fp32" (the accuracy's difference from the
    fp32 run, in points) only when fp32 ran.

    Example:
        >>> from ampkit.tools.demo.run import DemoSettings, demo_configurations, run_demo
        >>> from ampkit.tools.demo.report import summary_table
        >>> result = run_demo(DemoSettings(epochs=1, device="cpu",
        ...                                configurations=demo_configurations(["fp32"])))
        >>> table = summary_table(result)
        >>> table.columns[:4], table.rows[0][0], table.rows[0][2], table.rows[0][-1]
        (('Configuration', 'Test accuracy', 'vs fp32', 'Final loss'), 'fp32', '-', '0%')
    """
    on_cuda = result.device.startswith("cuda")
    reference = _reference_run(result)
    columns = ["Configuration", "Test accuracy"]
    if reference is not None:
        columns.append("vs fp32")
    columns += ["Final loss", "Time / step"]
    if on_cuda:
        columns.append("Samples / s")
    columns += ["Peak memory", "Skipped steps", "Final loss scale", "Low-precision ops"]
    rows = []
    for run in result.runs:
        row = [run.name, f"{run.test_accuracy:.1%}"]
        if reference is not None:
            row.append("-" if run is reference
                       else _points(run.test_accuracy - reference.test_accuracy))
        row += [f"{run.final_loss:.4f}", f"{run.step_time_s * 1e3:.2f} ms"]
        if on_cuda:
            row.append(f"{run.samples_per_second:,.0f}")
        scaled = run.final_loss_scale is not None
        row += [_format_bytes(run.peak_memory_bytes),
                str(run.skipped_steps) if scaled else _NO_SCALER,
                _format_scale(run.final_loss_scale), f"{run.low_precision_share:.0%}"]
        rows.append(tuple(row))
    return SummaryTable(tuple(columns), tuple(rows))


#: What the columns mean, for the page and the CLI.
COLUMN_NOTES = (
    "vs fp32: test accuracy minus the fp32 run's, in points (one test image is "
    "0.22 points). "
    "Final loss: mean training loss over the last epoch. "
    "Time / step: median wall time of the training steps after the first. "
    "Skipped steps and final loss scale: float16 runs, which use dynamic loss scaling "
    "('-': no loss scaling). "
    "Low-precision ops: share of the floating-point aten op calls of one training step "
    "(forward, backward, optimizer) that produced float16 or bfloat16."
)


# -- runs that trained bit-identically ------------------------------------------------------

# aten ops that make no new values from old ones, by what they do instead. Views are
# recognised from their schemas (an aliasing result), new tensors from having no tensor
# argument or from a ``*_like`` name; these are the copies and casts.
_COPIES = frozenset({"_to_copy", "copy_", "_foreach_copy_", "clone", "_copy_from",
                     "_copy_from_and_resize", "lift_fresh", "lift_fresh_copy"})
_KIND_WORDS = {"copy": "casts and copies", "view": "views", "new": "new tensors",
               "scaler": "the loss scaler's unscaling and overflow check"}


@functools.cache
def _op_kind(name: str) -> str:
    """``"compute"``, or for an op that computes no training value: ``"copy"``,
    ``"view"``, ``"new"`` (allocations, constants) or ``"scaler"`` (``_amp_*``)."""
    import torch

    if name in _COPIES:
        return "copy"
    if name.startswith("_amp_"):
        return "scaler"
    if name.endswith("_like"):
        return "new"
    packet = getattr(torch.ops.aten, name, None) if "::" not in name else None
    if packet is None:
        return "compute"
    schemas = [torch_internals.op_schema(getattr(packet, overload))
               for overload in packet.overloads()]
    if schemas and all(s.returns and all(r.alias_info is not None and not r.alias_info.is_write
                                         for r in s.returns) for s in schemas):
        return "view"
    # factories: no tensor argument but an ``out=`` one
    if schemas and all(not any("Tensor" in str(a.type) and not a.is_out for a in s.arguments)
                       for s in schemas):
        return "new"
    return "compute"


@dataclasses.dataclass(frozen=True)
class IdenticalRuns:
    """Runs whose training losses were equal at every step and whose test accuracies
    were equal: they trained bit-identically (or as near as the losses can tell).

    ``differing_ops`` are the ops whose call counts per precision differed between the
    runs' first training steps, as ``(op, kind)`` with kind ``"compute"``, ``"copy"``,
    ``"view"``, ``"new"`` or ``"scaler"``.

    Example:
        >>> from ampkit.tools.demo.report import IdenticalRuns
        >>> same = IdenticalRuns(("O1-bf16", "O2-bf16"), 105, 0.987,
        ...                      (("_to_copy", "copy"), ("detach", "view")))
        >>> print(same.sentence())  # doctest: +NORMALIZE_WHITESPACE
        O1-bf16 and O2-bf16 trained bit-identically: the same training loss at all 105
        steps and the same test accuracy (98.7%). Their first training steps ran the same
        compute ops in the same precisions, the same number of times; they differ only in
        casts and copies (_to_copy) and views (detach), which compute nothing.
    """

    names: tuple[str, ...]
    steps: int
    test_accuracy: float
    differing_ops: tuple[tuple[str, str], ...]

    def sentence(self) -> str:
        """What ran identically, and why, in one paragraph."""
        names = " and ".join([", ".join(self.names[:-1]), self.names[-1]])
        text = (f"{names} trained bit-identically: the same training loss at all "
                f"{self.steps} steps and the same test accuracy ({self.test_accuracy:.1%}).")
        compute = [op for op, kind in self.differing_ops if kind == "compute"]
        others: dict[str, list[str]] = {}
        for op, kind in self.differing_ops:
            if kind != "compute":
                others.setdefault(kind, []).append(op)
        listed = [f"{_KIND_WORDS[kind]} ({', '.join(ops)})" for kind, ops in others.items()]
        rest = (", ".join(listed[:-1]) + " and " + listed[-1]) if len(listed) > 1 else (
            listed[0] if listed else "")
        if not self.differing_ops:
            return text + (" Their first training steps ran the same ops in the same "
                           "precisions, the same number of times.")
        if not compute:
            quiet = {kind for _, kind in self.differing_ops} <= {"copy", "view", "new"}
            return text + (" Their first training steps ran the same compute ops in the "
                           "same precisions, the same number of times; they differ only in "
                           f"{rest}" + (", which compute nothing." if quiet else "."))
        return text + (f" Their first training steps differ in compute ops "
                       f"({', '.join(compute)})" + (f" and in {rest}" if rest else "")
                       + ", whose results matched here nonetheless.")


def _op_differences(runs: Sequence[RunResult]) -> tuple[tuple[str, str], ...]:
    tables = [{row[0]: row[1:] for row in run.op_counts} for run in runs]
    names = sorted(set().union(*tables))
    return tuple((name, _op_kind(name)) for name in names
                 if len({table.get(name) for table in tables}) > 1)


def identical_runs(result: DemoResult) -> list[IdenticalRuns]:
    """Groups of two or more runs that trained bit-identically: equal losses at every
    step (NaN never equals) and equal test accuracy; with why, from their op counts.

    Example:
        >>> import torch
        >>> from ampkit.tools.demo.run import DemoSettings, RunConfig, run_demo
        >>> from ampkit.tools.demo.report import identical_runs
        >>> result = run_demo(DemoSettings(epochs=1, device="cpu", configurations=(
        ...     RunConfig("O1", torch.bfloat16), RunConfig("O2", torch.bfloat16))))
        >>> [same.names for same in identical_runs(result)]
        [('O1-bf16', 'O2-bf16')]
    """
    groups: list[list[RunResult]] = []
    for run in result.runs:
        for group in groups:
            first = group[0]
            # element by element: a NaN never equals, so diverged runs are not "identical"
            if (len(first.losses) == len(run.losses)
                    and all(a == b for a, b in zip(first.losses, run.losses))
                    and first.test_accuracy == run.test_accuracy):
                group.append(run)
                break
        else:
            groups.append([run])
    return [IdenticalRuns(tuple(r.name for r in group), len(group[0].losses),
                          group[0].test_accuracy, _op_differences(group))
            for group in groups if len(group) > 1]


# -- files ----------------------------------------------------------------------------------

def report_file_names(settings: DemoSettings) -> tuple[str, ...]:
    """The files :func:`write_report` writes for a run of ``settings``.

    Example:
        >>> import torch
        >>> from ampkit.tools.demo.run import DemoSettings, RunConfig
        >>> from ampkit.tools.demo.report import report_file_names
        >>> report_file_names(DemoSettings(configurations=(RunConfig("O1", torch.float16),)))
        ('loss_curves.png', 'accuracy.png', 'loss_scale.png', 'report.html', 'results.json')
    """
    names = ["loss_curves.png", "accuracy.png"]
    if any(config.loss_scaling for config in settings.configurations):
        names.append("loss_scale.png")
    if settings.pure_bf16_steps:
        names.append("pure_bf16.png")
    return (*names, "report.html", "results.json")


@dataclasses.dataclass(frozen=True)
class ReportFiles:
    """The paths :func:`write_report` wrote (``loss_scale_png`` is ``None`` when no
    run scaled its loss)."""

    folder: Path
    loss_curves_png: Path
    loss_scale_png: Path | None
    accuracy_png: Path
    html: Path
    json: Path
    pure_bf16_png: Path | None = None  # when the demo trained the pure-bf16 curves

    def all(self) -> tuple[Path, ...]:
        """Every file written."""
        files = (self.loss_curves_png, self.loss_scale_png, self.accuracy_png,
                 self.pure_bf16_png, self.html, self.json)
        return tuple(f for f in files if f is not None)


def report_data(result: DemoResult) -> dict[str, Any]:
    """The JSON content of the report (plain ``dict``/``list``/``str``/numbers).

    Example:
        >>> from ampkit.tools.demo.run import DemoSettings, demo_configurations, run_demo
        >>> from ampkit.tools.demo.report import report_data
        >>> settings = DemoSettings(epochs=1, device="cpu",
        ...                         configurations=demo_configurations(["fp32"]))
        >>> run = report_data(run_demo(settings))["runs"][0]
        >>> run["name"], len(run["losses"])
        ('fp32', 21)
    """
    settings = result.settings
    runs = []
    for run in result.runs:
        fields = dataclasses.asdict(run)
        runs.append({key: finite_or_none(value) for key, value in fields.items()})
    return {
        "schema_version": JSON_SCHEMA_VERSION,
        "ampkit_version": result.ampkit_version,
        "torch_version": result.torch_version,
        "device": result.device,
        "device_name": result.device_name,
        "epochs": settings.epochs,
        "seed": settings.seed,
        "batch_size": settings.batch_size,
        "learning_rate": settings.learning_rate,
        "wall_time_s": result.wall_time_s,
        "memory_measure": result.memory_measure,
        "example_code": result.example_code(),
        "runs": runs,
        "identical_runs": [{"names": list(same.names), "sentence": same.sentence()}
                           for same in identical_runs(result)],
        "pure_bf16_curves": {mode: finite_or_none(list(losses))
                             for mode, losses in result.pure_bf16_curves.items()},
    }


# -- plots ----------------------------------------------------------------------------------

# One colour per configuration, the same in every plot; fp32 is the black reference.
_COLOURS = {"fp32": "#000000", "O1-bf16": "#1f77b4", "O2-bf16": "#2ca02c",
            "O3-bf16": "#9467bd", "O1-fp16": "#ff7f0e", "O2-fp16": "#d62728",
            "O3-fp16": "#8c564b"}
_LINES = {"fp32": ("-", 2.6), "O1": ("-", 1.8), "O2": ("--", 1.8), "O3": (":", 2.0)}


def _line_style(run_name: str) -> dict[str, Any]:
    style, width = _LINES[run_name.split("-")[0]]
    return {"color": _COLOURS.get(run_name), "linestyle": style, "linewidth": width}


def _moving_average(values: Sequence[float], window: int) -> list[float]:
    averaged, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        averaged.append(total / min(i + 1, window))
    return averaged


def _drawn_once(result: DemoResult, runs: Sequence[RunResult] | None = None
                ) -> list[tuple[str, RunResult]]:
    """(label, run) per distinct training among ``runs`` (default: all): bit-identical
    runs share one line, labelled with all their names."""
    runs = result.runs if runs is None else runs
    chosen = {run.name for run in runs}
    same = {name: tuple(n for n in group.names if n in chosen)
            for group in identical_runs(result) for name in group.names}
    lines: list[tuple[str, RunResult]] = []
    seen: set[str] = set()
    for run in runs:
        if run.name in seen:
            continue
        names = same.get(run.name, (run.name,))
        seen.update(names)
        lines.append((" = ".join(names), run))
    return lines


def _plot_losses(result: DemoResult, path: Path) -> None:
    reference = _reference_run(result)
    lines = _drawn_once(result)
    steps_per_epoch = max(1, len(result.runs[0].losses) // result.settings.epochs)
    window = max(1, steps_per_epoch // 3)
    with_difference = reference is not None and len(lines) > 1
    fig = new_figure(8.0, 7.0 if with_difference else 4.5)
    axes = fig.subplots(2, 1, sharex=True, height_ratios=(3, 2)) if with_difference else [
        fig.add_subplot()]
    top = axes[0]
    for label, run in lines:
        steps = range(1, len(run.losses) + 1)
        top.plot(steps, _moving_average(run.losses, window), **_line_style(run.name),
                 label=label)
    top.set_yscale("log")
    top.set_ylabel("training loss (log scale)")
    top.set_title(f"Training loss, moving average over {window} steps")
    top.grid(True, axis="y", alpha=0.3)
    top.legend(ncols=2, fontsize="small")
    if with_difference:
        assert reference is not None
        bottom = axes[1]
        bottom.axhline(0.0, color=_COLOURS[_REFERENCE], linewidth=1.2)
        for label, run in lines:
            if run is reference or reference.name in label.split(" = "):
                continue
            diff = [a - b for a, b in zip(run.losses, reference.losses)]
            bottom.plot(range(1, len(diff) + 1), _moving_average(diff, window),
                        **_line_style(run.name), label=label)
        bottom.set_ylabel("loss minus fp32's")
        bottom.set_title(f"Difference from fp32, moving average over {window} steps",
                         fontsize="medium")
        bottom.grid(True, axis="y", alpha=0.3)
    for ax in axes:
        for epoch in range(1, result.settings.epochs):
            ax.axvline(epoch * steps_per_epoch + 0.5, color="#bbbbbb", linewidth=0.6,
                       linestyle=":")
    axes[-1].set_xlabel("training step (dotted lines: epochs)")
    fig.savefig(path)


def _plot_loss_scales(result: DemoResult, path: Path) -> bool:
    scaled = _drawn_once(result, [run for run in result.runs if run.loss_scales])
    if not scaled:
        return False
    fig = new_figure(8.0, 3.6)
    ax = fig.add_subplot()
    for label, run in scaled:
        skipped = f"{run.skipped_steps} skipped step{'' if run.skipped_steps == 1 else 's'}"
        ax.plot(range(1, len(run.loss_scales) + 1), run.loss_scales, drawstyle="steps-post",
                **_line_style(run.name), label=f"{label} ({skipped})")
    ax.set_yscale("log", base=2)
    ax.set_xlabel("training step")
    ax.set_ylabel("loss scale after the step")
    ax.set_title("Dynamic loss scale of the float16 runs (it halves on each overflow)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.savefig(path)
    return True


def _plot_accuracy(result: DemoResult, path: Path) -> None:
    runs = result.runs
    reference = _reference_run(result)
    accuracies = [100 * run.test_accuracy for run in runs]
    finite = [a for a in accuracies if math.isfinite(a)] or [0.0]
    low, high = min(finite), max(finite)
    pad = max(0.5, 0.2 * (high - low))
    fig = new_figure(8.0, 1.3 + 0.42 * len(runs))
    ax = fig.add_subplot()
    positions = range(len(runs))
    if reference is not None:
        ax.axvline(100 * reference.test_accuracy, color=_COLOURS[_REFERENCE],
                   linewidth=1.0, linestyle="--", label="fp32")
    for y, run, value in zip(positions, runs, accuracies):
        colour = _COLOURS.get(run.name, "#777777")
        if reference is not None and run is not reference:
            ax.plot([100 * reference.test_accuracy, value], [y, y], color=colour,
                    linewidth=2.0, alpha=0.5)
        ax.plot([value], [y], marker="o", markersize=8, color=colour)
        label = f"{value:.1f}%"
        if reference is not None:
            label += (" (fp32)" if run is reference else
                      f" ({_points(run.test_accuracy - reference.test_accuracy)} points)")
        # one column of labels right of every dot and of the fp32 line
        ax.annotate(label, (high, y), xytext=(14, 0), textcoords="offset points",
                    va="center", fontsize="small")
    ax.set_yticks(list(positions), [run.name for run in runs])
    ax.set_ylim(len(runs) - 0.5, -0.5)
    ax.set_xlim(low - pad, high + 2.5 * pad)  # room for the labels on the right
    ax.grid(True, axis="x", alpha=0.3)
    ax.set_xlabel("test accuracy (%), axis zoomed to the values; one test image is "
                  "0.22 points")
    ax.set_title(f"Test accuracy on the held-out 25% of the digits "
                 f"({result.settings.epochs} epochs)" + (", against fp32 (dashed)"
                                                         if reference is not None else ""))
    fig.savefig(path)


_PURE_STYLES = {"fp32": ("#000000", "-", 3.0, "fp32"),
                "nearest": ("#d62728", "--", 1.8, "pure bf16, round-to-nearest"),
                "stochastic": ("#2ca02c", "-", 1.6, "pure bf16, stochastic rounding")}


def _plot_pure_curves(result: DemoResult, path: Path) -> bool:
    curves = result.pure_bf16_curves
    if not curves:
        return False
    fig = new_figure(8.0, 4.0)
    ax = fig.add_subplot()
    window = max(1, len(next(iter(curves.values()))) // 10)
    for mode, losses in curves.items():
        colour, style, width, label = _PURE_STYLES.get(mode, (None, "-", 1.2, mode))
        ax.plot(range(1, len(losses) + 1), _moving_average(losses, window), color=colour,
                linestyle=style, linewidth=width, label=label)
    ax.set_xlabel("training step")
    ax.set_ylabel("training loss (cross-entropy)")
    ax.set_title(f"Pure bf16 weights and AdamW state: a tiny character GPT on scikit-learn's "
                 f"dataset descriptions\n(moving average over {window} steps; "
                 f"master_weights=\"stochastic\" vs round-to-nearest)", fontsize="medium")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.savefig(path)
    return True


# -- the page -------------------------------------------------------------------------------

def _html_page(result: DemoResult, files: ReportFiles) -> str:
    from ampkit.tools.demo.run import TRAINING_CODE_CONTEXT

    s = result.settings
    meta = (f"{len(result.runs)} runs of {s.epochs} epochs on {result.device} "
            f"({result.device_name}), batch {s.batch_size}, seed {s.seed}; "
            f"torch {result.torch_version}, ampkit {result.ampkit_version}; "
            f"{result.wall_time_s:.0f} s in all; {timestamp()}. Results vary by CPU: the "
            f"kernels torch picks depend on its instruction set.")
    figures = [("loss-curves", files.loss_curves_png,
                "Training loss of every run, and its difference from fp32"),
               ("accuracy", files.accuracy_png, "Test accuracy of every run against fp32"),
               ("loss-scale", files.loss_scale_png, "Loss scale of the float16 runs"),
               ("pure-bf16", files.pure_bf16_png,
                "Pure bf16 training: fp32, round-to-nearest, stochastic rounding")]
    return render_page(
        "demo.html.j2", meta=meta, table=summary_table(result),
        notes=f"{COLUMN_NOTES} Peak memory: {result.memory_measure}.",
        identical=identical_runs(result),
        figures=[{"id": name, "alt": alt, "uri": png_data_uri(png)}
                 for name, png, alt in figures if png is not None],
        example=result.example_config, code=result.example_code(),
        code_context=TRAINING_CODE_CONTEXT, runs=result.runs)


def write_report(result: DemoResult, out_dir: str | os.PathLike[str]) -> ReportFiles:
    """Write the plots, the HTML page and the JSON for ``result`` into ``out_dir``
    (created if needed). It writes only :func:`report_file_names` (replacing files of
    those names) and deletes nothing; the command line refuses an ``--out`` that holds
    one of them unless given ``--overwrite``.

    Example:
        >>> import json, tempfile
        >>> from ampkit.tools.demo.run import DemoSettings, demo_configurations, run_demo
        >>> from ampkit.tools.demo.report import write_report
        >>> result = run_demo(DemoSettings(epochs=1, device="cpu",
        ...                                configurations=demo_configurations(["fp32"])))
        >>> with tempfile.TemporaryDirectory() as out:
        ...     files = write_report(result, out)
        ...     sorted(p.name for p in files.all())
        ...     json.loads(files.json.read_text())["runs"][0]["name"]
        ['accuracy.png', 'loss_curves.png', 'report.html', 'results.json']
        'fp32'
    """
    folder = check_output_dir(out_dir)
    files = ReportFiles(folder=folder, loss_curves_png=folder / "loss_curves.png",
                        loss_scale_png=folder / "loss_scale.png",
                        accuracy_png=folder / "accuracy.png",
                        html=folder / "report.html", json=folder / "results.json",
                        pure_bf16_png=folder / "pure_bf16.png")
    _plot_losses(result, files.loss_curves_png)
    _plot_accuracy(result, files.accuracy_png)
    if not _plot_loss_scales(result, folder / "loss_scale.png"):
        files = dataclasses.replace(files, loss_scale_png=None)
    if not _plot_pure_curves(result, folder / "pure_bf16.png"):
        files = dataclasses.replace(files, pure_bf16_png=None)
    files.html.write_text(_html_page(result, files), encoding="utf-8")
    data = report_data(result)
    data["files"] = [path.name for path in files.all()]
    files.json.write_text(json.dumps(data, indent=2, allow_nan=False) + "\n",
                          encoding="utf-8")
    return files
