"""The ``ampkit`` command line (also ``python -m ampkit``).

``ampkit demo`` trains a small CNN on scikit-learn's digits in fp32 and at the AMP levels
(see :mod:`ampkit.tools.demo`), shows a progress bar per run, prints a summary table and
the ampkit lines of the O2 run, and writes a report folder (see :mod:`ampkit.tools.report`).
``ampkit tune`` searches op lists for the same model (see :mod:`ampkit.tools.cli_tune`).

Options of ``ampkit demo``:

* ``--levels``: comma-separated (or repeated) among ``fp32`` (alias ``O0``), ``O1``,
  ``O2``, ``O3``; ``--dtypes``: among ``bf16``, ``fp16``. Without ``--levels`` the runs are
  fp32, O1/O2/O3 in bf16 and O1/O2 in fp16; with it, every listed AMP level runs in every
  listed dtype (``--dtypes`` alone filters the default set). Case does not matter.
* ``--epochs`` (default 5), ``--seed`` (default 0), ``--device`` (``auto``, ``cpu``,
  ``cuda``, ``cuda:<index>``), ``--out`` (default ``./ampkit-report``).
* ``--threads`` (default 1): torch's CPU threads. The model is tiny (64 images of 8x8
  per step), so more threads only add synchronisation, and on cores that other programs
  keep busy they make each step many times slower.
* ``--quiet``: no progress bars and no code listing: only the final table.

Exit status: 0 on success; 2 for a bad option (argparse's message, listing the
choices); 1 for a one-line error about the machine (no CUDA GPU, an output folder that
cannot be written, a missing optional dependency), each reported before training
starts; 130 when interrupted.

Example:
    >>> from ampkit.tools.cli import build_parser
    >>> args = build_parser().parse_args(["demo", "--levels", "fp32,o2", "--dtypes", "fp16"])
    >>> args.levels, args.dtypes, args.epochs
    (['fp32', 'O2'], ['fp16'], 5)
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import ampkit
from ampkit.tools.demo import (
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

    from ampkit.tools.demo import DemoResult

__all__ = ["build_parser", "main"]

_PROG = "ampkit"
_DEVICE_CHOICES = "auto, cpu, cuda, cuda:<index>"


def _choice_list(accepted: Sequence[str]) -> Callable[[str], list[str]]:
    canonical = {choice.lower(): choice for choice in accepted}

    def parse(text: str) -> list[str]:
        chosen = []
        for item in (part.strip() for part in text.split(",")):
            if item.lower() not in canonical:
                raise argparse.ArgumentTypeError(
                    f"invalid choice: {item!r} (choose from {', '.join(accepted)})")
            chosen.append(canonical[item.lower()])
        return chosen

    parse.__name__ = "comma-separated list"
    return parse


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}")
    return value


def _device_name(text: str) -> str:
    try:
        resolve_device(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid choice: {text!r} (choose from {_DEVICE_CHOICES})") from None
    except RuntimeError:
        pass  # a valid name for a device this machine lacks: reported after parsing
    return text


def build_parser() -> argparse.ArgumentParser:
    """The ``ampkit`` argument parser (subcommand ``demo``; ``--version``).

    Example:
        >>> from ampkit.tools.cli import build_parser
        >>> build_parser().parse_args(["demo"]).out
        'ampkit-report'
    """
    import torch

    parser = argparse.ArgumentParser(
        prog=_PROG, description="ampkit: Automatic Mixed Precision for PyTorch.")
    parser.add_argument("--version", action="version",
                        version=f"ampkit {ampkit.__version__} (torch {torch.__version__})")
    commands = parser.add_subparsers(dest="command", metavar="{demo,tune}", required=True)
    demo = commands.add_parser(
        "demo", help="train a small CNN on scikit-learn's digits in fp32 and at each AMP "
                     "level, and write a report",
        description="Train the same small CNN on scikit-learn's digits (no download) once "
                    "per configuration, print a table and the ampkit code of the O2 run, "
                    "and write plots, an HTML page and JSON to --out.")
    demo.add_argument("--epochs", type=_positive_int, default=DEFAULT_EPOCHS,
                      help=f"training epochs per run (default: {DEFAULT_EPOCHS})")
    demo.add_argument("--device", type=_device_name, default="auto",
                      help=f"one of {_DEVICE_CHOICES} (default: auto, which is CUDA when "
                           "available, else CPU)")
    demo.add_argument("--levels", type=_choice_list(LEVEL_CHOICES), action="extend",
                      help=f"comma-separated, among {', '.join(LEVEL_CHOICES)} (O0 = fp32); "
                           "default: fp32,O1,O2,O3 without O3-fp16. Given, every listed "
                           "level runs in every listed dtype")
    demo.add_argument("--dtypes", type=_choice_list(tuple(DTYPE_CHOICES)), action="extend",
                      help=f"comma-separated, among {', '.join(DTYPE_CHOICES)} (default: "
                           "both); fp16 runs use dynamic loss scaling")
    demo.add_argument("--seed", type=_non_negative_int, default=0,
                      help="seed of the data split, the initial weights and the batch order "
                           "(default: 0)")
    demo.add_argument("--out", default="ampkit-report",
                      help="report folder, created if needed (default: ampkit-report)")
    demo.add_argument("--threads", type=_positive_int, default=1,
                      help="CPU threads for torch's ops; one suits the demo's tiny convolutions "
                           "best, and stays fast when other programs keep the cores busy "
                           "(default: 1)")
    demo.add_argument("--quiet", action="store_true",
                      help="no progress bars and no code listing: only the final table")
    from ampkit.tools import cli_tune  # ``ampkit tune``: its options live there

    cli_tune.add_parser(commands)
    return parser


def _fail(message: str) -> int:
    print(f"{_PROG} demo: error: {message}", file=sys.stderr)
    return 1


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

    from ampkit.tools.demo import run_demo

    if quiet:
        return run_demo(settings)
    progress = Progress(TextColumn("{task.description:<24}"), BarColumn(),
                        MofNCompleteColumn(), TextColumn("steps  loss {task.fields[loss]:.4f}"),
                        TimeElapsedColumn(), console=Console(stderr=True))
    with progress:
        return run_demo(settings, _ProgressBars(progress))


def _print_summary(result: DemoResult, files: Any, quiet: bool, console: Console) -> None:
    from rich.syntax import Syntax
    from rich.table import Table

    from ampkit.tools.report import COLUMN_NOTES, summary_table

    summary = summary_table(result)
    epochs = result.settings.epochs
    table = Table(title=f"ampkit demo: digits CNN, {epochs} epoch{'' if epochs == 1 else 's'} "
                        f"per run on {result.device} ({result.device_name})")
    for i, column in enumerate(summary.columns):
        table.add_column(column, justify="left" if i == 0 else "right", no_wrap=True)
    for row in summary.rows:
        table.add_row(*row)
    console.print(table)
    if quiet:
        return
    console.print(f"{COLUMN_NOTES} Peak memory: {result.memory_measure}.",
                  style="dim", highlight=False)
    console.print(f"\nReport: {files.html} (plots: {files.folder}, data: {files.json.name})",
                  highlight=False, soft_wrap=True)
    example = result.example_config
    if example is not None:
        console.print(f"\nThe {example.name} run's ampkit code ({TRAINING_CODE_CONTEXT}):",
                      highlight=False)
        console.print(Syntax(result.example_code(), "python", theme="ansi_dark",
                             background_color="default"))


def _demo(args: argparse.Namespace) -> int:
    missing = [name for name in ("sklearn", "matplotlib", "rich")
               if importlib.util.find_spec(name) is None]
    if missing:
        packages = {"sklearn": "scikit-learn"}
        return _fail(f"the demo needs {', '.join(packages.get(m, m) for m in missing)}: "
                     f"pip install 'ampkit[demo]'")
    try:
        resolve_device(args.device)
    except RuntimeError as error:
        return _fail(str(error))
    from ampkit.tools.report import check_output_dir, write_report

    try:
        check_output_dir(args.out)
    except OSError as error:
        return _fail(str(error))
    import torch

    torch.set_num_threads(args.threads)
    settings = DemoSettings(epochs=args.epochs, device=args.device, seed=args.seed,
                            configurations=demo_configurations(args.levels, args.dtypes))
    from rich.console import Console

    # Off a terminal (a pipe, a log file) rich would wrap the table at 80 columns.
    console = Console() if sys.stdout.isatty() else Console(width=160)
    result = _run(settings, args.quiet)
    files = write_report(result, args.out)
    _print_summary(result, files, args.quiet, console)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``ampkit`` command with ``argv`` (default: ``sys.argv[1:]``) and return
    its exit status. Bad options exit through argparse (status 2).

    Example:
        >>> from ampkit.tools.cli import main
        >>> main(["demo", "--device", "tpu"])
        Traceback (most recent call last):
        ...
        SystemExit: 2
    """
    args = build_parser().parse_args(argv)
    try:
        if args.command == "demo":
            return _demo(args)
        if args.command == "tune":
            from ampkit.tools import cli_tune

            return cli_tune.run(args)
    except KeyboardInterrupt:
        print(f"{_PROG}: interrupted", file=sys.stderr)
        return 130
    raise AssertionError(f"unhandled command {args.command!r}")  # argparse enforces choices

