"""The boundary with torch's internals (``ampkit.torch_internals``): every entry listed
with its check, each check run on the torch at hand, and the behaviours the checks
exist for (a checkpoint internal renamed behind a surviving shim, a compile flag whose
meaning widened between releases)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch
import torch.utils.checkpoint as cp

from ampkit import torch_internals as ti


@pytest.mark.parametrize("name", sorted(ti.ENTRIES))
def test_each_entry_says_what_it_is_for_and_its_check_passes(name: str) -> None:
    entry = ti.ENTRIES[name]
    assert entry.name == name and entry.names and entry.need and entry.public
    assert all(n.startswith("torch.") for n in entry.names)
    ti.check(name)  # raises TorchInternalsError naming the torch version where it fails


def test_an_unknown_entry_is_named_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"name: unknown torch internal 'nope'.*compile"):
        ti.check("nope")


def test_a_failed_check_names_the_torch_version_and_the_entry() -> None:
    error = ti.fail("checkpoint_recompute", "is gone")
    assert isinstance(error, RuntimeError)
    assert f"torch {torch.__version__}" in str(error) and "checkpoint_recompute" in str(error)


# -- compile_session ------------------------------------------------------------------------

def test_a_backend_runs_inside_the_compile_session() -> None:
    # torch 2.11/2.12: torch.compiler.is_compiling() is False here (fails before there:
    # a region's graph node run by AOTAutograd's trace was taken for a compiled run)
    ti.check_compile_session_in_a_backend()
    assert not ti.compiling()


# -- checkpoint_recompute ---------------------------------------------------------------------

def test_the_carry_is_undone_and_named_where_checkpoint_calls_other_internals(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A torch whose checkpoint() reaches none of the wrapped names (as 2.14's, which calls
    # a new internal behind a surviving shim, did for the old wrapper): simulated by a
    # checkpoint that runs the function itself.
    before = {n: getattr(cp, n, None) for n in (
        "_checkpoint_without_reentrant_generator_impl",
        "_checkpoint_without_reentrant_generator", "CheckpointFunction")}
    monkeypatch.setattr(cp, "checkpoint", lambda fn, *args, **kwargs: fn(*args))
    with pytest.warns(RuntimeWarning, match=r"torch .*checkpoint_recompute.*is not what "
                      r"checkpoint\(\) calls.*recomputes without the ampkit policy"):
        assert ti.install_checkpoint_carry(lambda fn: fn) is False
    assert {n: getattr(cp, n, None) for n in before} == before  # nothing left wrapped
    with pytest.raises(ti.TorchInternalsError, match="checkpoint_recompute"):
        ti.check("checkpoint_recompute")


# -- nothing outside the boundary names a private torch name --------------------------------

SRC = Path(__file__).resolve().parents[2] / "src" / "ampkit"
BOUNDARY = SRC / "torch_internals"
#: operator namespaces: ops, reached as torch exposes them (not internals of torch's)
OPS = re.compile(r"^torch\.(_foreach_\w+|_scaled_mm|_amp_foreach_\w+|_amp_update_scale_|"
                 r"_convolution|_C\._nn(\.\w+)?|ops\..*)$")
PRIVATE = re.compile(r"^torch(\.\w+)*\._[A-Za-z]\w*(\.\w+)*$")
#: strings that name a private torch module but are not a use of it: (file, string, why)
NOT_USES = {("tools/cli/args.py", "torch.utils._pytree"): "a logger name, to filter a "
            "third-party notice"}


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and \
                isinstance(body[0].value, ast.Constant):
            ids.add(id(body[0].value))
    return ids


def private_uses(path: Path) -> list[str]:
    """``line: name`` for each private torch name ``path``'s code uses: attribute chains
    from ``torch``, imports, and strings naming a private torch module (what
    ``sys.modules``/``__import__`` take); docstrings and comments are not code."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docs = _docstrings(tree)
    # an attribute chain is one name: ``torch._C._nn`` is not also ``torch._C``
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    rel = path.relative_to(SRC).as_posix()
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            dotted = _dotted(node)
            if dotted is not None:
                names.append(dotted)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.extend(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.extend(a.name for a in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                id(node) not in docs and (rel, node.value) not in NOT_USES:
            names.append(node.value)
        for name in names:
            if name.startswith("torch.") and PRIVATE.match(name) and not OPS.match(name):
                found.append(f"{rel}:{node.lineno}: {name}")
    return found


def test_the_finder_sees_each_kind_of_use(tmp_path: Path) -> None:
    global SRC
    code = ("import torch\nimport torch._dynamo.config\nfrom torch._ops import OpOverload\n"
            "x = torch._C._get_tracing_state()\ny = torch._foreach_add\n"
            "z = torch.ops.aten._to_copy\nm = 'torch._dynamo.guards'\n"
            "def f():\n    'a docstring naming torch._dynamo'\n")
    (tmp_path / "m.py").write_text(code, encoding="utf-8")
    saved, SRC = SRC, tmp_path
    try:
        got = {u.split(": ")[1] for u in private_uses(tmp_path / "m.py")}
    finally:
        SRC = saved
    assert got == {"torch._dynamo.config", "torch._ops.OpOverload",
                   "torch._C._get_tracing_state", "torch._dynamo.guards"}


def test_no_private_torch_name_outside_the_boundary() -> None:
    found = [use for path in sorted(SRC.rglob("*.py")) if BOUNDARY not in path.parents
             for use in private_uses(path)]
    assert not found, ("private torch names outside ampkit.torch_internals (add an entry "
                       "there and use it):\n" + "\n".join(found))


def test_a_dispatch_mode_sees_the_ops() -> None:
    ti.lazy_check_dispatch_mode()  # the half of python_dispatch that imports dynamo
