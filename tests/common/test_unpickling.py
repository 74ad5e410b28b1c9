"""Old module paths: gone (an import fails), listed in the CHANGELOG's "Removed", and
read from an older pickle by ``ampkit.common.unpickling`` only."""

import importlib
import io
import json
import pickle
import re
import subprocess
import sys
import zipfile
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


def test_every_old_path_is_gone_and_its_home_exists():
    # one fresh process for all of them: each import is tried where nothing of
    # ampkit was imported by another test first
    code = ("import importlib, json, sys\nout = {}\n"
            "for old in json.loads(sys.argv[1]):\n"
            "    try:\n        importlib.import_module(old)\n"
            "        out[old] = None\n"
            "    except ModuleNotFoundError as e:\n        out[old] = e.name\n"
            "print(json.dumps(out))\n")
    result = subprocess.run([sys.executable, "-c", code, json.dumps(sorted(MOVED_MODULES))],
                            capture_output=True, text=True, timeout=300, check=True)
    missing = json.loads(result.stdout)
    assert missing.keys() == MOVED_MODULES.keys()
    assert [old for old, name in missing.items()
            if name is None or not old.startswith(name)] == []
    for new in set(MOVED_MODULES.values()):
        assert importlib.import_module(new).__name__ == new


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


def _renamed_in_checkpoint(raw: bytes, new: bytes, old: bytes) -> bytes:
    # torch.save's zip archive, with the pickle inside it naming the old module (a
    # replace over the archive's bytes would break its sizes and checksums)
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(raw)) as src, \
            zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("data.pkl"):
                data = data.replace(new, old)
            dst.writestr(info, data)
    return out.getvalue()


@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy"])
def test_torch_load_takes_it_as_its_pickle_module(zipped):
    policy = Policy("kept", fp32_ops={"exp"})
    buffer = io.BytesIO()
    torch.save({"policy": policy, "w": torch.ones(2)}, buffer,
               _use_new_zipfile_serialization=zipped)
    raw = buffer.getvalue()
    new, gone = b"ampkit.policies.policy", b"ampkit.policy"
    old = (_renamed_in_checkpoint(raw, new, gone) if zipped else raw.replace(new, gone))
    assert old != raw
    with pytest.raises(ModuleNotFoundError, match=r"ampkit\.policy"):
        torch.load(io.BytesIO(old), weights_only=False)
    loaded = torch.load(io.BytesIO(old), pickle_module=unpickling, weights_only=False)
    assert loaded["policy"] == policy and torch.equal(loaded["w"], torch.ones(2))


def test_renamed_names_map_to_objects_that_exist():
    for (old, _), (module, name) in MOVED_NAMES.items():
        assert MOVED_MODULES[old] == module
        assert hasattr(importlib.import_module(module), name)
