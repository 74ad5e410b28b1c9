"""``ampkit demo``: its options, and the run (a rich progress bar per configuration, the
summary table and the O2 run's ampkit code printed, the report folder written; see
:mod:`ampkit.tools.demo`). The options are listed in :mod:`ampkit.tools.cli`.

Example:
    >>> from ampkit.tools.cli import build_parser
    >>> build_parser().parse_args(["demo", "--epochs", "2"]).epochs
    2
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from ampkit.tools.cli.args import (
    DTYPE_SPELLINGS,
    MISSING,
    add_device_option,
    add_run_options,
    choice_list,
    console,
    fail,
    folder_undo,
    missing_modules,
    non_negative_int,
    positive_int,
    rich_table,
    spelled,
)
from ampkit.tools.demo.run import (
    DEFAULT_EPOCHS,
    DTYPE_CHOICES,
    LEVEL_CHOICES,
    TRAINING_CODE_CONTEXT,
    DemoSettings,
    RunConfig,
    RunResult,
    demo_configurations,
    resolve_device,
)

if TYPE_CHECKING:
    from rich.console import Console

    from ampkit.tools.demo.run import DemoResult

__all__ = ["add_parser", "run"]


def add_parser(commands: Any) -> argparse.ArgumentParser:
    """Add the ``demo`` subcommand to an argparse subparsers object; return it."""
    demo: argparse.ArgumentParser = commands.add_parser(
        "demo", help="train a small CNN on scikit-learn's digits in fp32 and at each AMP "
                     "level, and write a report",
        description="Train the same small CNN on scikit-learn's digits (no download) once "
                    "per configuration, print a table and the ampkit code of the O2 run, "
                    "and write plots, an HTML page and JSON to --out.")
    demo.add_argument("--epochs", type=positive_int, default=DEFAULT_EPOCHS,
                      help=f"training epochs per run (default: {DEFAULT_EPOCHS})")
    add_device_option(demo, default="auto",
                      default_help="auto, which is CUDA when available, else CPU")
    demo.add_argument("--levels", type=choice_list(LEVEL_CHOICES), action="extend",
                      help=f"comma-separated, among {', '.join(LEVEL_CHOICES)} (O0 = fp32; "
                           "case does not matter); "
                           "default: fp32,O1,O2,O3 without O3-fp16. Given, every listed "
                           "level runs in every listed dtype")
    dtype_names = spelled(tuple(DTYPE_CHOICES), DTYPE_SPELLINGS)
    demo.add_argument("--dtypes", type=choice_list(tuple(DTYPE_CHOICES), DTYPE_SPELLINGS),
                      action="extend",
                      help=f"comma-separated, among {dtype_names} (any case; default: both); "
                           "fp16 runs use dynamic loss scaling")
    add_run_options(
        demo, out="ampkit-report", out_help="report folder, created if needed",
        overwrite_help="replace report files of the same names already in --out (without "
                       "it, the demo refuses to start when one is there; other files are "
                       "never touched)",
        seed_help="seed of the data split, the initial weights and the batch order",
        threads_help="CPU threads for torch's ops; one suits the demo's tiny convolutions "
                     "best, and stays fast when other programs keep the cores busy")
    demo.add_argument("--pure-bf16-steps", type=non_negative_int, default=100,
                      help="steps of the pure-bf16 curves (fp32, round-to-nearest, "
                           "stochastic rounding) of a tiny character GPT; 0 skips them "
                           "(default: 100, a few seconds)")
    demo.add_argument("--quiet", action="store_true",
                      help="no progress bars and no code listing: only the final table")
    return demo


class _ProgressBars:
    """One rich progress bar per run."""

    def __init__(self, progress: Any) -> None:
        self.progress = progress
        self.task: Any = None

    def run_started(self, config: RunConfig, total_steps: int) -> None:
        self.task = self.progress.add_task(config.name, total=total_steps, loss=float("nan"))

    def step_finished(self, config: RunConfig, step: int, loss: float) -> None:
        self.progress.update(self.task, completed=step, loss=loss)

    def run_finished(self, result: RunResult) -> None:
        self.progress.update(self.task, description=f"{result.name} "
                                                    f"(test acc {result.test_accuracy:.1%})")


def _run(settings: DemoSettings, quiet: bool) -> DemoResult:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    from ampkit.tools.demo.run import run_demo

    if quiet:
        return run_demo(settings)
    progress = Progress(TextColumn("{task.description:<24}"), BarColumn(),
                        MofNCompleteColumn(), TextColumn("steps  loss {task.fields[loss]:.4f}"),
                        TimeElapsedColumn(), console=Console(stderr=True))
    with progress:
        return run_demo(settings, _ProgressBars(progress))


def _print_summary(result: DemoResult, files: Any, quiet: bool, out: Console) -> None:
    from rich.syntax import Syntax

    from ampkit.common.text import TextTable
    from ampkit.tools.demo.report import COLUMN_NOTES, identical_runs, summary_table

    summary = summary_table(result)
    epochs = result.settings.epochs
    out.print(rich_table(
        TextTable.of(summary.columns, summary.rows),
        title=f"ampkit demo: digits CNN, {epochs} epoch{'' if epochs == 1 else 's'} per run "
              f"on {result.device} ({result.device_name})"))
    for same in identical_runs(result):
        out.print(same.sentence(), highlight=False)
    if quiet:
        return
    out.print(f"{COLUMN_NOTES} Peak memory: {result.memory_measure}.",
              style="dim", highlight=False)
    out.print(f"\nReport: {files.html} (plots: {files.folder}, data: {files.json.name})",
              highlight=False, soft_wrap=True)
    example = result.example_config
    if example is not None:
        out.print(f"\nThe {example.name} run's ampkit code ({TRAINING_CODE_CONTEXT}):",
                  highlight=False)
        out.print(Syntax(result.example_code(), "python", theme="ansi_dark",
                         background_color="default"))


def run(args: argparse.Namespace) -> int:
    """Carry out ``ampkit demo`` for parsed ``args``; return the exit status."""
    needs = missing_modules("sklearn", "matplotlib", "rich")
    if needs:
        return fail("demo", f"the demo {needs}", MISSING)
    try:
        resolve_device(args.device)
    except RuntimeError as error:
        return fail("demo", str(error), MISSING)
    from ampkit.tools.demo.report import report_file_names, write_report
    from ampkit.tools.pages.html import check_output_dir

    settings = DemoSettings(epochs=args.epochs, device=args.device, seed=args.seed,
                            pure_bf16_steps=args.pure_bf16_steps,
                            configurations=demo_configurations(args.levels, args.dtypes))
    names = report_file_names(settings)
    undo = folder_undo(args.out, names)  # a folder this run made goes if it fails
    try:
        check_output_dir(args.out, names, overwrite=args.overwrite)
    except OSError as error:
        undo()
        return fail("demo", str(error))
    import torch

    torch.set_num_threads(args.threads)
    try:
        result = _run(settings, args.quiet)
        files = write_report(result, args.out)
    except BaseException:
        undo()
        raise
    _print_summary(result, files, args.quiet, console())
    return 0
