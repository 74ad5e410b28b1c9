"""The import graph of ampkit's own modules: no circles, and no module imports another
module's private (``_name``) names. Read from the source (every import statement,
including those inside functions), so an import deferred into a function to hide a
circle is still a circle. Imports under ``if TYPE_CHECKING:`` never run, so they cannot
make an import order, but a circle through them is still two modules that need each
other: a second check counts them too. Packages' own modules (``ampkit.conversion.plan``,
...) are modules of the graph like any other: a name private to one file of a package
is private to it. Dunder names (a one-line dialect shim's
``from ampkit.dialects.torch import __all__``) count as public.

The layering is proved here too: no core module imports ``ampkit.tools``;
a private module (``_name.py``) is imported only from inside its own package; and the
folders (packages) import one another without a loop."""

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
    assert "ampkit.policies.registry" in edges["ampkit.policies.policy"]
    assert "ampkit.tools.accuracy.compare_report" in edges["ampkit.tools.accuracy.comparison"]
    assert "ampkit.conversion.classes" in edges["ampkit.conversion.boundary"]
    assert "ampkit.conversion.plan" in edges["ampkit.conversion"]
    assert "ampkit.conversion.parameter_casts" in edges["ampkit.conversion.classes"]


def _room(module: str) -> str:
    # ampkit.tools.<room>.<module> -> <room>; a flat tools module is its own room.
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "tools" else ""


def test_tools_rooms_depend_downward(graph):
    # tools/ is rooms by concept: the command line sits on top, and the rooms
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


# -- layering: the core never reaches into the tools, a private module stays
# in its package, and folders (packages) import one another in one direction only -----

#: The one module outside ``ampkit.tools`` that may import it: ``python -m ampkit`` is
#: the command line's entry point.
_CLI_ENTRY = "ampkit.__main__"


def _in_tools(module: str) -> bool:
    return module == "ampkit.tools" or module.startswith("ampkit.tools.")


def _private_owner(module: str) -> str | None:
    """The package a private module belongs to (``ampkit.tools.ops`` for
    ``ampkit.tools.ops._x``), or ``None`` for a public one."""
    parts = module.split(".")
    for i, part in enumerate(parts):
        if _is_private(part):
            return ".".join(parts[:i])
    return None


def _private_module_imports(edges: dict[str, set[str]]) -> list[str]:
    # a private module is for its own package (and the packages inside it)
    out = []
    for module, targets in edges.items():
        for target in targets:
            owner = _private_owner(target)
            if owner is not None and not (module == owner or module.startswith(owner + ".")):
                out.append(f"{module} imports {target}, private to {owner}")
    return sorted(out)


def _folder(module: str, modules: dict[str, Path]) -> str:
    """The folder a module sits in, as a package name; a file directly in ``ampkit/``
    is a node of its own (the flat core modules are layers, not one folder)."""
    if modules[module].name == "__init__.py":
        return module
    parent = module.rpartition(".")[0]
    return module if parent == "ampkit" else parent


def _folder_graph(edges: dict[str, set[str]], modules: dict[str, Path]
                  ) -> dict[str, set[str]]:
    folders: dict[str, set[str]] = {_folder(m, modules): set() for m in modules}
    for module, targets in edges.items():
        here = _folder(module, modules)
        folders[here].update(_folder(t, modules) for t in targets
                             if t in modules and _folder(t, modules) != here)
    return folders


def test_no_core_module_imports_the_tools(graph):
    edges, _ = graph
    upward = sorted(f"{m} imports {t}" for m, targets in edges.items() for t in targets
                    if not _in_tools(m) and m != _CLI_ENTRY and _in_tools(t))
    assert upward == []


def test_no_private_module_imported_across_packages(graph):
    edges, _ = graph
    assert _private_module_imports(edges) == []


def test_no_folder_level_import_loop(graph):
    edges, _ = graph
    folders = _folder_graph(edges, _modules())
    # the reader sees the folders the rooms are (a sanity check that it is not empty)
    assert "ampkit.tools.accuracy" in folders["ampkit.tools.fp8"]
    assert _cycles(folders) == []


def test_no_folder_level_import_loop_type_only_included():
    edges, _ = _graph(type_only=True)
    assert _cycles(_folder_graph(edges, _modules())) == []


#: The core's packages from the bottom up: each imports only those before it (and torch).
#: ``common`` holds the leaf helpers, ``policies`` what an op list is, ``engine`` the
#: regions that apply a policy, ``conversion`` whole models at a level.
_CORE_LAYERS = ("ampkit.torch_internals", "ampkit.common", "ampkit.policies",
                "ampkit.engine", "ampkit.conversion")

#: What the top level of ``src/ampkit`` holds: the package's face and the public modules
#: users import by name; everything else lives in a package of its layer.
_TOP_LEVEL = {"__init__.py", "__main__.py", "config.py", "front_door.py", "fsdp.py",
              "step_in_backward.py", "apex.py", "mindspore.py", "mxnet.py", "paddle.py",
              "torch.py"}


def _layer_violations(folders: dict[str, set[str]], layers: tuple[str, ...]) -> list[str]:
    out = []
    for rank, layer in enumerate(layers):
        allowed = set(layers[:rank])
        out += [f"{layer} imports {t}" for t in sorted(folders.get(layer, ()))
                if t.startswith("ampkit.") and t not in allowed]
    return out


def test_the_core_packages_import_only_the_layers_below(graph):
    edges, _ = graph
    folders = _folder_graph(edges, _modules())
    assert all(layer in folders for layer in _CORE_LAYERS)
    assert _layer_violations(folders, _CORE_LAYERS) == []


def test_the_top_level_holds_only_the_public_faces():
    top = SRC / "ampkit"
    assert {p.name for p in top.glob("*.py")} == _TOP_LEVEL
    assert len(_TOP_LEVEL) <= 14


def test_the_layering_checks_catch_what_they_look_for():
    folders = {"ampkit.common": {"ampkit.torch_internals"},
               "ampkit.policies": {"ampkit.common", "ampkit.engine"},
               "ampkit.engine": {"ampkit.policies"}}
    layers = ("ampkit.torch_internals", "ampkit.common", "ampkit.policies", "ampkit.engine")
    assert _layer_violations(folders, layers) == ["ampkit.policies imports ampkit.engine"]
    assert _private_owner("ampkit.tools.ops._tracing") == "ampkit.tools.ops"
    assert _private_owner("ampkit._text") == "ampkit"
    assert _private_owner("ampkit.tools.ops.tracing") is None
    edges = {"ampkit.fp8.convert": {"ampkit.tools._text"},
             "ampkit.tools.accuracy.compare": {"ampkit.tools.ops._tracing"},
             "ampkit.tools.ops.op_stats": {"ampkit.tools.ops._tracing"},
             "ampkit.levels": {"ampkit._text"}}
    assert _private_module_imports(edges) == [
        "ampkit.fp8.convert imports ampkit.tools._text, private to ampkit.tools",
        "ampkit.tools.accuracy.compare imports ampkit.tools.ops._tracing, private to "
        "ampkit.tools.ops"]
    fake = {m: Path(m.replace(".", "/") + ".py") for m in (
        "ampkit.levels", "ampkit.tools.accuracy.compare", "ampkit.tools.fp8.errors")}
    loop = {"ampkit.tools.accuracy.compare": {"ampkit.tools.fp8.errors"},
            "ampkit.tools.fp8.errors": {"ampkit.levels"}, "ampkit.levels": set()}
    assert _cycles(_folder_graph(loop, fake)) == []
    loop["ampkit.tools.fp8.errors"].add("ampkit.tools.accuracy.compare")
    assert _cycles(_folder_graph(loop, fake)) == [["ampkit.tools.accuracy",
                                                   "ampkit.tools.fp8"]]


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
