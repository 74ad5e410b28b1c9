"""The ``ampkit`` command line (also ``python -m ampkit``).

* ``ampkit demo`` trains a small CNN on scikit-learn's digits in fp32 and at the AMP
  levels (see :mod:`ampkit.tools.demo.run`), shows a progress bar per run, prints a
  summary table and the ampkit lines of the O2 run, and writes a report folder (see
  :mod:`ampkit.tools.demo.report`; the command: :mod:`ampkit.tools.cli.demo`).
* ``ampkit compare TARGET --inputs FN`` runs the user's model in fp32 and in low
  precision and reports op by op (see :mod:`ampkit.tools.cli.compare`).
* ``ampkit tune [TARGET --eval FN]`` searches the op lists that keep a metric within a
  tolerance; without TARGET, on the demo's CNN (see :mod:`ampkit.tools.cli.tune`).
* ``ampkit plan TARGET --inputs FN --world-size N --parallel LAYOUT`` sizes a training
  step's memory per rank for every precision mode on fake tensors (see
  :mod:`ampkit.tools.cli.plan`).

TARGET and FN are ``package.module:attribute`` references, imported with the current
folder on ``sys.path`` (see :mod:`ampkit.tools.cli.target`).

Options of ``ampkit demo``:

* ``--levels``: comma-separated (or repeated) among ``fp32`` (alias ``O0``), ``O1``,
  ``O2``, ``O3``; ``--dtypes``: among ``bf16`` (or ``bfloat16``), ``fp16`` (or
  ``float16``, ``half``). Without ``--levels`` the runs are
  fp32, O1/O2/O3 in bf16 and O1/O2 in fp16; with it, every listed AMP level runs in every
  listed dtype (``--dtypes`` alone filters the default set). Case does not matter.
* ``--epochs`` (default 5), ``--seed`` (default 0, at most 2**32 - 1), ``--device``
  (``auto``, ``cpu``, ``cuda``, ``cuda:<index>``), ``--out`` (default ``./ampkit-report``).
* ``--overwrite``: replace files of the report's names already in ``--out``. Without
  it the demo refuses to start when one is there. It never deletes a file, and never
  touches a file of another name.
* ``--threads`` (default 1): torch's CPU threads. The model is tiny (64 images of 8x8
  per step), so more threads only add synchronisation, and on cores that other programs
  keep busy they make each step many times slower.
* ``--quiet``: no progress bars and no code listing: only the final table.

Exit status of every command: 0 on success; 2 for bad input (an unknown option or
choice, a number out of range, a TARGET that does not import or is of the wrong kind,
an empty, unwritable or occupied ``--out``), reported on one line before any work,
and for the user's own code failing (a factory, ``--inputs``, ``--eval``,
``--loss-fn`` or the model's forward raising, or returning the wrong kind of value; a
NaN float32 metric in ``tune``), one line naming the function, the exception and the
user's line it came from, without a traceback; 1 for what the machine lacks (no CUDA
GPU, a missing optional dependency); 3 when ``ampkit tune`` found no policy within the
tolerance; 130 when interrupted. A command that fails removes the ``--out`` folders it
made (never a folder that was there, nor a file of another name).

Example:
    >>> from ampkit.tools.cli import build_parser
    >>> args = build_parser().parse_args(["demo", "--levels", "fp32,o2", "--dtypes",
    ...                                   "float16,BFloat16"])
    >>> args.levels, args.dtypes, args.epochs
    (['fp32', 'O2'], ['fp16', 'bf16'], 5)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import ampkit
from ampkit.tools.cli import compare as compare_command
from ampkit.tools.cli import demo as demo_command
from ampkit.tools.cli import plan as plan_command
from ampkit.tools.cli import tune as tune_command
from ampkit.tools.cli.args import PROG, Parser

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The ``ampkit`` argument parser (subcommands ``demo``, ``compare``, ``tune``, ``plan``;
    ``--version``).

    Example:
        >>> from ampkit.tools.cli import build_parser
        >>> build_parser().parse_args(["demo"]).out
        'ampkit-report'
    """
    import torch

    parser = Parser(
        prog=PROG, description="ampkit: Automatic Mixed Precision for PyTorch.")
    parser.add_argument("--version", action="version",
                        version=f"ampkit {ampkit.__version__} (torch {torch.__version__})")
    commands = parser.add_subparsers(dest="command", metavar="{demo,compare,tune,plan}",
                                     required=True)
    demo_command.add_parser(commands)
    compare_command.add_parser(commands)
    tune_command.add_parser(commands)
    plan_command.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``ampkit`` command with ``argv`` (default: ``sys.argv[1:]``) and return
    its exit status. Bad options exit through argparse (status 2, one line).

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
            return demo_command.run(args)
        if args.command == "compare":
            return compare_command.run(args)
        if args.command == "tune":
            return tune_command.run(args)
        if args.command == "plan":
            return plan_command.run(args)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    raise AssertionError(f"unhandled command {args.command!r}")  # argparse enforces choices
