"""``ampkit tune``: :func:`ampkit.tune` from the command line.

``ampkit tune TARGET --eval FN`` tunes the user's model: TARGET is an ``nn.Module`` or a
callable returning one, FN is ``eval_fn(model) -> number``, both as
``package.module:attribute`` (see :mod:`ampkit.tools.cli.target`). The search looks for
the policy that runs the most ops in ``--dtype`` (``bf16`` or ``fp16``; default
``bf16``) while the metric stays within ``--tolerance`` of float32's (absolute in the
metric's units; ``--relative``: a fraction of the float32 metric; a move either way
counts unless ``--higher-is-better`` or ``--lower-is-better`` says which way is bad),
in at most ``--budget`` trials (default 5), starting from every op in low precision or
from ``--start`` (a preset name).

Without TARGET it keeps its first behaviour: it trains the demo's small CNN
(:class:`~ampkit.tools.demo.digits.DigitsCNN`) on scikit-learn's digits in float32 for
``--epochs`` (default 1) and tunes with the test accuracy as the metric
(higher is better, default tolerance 0.005).

A progress bar counts the trials (``--quiet``: none); each trial's metric and the lists
found are printed; ``--out`` (default ``tuned-policy.json``) receives the policy,
loadable with ``ampkit.Policy.load``. An existing ``--out`` is replaced only with
``--overwrite``.

Exit status: 0 when a policy within tolerance was found, 3 when the search stopped
without one (the closest policy is still written), 2 for bad input (one line, see
:mod:`ampkit.tools.cli`), 1 for a missing optional dependency.

Example:
    >>> import argparse
    >>> from ampkit.tools.cli.tune import add_parser
    >>> commands = argparse.ArgumentParser().add_subparsers(dest="command")
    >>> args = add_parser(commands).parse_args(["mymodels:build", "--eval", "mymodels:acc",
    ...                                         "--dtype", "FP16"])
    >>> args.target, args.eval, args.dtype
    ('mymodels:build', 'mymodels:acc', torch.float16)
"""

from __future__ import annotations

import argparse
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

from ampkit.tools.accuracy.tune import MetricError
from ampkit.tools.cli.args import (
    MISSING,
    add_run_options,
    console,
    fail,
    low_dtype,
    missing_modules,
    number,
    positive_int,
)
from ampkit.tools.cli.target import TargetError, forward_error, model_factory, user_function

__all__ = ["NOT_WITHIN", "add_parser", "check_output_file", "run"]

#: Exit status when the search stopped without a policy within the tolerance.
NOT_WITHIN = 3

_DEMO_EPOCHS = 1
_DEMO_TOLERANCE = 0.005
_TARGET_TOLERANCE = 0.01


def _preset(text: str) -> str:
    from ampkit.policies.presets import available_policies

    if text not in available_policies():
        raise argparse.ArgumentTypeError(
            f"invalid choice: {text!r} (choose from {', '.join(available_policies())})")
    return text


def add_parser(commands: Any) -> argparse.ArgumentParser:
    """Add the ``tune`` subcommand to an argparse subparsers object; return it."""
    import torch

    tune: argparse.ArgumentParser = commands.add_parser(
        "tune", help="find the op lists that keep a model's metric in low precision",
        description="Search for the policy running the most ops in low precision whose "
                    "metric stays within --tolerance of float32's; print each trial and "
                    "write the policy. TARGET (package.module:attribute) is your "
                    "nn.Module or a callable returning one, and --eval your "
                    "eval_fn(model) -> number. Without TARGET: the demo's CNN on the "
                    "digits, trained in float32 for --epochs, with its test accuracy.")
    tune.add_argument("target", nargs="?", metavar="TARGET",
                      help="package.module:attribute of an nn.Module or a callable "
                           "returning one (imported from the current folder too); "
                           "default: the demo's CNN")
    tune.add_argument("--eval", metavar="FN",
                      help="package.module:attribute of eval_fn(model) -> number "
                           "(required with TARGET)")
    tune.add_argument("--dtype", type=low_dtype, default=torch.bfloat16,
                      help="bf16 or fp16 (default: bf16)")
    tune.add_argument("--tolerance", type=number,
                      help=f"largest move of the metric from float32's, in its units "
                           f"(default: {_TARGET_TOLERANCE} with TARGET; "
                           f"{_DEMO_TOLERANCE}, half a point of accuracy, without)")
    tune.add_argument("--relative", action="store_true",
                      help="read --tolerance as a fraction of the float32 metric")
    direction = tune.add_mutually_exclusive_group()
    direction.add_argument("--higher-is-better", dest="higher_is_better",
                           action="store_const", const=True,
                           help="only a drop counts (an accuracy; the default without "
                                "TARGET)")
    direction.add_argument("--lower-is-better", dest="higher_is_better",
                           action="store_const", const=False,
                           help="only a rise counts (a loss)")
    tune.add_argument("--budget", type=positive_int, default=5,
                      help="most trials (default: 5)")
    tune.add_argument("--start", type=_preset,
                      help="preset to start from (default: every op in low precision)")
    tune.add_argument("--epochs", type=positive_int,
                      help=f"without TARGET: float32 training epochs of the demo's CNN "
                           f"before tuning (default: {_DEMO_EPOCHS})")
    add_run_options(
        tune, out="tuned-policy.json", out_help="where the policy is written",
        overwrite_help="replace an existing --out (without it, tune refuses to start)",
        seed_help="torch's seed before TARGET is built (without TARGET: the digits' "
                  "split and the CNN's weights)")
    tune.add_argument("--quiet", action="store_true", help="no progress bar")
    return tune


def check_output_file(path: str, *, overwrite: bool) -> None:
    """Check, before any work, that the file ``path`` can be written: its folder exists
    and takes new files, and it is not there already (unless ``overwrite``).

    Raises:
        OSError: with a one-line message naming ``path``.

    Example:
        >>> import os, tempfile
        >>> from ampkit.tools.cli.tune import check_output_file
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     open(os.path.join(tmp, "p.json"), "w").close()
        ...     check_output_file(os.path.join(tmp, "p.json"), overwrite=False)
        ... # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        FileExistsError: ... already exists: pass --overwrite to replace it
    """
    target = Path(path)
    if target.is_dir():
        raise IsADirectoryError(f"cannot write the policy to {path!r}: it is a folder")
    if target.exists() and not overwrite:
        raise FileExistsError(f"cannot write the policy to {path!r}: it already exists: "
                              f"pass --overwrite to replace it")
    folder = target.parent
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".ampkit-write-check-"):
            pass
        if target.exists() and not os.access(target, os.W_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as error:
        raise type(error)(f"cannot write the policy to {path!r}: "
                          f"{error.strerror or error}") from None


def _train_demo_model(epochs: int, seed: int) -> tuple[Any, Any]:
    import torch
    import torch.nn.functional as F

    from ampkit.tools.demo.digits import DigitsCNN, batch_order, load_digits_data

    data = load_digits_data(seed, "cpu")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DigitsCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for epoch in batch_order(len(data.y_train), 64, epochs, seed):
        for index in epoch:
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(data.x_train[index]), data.y_train[index]).backward()
            optimizer.step()
    return model.eval(), data


def _is_metric(value: Any) -> bool:
    from ampkit.tools.accuracy.tune import metric_value

    try:
        metric_value(value, "--eval")
    except TypeError:
        return False
    return True


def _check_arguments(args: argparse.Namespace) -> str | None:
    if args.target is None:
        if args.eval is not None:
            return "--eval needs a TARGET (the model it evaluates)"
        return None
    if args.eval is None:
        return (f"TARGET {args.target!r} needs --eval FN: eval_fn(model) -> number, as "
                f"package.module:attribute")
    if args.epochs is not None:
        return ("--epochs trains the demo's CNN, and applies only without TARGET "
                "(train your model before tune sees it)")
    return None


def run(args: argparse.Namespace) -> int:
    """Carry out ``ampkit tune`` for parsed ``args``; return the exit status."""
    problem = _check_arguments(args)
    if problem:
        return fail("tune", problem)
    needs = missing_modules("rich", *(("sklearn",) if args.target is None else ()))
    if needs:
        return fail("tune", f"ampkit tune {needs}", MISSING)
    build = evaluate = None
    if args.target is not None:
        try:
            evaluate = user_function(args.eval, "--eval", (
                _is_metric, "a number or a one-element tensor"))
            build = model_factory(args.target)
        except TargetError as error:
            return fail("tune", str(error))
    try:
        check_output_file(args.out, overwrite=args.overwrite)
    except OSError as error:
        return fail("tune", str(error))
    import torch
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    import ampkit

    torch.set_num_threads(args.threads)
    out = console()
    if args.target is None:
        epochs = args.epochs or _DEMO_EPOCHS
        model, data = _train_demo_model(epochs, args.seed)

        def eval_fn(m: torch.nn.Module) -> float:
            with torch.no_grad():
                return float((m(data.x_test).argmax(1) == data.y_test).float().mean())

        metric_name = "test accuracy"
        about = f"{len(data.y_test)} held-out digits, {epochs} epoch(s) of training"
        higher = True if args.higher_is_better is None else args.higher_is_better
        tolerance = _DEMO_TOLERANCE if args.tolerance is None else args.tolerance
    else:
        assert build is not None and evaluate is not None
        torch.manual_seed(args.seed)
        try:
            model = build()
        except TargetError as error:
            return fail("tune", str(error))
        eval_fn = evaluate
        metric_name, about = "metric", f"{args.eval} on {args.target}"
        higher = args.higher_is_better
        tolerance = _TARGET_TOLERANCE if args.tolerance is None else args.tolerance

    def shown(value: float) -> str:
        return f"{value:.2%}" if args.target is None else f"{value:.6g}"

    def moved(value: float) -> str:
        return f"{100 * value:+.2f} points" if args.target is None else f"{value:+.4g}"

    progress = Progress(TextColumn("{task.description:<32}"), BarColumn(),
                        MofNCompleteColumn(), TextColumn("trials"),
                        console=Console(stderr=True), disable=args.quiet)
    dtype = str(args.dtype).removeprefix("torch.")
    lines: list[str] = []
    with progress:
        task = progress.add_task(f"tuning {dtype}", total=args.budget)

        def on_trial(t: ampkit.tools.Trial) -> None:
            progress.update(task, advance=1,
                            description=f"trial {t.index}: {metric_name} {shown(t.metric)}")
            lines.append(f"trial {t.index}: {metric_name} {shown(t.metric)} "
                         f"({moved(t.difference)}), "
                         f"{t.low_precision_share:.0%} of op calls in {dtype}, "
                         f"float32 ops: {', '.join(t.fp32_ops) or '-'}; most error added "
                         f"by: {', '.join(f'{op} {err:.2g}' for op, err in t.worst_ops)}"
                         + (f"; moving {t.moved} to float32" if t.moved else ""))

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ampkit.tools.TuneWarning)  # said below
                result = ampkit.tune(model, eval_fn, args.dtype, tolerance=tolerance,
                                     relative=args.relative, higher_is_better=higher,
                                     budget=args.budget, start=args.start,
                                     on_trial=on_trial)
        except MetricError as error:
            problem = f"--eval {args.eval!r}: {error}" if args.eval else str(error)
        except Exception as error:
            found = None if args.target is None else forward_error(error, model, args.target)
            if found is None:  # ampkit's own: its traceback is the report to file
                raise
            problem = str(found)
        else:
            problem = None
            progress.update(task, total=len(result.trials))
        if problem is not None:
            progress.live.transient = True  # the error line alone stays on the screen
            progress.remove_task(task)
    if problem is not None:
        return fail("tune", problem)
    direction = {True: "a drop", False: "a rise", None: "a move"}[higher]
    out.print(f"fp32 {metric_name} {shown(result.reference_metric)} ({about}); "
              f"tolerance: {direction} of at most {moved(result.tolerance).lstrip('+')}",
              highlight=False)
    for line in lines:
        out.print(line, highlight=False, soft_wrap=True)
    verdict = ("within tolerance" if result.within_tolerance
               else f"NOT within tolerance ({result.stop_reason}); the closest policy")
    out.print(f"\n{verdict}:\n{result.policy.describe()}", highlight=False)
    result.save(args.out)
    out.print(f"\npolicy written to {args.out} (load: ampkit.autocast(policy="
              f"ampkit.Policy.load({args.out!r})))", highlight=False, soft_wrap=True)
    return 0 if result.within_tolerance else NOT_WITHIN
