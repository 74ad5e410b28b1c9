"""The benchmark scripts run: each imports and parses its arguments, and those a GPU
session needs most run on tiny settings and print what they promise.

They are the tools a GPU session runs in its few minutes on the machine: a script that
broke on the CPU would waste that time. Speeds are not checked here (they mean nothing
on this CPU); what is checked is that each configuration was measured and reported, and
the cast counts, which do not depend on the machine."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _script(name: str) -> ModuleType:
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))  # the scripts import their neighbours
    return importlib.import_module(name)


def _table_rows(text: str) -> dict[str, list[str]]:
    """``{first cell: cells}`` of every markdown table row printed."""
    rows = {}
    for line in text.splitlines():
        if line.startswith("| ") and not line.startswith("|---"):
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            rows[cells[0]] = cells
    return rows


SCRIPTS = sorted(path.stem for path in BENCHMARKS.glob("*.py")
                 if not path.name.startswith("_"))


def test_the_scripts_are_found():
    assert {"autocast_overhead", "cast_traffic", "o2_step_overhead"} <= set(SCRIPTS)


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_script_imports_and_answers_help(name, capsys):
    # A script that imports a module ampkit has since renamed breaks only when run:
    # this imports each one and parses --help (argparse exits 0 after printing usage).
    script = _script(name)
    with pytest.raises(SystemExit) as exited:
        script.main(["--help"])
    assert exited.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_autocast_overhead_reports_every_region_against_native(capsys, monkeypatch):
    autocast_overhead = _script("autocast_overhead")
    monkeypatch.setattr(autocast_overhead, "SIZES", {"tiny": (16, 1, 4, 2, 2)})
    autocast_overhead.main(["--rounds", "1", "--threads", "1"])
    out = capsys.readouterr().out
    for region in ("native", "empty-mode", "ampkit", "ampkit+5same", "ampkit+5new"):
        assert re.search(rf"^  {re.escape(region)} +\d+\.\d{{3}} ms/step +\(\d+\.\d{{3}}x native\)",
                         out, re.MULTILINE), out
    assert "(1.000x native)" in out


def test_cast_traffic_reports_each_mode_and_o2_below_native_when_accumulating(capsys):
    # (A copy lives for one forward: O2 is below native with
    # accumulation only with the opt-in reuse_casts block.)
    cast_traffic = _script("cast_traffic")
    status = cast_traffic.main(["--models", "cnn", "--dtype", "bfloat16", "--modes",
                                "native", "O2", "--accumulate", "2", "--reuse-casts",
                                "--by-op"])
    out = capsys.readouterr().out
    assert status == 0
    assert "(2 micro-batches in one reuse_casts block)" in out
    rows = _table_rows(out)
    assert rows["native"][3] == "1.00x"
    ratio = float(rows["O2"][3].rstrip("x"))
    assert 0 < ratio < 1, out
    assert re.search(r"O2: .*_to_copy \d+", out), out  # the --by-op breakdown


def test_cast_traffic_refuses_a_non_positive_accumulate(capsys):
    cast_traffic = _script("cast_traffic")
    with pytest.raises(SystemExit):
        cast_traffic.main(["--accumulate", "0"])
    assert "--accumulate" in capsys.readouterr().err


def test_gpu_throughput_rehearsal_reports_each_mode_against_native_bf16(capsys):
    # The whole rehearsal (every model, mode and phase) runs in test_gpu_rehearsal.py;
    # this is the table's arithmetic on one model, eager.
    gpu_throughput = _script("gpu_throughput")
    modes = ["fp32", "native-bf16", "O2", "pure-stochastic", "pure-in-backward"]
    status = gpu_throughput.main(["--rehearse", "--models", "resnet50", "--compile", "off",
                                  "--modes", *modes, "--warmup", "1", "--rounds", "2",
                                  "--steps", "1", "--threads", "1", "--profile", "3",
                                  "--profile-modes", "O2"])
    out = capsys.readouterr().out
    assert status == 0
    rows = _table_rows(out)
    for mode in modes:
        speed, ms = float(rows[mode][1].replace(",", "")), float(rows[mode][2])
        # 4 images a step (images/s is printed rounded to a whole number)
        assert speed == pytest.approx(4 / (ms / 1e3), rel=0.01, abs=0.5), out
    assert rows["native-bf16"][3] == "1.00x"
    assert "resnet50 O2 (eager), one step profiled" in out
    assert "Self CPU" in out  # the profiler's table


def test_gpu_throughput_reports_a_compiled_step_that_fell_back_as_skipped(capsys,
                                                                          monkeypatch):
    # An optimizer the compiled step does not take (here a subclass of AdamW) steps
    # eagerly with a warning: its row must say so, not be timed as "compiled step".
    gpu_throughput = _script("gpu_throughput")

    class MyAdamW(torch.optim.AdamW):
        pass

    monkeypatch.setattr(torch.optim, "AdamW", MyAdamW)
    modes = ["native-bf16", "pure-stochastic-compiled-step"]
    status = gpu_throughput.main(["--rehearse", "--models", "resnet50", "--compile", "off",
                                  "--modes", *modes, "--warmup", "1", "--rounds", "1",
                                  "--steps", "1", "--threads", "1"])
    out = capsys.readouterr().out
    assert status == 0
    cells = _table_rows(out)["pure-stochastic-compiled-step"]
    assert cells[1].startswith("skipped: the compiled step fell back to the eager step: "), out
    assert "MyAdamW" in cells[1], out
    assert float(_table_rows(out)["native-bf16"][1].replace(",", "")) > 0


def test_gpu_throughput_refuses_compile_modes_without_a_compiled_phase(capsys):
    gpu_throughput = _script("gpu_throughput")
    with pytest.raises(SystemExit):
        gpu_throughput.main(["--rehearse", "--compile", "off", "--compile-modes", "O2"])
    assert "--compile-modes" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_gpu_throughput_says_it_needs_cuda(capsys):
    gpu_throughput = _script("gpu_throughput")
    assert gpu_throughput.main([]) == 1
    assert "no CUDA device" in capsys.readouterr().err


def test_o2_step_overhead_reports_each_configuration(capsys):
    o2_step_overhead = _script("o2_step_overhead")
    status = o2_step_overhead.main(["--layers", "3", "--rounds", "1", "--steps", "1"])
    out = capsys.readouterr().out
    assert status == 0
    rows = _table_rows(out)
    for config in o2_step_overhead.CONFIGS:
        forward, backward, step, total = (float(cell) for cell in rows[config][1:5])
        assert forward > 0 and backward > 0 and step > 0
        assert total == pytest.approx(forward + backward + step, abs=0.003)
    assert "6 parameters" in out
    assert "O2 over bf16, per parameter" in out
    assert re.search(r"all over native: O2 \d+\.\d{3}x, py-cast \d+\.\d{3}x", out)


def test_o2_step_overhead_py_cast_layer_does_native_autocasts_work():
    # The floor configuration is only a fair comparison if it computes what native
    # autocast computes for the same layer: the same bits forward and backward.
    o2_step_overhead = _script("o2_step_overhead")
    torch.manual_seed(0)
    native = torch.nn.Linear(16, 16)
    floor = o2_step_overhead._CastInForward(16, 16)
    floor.load_state_dict(native.state_dict())
    x = torch.randn(4, 16)
    outs = []
    for layer in (native, floor):
        with torch.autocast("cpu", torch.bfloat16):
            out = layer(x)
        out.float().square().sum().backward()
        outs.append(out)
    assert outs[0].dtype == outs[1].dtype == torch.bfloat16
    assert torch.equal(outs[0], outs[1])
    assert floor.weight.grad.dtype == torch.float32
    assert torch.equal(native.weight.grad, floor.weight.grad)
    assert torch.equal(native.bias.grad, floor.bias.grad)
