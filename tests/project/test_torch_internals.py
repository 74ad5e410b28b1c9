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
import torch.nn as nn
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
#: ``torch.ops.<namespace>.<op>`` is torch's public way to name an op, private-looking
#: op names (``torch.ops.aten._to_copy``) included
OPS = re.compile(r"^torch\.ops\..*$")
PRIVATE = re.compile(r"^torch(\.\w+)*\._[A-Za-z]\w*(\.\w+)*$")
#: strings that name a private torch module but are not a use of it: (file, string, why)
NOT_USES = {("tools/cli/args.py", "torch.utils._pytree"): "a logger name, to filter a "
            "third-party notice"}


def _private(names: object) -> set[str]:
    return {n for n in names if n.startswith("_") and not n.startswith("__")}  # type: ignore[attr-defined]


def torch_private_attributes() -> set[str]:
    """The private attribute names of the torch objects ampkit handles (modules, tensors,
    parameters, optimizers and their scheduler-wrapped steps, op objects, libraries),
    read from live objects of this torch, and torch's private functions (``torch._x``
    builtins, ``torch._C._nn``): ``x._name`` with one of them, outside the boundary, is
    a private torch name used."""
    import warnings

    objects: list[object] = [nn.Linear(1, 1), nn.LSTM(1, 1), nn.BatchNorm1d(1),
                             torch.zeros(1), nn.Parameter(torch.zeros(1)),
                             torch.ops.aten.mm.default, torch.ops.aten.mm]
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt.step()
        lib = torch.library.Library("ampkit_boundary_probe", "FRAGMENT")
    objects += [opt, opt.step, lib]
    found: set[str] = set()
    for obj in objects:
        found |= _private(dir(obj)) | _private(getattr(obj, "__dict__", {}))
    builtin = type(torch._C._get_tracing_state)
    found |= {n for n in _private(dir(torch)) if isinstance(getattr(torch, n), builtin)}
    found |= {"_nn"}  # torch._C._nn, the builtins behind torch.nn.functional
    # flags torch sets and reads on objects it does not own: FSDP's on a module,
    # torch.compiler.disable's on a function, the loss scalers' on an optimizer
    found |= {"_is_fsdp_managed_module", "_torchdynamo_disable", "_torchdynamo_disable_msg",
              "_step_supports_amp_scaling", "_opt_called", "_wrapped_by_lr_sched"}
    return found


TORCH_ATTRS = torch_private_attributes()


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


def _own_attributes(tree: ast.AST) -> dict[int, set[str]]:
    """For each ``self.x`` node inside a class of ampkit's: the names that class defines
    itself (its methods, class attributes, ``self.x = ...``), which are ampkit's, not
    torch's, even where torch uses the same name."""
    own: dict[int, set[str]] = {}
    for cls in ast.walk(tree):
        if not isinstance(cls, ast.ClassDef):
            continue
        names = set()
        for node in ast.walk(cls):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                    isinstance(node.value, ast.Name) and node.value.id == "self":
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
        for node in ast.walk(cls):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                    node.value.id in ("self", "cls"):
                own[id(node)] = names
    return own


_ATTRIBUTE_CALLS = {"getattr", "setattr", "hasattr", "delattr", "object.__setattr__"}


def private_uses(path: Path) -> list[str]:
    """``line: name`` for each private torch name ``path``'s code uses: attribute chains
    from ``torch`` (``torch._C._nn``, ``torch._foreach_add_``), a private attribute of a
    torch object (``module._parameters``, ``tensor._version``, ``op._schema``, read,
    written or named in a string as ``getattr`` takes it), imports, and strings naming a
    private torch module (what ``sys.modules``/``__import__`` take); docstrings and
    comments are not code."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docs = _docstrings(tree)
    own = _own_attributes(tree)
    # an attribute chain is one name: ``torch._C._nn`` is not also ``torch._C``
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    # strings that name an attribute: getattr(x, "_name"), state["_name"] (pickled state)
    named = {id(n.args[1]) for n in ast.walk(tree) if isinstance(n, ast.Call)
             and _dotted(n.func) in _ATTRIBUTE_CALLS and len(n.args) > 1}
    named |= {id(n.slice) for n in ast.walk(tree) if isinstance(n, ast.Subscript)}
    rel = path.relative_to(SRC).as_posix()
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Attribute):
            dotted = _dotted(node)
            if dotted is not None and dotted.split(".")[0] == "torch":
                if id(node) not in inner and not OPS.match(dotted):
                    names.append(dotted)  # a chain from torch: one name, whole
            elif node.attr in TORCH_ATTRS and node.attr not in own.get(id(node), ()):
                names.append(f"<object>.{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.extend(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.extend(a.name for a in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                id(node) not in docs and (rel, node.value) not in NOT_USES:
            if node.value in TORCH_ATTRS and id(node) in named:
                names.append(f"<object>.{node.value}")
            elif node.value.startswith("torch."):
                names.append(node.value)
        for name in names:
            if name.startswith("<object>.") or (name.startswith("torch.")
                                                and PRIVATE.match(name)
                                                and not OPS.match(name)):
                found.append(f"{rel}:{node.lineno}: {name}")
    return found


def test_the_finder_sees_each_kind_of_use(tmp_path: Path) -> None:
    global SRC
    code = ("import torch\nimport torch._dynamo.config\nfrom torch._ops import OpOverload\n"
            "x = torch._C._get_tracing_state()\ny = torch._foreach_add\n"
            "z = torch.ops.aten._to_copy\nm = 'torch._dynamo.guards'\n"
            "def f(module, t, op, opt):\n    'a docstring naming torch._dynamo'\n"
            "    module._parameters['w'] = None\n    v = t._version\n"
            "    s = op._schema\n    module._forward_pre_hooks.clear()\n"
            "    getattr(opt, '_step_supports_amp_scaling', False)\n"
            "    torch._C._nn.linear\n"
            "class Mine:\n    def __init__(self):\n        self._scale = 1\n"
            "    def get(self):\n        return self._scale\n")
    (tmp_path / "m.py").write_text(code, encoding="utf-8")
    saved, SRC = SRC, tmp_path
    try:
        got = {u.split(": ")[1] for u in private_uses(tmp_path / "m.py")}
    finally:
        SRC = saved
    assert got == {"torch._dynamo.config", "torch._ops.OpOverload",
                   "torch._C._get_tracing_state", "torch._dynamo.guards",
                   "torch._foreach_add", "<object>._parameters", "<object>._version",
                   "<object>._schema", "<object>._forward_pre_hooks",
                   "<object>._step_supports_amp_scaling", "torch._C._nn.linear"}


def test_the_torch_attributes_include_what_ampkit_reads() -> None:
    assert {"_parameters", "_buffers", "_version", "_schema", "_forward_pre_hooks",
            "_backward_hooks", "_compiled_call_impl", "_op", "_scaled_mm",
            "_amp_update_scale_", "_foreach_copy_", "_convolution", "_opt_called",
            "_is_view", "_values", "_destroy"} <= TORCH_ATTRS


def test_no_private_torch_name_outside_the_boundary() -> None:
    found = [use for path in sorted(SRC.rglob("*.py")) if BOUNDARY not in path.parents
             for use in private_uses(path)]
    assert not found, ("private torch names outside ampkit.torch_internals (add an entry "
                       "there and use it):\n" + "\n".join(found))


def test_a_dispatch_mode_sees_the_ops() -> None:
    ti.lazy_check_dispatch_mode()  # the half of python_dispatch that imports dynamo
