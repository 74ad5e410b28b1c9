"""A torch whose internals moved: each private entry of ``ampkit.torch_internals`` made
missing (or made to behave otherwise) in a fresh interpreter before ``import ampkit``.
``import ampkit``, ``ampkit.GradScaler``, ``ampkit.autocast`` without custom lists and a
dialect's region keep working, with the results of an intact torch; the feature that
needs the entry raises ``TorchInternalsError`` naming torch's version, the entry and the
public alternative."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

#: Hides (or replaces) ``module.attr`` from ampkit's code only: torch's own code keeps
#: what it has (a torch that moved an internal moved its own uses too). The module is
#: swapped for a proxy where ampkit finds it (its parent's attribute, ``sys.modules``);
#: the proxy asks which module's code is reading.
HIDE = textwrap.dedent("""
    import importlib, sys, types
    _GONE = object()
    def hide(path, attr, replacement=_GONE):
        real = importlib.import_module(path)
        class Proxy(types.ModuleType):
            def __getattribute__(self, name):
                caller = sys._getframe(1).f_globals.get("__name__", "")
                if name == attr and caller.startswith("ampkit"):
                    if replacement is _GONE:
                        raise AttributeError(f"module {path!r} has no attribute {name!r}")
                    return replacement
                return getattr(real, name)
        proxy = Proxy(path)
        parent, _, leaf = path.rpartition(".")
        setattr(importlib.import_module(parent), leaf, proxy)
        sys.modules[path] = proxy
""")

#: entry -> the simulation of a torch without it, run before ``import ampkit``
MISSING = {
    "autograd_state": "hide('torch._C', '_current_autograd_node')",
    "global_module_hooks": "hide('torch.nn.modules.module', '_global_backward_hooks')",
    "compile_session": "hide('torch._guards', 'CompileContext')",
    "norm_bases": "hide('torch.nn.modules.batchnorm', '_NormBase')",
    "schemas": "hide('torch._C', '_jit_get_schemas_for_operator')",
}
#: entry -> a simulation that leaves the name but changes what it does
CHANGED = {
    # reports a compilation outside torch.compile
    "compile_session": "hide('torch._guards', 'CompileContext', type('CompileContext', (), "
                       "{'current_compile_id': staticmethod(lambda: 1)}))",
    # a base the public norms no longer share
    "norm_bases": "hide('torch.nn.modules.batchnorm', '_NormBase', "
                  "type('_NormBase', (torch.nn.Module,), {}))",
    # lists no overload
    "schemas": "hide('torch._C', '_jit_get_schemas_for_operator', lambda name: [])",
    # keeps no table where registration puts the hooks
    "global_module_hooks": "hide('torch.nn.modules.module', '_global_forward_hooks', {})",
}

#: what works on every torch: autocast without custom lists, GradScaler against torch's,
#: a dialect's region, O1 conversion; printed as JSON for the intact run to compare with
PLAIN = textwrap.dedent("""
    import json, warnings
    import torch
    {simulate}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import ampkit
    out = {{"warned": [str(w.message) for w in caught if "ampkit" in str(w.message)]}}
    torch.manual_seed(0)
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    with ampkit.autocast("cpu", torch.bfloat16):
        y = a @ b
    out["autocast"] = [str(y.dtype), y.float().tolist()]
    import ampkit.paddle as amp
    with amp.auto_cast(dtype="bfloat16"):
        z = torch.nn.functional.linear(a, b.t())
    out["paddle"] = [str(z.dtype), z.float().tolist()]
    model = torch.nn.Linear(8, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampkit.GradScaler("cpu", init_scale=2.0 ** 8)
    for step in range(2):
        loss = model(a).square().mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    out["scaler"] = [scaler.get_scale(), model.weight.tolist()]
    o1 = ampkit.initialize(torch.nn.Linear(8, 3).requires_grad_(False), level="O1",
                           dtype=torch.bfloat16)
    seen = []
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda m, i, o: seen.append(type(m).__name__))
    out["o1"] = [o1(a).float().tolist(), seen]
    handle.remove()
    from ampkit import torch_internals
    out["unavailable"] = sorted(torch_internals.unavailable())
    try:
    {use}
    except torch_internals.TorchInternalsError as error:
        out["feature"] = f"REFUSED {{error}}"
    else:
        out["feature"] = "RAN"
    print(json.dumps(out))
""")

#: entry -> code that uses the feature needing it (must raise TorchInternalsError)
FEATURE = {
    "autograd_state": "checker = ampkit.NumericsChecker()\n"
                      "with checker:\n"
                      "    torch.nn.Linear(2, 2)(torch.ones(1, 2)).sum().backward()",
    "norm_bases": "ampkit.initialize(torch.nn.Sequential(torch.nn.Linear(2, 2), "
                  "torch.nn.BatchNorm1d(2)), level='O2', dtype=torch.bfloat16)",
    # read through each op object instead (the plain paths above show the same rules)
    "schemas": "from ampkit import torch_internals\n"
               "torch_internals.check('schemas')",
    "compile_session": "from ampkit import torch_internals\n"
                       "torch_internals.check('compile_session')",
    # a converted module takes nn.Module's ordinary call (the plain paths above), and
    # reading the tables refuses
    "global_module_hooks": "from ampkit import torch_internals\n"
                           "len(torch_internals.global_forward_hooks)",
}
CASES = [pytest.param(e, s, id=f"missing-{e}") for e, s in MISSING.items()] + \
        [pytest.param(e, s, id=f"changed-{e}") for e, s in CHANGED.items()]

def _run(code: str) -> str:
    code = HIDE + code
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(SRC), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def intact() -> dict[str, object]:
    return dict(json.loads(_run(PLAIN.format(simulate="pass", use="    pass"))))


@pytest.mark.parametrize("entry,simulate", CASES)
def test_a_moved_internal_costs_only_the_feature_that_needs_it(
        entry: str, simulate: str, intact: dict[str, object]) -> None:
    import torch

    from ampkit.torch_internals import ENTRIES

    use = textwrap.indent(FEATURE[entry], "    ")
    got = json.loads(_run(PLAIN.format(simulate=simulate, use=use)))
    # import ampkit: one warning, naming the entry it disabled
    assert got["unavailable"] == [entry]
    assert len(got["warned"]) == 1 and repr(entry) in got["warned"][0]
    assert intact["unavailable"] == [] and intact["warned"] == []
    # the plain paths: the same numbers as on the intact torch
    for key in ("autocast", "paddle", "scaler", "o1"):
        assert got[key] == intact[key], key
    # the feature that needs it: refused, naming torch, the entry and the public way
    line = got["feature"]
    assert line.startswith("REFUSED"), line
    assert f"torch {torch.__version__}" in line and repr(entry) in line
    assert ENTRIES[entry].public[:40] in line
