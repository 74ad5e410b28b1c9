"""``ampkit plan`` end to end: the command on a user's model module (a file in the
current folder, as a user runs it), its ``--json`` and ``--html`` outputs, and
``--device-memory``'s fitting modes and largest batches, checked against
``ampkit.plan`` called directly on the same factories."""

from __future__ import annotations

import importlib
import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

import ampkit
from ampkit.tools.cli import main

pytestmark = pytest.mark.filterwarnings("ignore")

_MODULE = """
    import torch
    import torch.nn as nn


    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(32, 64), nn.LayerNorm(64),
                                         nn.Linear(64, 16)])

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x


    def inputs(batch: int = 4):
        return torch.randn(batch, 32)
"""


@pytest.fixture
def user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The user's folder as the current one, holding ``planmodels.py``; the module as
    imported here (the same factories the command loads)."""
    (tmp_path / "planmodels.py").write_text(textwrap.dedent(_MODULE))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    monkeypatch.delitem(sys.modules, "planmodels", raising=False)
    return importlib.import_module("planmodels")


def _run(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exit_info:
        return int(exit_info.code or 0)


def test_the_json_rows_equal_ampkit_plan_called_directly_and_the_page_shows_them(
        user: Any, tmp_path: Path) -> None:
    modes = ["O2", "pure-stochastic", "pure-stochastic+step-in-backward"]
    status = _run(["plan", "planmodels:Net", "--inputs", "planmodels:inputs",
                   "--world-size", "3", "--parallel", "fsdp2", "--modes", ",".join(modes),
                   "--json", "plan.json", "--html", "plan.html"])
    assert status == 0
    data = json.loads((tmp_path / "plan.json").read_text())
    direct = ampkit.plan(user.Net, user.inputs, world_size=3, parallel="fsdp2", modes=modes)
    assert data["rows"] == [dict(r) for r in direct.rows]
    assert (data["world_size"], data["parallel"]) == (3, "fsdp2")
    assert data["device_memory"] is None and data["largest_batch"] is None
    assert all(r["peak"] is not None for r in data["rows"])  # each mode ran
    page = (tmp_path / "plan.html").read_text()
    assert "<svg" in page
    assert all(mode in page for mode in modes)


def test_device_memory_gives_the_fitting_modes_and_the_largest_batch_of_each(
        user: Any, tmp_path: Path) -> None:
    modes = ["fp32", "O2"]

    def peaks(batch: int) -> dict[str, int]:
        rows = ampkit.plan(user.Net, user.inputs, modes=modes, batch=batch).rows
        return {r["mode"]: r["peak"] for r in rows}

    # a device that holds O2 at batch 6 exactly: fp32's largest batch is smaller
    device = peaks(6)["O2"]
    status = _run(["plan", "planmodels:Net", "--inputs", "planmodels:inputs",
                   "--modes", ",".join(modes), "--device-memory", str(device),
                   "--json", "plan.json"])
    assert status == 0
    data = json.loads((tmp_path / "plan.json").read_text())
    at_default = {r["mode"]: r["peak"] for r in
                  ampkit.plan(user.Net, user.inputs, modes=modes).rows}  # batch=4
    assert data["device_memory"] == device
    assert data["fits"] == [m for m in modes if at_default[m] <= device]
    assert data["fits"], at_default  # batch 4 < 6: at least O2 fits
    for mode, batch in data["largest_batch"].items():
        # the largest batch that fits, found here by planning it and the next one
        assert peaks(batch)[mode] <= device < peaks(batch + 1)[mode], (mode, batch)
    assert data["largest_batch"]["O2"] == 6


def test_the_command_refuses_fsdp2_with_tensor_parallelism_in_the_planner_s_words(
        user: Any, capsys: pytest.CaptureFixture[str]) -> None:
    status = _run(["plan", "planmodels:Net", "--inputs", "planmodels:inputs",
                   "--world-size", "4", "--parallel", "fsdp2+tp"])
    assert status == 2
    assert "parallel='fsdp2+tp' is not supported yet" in capsys.readouterr().err
