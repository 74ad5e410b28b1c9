"""``ampkit tune``: :func:`ampkit.tune` on the demo's model and data.

Trains the demo's small CNN (:class:`~ampkit.tools.demo.DigitsCNN`) on scikit-learn's
digits in float32 for ``--epochs`` (default 1), then searches for the policy that runs
the most ops in ``--dtype`` (``bf16`` or ``fp16``; default ``bf16``) while the test
accuracy stays within ``--tolerance`` of float32's (absolute, in accuracy points on a
0-1 scale, default 0.005; only a drop counts), in at most ``--budget`` trials
(default 5). A progress bar counts the trials (``--quiet``: none); each trial's accuracy
and the lists found are printed; ``--out`` (default ``tuned-policy.json``) receives the
policy, loadable with ``ampkit.Policy.load`` and ``ampkit.autocast(policy=...)``.

Runs on the CPU with one torch thread (``--threads``). Exit status: 0 when a policy
within tolerance was found, 3 when the search stopped without one (the closest policy
is still written), 1 for a missing optional dependency or an unwritable ``--out``, 2
for a bad option.

Example:
    >>> import argparse
    >>> from ampkit.tools.cli_tune import add_parser
    >>> commands = argparse.ArgumentParser().add_subparsers(dest="command")
    >>> add_parser(commands).parse_args(["--dtype", "fp16"]).dtype
    torch.float16
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from typing import Any

from ampkit.tools.cli import _positive_int

__all__ = ["add_parser", "run"]

_NOT_WITHIN = 3


def _dtype(text: str) -> Any:
    from ampkit.policy import as_dtype

    try:
        return as_dtype(text.lower(), allow_none=False)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid choice: {text!r} (choose from bf16, fp16)") from None


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def add_parser(commands: Any) -> argparse.ArgumentParser:
    """Add the ``tune`` subcommand to an argparse subparsers object; return it."""
    import torch

    tune = commands.add_parser(
        "tune", help="find the op lists that keep the demo CNN's accuracy in low precision",
        description="Train the demo's CNN on the digits in float32, then search for the "
                    "policy running the most ops in low precision within --tolerance of "
                    "the float32 test accuracy; print each trial and write the policy.")
    tune.add_argument("--dtype", type=_dtype, default=torch.bfloat16,
                      help="bf16 or fp16 (default: bf16)")
    tune.add_argument("--epochs", type=_positive_int, default=1,
                      help="float32 training epochs before tuning (default: 1)")
    tune.add_argument("--tolerance", type=_number, default=0.005,
                      help="largest accuracy drop allowed, absolute on a 0-1 scale "
                           "(default: 0.005, half a point)")
    tune.add_argument("--budget", type=_positive_int, default=5,
                      help="most trials (default: 5)")
    tune.add_argument("--seed", type=int, default=0, help="data split and weights (default: 0)")
    tune.add_argument("--out", default="tuned-policy.json",
                      help="where the policy is written (default: tuned-policy.json)")
    tune.add_argument("--threads", type=_positive_int, default=1,
                      help="torch CPU threads (default: 1)")
    tune.add_argument("--quiet", action="store_true", help="no progress bar")
    return tune


def _fail(message: str) -> int:
    print(f"ampkit tune: error: {message}", file=sys.stderr)
    return 1


def _train(epochs: int, seed: int) -> tuple[Any, Any]:
    import torch
    import torch.nn.functional as F

    from ampkit.tools.demo import DigitsCNN, _batch_order, load_digits_data

    data = load_digits_data(seed, "cpu")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DigitsCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for epoch in _batch_order(len(data.y_train), 64, epochs, seed):
        for index in epoch:
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(data.x_train[index]), data.y_train[index]).backward()
            optimizer.step()
    return model.eval(), data


def run(args: argparse.Namespace) -> int:
    """Carry out ``ampkit tune`` for parsed ``args``; return the exit status."""
    missing = [name for name in ("sklearn", "rich")
               if importlib.util.find_spec(name) is None]
    if missing:
        return _fail(f"ampkit tune needs {', '.join(missing)}: pip install 'ampkit[demo]'")
    import torch
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    import ampkit

    try:
        with open(args.out, "a", encoding="utf-8"):
            pass
    except OSError as error:
        return _fail(f"cannot write the policy to {args.out!r}: {error.strerror or error}")
    torch.set_num_threads(args.threads)
    console = Console() if sys.stdout.isatty() else Console(width=160)
    model, data = _train(args.epochs, args.seed)

    def accuracy(m: torch.nn.Module) -> float:
        with torch.no_grad():
            return float((m(data.x_test).argmax(1) == data.y_test).float().mean())

    progress = Progress(TextColumn("{task.description:<32}"), BarColumn(),
                        MofNCompleteColumn(), TextColumn("trials"),
                        console=Console(stderr=True), disable=args.quiet)
    dtype = str(args.dtype).removeprefix("torch.")
    lines: list[str] = []
    with progress:
        task = progress.add_task(f"tuning {dtype}", total=args.budget)

        def on_trial(t: ampkit.tools.Trial) -> None:
            progress.update(task, advance=1,
                            description=f"trial {t.index}: accuracy {t.metric:.1%}")
            lines.append(f"trial {t.index}: accuracy {t.metric:.2%} "
                         f"({100 * t.difference:+.2f} points), "
                         f"{t.low_precision_share:.0%} of op calls in {dtype}, "
                         f"float32 ops: {', '.join(t.fp32_ops) or '-'}; most error added "
                         f"by: {', '.join(f'{op} {err:.2g}' for op, err in t.worst_ops)}"
                         + (f"; moving {t.moved} to float32" if t.moved else ""))

        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ampkit.tools.TuneWarning)  # said below
            result = ampkit.tune(model, accuracy, args.dtype, tolerance=args.tolerance,
                                 higher_is_better=True, budget=args.budget,
                                 on_trial=on_trial)
        progress.update(task, total=len(result.trials))
    console.print(f"fp32 test accuracy {result.reference_metric:.2%} "
                  f"({len(data.y_test)} held-out digits, {args.epochs} epoch(s) of training); "
                  f"tolerance: a drop of at most {100 * result.tolerance:.2f} points",
                  highlight=False)
    for line in lines:
        console.print(line, highlight=False)
    verdict = ("within tolerance" if result.within_tolerance
               else f"NOT within tolerance ({result.stop_reason}); the closest policy")
    console.print(f"\n{verdict}:\n{result.policy.describe()}", highlight=False)
    result.save(args.out)
    console.print(f"\npolicy written to {args.out} (load: ampkit.autocast(policy="
                  f"ampkit.Policy.load({args.out!r})))", highlight=False, soft_wrap=True)
    return 0 if result.within_tolerance else _NOT_WITHIN
