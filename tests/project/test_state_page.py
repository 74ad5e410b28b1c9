"""docs/state.md lists all of ampkit's process-wide state, and stays true:
the source is read (every module's syntax tree) for what lives beyond one call, and
each thing found must have its row on the page, and each row a thing in the source.

What is looked for:

* a module-level **store**: a name bound at module level that functions rebind
  (``global``), a container literal or constructor (``{}``, ``[]``, ``set()``,
  ``dict()``, ...) that the module mutates (item assignment or deletion, ``append``,
  ``add``, ``update``, ``setdefault``, ``pop``, ...), a weak dictionary or set, or an
  instance of a ``threading.local`` class (the state of each thread);
* a runtime **class swap**: an assignment to ``<obj>.__class__`` (or ``setattr`` of
  it);
* a **step patch**: an assignment to ``<obj>.step`` or ``<obj>.__dict__["step"]``;
* a global **hook**: ``register_optimizer_step_pre_hook`` /
  ``register_optimizer_step_post_hook`` / ``register_module_*`` (torch's process-wide
  hooks);
* an import **finder**: a change to ``sys.meta_path``.

A store is named ``module.name``; the others by the function (or class and method)
that makes them, ``module.function``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "ampkit"
PAGE = ROOT / "docs" / "state.md"

_MUTATORS = {"append", "add", "update", "setdefault", "pop", "clear", "extend", "insert",
             "remove", "discard", "popitem", "appendleft"}
_CONTAINERS = {"dict", "list", "set", "defaultdict", "OrderedDict", "Counter", "deque"}
_WEAK = {"WeakKeyDictionary", "WeakValueDictionary", "WeakSet", "WeakIdKeyDictionary",
         "local"}
_HOOKS = ("register_optimizer_step_pre_hook", "register_optimizer_step_post_hook",
          "register_module_")


def _module(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _called(node: ast.AST) -> str | None:
    if not isinstance(node, ast.Call):
        return None
    func = node.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)


def _stores(tree: ast.Module, module: str) -> set[str]:
    thread_classes = {node.name for node in tree.body if isinstance(node, ast.ClassDef)
                      and any(ast.unparse(b) == "threading.local" for b in node.bases)}
    top: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        for target in targets:
            if isinstance(target, ast.Name):
                top[target.id] = value
    rebound: set[str] = set()
    mutated: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            rebound.update(node.names)
        targets = (node.targets if isinstance(node, ast.Assign | ast.Delete)
                   else [node.target] if isinstance(node, ast.AugAssign) else [])
        for target in targets:
            if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name):
                mutated.add(target.value.id)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in _MUTATORS and isinstance(node.func.value, ast.Name)):
            mutated.add(node.func.value.id)
    found = set()
    for name, value in top.items():
        container = (isinstance(value, ast.Dict | ast.List | ast.Set)
                     or _called(value) in _CONTAINERS)
        if (name in rebound or (container and name in mutated) or _called(value) in _WEAK
                or _called(value) in thread_classes):
            found.add(f"{module}.{name}")
    return found


def _mechanisms(tree: ast.Module, module: str) -> set[tuple[str, str]]:
    found: set[tuple[str, str]] = set()

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            here = where
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                here = f"{where}.{child.name}"
            if isinstance(child, ast.Assign):
                for target in child.targets:
                    if isinstance(target, ast.Attribute) and target.attr == "__class__":
                        found.add(("class swap", here))
                    if isinstance(target, ast.Attribute) and target.attr == "step":
                        found.add(("step patch", here))
                    if (isinstance(target, ast.Subscript)
                            and ast.unparse(target.value).endswith("__dict__")
                            and isinstance(target.slice, ast.Constant)
                            and target.slice.value == "step"):
                        found.add(("step patch", here))
            if isinstance(child, ast.Call):
                called = ast.unparse(child.func)
                if "meta_path" in called:
                    found.add(("finder", here))
                if any(hook in called for hook in _HOOKS):
                    found.add(("hook", here))
                if (called == "setattr" and len(child.args) >= 2
                        and isinstance(child.args[1], ast.Constant)
                        and child.args[1].value in ("__class__", "step")):
                    found.add(("class swap" if child.args[1].value == "__class__"
                               else "step patch", here))
            visit(child, here)

    visit(tree, module)
    return found


def _in_source() -> set[tuple[str, str]]:
    found: set[tuple[str, str]] = set()
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        module = _module(path)
        found |= {("store", name) for name in _stores(tree, module)}
        found |= _mechanisms(tree, module)
    return found


def _on_page() -> set[tuple[str, str]]:
    # table rows: | `name` | kind | owner | why ... |
    rows = re.findall(r"^\| `([\w.]+)` \| ([a-z ]+) \|", PAGE.read_text(), re.M)
    return {(kind.strip(), name) for name, kind in rows}


def test_every_piece_of_process_wide_state_is_on_the_page():
    missing = sorted(_in_source() - _on_page())
    assert missing == [], "add a row to docs/state.md for each"


def test_every_row_of_the_page_is_still_in_the_source():
    stale = sorted(_on_page() - _in_source())
    assert stale == [], "remove these rows from docs/state.md (or fix their kind)"


def test_the_reader_finds_what_it_looks_for():
    source = ast.parse(
        "import threading, weakref\n"
        "class _T(threading.local):\n    pass\n"
        "_cache = {}\n_table = {'a': 1}\n_flag = False\n_weak = weakref.WeakSet()\n"
        "_tls = _T()\n"
        "def f(x, opt, m):\n    global _flag\n    _flag = True\n    _cache[x] = 1\n"
        "    m.__class__ = int\n    opt.step = None\n    opt.__dict__['step'] = None\n"
        "    torch.optim.optimizer.register_optimizer_step_pre_hook(f)\n"
        "    sys.meta_path.insert(0, x)\n")
    assert _stores(source, "m") == {"m._cache", "m._flag", "m._weak", "m._tls"}
    assert _mechanisms(source, "m") == {("class swap", "m.f"), ("step patch", "m.f"),
                                        ("hook", "m.f"), ("finder", "m.f")}
