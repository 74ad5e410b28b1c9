"""``ampkit compare``: :func:`ampkit.compare` on the user's model from the command line.

``ampkit compare TARGET --inputs FN`` builds the model (TARGET: an ``nn.Module`` or a
callable returning one) and its inputs (FN: a callable returning the forward's
arguments), both as ``package.module:attribute`` (see :mod:`ampkit.tools.cli.target`),
runs it in float32 and under ``--precision`` (a level ``O1``-``O3``, a preset name, or
a policy file written by ``ampkit tune`` / ``Policy.save``; default ``torch``, native
autocast's lists) or as ``--config FILE`` says (an :class:`ampkit.AmpConfig` file: the
model prepared as ``initialize(config=...)`` prepares it, fp8 layers included) in
``--dtype``, with ``--custom-white-list`` / ``--custom-black-list`` added (with
``--config`` these and ``--dtype`` must agree with it), and ``--loss-fn`` for
gradients, on ``--device`` (default: where TARGET and ``--inputs`` put them). Every
other :class:`ampkit.AmpConfig` field is a flag too (``--level``, ``--keep-fp32-modules``,
``--master-weights``, ...: made from the fields, with their help); given, they make
the config (or, with ``--config``, must agree with it). With
``--fp8 RECIPE`` (``tensorwise``, ``rowwise``, ``rowwise_with_gw_hp``; needs
``ampkit[fp8]``) every Linear that can run in fp8 is also measured alone in fp8 and in
``--dtype`` against float32
(:attr:`Comparison.fp8_layers <ampkit.tools.accuracy.compare.Comparison.fp8_layers>`): a table
of its own, printed and in the HTML report, and a ``fp8_layers`` key in
``compare.json``. It prints :meth:`Comparison.summary
<ampkit.tools.accuracy.compare.Comparison.summary>` (what ``Comparison.table()`` holds, its
tables drawn with rich) and writes the HTML report, its two plots and
``compare.json`` into ``--out`` (default ``compare-report``); report files already
there are replaced only with ``--overwrite``, and no other file is touched.
While the model runs, a progress bar per run (its op calls so far, of the float32
run's count) is drawn on stderr; ``--quiet`` hides them, and there are none when stderr
is not a terminal.

Exit status: 0 on success, 2 for bad input or the user's code failing (one line, see
:mod:`ampkit.tools.cli`; a folder ``--out`` made is removed again), 1 for a missing
optional dependency (matplotlib draws the plots) or device.

Example:
    >>> import argparse
    >>> from ampkit.tools.cli.compare import add_parser
    >>> commands = argparse.ArgumentParser().add_subparsers(dest="command")
    >>> args = add_parser(commands).parse_args(
    ...     ["models:build", "--inputs", "models:batch", "--precision", "o2",
    ...      "--custom-black-list", "softmax,layer_norm"])
    >>> args.precision, args.custom_black_list, args.out
    ('O2', ['softmax', 'layer_norm'], 'compare-report')
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ampkit.tools.cli.args import (
    MISSING,
    add_config_options,
    add_device_option,
    add_run_options,
    config_file,
    config_flag,
    config_from_args,
    console,
    fail,
    folder_undo,
    fp8_recipe,
    known_import_noise_silenced,
    low_dtype,
    missing_modules,
    number,
    positive_int,
    print_parts,
)
from ampkit.tools.cli.target import (
    TargetError,
    forward_error,
    inputs_factory,
    model_factory,
    user_function,
)
from ampkit.torch_internals import tree_map

__all__ = ["add_parser", "run"]

_LEVELS = ("O1", "O2", "O3")
# AmpConfig's fields that compare has flags of its own for (their meaning with --config
# is compare's: see the module's docstring)
_OWN_CONFIG_FLAGS = ("dtype", "fp8", "custom_white_list", "custom_black_list")


def _precision(text: str) -> Any:
    """A level, a preset name, or the path of a policy file (read with Policy.load)."""
    from ampkit.policies.policy import Policy
    from ampkit.policies.presets import available_policies

    if text.upper() in _LEVELS:
        return text.upper()
    if text in available_policies():
        return text
    if Path(text).is_file():
        try:
            return Policy.load(text)
        except (OSError, ValueError, TypeError, KeyError) as error:
            raise argparse.ArgumentTypeError(
                f"cannot read the policy file {text!r}: {type(error).__name__}: "
                f"{' '.join(str(error).split())}") from None
    raise argparse.ArgumentTypeError(
        f"invalid choice: {text!r} (choose from a level, {', '.join(_LEVELS)}; a preset, "
        f"{', '.join(available_policies())}; or a policy file such as ampkit tune writes)")


def _op_list(text: str) -> list[str]:
    from ampkit.policies.registry import resolve_op

    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"must name at least one op, got {text!r}")
    for name in names:
        try:
            resolve_op(name, argument="op")
        except (ValueError, TypeError) as error:
            raise argparse.ArgumentTypeError(str(error).removeprefix("op: ")) from None
    return names


def add_parser(commands: Any) -> argparse.ArgumentParser:
    """Add the ``compare`` subcommand to an argparse subparsers object; return it."""
    compare: argparse.ArgumentParser = commands.add_parser(
        "compare", help="run your model in fp32 and in low precision, op by op, and "
                        "report where they diverge",
        description="Run TARGET (package.module:attribute of an nn.Module or a callable "
                    "returning one) on the inputs --inputs returns, in float32 and under "
                    "--precision; print the ops and modules that added the most error and "
                    "write an HTML report and JSON to --out.")
    compare.add_argument("target", metavar="TARGET",
                         help="package.module:attribute of an nn.Module or a callable "
                              "returning one (imported from the current folder too)")
    compare.add_argument("--inputs", metavar="FN", required=True,
                         help="package.module:attribute of a callable returning the "
                              "forward's inputs (a tuple: the positional arguments)")
    how = compare.add_mutually_exclusive_group()
    how.add_argument("--precision", type=_precision, default="torch",
                     help="a level (O1, O2, O3), a preset (torch, conservative, ...) or "
                          "a policy file (default: torch, native autocast's lists)")
    how.add_argument("--config", type=config_file, metavar="FILE",
                     help="an ampkit.AmpConfig file (.json, .yaml, .yml): the model is "
                          "converted as initialize(config=...) converts it (its level, "
                          "dtype, policy, lists, kept modules, fp8); --dtype, --fp8 and the "
                          "lists given too must agree with it or add to it")
    compare.add_argument("--dtype", type=low_dtype,
                         help="bf16 or fp16 (default: the policy's, else the device's "
                              "autocast default: bf16 on CPU, fp16 on CUDA)")
    compare.add_argument("--custom-white-list", type=_op_list, action="extend",
                         metavar="OPS", help="comma-separated ops to run in low precision too")
    compare.add_argument("--custom-black-list", type=_op_list, action="extend",
                         metavar="OPS", help="comma-separated ops to keep in float32")
    compare.add_argument("--loss-fn", metavar="FN",
                         help="package.module:attribute of loss_fn(output) -> scalar tensor; "
                              "given, gradients are compared too")
    compare.add_argument("--fp8", type=fp8_recipe, metavar="RECIPE",
                         help="also measure each fp8-capable Linear alone in fp8 with this "
                              "torchao recipe (tensorwise, rowwise, rowwise_with_gw_hp), "
                              "against float32 and --dtype; needs ampkit[fp8]")
    compare.add_argument("--threshold", type=number,
                         help="relative error that counts as diverged (default: 8 machine "
                              "epsilons of the dtype)")
    compare.add_argument("--limit", type=positive_int, default=20,
                         help="rows per table printed (default: 20; the report has all)")
    compare.add_argument("--quiet", action="store_true",
                         help="no progress bars (there are none either when stderr is "
                              "not a terminal)")
    add_device_option(compare, default=None,
                      default_help="where TARGET and --inputs put the model and tensors")
    # every other AmpConfig field, as a flag (--level, --keep-fp32-modules, ...); these
    # four are compare's own flags above
    add_config_options(compare, skip=_OWN_CONFIG_FLAGS)
    add_run_options(
        compare, out="compare-report", out_help="report folder, created if needed",
        overwrite_help="replace report files of the same names already in --out",
        seed_help="torch's seed before TARGET and --inputs are built")
    return compare


def run(args: argparse.Namespace) -> int:
    """Carry out ``ampkit compare`` for parsed ``args``; return the exit status."""
    needs = missing_modules("matplotlib", "rich")
    if needs:
        return fail("compare", f"ampkit compare {needs}", MISSING)
    if args.device is not None:
        from ampkit.tools.demo.run import resolve_device

        try:
            resolve_device(args.device)
        except RuntimeError as error:
            return fail("compare", str(error), MISSING)
    try:
        own = {name: getattr(args, name) for name in _OWN_CONFIG_FLAGS if name != "fp8"}
        config = config_from_args(args, args.config, own)
    except ValueError as error:
        return fail("compare", " ".join(str(error).split()))
    if config is not args.config:  # the config's fields given as flags made one
        if args.precision != "torch":
            return fail("compare", "--precision and the config's flags both choose the "
                                   "precision; give the level with --level")
        args.config = config
    if args.config is not None:
        problem = _against_config(args)
        if problem:
            return fail("compare", problem)
    if args.fp8 is not None:
        from ampkit.fp8.recipe import require_torchao

        try:
            with known_import_noise_silenced():
                require_torchao()
        except ImportError as error:
            return fail("compare", f"--fp8: {error}", MISSING)
    try:
        loss_fn = (None if args.loss_fn is None else
                   user_function(args.loss_fn, "--loss-fn", (_is_loss, "a one-element tensor")))
        make_inputs = inputs_factory(args.inputs)
        build = model_factory(args.target)
    except TargetError as error:
        return fail("compare", str(error))
    from ampkit.tools.accuracy.compare_report import REPORT_FILES
    from ampkit.tools.pages.html import check_output_dir

    undo = folder_undo(args.out, REPORT_FILES)  # nothing this run made outlives a failure
    try:
        check_output_dir(args.out, REPORT_FILES, overwrite=args.overwrite)
    except OSError as error:
        undo()
        return fail("compare", str(error))
    try:
        status = _compare(args, build, make_inputs, loss_fn)
    except BaseException:
        undo()
        raise
    if status:
        undo()
    return status


def _against_config(args: argparse.Namespace) -> str | None:
    """What --fp8 says against the --config file, if they disagree (a recipe to
    measure: one the config holds, or any where it holds none), in the one wording of
    a contradiction. --dtype and the lists are part of the config (config_from_args)."""
    from ampkit.config import contradiction

    held = args.config.fp8
    if args.fp8 is None or held is None or str(args.fp8).lower() == held:
        return None
    return contradiction(f"{config_flag('fp8')} {args.fp8}", "fp8", held)


class _ProgressBars:
    """A rich progress bar per run of :func:`ampkit.compare`, on stderr, counting its
    watched op calls (the float32 run's count is the low-precision run's total); none
    with ``--quiet`` or where stderr is not a terminal (a log file gets no bars)."""

    def __init__(self, quiet: bool) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        err = Console(stderr=True)
        self.progress = Progress(TextColumn("{task.description:<18}"), BarColumn(),
                                 MofNCompleteColumn(), TextColumn("op calls"),
                                 TimeElapsedColumn(), console=err,
                                 disable=quiet or not err.is_terminal)
        self._tasks: dict[str, Any] = {}

    def update(self, run: str, done: int, total: int | None) -> None:
        task = self._tasks.get(run)
        if task is None:
            task = self._tasks[run] = self.progress.add_task(f"{run} run", total=total)
        shown = done if total is None else min(done, total)  # a run may call more ops
        self.progress.update(task, completed=shown, total=total or done)


def _is_loss(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor) and value.numel() == 1


def _compare(args: argparse.Namespace, build: Any, make_inputs: Any, loss_fn: Any) -> int:
    import torch

    import ampkit

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    try:
        model = build()
        inputs = make_inputs()
    except TargetError as error:
        return fail("compare", str(error))
    if args.device is not None:
        from ampkit.tools.demo.run import resolve_device

        device = resolve_device(args.device)
        model = model.to(device)
        inputs = tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t,
                          inputs)
    precision = args.precision if args.config is None else args.config
    from ampkit.tools.accuracy.compare import check_settings

    try:  # what compare refuses before it runs the model is bad input, said in one line
        check_settings(model, precision=precision, dtype=args.dtype,
                       custom_white_list=args.custom_white_list,
                       custom_black_list=args.custom_black_list, threshold=args.threshold,
                       fp8=args.fp8)
    except (ValueError, TypeError) as error:
        return fail("compare", " ".join(str(error).split()))
    except RuntimeError as error:  # the machine: this CPU or GPU lacks the fp8 kernel
        return fail("compare", " ".join(str(error).split()), MISSING)
    from ampkit.tools.accuracy.compare import NothingToCompareError

    bars = _ProgressBars(args.quiet)
    try:
        with bars.progress:
            report = ampkit.compare(model, *inputs, precision=precision, dtype=args.dtype,
                                    custom_white_list=args.custom_white_list,
                                    custom_black_list=args.custom_black_list,
                                    loss_fn=loss_fn, threshold=args.threshold,
                                    fp8=args.fp8, progress=bars.update)
    except NothingToCompareError as error:  # what TARGET and --inputs gave
        return fail("compare", f"TARGET {args.target!r} on --inputs {args.inputs!r}: "
                               f"{' '.join(str(error).split())}")
    except (Exception, SystemExit) as error:  # SystemExit: sys.exit() in the forward
        found = forward_error(error, model, args.target)
        if found is None:  # ampkit's own: its traceback is the report to file
            raise
        return fail("compare", str(found))
    out = console()
    print_parts(out, report.summary(limit=args.limit))
    page = report.write_report(args.out)
    out.print(f"\nReport: {page} (plots beside it; data: {page.with_suffix('.json').name})",
              highlight=False, soft_wrap=True)
    return 0
