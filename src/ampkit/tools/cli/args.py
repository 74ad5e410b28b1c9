"""What every ``ampkit`` command shares: argument types, exit statuses, the one-line
error and the console.

``ampkit demo``, ``ampkit compare`` and ``ampkit tune`` (:mod:`ampkit.tools.cli`,
:mod:`ampkit.tools.cli.compare`, :mod:`ampkit.tools.cli.tune`) all import from here, so
a seed, a count or a dtype name is checked, and refused, in the same words everywhere.

Example:
    >>> from ampkit.tools.cli.args import BAD_INPUT, positive_int
    >>> positive_int("0")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: must be a positive integer, got '0'
    >>> BAD_INPUT
    2
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import logging
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from ampkit.common.text import TextTable

__all__ = ["BAD_INPUT", "DEVICE_CHOICES", "DTYPE_SPELLINGS", "MAX_SEED", "MISSING", "PROG",
           "Parser", "add_config_options", "add_device_option", "add_run_options",
           "choice_list", "config_file", "config_flag", "config_from_args", "console",
           "device_name", "fail", "folder_undo", "fp8_recipe", "print_parts", "rich_table",
           "known_import_noise_silenced", "low_dtype",
           "missing_modules", "non_negative_int", "number", "output_path", "positive_int",
           "seed", "spelled"]

#: The command's name in messages.
PROG = "ampkit"

# Other spellings of the demo's dtype names: torch's own dtype names, and "half".
DTYPE_SPELLINGS: dict[str, tuple[str, ...]] = {"bf16": ("bfloat16",),
                                                 "fp16": ("float16", "half")}


def spelled(accepted: Sequence[str], aliases: dict[str, tuple[str, ...]]) -> str:
    """Each choice with its other spellings, for a help text or an error.

    Example:
        >>> from ampkit.tools.cli.args import DTYPE_SPELLINGS, spelled
        >>> spelled(("bf16", "fp16"), DTYPE_SPELLINGS)
        'bf16|bfloat16, fp16|float16|half'
    """
    return ", ".join("|".join((choice, *aliases.get(choice, ()))) for choice in accepted)


def choice_list(accepted: Sequence[str], aliases: dict[str, tuple[str, ...]] | None = None
                 ) -> Callable[[str], list[str]]:
    """A parser of comma-separated choices, case-insensitive, with other spellings of a
    choice (``aliases``) mapped to it.

    Example:
        >>> from ampkit.tools.cli.args import DTYPE_SPELLINGS, choice_list
        >>> choice_list(("bf16", "fp16"), DTYPE_SPELLINGS)("half,BF16")
        ['fp16', 'bf16']
    """
    aliases = aliases or {}
    canonical = {choice.lower(): choice for choice in accepted}
    canonical.update({alias.lower(): choice for choice in accepted
                      for alias in aliases.get(choice, ())})

    def parse(text: str) -> list[str]:
        chosen = []
        for item in (part.strip() for part in text.split(",")):
            if item.lower() not in canonical:
                raise argparse.ArgumentTypeError(
                    f"invalid choice: {item!r} (choose from {spelled(accepted, aliases)}; "
                    f"case does not matter)")
            chosen.append(canonical[item.lower()])
        return chosen

    parse.__name__ = "comma-separated list"
    return parse


#: Exit statuses (see the module docstring).
BAD_INPUT = 2
MISSING = 1

#: numpy's and scikit-learn's seeds are 32-bit.
MAX_SEED = 2**32 - 1

_Number = TypeVar("_Number", int, float)


class Parser(argparse.ArgumentParser):
    """argparse, with every error on one line: ``ampkit demo: error: ...``, exit 2.

    Example:
        >>> from ampkit.tools.cli.args import Parser
        >>> Parser(prog="ampkit demo").parse_args(["--no-such-option"])
        Traceback (most recent call last):
        ...
        SystemExit: 2
    """

    def error(self, message: str) -> NoReturn:
        self.exit(BAD_INPUT, f"{self.prog}: error: {message} (see: {self.prog} --help)\n")


def _checked(text: str, convert: Callable[[str], _Number], accept: Callable[[_Number], bool],
             expected: str) -> _Number:
    # The one shape of every numeric argument type: convert, check, or refuse in the
    # shared wording "must be <expected>, got '<text>'".
    try:
        value: _Number | None = convert(text)
    except ValueError:
        value = None
    if value is None or not accept(value):
        raise argparse.ArgumentTypeError(f"must be {expected}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An argument type: an integer >= 1.

    Example:
        >>> from ampkit.tools.cli.args import positive_int
        >>> positive_int("3")
        3
    """
    return _checked(text, int, lambda value: value >= 1, "a positive integer")


def non_negative_int(text: str) -> int:
    """An argument type: an integer >= 0.

    Example:
        >>> from ampkit.tools.cli.args import non_negative_int
        >>> non_negative_int("0")
        0
    """
    return _checked(text, int, lambda value: value >= 0, "a non-negative integer")


def number(text: str) -> float:
    """An argument type: a finite number >= 0.

    Example:
        >>> from ampkit.tools.cli.args import number
        >>> number("1e-3")
        0.001
    """
    return _checked(text, float, lambda value: 0 <= value < float("inf"),
                    "a finite number >= 0")


def seed(text: str) -> int:
    """An argument type: a seed numpy and scikit-learn accept (0 to 2**32 - 1).

    Example:
        >>> from ampkit.tools.cli.args import seed
        >>> seed("-5")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: must be an integer from 0 to 4294967295 (2**32 - 1), got '-5'
    """
    return _checked(text, int, lambda value: 0 <= value <= MAX_SEED,
                    f"an integer from 0 to {MAX_SEED} (2**32 - 1)")


def output_path(text: str) -> str:
    """An argument type: a non-empty file or folder name.

    Example:
        >>> from ampkit.tools.cli.args import output_path
        >>> output_path("report")
        'report'
    """
    if not text.strip():
        raise argparse.ArgumentTypeError(
            "must name a file or folder; an empty name would write into the current folder")
    return text


def add_run_options(parser: argparse.ArgumentParser, *, out: str, out_help: str,
                    overwrite_help: str, seed_help: str,
                    threads_help: str = "torch CPU threads") -> None:
    """Add the options every command that runs a model and writes files has: ``--seed``,
    ``--out``, ``--overwrite`` and ``--threads``, with one type, default and wording
    each; the helps say what they mean for the command (the defaults are appended).

    Example:
        >>> import argparse
        >>> from ampkit.tools.cli.args import add_run_options
        >>> parser = argparse.ArgumentParser()
        >>> add_run_options(parser, out="report", out_help="report folder",
        ...                 overwrite_help="replace files", seed_help="torch's seed")
        >>> args = parser.parse_args(["--seed", "3"])
        >>> args.seed, args.out, args.overwrite, args.threads
        (3, 'report', False, 1)
    """
    parser.add_argument("--seed", type=seed, default=0,
                        help=f"{seed_help}, 0 to 2**32 - 1 (default: 0)")
    parser.add_argument("--out", type=output_path, default=out,
                        help=f"{out_help} (default: {out})")
    parser.add_argument("--overwrite", action="store_true", help=overwrite_help)
    parser.add_argument("--threads", type=positive_int, default=1,
                        help=f"{threads_help} (default: 1)")


# Log records third-party packages emit when torchao is imported, which say nothing
# about the user's run: torchao's optional C++ kernels built for other machines or
# Python versions ("Failed to load .../_C_mxfp8...so"), and torch's notice that torchao
# still registers its Enums with pytree. (logger name, start of the message)
_IMPORT_NOISE = (("torchao", "Failed to load "),
                 ("torch.utils._pytree", "%s is an Enum subclass and is now natively"))


class _DropKnown(logging.Filter):
    def __init__(self, start: str) -> None:
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.start)


@contextlib.contextmanager
def known_import_noise_silenced() -> Iterator[None]:
    """Drop, while the block runs, the known log records of :data:`_IMPORT_NOISE`
    (each by its logger and the start of its message; every other record, warning and
    logger is left alone), so that ``--fp8`` output starts with ampkit's own.

    Example:
        >>> import logging
        >>> from ampkit.tools.cli.args import known_import_noise_silenced
        >>> with known_import_noise_silenced():
        ...     logging.getLogger("torchao").warning("Failed to load x.so: no GPU")
    """
    filters = [(logging.getLogger(name), _DropKnown(start)) for name, start in _IMPORT_NOISE]
    for logger, drop in filters:
        logger.addFilter(drop)
    try:
        yield
    finally:
        for logger, drop in filters:
            logger.removeFilter(drop)


def folder_undo(path: str | os.PathLike[str], files: Iterable[str]) -> Callable[[], None]:
    """Note, before a command creates the folder ``path`` (and its missing parents),
    which of them do not exist yet; the function returned removes what the command
    made there: ``files`` (the command's own file names) in ``path``, then each folder
    it created, innermost first, if it is empty. A folder that existed stays, and so
    does any file of another name.

    Example:
        >>> import os, tempfile
        >>> from ampkit.tools.cli.args import folder_undo
        >>> root = tempfile.mkdtemp()
        >>> out = os.path.join(root, "a", "report")
        >>> undo = folder_undo(out, ["r.html"])
        >>> os.makedirs(out)
        >>> open(os.path.join(out, "r.html"), "w").close()
        >>> undo()
        >>> os.listdir(root)
        []
    """
    folder = Path(os.path.abspath(path))
    created: list[Path] = []  # innermost first
    probe = folder
    while not probe.exists() and probe != probe.parent:
        created.append(probe)
        probe = probe.parent
    names = tuple(files)

    def undo() -> None:
        if not created:
            return
        for name in names:
            with contextlib.suppress(OSError):
                (folder / name).unlink()
        for made in created:
            try:
                made.rmdir()
            except OSError:  # not empty (someone else's file), or gone: leave it
                return

    return undo


#: The ``--device`` names every command takes.
DEVICE_CHOICES = "auto, cpu, cuda, cuda:<index>"


def device_name(text: str) -> str:
    """An argument type: a device name (:data:`DEVICE_CHOICES`); whether this machine
    has it is checked after parsing (a missing GPU is exit status 1, not bad input).

    Example:
        >>> from ampkit.tools.cli.args import device_name
        >>> device_name("cuda:1")
        'cuda:1'
        >>> device_name("tpu")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: invalid choice: 'tpu' (choose from auto, cpu, cuda, ...)
    """
    from ampkit.tools.demo.run import resolve_device

    try:
        resolve_device(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid choice: {text!r} (choose from {DEVICE_CHOICES})") from None
    except RuntimeError:
        pass  # a valid name for a device this machine lacks: reported after parsing
    return text


def add_device_option(parser: argparse.ArgumentParser, *, default: str | None,
                      default_help: str) -> None:
    """Add ``--device`` (:func:`device_name`), one wording for every command.

    Example:
        >>> import argparse
        >>> from ampkit.tools.cli.args import add_device_option
        >>> parser = argparse.ArgumentParser()
        >>> add_device_option(parser, default="auto", default_help="auto")
        >>> parser.parse_args(["--device", "cpu"]).device
        'cpu'
    """
    parser.add_argument("--device", type=device_name, default=default,
                        help=f"one of {DEVICE_CHOICES} (default: {default_help})")


def config_file(text: str) -> Any:
    """An argument type: an :class:`ampkit.AmpConfig` file (``.json``, ``.yaml``,
    ``.yml``), read and checked by ``AmpConfig.from_file``.

    Example:
        >>> from ampkit.tools.cli.args import config_file
        >>> config_file("amp.toml")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: amp.toml: an ampkit config file is JSON (.json) or ...
    """
    from ampkit.config import AmpConfig

    try:
        return AmpConfig.from_file(text)
    except OSError as error:
        raise argparse.ArgumentTypeError(
            f"cannot read the config file {text!r}: {error.strerror or error}") from None
    except ValueError as error:
        raise argparse.ArgumentTypeError(" ".join(str(error).split())) from None


def low_dtype(text: str) -> Any:
    """An argument type: a low-precision dtype name (``bf16``, ``fp16`` and their
    other spellings, any case).

    Example:
        >>> from ampkit.tools.cli.args import low_dtype
        >>> low_dtype("BFloat16")
        torch.bfloat16
    """
    from ampkit.policies.policy import as_dtype

    try:
        return as_dtype(text.lower(), allow_none=False)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid choice: {text!r} (choose from {spelled(('bf16', 'fp16'), DTYPE_SPELLINGS)}"
            f"; case does not matter)") from None


def fp8_recipe(text: str) -> str:
    """An argument type: an fp8 recipe name (:data:`ampkit.fp8.FP8_RECIPES`, any case),
    checked by ``ampkit.fp8.parse_fp8`` as ``initialize(fp8=...)`` checks it.

    Example:
        >>> from ampkit.tools.cli.args import fp8_recipe
        >>> fp8_recipe("RowWise")
        'rowwise'
        >>> fp8_recipe("e4m3")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: invalid choice: 'e4m3' (choose from tensorwise, rowwise, ...
    """
    from ampkit.fp8.recipe import FP8_RECIPES, parse_fp8

    try:
        return str(parse_fp8(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid choice: {text!r} (choose from {spelled(FP8_RECIPES, {})}; case does "
            f"not matter)") from None


def fail(command: str, message: str, status: int = BAD_INPUT) -> int:
    """Print ``ampkit <command>: error: <message>`` to stderr; return ``status``.

    Example:
        >>> import contextlib, io
        >>> from ampkit.tools.cli.args import fail
        >>> with contextlib.redirect_stderr(io.StringIO()) as err:
        ...     status = fail("tune", "no policy")
        >>> status, err.getvalue()
        (2, 'ampkit tune: error: no policy\\n')
    """
    print(f"{PROG} {command}: error: {message}", file=sys.stderr)
    return status


def missing_modules(*names: str) -> str | None:
    """The message for the optional packages among ``names`` that are not installed
    (``None`` when all are).

    Example:
        >>> from ampkit.tools.cli.args import missing_modules
        >>> missing_modules("json") is None
        True
        >>> missing_modules("sklearn_is_not_this")
        "needs sklearn_is_not_this: pip install 'ampkit[demo]'"
    """
    packages = {"sklearn": "scikit-learn"}
    missing = [packages.get(n, n) for n in names if importlib.util.find_spec(n) is None]
    return f"needs {', '.join(missing)}: pip install 'ampkit[demo]'" if missing else None


def console() -> Console:
    """The rich console commands print on: full width on a terminal, 160 columns off
    one (a pipe, a log file), where rich would otherwise wrap tables at 80.

    Example:
        >>> from ampkit.tools.cli.args import console
        >>> console().width > 0
        True
    """
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=160)


def rich_table(table: TextTable, title: str | None = None) -> Table:
    """``table`` as a rich table, the way every command draws one (the demo's summary,
    compare's tables): its columns aligned as the text table aligns them, cells never
    wrapped.

    Example:
        >>> from ampkit.common.text import TextTable
        >>> from ampkit.tools.cli.args import rich_table
        >>> drawn = rich_table(TextTable(("op", "calls"), (("mm", "12"),)), title="ops")
        >>> [c.justify for c in drawn.columns], drawn.row_count
        (['left', 'right'], 1)
    """
    from rich.table import Table

    drawn = Table(title=title)
    for column, side in zip(table.columns, table.alignment()):
        drawn.add_column(column, justify="left" if side == "l" else "right", no_wrap=True)
    for row in table.rows:
        drawn.add_row(*row)
    return drawn


def print_parts(out: Console, parts: Iterable[str | TextTable]) -> None:
    """Print a summary's parts (``Comparison.summary()``): lines as they are, tables
    with :func:`rich_table`.

    Example:
        >>> from rich.console import Console
        >>> from ampkit.common.text import TextTable
        >>> from ampkit.tools.cli.args import print_parts
        >>> out = Console(width=40, record=True, file=open("/dev/null", "w"))
        >>> print_parts(out, ["ops", TextTable(("op",), (("mm",),))])
        >>> "mm" in out.export_text()
        True
    """
    for part in parts:
        if isinstance(part, str):
            out.print(part, highlight=False, soft_wrap=True)
        else:
            out.print(rich_table(part))


# -- AmpConfig's fields as flags --------------------------------------------------------

def config_flag(name: str) -> str:
    """The command-line flag of :class:`ampkit.AmpConfig`'s field ``name``.

    Example:
        >>> from ampkit.tools.cli.args import config_flag
        >>> config_flag("keep_fp32_modules")
        '--keep-fp32-modules'
    """
    return "--" + name.replace("_", "-")


def _true_or_false(text: str) -> bool:
    key = text.strip().lower()
    if key not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"must be true or false, got {text!r}")
    return key == "true"


def _names(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"must name at least one, got {text!r}")
    return names


def add_config_options(parser: argparse.ArgumentParser, *, skip: Iterable[str] = ()) -> None:
    """Add a flag for each of :class:`ampkit.AmpConfig`'s fields (read when called;
    those in ``skip`` are the command's own): :func:`config_flag`'s name, the field's
    help (:func:`ampkit.config.field_help`), and a type read from the field's
    (:func:`ampkit.config.text_kind`): a number, ``true``/``false``, comma-separated
    names, or text that AmpConfig's own check parses. Unset, a flag says nothing
    (``None``); :func:`config_from_args` makes the config.

    Example:
        >>> import argparse
        >>> from ampkit.tools.cli.args import add_config_options, config_from_args
        >>> parser = argparse.ArgumentParser()
        >>> add_config_options(parser)
        >>> args = parser.parse_args(["--level", "o2", "--dtype", "fp16",
        ...                           "--custom-black-list", "softmax,exp", "--hysteresis", "2"])
        >>> cfg = config_from_args(args)
        >>> cfg.level, cfg.custom_black_list, cfg.hysteresis
        ('O2', ('exp', 'softmax'), 2)
    """
    from ampkit.config import config_fields, field_help, text_kind

    group = parser.add_argument_group(
        "ampkit config", "AmpConfig's fields (ampkit.AmpConfig); with --config, each "
                         "one given must agree with the file")
    skipped = set(skip)
    for f in config_fields():
        if f.name in skipped:
            continue
        kind = text_kind(f.name)
        options: dict[str, Any] = {"dest": f"config_{f.name}", "default": None,
                                   "help": field_help(f.name)}
        if kind is bool and f.default is False:  # a switch, off unless given
            options["action"] = "store_const"
            options["const"] = True
        elif kind is bool:
            options.update(type=_true_or_false, metavar="true|false")
        elif kind is list:
            options.update(type=_names, action="extend", metavar="NAMES")
        else:
            options.update(type=kind, metavar=f.name.upper())
        group.add_argument(config_flag(f.name), **options)


def config_from_args(args: argparse.Namespace, base: Any = None,
                     own: Mapping[str, Any] | None = None) -> Any:
    """The :class:`ampkit.AmpConfig` the flags of :func:`add_config_options` say:
    ``base`` (a config read from ``--config``) with each flag given checked against it,
    or a config of the flags given; ``base`` when none is. ``own`` holds the fields a
    command sets with flags of its own (``compare``'s ``--dtype``, its lists): where
    there is a config, they are part of it (checked against ``base`` as the others);
    alone they make none.

    Raises:
        ValueError: a bad value (the field's own check, naming its flag), or a flag that
            contradicts ``base``.

    Example:
        >>> import argparse
        >>> from ampkit import AmpConfig
        >>> from ampkit.tools.cli.args import add_config_options, config_from_args
        >>> parser = argparse.ArgumentParser()
        >>> add_config_options(parser)
        >>> config_from_args(parser.parse_args(["--level", "O3"]), AmpConfig("O2"))
        Traceback (most recent call last):
        ...
        ValueError: --level O3 contradicts the config's level='O2'; give it once
    """
    from ampkit import config as schema

    given = {f.name: getattr(args, f"config_{f.name}") for f in schema.config_fields()
             if getattr(args, f"config_{f.name}", None) is not None}
    if not given and base is None:
        return None
    given.update({k: v for k, v in (own or {}).items() if v is not None})
    if not given:
        return base

    def spell(name: str, value: Any) -> str:  # as typed: the flag and its text
        text = (",".join(value) if isinstance(value, list)
                else str(value).removeprefix("torch."))
        return f"{config_flag(name)} {text}"

    try:
        return schema.merged_config(given, base, spell=spell)
    except TypeError as error:  # a command line gives values: one type
        raise ValueError(str(error)) from None
