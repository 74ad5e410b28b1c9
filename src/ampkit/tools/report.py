"""The demo's report folder: PNG plots, one self-contained HTML page, and JSON.

:func:`write_report` writes, for a :class:`~ampkit.tools.demo.DemoResult`:

* ``loss_curves.png``: the training loss of every run over the steps, in one plot;
* ``loss_scale.png``: the loss scale over the steps of the runs that scale their loss
  (float16 runs; not written when there are none);
* ``accuracy.png``: the test accuracy of every run;
* ``report.html``: one page with the summary table (``<table id="results">``, one row
  per run), the plots embedded as ``data:`` URIs (the file can be mailed on its own),
  the code the O2 run used, and each run's op-call table;
* ``results.json``: everything above as data (non-finite numbers as ``null``).

:func:`summary_table` is the table the CLI prints and the page shows.

Example:
    >>> import tempfile
    >>> from ampkit.tools.demo import DemoSettings, demo_configurations, run_demo
    >>> from ampkit.tools.report import write_report
    >>> result = run_demo(DemoSettings(epochs=1, device="cpu",
    ...                                configurations=demo_configurations(["fp32"])))
    >>> with tempfile.TemporaryDirectory() as out:
    ...     files = write_report(result, out)
    ...     sorted(p.name for p in files.all())
    ['accuracy.png', 'loss_curves.png', 'report.html', 'results.json']
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import html
import json
import math
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from ampkit.tools.demo import DemoResult

__all__ = ["ReportFiles", "SummaryTable", "check_output_dir", "report_data",
           "summary_table", "write_report"]

#: Bumped when a key of ``results.json`` changes meaning or goes away.
JSON_SCHEMA_VERSION = 1

_NO_SCALER = "-"


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


def summary_table(result: DemoResult) -> SummaryTable:
    """The results as text cells. Samples per second are shown on CUDA only (on the CPU
    they only restate the time per step).

    Example:
        >>> from ampkit.tools.demo import DemoSettings, demo_configurations, run_demo
        >>> from ampkit.tools.report import summary_table
        >>> result = run_demo(DemoSettings(epochs=1, device="cpu",
        ...                                configurations=demo_configurations(["fp32"])))
        >>> table = summary_table(result)
        >>> table.columns[:3], table.rows[0][0], table.rows[0][-1]
        (('Configuration', 'Test accuracy', 'Final loss'), 'fp32', '0%')
    """
    on_cuda = result.device.startswith("cuda")
    columns = ["Configuration", "Test accuracy", "Final loss", "Time / step"]
    if on_cuda:
        columns.append("Samples / s")
    columns += ["Peak memory", "Skipped steps", "Final loss scale", "Low-precision ops"]
    rows = []
    for run in result.runs:
        row = [run.name, f"{run.test_accuracy:.1%}", f"{run.final_loss:.4f}",
               f"{run.step_time_s * 1e3:.2f} ms"]
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
    "Final loss: mean training loss over the last epoch. "
    "Time / step: median wall time of the training steps after the first. "
    "Skipped steps and final loss scale: float16 runs, which use dynamic loss scaling "
    "('-': no loss scaling). "
    "Low-precision ops: share of the floating-point aten op calls of one training step "
    "(forward, backward, optimizer) that produced float16 or bfloat16."
)


def check_output_dir(path: str | os.PathLike[str]) -> Path:
    """Create the folder ``path`` (and its parents) if needed and check that a file can
    be written in it; return it as a ``Path``.

    Raises:
        OSError: (the subclass the system raised) with a one-line message naming the
            folder, when it cannot be made or written.

    Example:
        >>> import os, tempfile
        >>> from ampkit.tools.report import check_output_dir
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
    return folder


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


def _finite_or_none(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (list, tuple)):
        return [_finite_or_none(v) for v in value]
    return value


def report_data(result: DemoResult) -> dict[str, Any]:
    """The JSON content of the report (plain ``dict``/``list``/``str``/numbers).

    Example:
        >>> from ampkit.tools.demo import DemoSettings, demo_configurations, run_demo
        >>> from ampkit.tools.report import report_data
        >>> result = run_demo(DemoSettings(epochs=1, device="cpu",
        ...                                configurations=demo_configurations(["fp32"])))
        >>> data = report_data(result)
        >>> data["runs"][0]["name"], len(data["runs"][0]["losses"])
        ('fp32', 21)
    """
    settings = result.settings
    runs = []
    for run in result.runs:
        fields = dataclasses.asdict(run)
        runs.append({key: _finite_or_none(value) for key, value in fields.items()})
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
        "pure_bf16_curves": {mode: _finite_or_none(list(losses))
                             for mode, losses in result.pure_bf16_curves.items()},
    }


# One colour per configuration, the same in every plot; fp32 is the black reference.
_COLOURS = {"fp32": "#000000", "O1-bf16": "#1f77b4", "O2-bf16": "#2ca02c",
            "O3-bf16": "#9467bd", "O1-fp16": "#ff7f0e", "O2-fp16": "#d62728",
            "O3-fp16": "#8c564b"}
# Runs often trace the same curve; wide solid lines under narrower dashed ones keep
# every run visible where they overlap.
_LINES = {"fp32": ("-", 3.2), "O1": ("-", 2.2), "O2": ("--", 1.6), "O3": (":", 1.6)}


def _line_style(run_name: str) -> dict[str, Any]:
    style, width = _LINES[run_name.split("-")[0]]
    return {"color": _COLOURS.get(run_name), "linestyle": style, "linewidth": width}


def _new_figure(width: float = 8.0, height: float = 4.5) -> Figure:
    from matplotlib.figure import Figure

    # A bare Figure (no pyplot): no global state, no GUI backend, safe in threads.
    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def _moving_average(values: tuple[float, ...], window: int) -> list[float]:
    averaged, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        averaged.append(total / min(i + 1, window))
    return averaged


def _plot_losses(result: DemoResult, path: Path) -> None:
    fig = _new_figure()
    ax = fig.add_subplot()
    steps_per_epoch = max(1, len(result.runs[0].losses) // result.settings.epochs)
    window = max(1, steps_per_epoch // 3)
    for run in result.runs:
        style = _line_style(run.name)
        steps = range(1, len(run.losses) + 1)
        line, = ax.plot(steps, run.losses, color=style["color"], alpha=0.2, linewidth=0.8)
        ax.plot(steps, _moving_average(run.losses, window),
                **{**style, "color": line.get_color()}, label=run.name)
    for epoch in range(1, result.settings.epochs):
        ax.axvline(epoch * steps_per_epoch + 0.5, color="#bbbbbb", linewidth=0.6,
                   linestyle=":")
    ax.set_yscale("log")
    ax.set_xlabel("training step (dotted lines: epochs)")
    ax.set_ylabel("training loss (cross-entropy, log scale)")
    ax.set_title(f"Training loss, moving average over {window} steps (faint: every step)")
    ax.grid(True, axis="y", alpha=0.3)  # vertical lines are the epochs'
    ax.legend(ncols=2, fontsize="small")
    fig.savefig(path)


def _plot_loss_scales(result: DemoResult, path: Path) -> bool:
    scaled = [run for run in result.runs if run.loss_scales]
    if not scaled:
        return False
    fig = _new_figure(8.0, 3.6)
    ax = fig.add_subplot()
    for run in scaled:
        skipped = f"{run.skipped_steps} skipped step{'' if run.skipped_steps == 1 else 's'}"
        ax.plot(range(1, len(run.loss_scales) + 1), run.loss_scales, drawstyle="steps-post",
                **_line_style(run.name), label=f"{run.name} ({skipped})")
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
    fig = _new_figure(8.0, 0.9 + 0.45 * len(runs))
    ax = fig.add_subplot()
    positions = range(len(runs))
    accuracies = [100 * run.test_accuracy for run in runs]
    bars = ax.barh(positions, accuracies, color=[_COLOURS.get(r.name, "#777777") for r in runs])
    ax.bar_label(bars, labels=[f"{a:.1f}%" for a in accuracies], padding=3, fontsize="small")
    ax.set_yticks(list(positions), [run.name for run in runs])
    ax.invert_yaxis()
    ax.set_xlim(0, 110)
    ax.set_xlabel(f"test accuracy (%), {len(runs)} runs, {result.settings.epochs} epochs")
    ax.set_title("Test accuracy on the held-out 25% of the digits")
    fig.savefig(path)


_PURE_STYLES = {"fp32": ("#000000", "-", 3.0, "fp32"),
                "nearest": ("#d62728", "--", 1.8, "pure bf16, round-to-nearest"),
                "stochastic": ("#2ca02c", "-", 1.6, "pure bf16, stochastic rounding")}


def _plot_pure_curves(result: DemoResult, path: Path) -> bool:
    curves = result.pure_bf16_curves
    if not curves:
        return False
    fig = _new_figure(8.0, 4.0)
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


def _data_uri(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode("ascii")


_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 60em;
       color: #222; padding: 0 1em; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; }
.meta, .notes { color: #555; font-size: 0.9em; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.92em; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.6em; }
th { background: #f0f0f0; } td { text-align: right; } td:first-child { text-align: left; }
img { max-width: 100%; height: auto; display: block; margin: 1em 0; }
pre { background: #f6f8fa; padding: 1em; overflow-x: auto; }
"""


def _html_page(result: DemoResult, files: ReportFiles) -> str:
    from ampkit.tools.demo import TRAINING_CODE_CONTEXT

    e = html.escape
    table = summary_table(result)
    head = "".join(f"<th>{e(c)}</th>" for c in table.columns)
    body = "\n".join("<tr>" + "".join(f"<td>{e(cell)}</td>" for cell in row) + "</tr>"
                     for row in table.rows)
    when = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    s = result.settings
    meta = (f"{len(result.runs)} runs of {s.epochs} epochs on {e(result.device)} "
            f"({e(result.device_name)}), batch {s.batch_size}, seed {s.seed}; "
            f"torch {e(result.torch_version)}, ampkit {e(result.ampkit_version)}; "
            f"{result.wall_time_s:.0f} s in all; {e(when)}.")
    figures = [("loss-curves", files.loss_curves_png, "Training loss of every run"),
               ("loss-scale", files.loss_scale_png, "Loss scale of the float16 runs"),
               ("accuracy", files.accuracy_png, "Test accuracy of every run"),
               ("pure-bf16", files.pure_bf16_png,
                "Pure bf16 training: fp32, round-to-nearest, stochastic rounding")]
    images = "\n".join(
        f'<figure><img id="{name}" alt="{e(alt)}" src="{_data_uri(png)}"></figure>'
        for name, png, alt in figures if png is not None)
    code = result.example_code()
    example = result.example_config
    code_section = "" if example is None else (
        f"<h2>The code of the {e(example.name)} run</h2>\n"
        f"<p>The ampkit lines this run executed ({e(TRAINING_CODE_CONTEXT)}):</p>\n"
        f"<pre><code>{e(code)}</code></pre>")
    op_tables = "\n".join(
        f"<details><summary>{e(run.name)}: {run.low_precision_share:.0%} of floating-point "
        f"op calls in low precision</summary><pre>{e(run.op_table)}</pre></details>"
        for run in result.runs)
    return f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>ampkit demo report</title>
<style>{_STYLE}</style>
</head>
<body>
<h1>ampkit demo: mixed precision training on scikit-learn's digits</h1>
<p class="meta">{meta}</p>
<table id="results">
<thead><tr>{head}</tr></thead>
<tbody>
{body}
</tbody>
</table>
<p class="notes">{e(COLUMN_NOTES)} Peak memory: {e(result.memory_measure)}.</p>
{images}
{code_section}
<h2>Op calls by precision (first training step of each run)</h2>
{op_tables}
</body>
</html>
"""


def write_report(result: DemoResult, out_dir: str | os.PathLike[str]) -> ReportFiles:
    """Write the plots, the HTML page and the JSON for ``result`` into ``out_dir``
    (created if needed; files of the same names are replaced).

    Example:
        >>> import json, tempfile
        >>> from ampkit.tools.demo import DemoSettings, demo_configurations, run_demo
        >>> from ampkit.tools.report import write_report
        >>> result = run_demo(DemoSettings(epochs=1, device="cpu",
        ...                                configurations=demo_configurations(["fp32"])))
        >>> with tempfile.TemporaryDirectory() as out:
        ...     files = write_report(result, out)
        ...     json.loads(files.json.read_text())["runs"][0]["name"]
        'fp32'
    """
    folder = check_output_dir(out_dir)
    loss_scale_png = folder / "loss_scale.png"
    files = ReportFiles(folder=folder, loss_curves_png=folder / "loss_curves.png",
                        loss_scale_png=loss_scale_png, accuracy_png=folder / "accuracy.png",
                        html=folder / "report.html", json=folder / "results.json")
    _plot_losses(result, files.loss_curves_png)
    if not _plot_loss_scales(result, loss_scale_png):
        files = dataclasses.replace(files, loss_scale_png=None)
        # A plot from an earlier report in the same folder would now be stale.
        loss_scale_png.unlink(missing_ok=True)
    _plot_accuracy(result, files.accuracy_png)
    pure_png = folder / "pure_bf16.png"
    if _plot_pure_curves(result, pure_png):
        files = dataclasses.replace(files, pure_bf16_png=pure_png)
    else:
        pure_png.unlink(missing_ok=True)  # stale from an earlier report
    files.html.write_text(_html_page(result, files), encoding="utf-8")
    data = report_data(result)
    data["files"] = [path.name for path in files.all()]
    files.json.write_text(json.dumps(data, indent=2, allow_nan=False) + "\n",
                          encoding="utf-8")
    return files
