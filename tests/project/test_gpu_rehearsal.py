"""The GPU campaign's dress rehearsal: ``benchmarks/gpu_checks.sh --rehearse``
runs every piece of the GPU run at toy sizes on this CPU, with this torch.

A GPU session has about 15 minutes of device time, all tries together: a piece that
breaks on an argument error, a missing import or a torch incompatibility must break
here instead. Checked: the script exits 0, every piece wrote its file under its header
line (device, torch and CUDA versions) and exited 0, the rehearsal runs the same pieces
as the GPU run, and each file holds what its piece promises (every mode of every model
measured, the stated skips only where they are expected).
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_checks.sh"
PIECES = ("suite-cuda.log", "suite-hidden.log", "throughput.txt", "profile.txt",
          "memory-o2.txt", "memory-pure.txt", "fp8.txt", "plan.txt")
HEADER = re.compile(r"^# device: .+; torch \S+; CUDA \S+$")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                       reason="gpu_checks.sh needs bash and coreutils' timeout"),
    pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                       reason="the GPT-2 and Llama models come from transformers"),
]


def _rows(text: str) -> dict[str, list[str]]:
    """``{first cell: cells}`` of the markdown rows under each table title line."""
    rows: dict[str, list[str]] = {}
    title = ""
    for line in text.splitlines():
        if re.match(r"^\w+, (eager|compiled)", line):
            title = line.split(":")[0]
        elif line.startswith("| ") and not line.startswith("|---"):
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            rows[f"{title} {cells[0]}"] = cells
    return rows


def test_the_rehearsal_runs_the_pieces_of_the_gpu_run():
    # Both branches of the script name the same files: a piece added to the GPU run
    # only would go unrehearsed.
    text = SCRIPT.read_text(encoding="utf-8")
    rehearsal, gpu = text.split('if [ "$rehearse" = 1 ]; then\n    # The suite pieces')[1] \
        .split("\nelse\n", 1)
    names = [re.findall(r"^\s*piece (\S+) ", part, re.MULTILINE) for part in (rehearsal, gpu)]
    assert names[0] == names[1] == list(PIECES)


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("gpu-rehearsal")
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(SCRIPT), "--rehearse", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1200)
    return out, f"exit status {done.returncode}\n{done.stdout}\n{done.stderr}"


def test_every_piece_wrote_its_file_under_the_header_and_passed(rehearsal):
    out, log = rehearsal
    assert log.startswith("exit status 0"), log
    summary = (out / "summary.txt").read_text(encoding="utf-8").splitlines()
    assert HEADER.match(summary[0]), summary[0]
    for name in PIECES:
        lines = (out / name).read_text(encoding="utf-8").splitlines()
        assert HEADER.match(lines[0]) and "REHEARSAL" in lines[0], (name, lines[0])
        assert lines[-1] == "# exit status 0", (name, lines[-10:])
        assert re.search(rf"^{re.escape(name)} +ok +\d+ s$", "\n".join(summary),
                         re.MULTILINE), summary
    assert summary[-1].endswith("0 piece(s) not ok"), summary


def test_the_suite_pieces_collected_the_cuda_tests(rehearsal):
    out, _ = rehearsal
    for name in ("suite-cuda.log", "suite-hidden.log"):
        text = (out / name).read_text(encoding="utf-8")
        assert re.search(r"\b\d+ skipped\b", text), text  # no GPU here: they skip
        assert "error" not in text.lower(), text


def test_the_throughput_table_measured_every_mode_of_every_model(rehearsal):
    gpu_throughput = _benchmark("gpu_throughput")
    out, _ = rehearsal
    text = (out / "throughput.txt").read_text(encoding="utf-8")
    rows = _rows(text)
    fp8 = {m for m, mode in gpu_throughput.MODES.items() if mode.fp8}
    for model in ("resnet50", "gpt2", "llama"):
        for phase, modes in (("eager", list(gpu_throughput.MODES)),
                             ("compiled (eager)", ["native-bf16", "O2", "fp8-tensorwise"])):
            for mode in modes:
                cells = rows[f"{model}, {phase} {mode}"]
                unavailable = mode in fp8 and gpu_throughput.fp8_unavailable(
                    gpu_throughput.MODES[mode].fp8, _cpu()) is not None
                if unavailable:  # the recipe cannot run on this torch and CPU (2.11: rowwise)
                    assert cells[1].startswith("skipped: "), cells  # said, with why
                elif mode in fp8 and model == "resnet50":
                    assert cells[1].startswith("skipped: its only Linear is the head"), cells
                else:
                    assert float(cells[1].replace(",", "")) > 0, (model, phase, cells)
            assert rows[f"{model}, {phase} native-bf16"][3] == "1.00x"


def test_the_throughput_table_has_the_compiled_pure_step_beside_the_eager_one(rehearsal):
    # The compiled step (compile_step=True) took every model's optimizer (a fallback to
    # the eager step would be printed as skipped), trained from the same weights on the
    # same batches to the loss the eager pure step reaches, and its warm-up (the step's
    # compilation) is reported.
    out, _ = rehearsal
    text = (out / "throughput.txt").read_text(encoding="utf-8")
    rows = _rows(text)
    for model in ("resnet50", "gpt2", "llama"):
        for rounding in ("stochastic", "kahan"):
            eager = rows[f"{model}, eager pure-{rounding}"]
            cells = rows[f"{model}, eager pure-{rounding}-compiled-step"]
            assert float(cells[1].replace(",", "")) > 0 and float(cells[2]) > 0, cells
            assert re.fullmatch(r"\d+\.\d\dx", cells[3]), cells
            loss, eager_loss = float(cells[6]), float(eager[6])
            assert math.isfinite(loss) and abs(loss - eager_loss) <= 0.01 * eager_loss, \
                (cells, eager)
    warmups = re.findall(r"^warm-up \(compilation included\): (.+)$", text, re.MULTILINE)
    assert len(warmups) == 6, warmups  # a line per model and phase
    for line in warmups[:3]:  # the eager phase's
        for rounding in ("stochastic", "kahan"):
            assert re.search(rf"\bpure-{rounding}-compiled-step \d+\.\d s\b", line), line


def test_the_profile_holds_one_native_and_one_o2_step_per_model(rehearsal):
    out, _ = rehearsal
    text = (out / "profile.txt").read_text(encoding="utf-8")
    for model in ("resnet50", "gpt2", "llama"):
        for mode in ("native-bf16", "O2"):
            assert f"{model} {mode} (eager), one step profiled, top 5 ops" in text
    assert text.count("Self CPU time total") == 6


def test_the_memory_and_fp8_scripts_reported_their_rows(rehearsal):
    out, _ = rehearsal
    o2 = _rows_of(out / "memory-o2.txt")
    assert {"fp32", "native", "O1", "O2", "O3"} <= set(o2)
    assert o2["fp32"][3] == "1.00x"
    pure = _rows_of(out / "memory-pure.txt")
    assert {"fp32", "O2 stochastic", "O2 kahan"} <= set(pure)
    assert re.search(r"\d ms$", pure["O2 stochastic"][-1]), pure  # --time-steps timed it
    # pure bf16 stepping inside backward: measured and timed (its step is the backward)
    for config in ("O2 stochastic, step in backward", "O2 kahan, step in backward"):
        assert re.search(r"\d ms$", pure[config][-1]), pure
    fp8 = (out / "fp8.txt").read_text(encoding="utf-8")
    if _benchmark("gpu_throughput").fp8_unavailable("tensorwise", _cpu()) is None:
        assert "| fp8 O2 tensorwise |" in fp8, fp8
    else:
        assert "fp8 O2 tensorwise: skipped: " in fp8, fp8


def test_the_plan_piece_compared_each_mode_with_a_measured_peak(rehearsal):
    out, _ = rehearsal
    plan = _rows_of(out / "plan.txt")
    assert {"O1", "O2", "pure-stochastic"} <= set(plan), plan
    for mode in ("O1", "O2", "pure-stochastic"):
        assert re.fullmatch(r"[+-]\d+\.\d%", plan[mode][3]), plan[mode]


def _rows_of(path: Path) -> dict[str, list[str]]:
    rows = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("| ") and not line.startswith("|---"):
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            rows[cells[0]] = cells
    return rows


def _cpu():  # type: ignore[no-untyped-def]
    import torch

    return torch.device("cpu")


def _benchmark(name: str):  # type: ignore[no-untyped-def]
    benchmarks = str(ROOT / "benchmarks")
    if benchmarks not in sys.path:
        sys.path.insert(0, benchmarks)  # the scripts import their neighbours
    import importlib

    return importlib.import_module(name)
