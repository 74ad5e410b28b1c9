"""The API reference by the names users import (``ampkit.initialize``, ``ampkit.apex.
initialize``), not by the modules that define them.

Two directives, used by the pages under ``docs/api``:

* ``.. ampkit-names:: MODULE`` documents MODULE (one of :data:`reference.PUBLIC_MODULES`)
  and every name in its ``__all__`` under ``MODULE.NAME``: a class or function through
  autodoc (its docstring, signature and example), a constant through ``autodata``, and
  an object that is torch's own (``ampkit.torch.custom_fwd``) by a short entry that sends
  the reader to PyTorch's documentation.
* ``.. ampkit-cli::`` documents the ``ampkit`` command: each subcommand a ``program``,
  each of its options an ``option`` entry, read off the parser itself (so a new option
  needs no edit here).

The directives write reStructuredText and parse it in place, so autodoc and the Python
domain do the rest (the entries land in ``objects.inv`` under the public names).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import re
from typing import Any

from docutils import nodes
from docutils.statemachine import StringList
from reference import PUBLIC_MODULES, defining_module
from sphinx.application import Sphinx
from sphinx.domains.python import PyClasslike
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles


def _escaped(text: str) -> str:
    """``text`` as plain reStructuredText: every mark that could start markup escaped."""
    return re.sub(r"([^\w\s]|_)", r"\\\1", " ".join(text.split()))


def _entry_lines(module_name: str, name: str, obj: Any) -> list[str]:
    """The reStructuredText that documents ``obj`` as ``module_name.name``."""
    public = f"{module_name}.{name}"
    home = defining_module(obj) if (inspect.isclass(obj) or inspect.isroutine(obj)) else None
    if home is not None and home.split(".")[0] == "torch":
        kind = "class" if inspect.isclass(obj) else "function"
        # the short name: automodule made module_name the current module
        return [f".. py:{kind}:: {name}", "",
                f"   PyTorch's own ``{home}.{obj.__name__}``, re-exported here unchanged so"
                " that code written for ``torch.amp`` imports it from the same place; see"
                " PyTorch's documentation.", ""]
    if inspect.isclass(obj):
        return [f".. autoclass:: {public}", ""]
    if inspect.isroutine(obj):
        return [f".. autofunction:: {public}", ""]
    if inspect.ismodule(obj):
        raise ValueError(f"{public} is a module: give it a page of its own")
    return [f".. autodata:: {public}", "   :no-value:", ""]


def _parsed(directive: SphinxDirective, lines: list[str]) -> list[Any]:
    """``lines`` parsed as reStructuredText where ``directive`` stands."""
    holder = nodes.section()
    holder.document = directive.state.document
    nested_parse_with_titles(directive.state, StringList(lines, source=directive.name), holder)
    return holder.children


class PublicNames(SphinxDirective):
    """``.. ampkit-names:: MODULE``: MODULE and every name in its ``__all__``."""

    required_arguments = 1

    def run(self) -> list[Any]:
        module_name = self.arguments[0]
        if module_name not in PUBLIC_MODULES:
            raise self.error(f"{module_name} is not in reference.PUBLIC_MODULES "
                             f"({', '.join(PUBLIC_MODULES)})")
        module = importlib.import_module(module_name)
        lines = [f".. automodule:: {module_name}", "   :no-members:", ""]
        for name in module.__all__:
            if name == "__version__":
                lines += [".. py:data:: __version__", "",
                          "   The installed release, as a string (``\"0.1.0\"``).", ""]
                continue
            lines += _entry_lines(module_name, name, getattr(module, name))
        return _parsed(self, lines)


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return list(action.choices.items())
    return []


def _option_lines(parser: argparse.ArgumentParser) -> list[str]:
    lines: list[str] = []
    for action in parser._actions:
        if action.help == argparse.SUPPRESS:
            continue
        if isinstance(action, argparse._SubParsersAction):
            continue
        if action.option_strings:
            metavar = ""
            if action.nargs != 0:
                shown = action.metavar or action.dest.upper()
                metavar = f" {shown if isinstance(shown, str) else ' '.join(shown)}"
            names = ", ".join(f"{option}{metavar}" for option in action.option_strings)
        else:
            names = str(action.metavar or action.dest)
        help_text = action.help or ""
        if "%(" in help_text:
            help_text = help_text % {**vars(action), "prog": parser.prog}
        lines += [f".. option:: {names}", "", f"   {_escaped(help_text)}", ""]
    return lines


class CommandLine(SphinxDirective):
    """``.. ampkit-cli:: [SUBCOMMAND]``: the ``ampkit`` command's own options, or those of
    one subcommand (``demo``, ``compare``, ``tune``), with its usage line."""

    optional_arguments = 1

    def run(self) -> list[Any]:
        from ampkit.tools.cli import build_parser

        parser = build_parser()
        program = "ampkit"
        if self.arguments:
            commands = dict(_subcommands(parser))
            if self.arguments[0] not in commands:
                raise self.error(f"no ampkit subcommand {self.arguments[0]!r} "
                                 f"(choose from {', '.join(commands)})")
            parser = commands[self.arguments[0]]
            program = f"ampkit {self.arguments[0]}"
        usage = parser.format_usage().removeprefix("usage: ").splitlines()
        lines = [f".. program:: {program}", "", "::", "", *(f"   {line}" for line in usage),
                 "", _escaped(parser.description or ""), "", *_option_lines(parser)]
        return _parsed(self, lines)


class _Classlike(PyClasslike):
    """``py:class``, which on a page of the public reference (``docs/api``, the internals'
    generated pages apart) registers no ``canonical``
    alias: autodoc names the defining module's path there (``ampkit.pure.
    PureLowPrecisionOptimizer``), which the internals' pages register already, so that
    a class with two public names would give the alias twice."""

    def add_target_and_index(self, name_cls: Any, sig: str, signode: Any) -> None:
        if self.env.docname.startswith("api/") and "_generated" not in self.env.docname:
            self.options.pop("canonical", None)
        super().add_target_and_index(name_cls, sig, signode)


def setup(app: Sphinx) -> dict[str, Any]:
    for kind in ("class", "exception"):
        app.add_directive_to_domain("py", kind, _Classlike, override=True)
    app.add_directive("ampkit-names", PublicNames)
    app.add_directive("ampkit-cli", CommandLine)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
