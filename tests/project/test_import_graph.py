"""The import graph of ampkit's own modules: no circles, and no module imports another
module's private (``_name``) names. Read from the source (every import statement,
including those inside functions), so an import deferred into a function to hide a
circle is still a circle. Imports under ``if TYPE_CHECKING:`` never run, so they cannot
make an import order, but a circle through them is still two modules that need each
other: a second check counts them too. Packages' own modules (``ampkit.conversion.plan``,
...) are modules of the graph like any other: a name private to one file of a package
is private to it. Dunder names (a one-line dialect shim's
``from ampkit.dialects.torch import __all__``) count as public."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((SRC / "ampkit").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _runtime_imports(tree: ast.AST, type_only: bool = False
                     ) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if (not type_only and isinstance(node, ast.If)
                and "TYPE_CHECKING" in ast.unparse(node.test)):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _graph(type_only: bool = False) -> tuple[dict[str, set[str]], list[str]]:
    modules = _modules()
    edges: dict[str, set[str]] = {m: set() for m in modules}
    private = []
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in _runtime_imports(ast.parse(path.read_text(), str(path)), type_only):
            if isinstance(node, ast.Import):
                edges[module].update(a.name for a in node.names if a.name in modules)
                continue
            target = node.module or ""
            if node.level:  # relative: resolve against this module's package
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{target}" if target else base
            if not target.startswith("ampkit"):
                continue
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                if submodule in modules:
                    edges[module].add(submodule)
                    continue
                edges[module].add(target)
                if _is_private(alias.name) and target != module:
                    private.append(f"{module} imports {alias.name} from {target}")
    return edges, private


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    # Tarjan's strongly connected components; a component of two or more is a circle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in edges:
                continue
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in edges:
        if v not in index:
            connect(v)
    return out


@pytest.fixture(scope="module")
def graph() -> tuple[dict[str, set[str]], list[str]]:
    return _graph()


def test_the_graph_is_read(graph):
    edges, _ = graph
    # A sanity check on the reader itself: known edges are found, including one made by
    # an import inside a function (compare's Comparison.write_report), and the modules
    # of a package are nodes of their own, with edges between them.
    assert "ampkit.registry" in edges["ampkit.policy"]
    assert "ampkit.tools.accuracy.compare_report" in edges["ampkit.tools.accuracy.comparison"]
    assert "ampkit.conversion.classes" in edges["ampkit.conversion.boundary"]
    assert "ampkit.conversion.plan" in edges["ampkit.conversion"]
    assert "ampkit.parameter_casts" in edges["ampkit.conversion.classes"]


def _room(module: str) -> str:
    # ampkit.tools.<room>.<module> -> <room>; a flat tools module is its own room.
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "tools" else ""


def test_tools_rooms_depend_downward(graph):
    # tools/ is rooms by concept (issue 38): the command line sits on top, and the rooms
    # the others build on (what ops ran, the HTML pages) never reach up into them.
    edges, _ = graph
    assert {"ampkit.tools.cli.compare", "ampkit.tools.accuracy.compare"} <= \
        edges["ampkit.tools.cli"] | edges["ampkit.tools.cli.compare"]
    into_cli = {m for m, targets in edges.items() if _room(m) != "cli"
                and any(_room(t) == "cli" for t in targets)}
    assert into_cli == {"ampkit.__main__"}
    for low in ("ops", "pages", "demo"):
        reached = {_room(t) for m, targets in edges.items() if _room(m) == low
                   for t in targets}
        assert not reached & {"accuracy", "cli"}, low


def test_no_import_circles(graph):
    edges, _ = graph
    assert _cycles(edges) == []


def test_no_import_circles_type_only_included():
    # The compare report reads a comparison through protocols of its own
    # (ComparisonView), so the results module it is called from is not imported back.
    edges, _ = _graph(type_only=True)
    assert "ampkit.tools.accuracy.comparison" not in edges[
        "ampkit.tools.accuracy.compare_report"]
    assert _cycles(edges) == []


def test_no_private_names_imported_across_modules(graph):
    _, private = graph
    assert private == []


def test_the_checks_catch_what_they_look_for():
    circle = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(circle) == [["a", "b", "c"]]
    assert _is_private("_state") and not _is_private("__all__")
    assert not _is_private("amp_state")
    # the type-only reading sees imports under ``if TYPE_CHECKING:``; the runtime one not
    source = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                       "    from ampkit.config import AmpConfig\n")
    assert [n.module for n in _runtime_imports(source, type_only=True)] == [
        "typing", "ampkit.config"]
    assert [n.module for n in _runtime_imports(source)] == ["typing"]
