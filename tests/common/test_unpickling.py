"""Old module paths: gone (an import fails), listed in the CHANGELOG's "Removed", and
read from an older pickle by ``ampkit.common.unpickling`` only."""

import importlib
import io
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ampkit.common import unpickling
from ampkit.common.unpickling import MOVED_MODULES, MOVED_NAMES
from ampkit.policies.policy import Policy

ROOT = Path(__file__).resolve().parents[2]

#: The modules of the 0.1.0 release that are gone (read from its tree, by hand: a test
#: must not compute what it checks from the code under test).
RELEASED_AND_GONE = {
    "ampkit._lazy", "ampkit.arguments", "ampkit.autocast_kernels", "ampkit.autocast_mode",
    "ampkit.casting", "ampkit.compile_frames", "ampkit.containers",
    "ampkit.function_patching", "ampkit.levels", "ampkit.master_weights_pure",
    "ampkit.module_selection", "ampkit.parameter_casts", "ampkit.policy", "ampkit.presets",
    "ampkit.registry", "ampkit.scaling.multi_loss", "ampkit.tools._text",
    "ampkit.tools._tracing", "ampkit.tools.cast_traffic", "ampkit.tools.cli_args",
    "ampkit.tools.cli_compare", "ampkit.tools.cli_target", "ampkit.tools.cli_tune",
    "ampkit.tools.compare", "ampkit.tools.compare_report", "ampkit.tools.comparison",
    "ampkit.tools.digits", "ampkit.tools.fp8_casts", "ampkit.tools.fp8_decisions",
    "ampkit.tools.fp8_errors", "ampkit.tools.fp8_tune", "ampkit.tools.list_usage",
    "ampkit.tools.numerics_checker", "ampkit.tools.op_stats", "ampkit.tools.plotting",
    "ampkit.tools.pure_curves", "ampkit.tools.report", "ampkit.tools.tune",
}


def test_every_released_path_that_is_gone_has_a_home():
    assert set(MOVED_MODULES) >= RELEASED_AND_GONE


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_an_old_path_is_gone_and_its_home_exists(old):
    code = (f"import importlib\ntry:\n    importlib.import_module({old!r})\n"
            "except ModuleNotFoundError as e:\n    print(e.name)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out and old.startswith(out[0])
    assert importlib.import_module(MOVED_MODULES[old]).__name__ == MOVED_MODULES[old]


def test_the_changelog_lists_every_removed_path_with_its_home():
    text = (ROOT / "CHANGELOG.md").read_text()
    unreleased = text[text.index("## [Unreleased]"):text.index("## [0.1.0]")]
    removed = unreleased[unreleased.index("### Removed"):]
    removed = removed[:removed.index("\n### ", 1)] if "\n### " in removed[1:] else removed
    pairs = dict(re.findall(r"`(ampkit[\w.]*)` → `(ampkit[\w.]*)`", removed))
    assert pairs == MOVED_MODULES


@pytest.mark.parametrize(("old", "name"), [
    ("ampkit.policy", "Policy"), ("ampkit.levels", "Level"),
    ("ampkit.parameter_casts", "reuse_casts"), ("ampkit.tools.compare", "compare")])
def test_an_old_path_in_a_pickle_loads_the_object_from_its_home(old, name):
    import ampkit
    new = MOVED_MODULES[old]
    obj = getattr(importlib.import_module(new), name)
    data = pickle.dumps(obj, protocol=2)  # GLOBAL opcodes: "module\nname\n"
    old_data = data.replace(f"{new}\n".encode(), f"{old}\n".encode())
    assert old_data != data
    with pytest.raises(ModuleNotFoundError, match=old.replace(".", r"\.")):
        pickle.loads(old_data)
    assert unpickling.loads(old_data) is obj
    assert getattr(ampkit, name, obj) is obj


def test_torch_load_takes_it_as_its_pickle_module():
    policy = Policy("kept", fp32_ops={"exp"})
    buffer = io.BytesIO()
    torch.save({"policy": policy, "w": torch.ones(2)}, buffer)
    raw = buffer.getvalue()
    old = raw.replace(b"ampkit.policies.policy", b"ampkit.policy")
    assert old != raw
    with pytest.raises(ModuleNotFoundError):
        torch.load(io.BytesIO(old), weights_only=False)
    loaded = torch.load(io.BytesIO(old), pickle_module=unpickling, weights_only=False)
    assert loaded["policy"] == policy and torch.equal(loaded["w"], torch.ones(2))


def test_renamed_names_map_to_objects_that_exist():
    for (old, _), (module, name) in MOVED_NAMES.items():
        assert MOVED_MODULES[old] == module
        assert hasattr(importlib.import_module(module), name)
