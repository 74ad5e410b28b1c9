"""``ampkit plan``: :func:`ampkit.plan` from the command line.

``ampkit plan TARGET --inputs FN --world-size N --parallel fsdp2`` sizes one training
step per rank for each precision mode (``--modes``, comma-separated; default all, see
:data:`ampkit.tools.plan.MODES`), on fake tensors: TARGET (a callable returning the
fp32 ``nn.Module``, as ``package.module:attribute``) and FN (returning the forward's
inputs) are called inside the planner's fake mode, so nothing of the model's size is
allocated. It prints the table (rich). With ``--device-memory 80GiB`` it also says
which modes fit and, when FN takes a ``batch`` argument, the largest batch each
fitting mode allows (by doubling then bisection, up to ``--max-batch``). ``--batch``
passes a batch to FN for the table itself. ``--json OUT`` writes the plan (and the
batches) as JSON; ``--html OUT`` a page with the table and a bar per mode of its
breakdown.

Exit status: 0 on success; 2 for bad input or the user's code failing (one line, see
:mod:`ampkit.tools.cli`); 1 for a missing optional dependency (rich).

Example:
    >>> import argparse
    >>> from ampkit.tools.cli.plan import add_parser
    >>> commands = argparse.ArgumentParser().add_subparsers(dest="command")
    >>> args = add_parser(commands).parse_args(
    ...     ["models:build", "--inputs", "models:batch", "--world-size", "64",
    ...      "--parallel", "fsdp2", "--modes", "O2,pure-kahan", "--device-memory", "80GiB"])
    >>> args.world_size, args.modes, args.device_memory
    (64, ['O2', 'pure-kahan'], 85899345920)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ampkit.tools.cli.args import (
    MISSING,
    console,
    fail,
    missing_modules,
    positive_int,
    rich_table,
)
from ampkit.tools.cli.target import (
    TargetError,
    call_user,
    load_callable,
    model_factory,
)

__all__ = ["add_parser", "run"]


def _modes(text: str) -> list[str]:
    from ampkit.tools.plan.setup import MODES

    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [n for n in names if n not in MODES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"invalid mode(s) {unknown or text!r} (choose from {', '.join(MODES)})")
    return names


def _parallel(text: str) -> str:
    from ampkit.tools.plan.setup import check_parallel

    try:
        check_parallel(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def _memory(text: str) -> int:
    from ampkit.tools.plan.report import parse_bytes

    try:
        value = parse_bytes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
    return value


def add_parser(commands: Any) -> argparse.ArgumentParser:
    """Add the ``plan`` subcommand to an argparse subparsers object; return it."""
    from ampkit.tools.plan.setup import LAYOUTS, OPTIMIZERS

    plan: argparse.ArgumentParser = commands.add_parser(
        "plan", help="size a training step's memory per rank for every precision mode, "
                     "on fake tensors",
        description="Run one training step of TARGET on fake tensors, for each precision "
                    "mode, under a fake process group of --world-size ranks, and print "
                    "the bytes per rank: parameters, gradients, optimizer state, "
                    "activations and the step's peak.")
    plan.add_argument("target", metavar="TARGET",
                      help="package.module:attribute of a callable returning the fp32 "
                           "nn.Module (called inside the planner's fake mode)")
    plan.add_argument("--inputs", metavar="FN", required=True,
                      help="package.module:attribute of a callable returning the forward's "
                           "inputs (a tuple: positional arguments; a dict: keywords); with "
                           "a batch argument, --device-memory finds the largest batch")
    plan.add_argument("--world-size", type=positive_int, default=1,
                      help="ranks of the simulated job (default: 1)")
    plan.add_argument("--parallel", type=_parallel, default="none",
                      help=f"parallel layout: {', '.join(LAYOUTS)} (default: none)")
    plan.add_argument("--shard-size", type=positive_int,
                      help="with --parallel hsdp: the ranks that shard one replica")
    plan.add_argument("--modes", type=_modes, help="comma-separated modes (default: all)")
    plan.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adamw",
                      help="the optimizer (default: adamw)")
    plan.add_argument("--device-policy", choices=("cuda", "cpu"), default="cuda",
                      help="whose autocast lists apply (default: cuda)")
    plan.add_argument("--batch", type=positive_int,
                      help="passed to FN as batch= for the table")
    plan.add_argument("--loss-fn", metavar="FN",
                      help="package.module:attribute of loss_fn(output) -> scalar tensor "
                           "(default: the output's .loss, else the mean of its floats)")
    plan.add_argument("--device-memory", type=_memory, metavar="SIZE",
                      help="memory of one device (80GiB, 40GB, bytes): say which modes fit "
                           "and the largest batch of each")
    plan.add_argument("--max-batch", type=positive_int, default=4096,
                      help="the largest batch searched with --device-memory (default: 4096)")
    plan.add_argument("--json", metavar="OUT", help="write the plan as JSON to OUT")
    plan.add_argument("--html", metavar="OUT", help="write an HTML page to OUT")
    return plan


def _check_out(path: str | None, option: str) -> str | None:
    if path is None:
        return None
    parent = Path(path).resolve().parent
    if not parent.is_dir():
        return f"{option} {path!r}: folder {str(parent)!r} does not exist"
    if Path(path).is_dir():
        return f"{option} {path!r} is a folder; give a file name"
    return None


def run(args: argparse.Namespace) -> int:
    """Carry out ``ampkit plan`` for parsed ``args``; return the exit status."""
    from ampkit.tools.cli.target import UserCodeError
    from ampkit.tools.plan import largest_batch, plan
    from ampkit.tools.plan.report import format_bytes
    from ampkit.tools.plan.setup import takes_batch

    needs = missing_modules("rich")
    if needs:
        return fail("plan", f"ampkit plan {needs}", MISSING)
    for path, option in ((args.json, "--json"), (args.html, "--html")):
        problem = _check_out(path, option)
        if problem:
            return fail("plan", problem)
    try:
        build = model_factory(args.target)
        make_inputs = load_callable(args.inputs, "--inputs")
        loss = None if args.loss_fn is None else load_callable(args.loss_fn, "--loss-fn")
    except TargetError as error:
        return fail("plan", str(error))
    what = f"--inputs {args.inputs!r}"
    batched = takes_batch(make_inputs)
    if args.batch is not None and not batched:
        return fail("plan", f"--batch is given but {what} takes no batch argument")

    def inputs(**keywords: Any) -> Any:
        return call_user(what, lambda: make_inputs(**keywords))

    def loss_fn(output: Any) -> Any:
        assert loss is not None
        return call_user(f"--loss-fn {args.loss_fn!r}", loss, output)

    options: dict[str, Any] = {
        "world_size": args.world_size, "parallel": args.parallel,
        "optimizer": args.optimizer, "device_policy": args.device_policy,
        "loss_fn": None if loss is None else loss_fn, "shard_size": args.shard_size}
    factory: Any = inputs if batched else (lambda: inputs())
    try:
        report = plan(build, factory, modes=args.modes, batch=args.batch, **options)
        largest: dict[str, int] = {}
        fitting = [] if args.device_memory is None else report.fits(args.device_memory)
        if args.device_memory is not None and batched:
            for mode in fitting:
                largest[mode] = largest_batch(build, factory, mode, args.device_memory,
                                              limit=args.max_batch, **options)
    except (TargetError, UserCodeError, ValueError, RuntimeError) as error:
        return fail("plan", " ".join(str(error).split()))
    out = console()
    out.print(rich_table(report.text_table(), title=report.title()))
    if args.device_memory is not None:
        size = format_bytes(args.device_memory)
        out.print(f"fit in {size}: {', '.join(fitting) if fitting else 'none'}",
                  highlight=False)
        for mode, batch in largest.items():
            out.print(f"  {mode}: largest batch {batch}"
                      f"{' (the --max-batch searched)' if batch >= args.max_batch else ''}",
                      highlight=False)
    if args.json:
        data = report.to_dict()
        data["device_memory"] = args.device_memory
        data["fits"] = fitting if args.device_memory is not None else None
        data["largest_batch"] = largest or None
        Path(args.json).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    if args.html:
        Path(args.html).write_text(report.html(device_memory=args.device_memory,
                                               largest=largest or None), encoding="utf-8")
    return 0
