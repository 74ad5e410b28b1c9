"""The demo's training runs, checked against plain PyTorch written out here.

Oracles: a plain PyTorch loop (fp32), native ``torch.autocast`` (O1-bf16), native
``torch.autocast`` + ``torch.amp.GradScaler`` (O1-fp16), and the printed O2 code itself,
executed as text. The data split and batch order are re-derived here from their
documented recipe, not taken from the demo.
"""

import json
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import ampkit
from ampkit.tools.cli import main
from ampkit.tools.demo.digits import DigitsCNN
from ampkit.tools.demo.run import (
    DEFAULT_EPOCHS,
    DemoResult,
    DemoSettings,
    RunConfig,
    RunResult,
    demo_configurations,
    run_demo,
    training_code,
)

SEED = 3  # not the default, so a seed that is ignored somewhere shows up


def _reference_data(seed: int) -> tuple[torch.Tensor, ...]:
    digits = load_digits()
    train, test = train_test_split(np.arange(len(digits.target)), test_size=0.25,
                                   random_state=seed, stratify=digits.target)
    x = torch.from_numpy(digits.images.astype(np.float32)).unsqueeze(1) / 16
    y = torch.from_numpy(digits.target).long()
    return x[train], y[train], x[test], y[test]


def _reference_batches(x: torch.Tensor, y: torch.Tensor, batch: int, epochs: int,
                       seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(epochs):
        perm = torch.randperm(len(y), generator=g)
        for start in range(0, len(y) - batch + 1, batch):
            idx = perm[start:start + batch]
            batches.append((x[idx], y[idx]))
    return batches


def _fresh_model_and_sgd(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = DigitsCNN()
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _demo(*names: str, epochs: int = 1) -> DemoResult:
    configs = {c.name: c for c in demo_configurations(["fp32", "O1", "O2", "O3"])}
    settings = DemoSettings(epochs=epochs, device="cpu", seed=SEED,
                            configurations=tuple(configs[n] for n in names))
    return run_demo(settings)


def _accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        return (model(x).float().argmax(1) == y).double().mean().item()


@pytest.fixture(scope="module")
def bf16_runs() -> dict[str, RunResult]:
    result = _demo("fp32", "O1-bf16", "O2-bf16", "O3-bf16")
    return {run.name: run for run in result.runs}


def test_fp32_run_is_a_plain_pytorch_loop_on_the_documented_split(
        bf16_runs: dict[str, RunResult]) -> None:
    x_train, y_train, x_test, y_test = _reference_data(SEED)
    model, opt = _fresh_model_and_sgd(SEED)
    losses = []
    for x, y in _reference_batches(x_train, y_train, 64, 1, SEED):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    run = bf16_runs["fp32"]
    assert len(run.losses) == len(losses) == 1347 // 64
    assert run.losses == tuple(losses)
    assert run.test_accuracy == _accuracy(model, x_test, y_test)
    assert run.final_loss == pytest.approx(float(np.mean(losses)))
    assert run.low_precision_share == 0.0
    assert (run.final_loss_scale, run.loss_scales, run.skipped_steps) == (None, (), 0)


def test_o1_bf16_run_matches_native_autocast_bit_for_bit(
        bf16_runs: dict[str, RunResult]) -> None:
    x_train, y_train, x_test, y_test = _reference_data(SEED)
    model, opt = _fresh_model_and_sgd(SEED)
    losses = []
    for x, y in _reference_batches(x_train, y_train, 64, 1, SEED):
        opt.zero_grad()
        with torch.autocast("cpu", torch.bfloat16):  # the loss inside native's region
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    with torch.autocast("cpu", torch.bfloat16):
        accuracy = _accuracy(model, x_test, y_test)
    run = bf16_runs["O1-bf16"]
    assert run.losses == tuple(losses)
    assert run.test_accuracy == accuracy


def test_o1_fp16_run_matches_native_autocast_and_torch_grad_scaler() -> None:
    x_train, y_train, _, _ = _reference_data(SEED)
    model, opt = _fresh_model_and_sgd(SEED)
    scaler = torch.amp.GradScaler("cpu", growth_interval=20)
    losses, scales = [], []
    for x, y in _reference_batches(x_train, y_train, 64, 1, SEED):
        opt.zero_grad()
        with torch.autocast("cpu", torch.float16):  # the loss inside native's region
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
        scales.append(scaler.get_scale())
    run = _demo("O1-fp16").runs[0]
    assert run.losses == tuple(losses)
    assert run.loss_scales == tuple(scales)
    assert run.final_loss_scale == scales[-1]
    # torch's scaler halves the scale exactly on a skipped step (growth never coincides)
    halvings = sum(b < a for a, b in zip([2.0**16, *scales], scales))
    assert run.skipped_steps == halvings


class _RecordingBatches:
    """The ``batches`` of the printed code; records the loss and scale of each step."""

    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]],
                 namespace: dict) -> None:
        self.batches, self.ns = batches, namespace
        self.losses: list[float] = []
        self.scales: list[float] = []

    def record(self) -> None:
        self.losses.append(self.ns["loss"].item())
        self.scales.append(self.ns["scaler"].get_scale())

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i, batch in enumerate(self.batches):
            if i:
                self.record()
            yield batch
        self.record()


@pytest.mark.parametrize("name", ["O2-fp16", "O2-bf16"])
def test_printed_code_is_the_code_the_run_executed(name: str) -> None:
    level, short = name.split("-")
    config = RunConfig(level, {"fp16": torch.float16, "bf16": torch.bfloat16}[short])
    code = training_code(config)
    assert 5 <= len(code.splitlines()) <= 8
    assert 'ampkit.initialize(model, optimizer, level="O2"' in code
    x_train, y_train, _, _ = _reference_data(SEED)
    model, optimizer = _fresh_model_and_sgd(SEED)
    ns = {"ampkit": ampkit, "torch": torch, "F": F, "model": model, "optimizer": optimizer}
    batches = _RecordingBatches(_reference_batches(x_train, y_train, 64, 1, SEED), ns)
    ns["batches"] = batches
    exec(compile(code, f"<printed {name} code>", "exec"), ns)
    run = _demo(name).runs[0]
    assert run.losses == tuple(batches.losses)
    if config.loss_scaling:
        assert run.loss_scales == tuple(batches.scales)
    else:
        assert run.loss_scales == () and set(batches.scales) == {1.0}  # disabled scaler


def test_op_tables_show_what_each_level_runs_in_low_precision(
        bf16_runs: dict[str, RunResult]) -> None:
    def row(run: str, op: str) -> list[int]:
        line = next(r for r in bf16_runs[run].op_table.splitlines()
                    if r.split("|")[0].strip() == op)
        return [int(c) for c in line.split("|")[1:]]  # fp16, bf16, fp32, other

    assert row("fp32", "convolution") == [0, 0, 2, 0]
    assert row("O1-bf16", "convolution") == [0, 2, 0, 0]  # native autocast: conv in bf16
    # O2 keeps the norms' parameters and arithmetic fp32, but BatchNorm takes the bf16
    # activation as it is and returns bf16 (no cast of the activation), so by output
    # dtype it is a bf16 call, as at O3 (whose parameters are bf16 too).
    assert row("O2-bf16", "native_batch_norm") == [0, 2, 0, 0]
    assert row("O3-bf16", "native_batch_norm") == [0, 2, 0, 0]
    shares = {name: run.low_precision_share for name, run in bf16_runs.items()}
    assert shares["fp32"] == 0.0
    assert 0.0 < shares["O1-bf16"] < shares["O3-bf16"] <= 1.0


def test_peak_memory_is_measured_and_lower_with_bf16_activations(
        bf16_runs: dict[str, RunResult]) -> None:
    fp32 = bf16_runs["fp32"].peak_memory_bytes
    # at least the fp32 activations saved for backward: two convs, two norms, two relus
    assert fp32 > 64 * 64 * 4 * (8 + 8 + 8 + 16 + 16 + 16)
    assert 0 < bf16_runs["O3-bf16"].peak_memory_bytes < fp32
    assert 0 < bf16_runs["O1-bf16"].peak_memory_bytes < fp32


def test_step_times_are_positive_and_give_the_throughput(
        bf16_runs: dict[str, RunResult]) -> None:
    for run in bf16_runs.values():
        assert run.step_time_s > 0
        assert run.samples_per_second == pytest.approx(64 / run.step_time_s)


def test_the_caller_rng_is_left_alone() -> None:
    torch.manual_seed(1234)
    expected = torch.rand(3)
    torch.manual_seed(1234)
    _demo("O3-bf16")
    assert torch.equal(torch.rand(3), expected)


def test_default_configurations_and_how_levels_and_dtypes_combine() -> None:
    names = [c.name for c in demo_configurations()]
    assert names == ["fp32", "O1-bf16", "O2-bf16", "O3-bf16", "O1-fp16", "O2-fp16"]
    assert [c.name for c in DemoSettings().configurations] == names
    assert [c.name for c in demo_configurations(dtypes=["fp16"])] == [
        "fp32", "O1-fp16", "O2-fp16"]
    assert [c.name for c in demo_configurations(["O3", "O0", "O3"], ["fp16", "bf16"])] == [
        "fp32", "O3-bf16", "O3-fp16"]
    assert [c.name for c in demo_configurations(["fp32"], ["bf16"])] == ["fp32"]
    fp16_runs = [c for c in demo_configurations() if c.loss_scaling]
    assert [c.scaler_options for c in fp16_runs] == [{"growth_interval": 20}] * 2


@pytest.mark.parametrize("call,message", [
    (lambda: demo_configurations(["O4"]),
     "levels must name only fp32, O0, O1, O2, O3, got 'O4'"),
    (lambda: demo_configurations(dtypes=["int8"]),
     "dtypes must name only bf16, fp16, got 'int8'"),
    (lambda: demo_configurations([]), "levels must name at least one of"),
    (lambda: RunConfig("O2"), "dtype of an O2 run must be torch.bfloat16 or torch.float16"),
    (lambda: RunConfig("fp32", torch.float16), "the fp32 run takes no dtype"),
    (lambda: RunConfig("O5", torch.float16), "level must be one of"),
    (lambda: DemoSettings(epochs=0), "epochs must be a positive int, got 0"),
    (lambda: DemoSettings(seed=-2), "seed must be a non-negative int, got -2"),
    (lambda: DemoSettings(device="gpu"), "device must be 'auto', 'cpu', 'cuda' or"),
    (lambda: DemoSettings(configurations=()), "configurations must be a non-empty"),
])
def test_bad_settings_raise_value_errors_naming_the_argument(call, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        call()


def test_quiet_prints_only_the_table(tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--epochs", "1", "--levels", "fp32", "--quiet",
                 "--out", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert err == ""  # no progress bars
    assert "fp32" in out and "Configuration" in out
    assert "initialize" not in out and "Report:" not in out
    assert (tmp_path / "report.html").is_file()


def test_the_demo_keeps_files_it_did_not_write(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "report"
    out.mkdir()
    # a user's files, two of them of names the demo writes when it makes those plots
    foreign = {"loss_scale.png": b"a user's plot", "pure_bf16.png": b"another one",
               "notes.txt": b"notes"}
    for name, data in foreign.items():
        (out / name).write_bytes(data)
    argv = ["demo", "--epochs", "1", "--levels", "fp32", "--pure-bf16-steps", "0",
            "--quiet", "--out", str(out)]
    assert main(argv) == 0
    for name, data in foreign.items():
        assert (out / name).read_bytes() == data, name
    ours = ["accuracy.png", "loss_curves.png", "report.html", "results.json"]
    assert sorted(p.name for p in out.iterdir()) == sorted([*foreign, *ours])
    capsys.readouterr()
    # a second run would replace files this one did not write: refused, nothing touched
    before = {name: (out / name).read_bytes() for name in ours}
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        f"ampkit demo: error: cannot write the report to '{out}': it already holds "
        f"loss_curves.png, accuracy.png, report.html, results.json; pass --overwrite to "
        f"replace them, or choose another --out\n")
    assert {name: (out / name).read_bytes() for name in ours} == before
    assert main([*argv, "--overwrite"]) == 0  # replaces its own names only
    for name, data in foreign.items():
        assert (out / name).read_bytes() == data, name
    assert (out / "results.json").read_bytes() != before["results.json"]  # a new run


@pytest.mark.slow
def test_default_epochs_give_real_accuracies_in_the_json(tmp_path: Path) -> None:
    assert main(["demo", "--quiet", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["epochs"] == DEFAULT_EPOCHS
    accuracy = {run["name"]: run["test_accuracy"] for run in data["runs"]}
    assert list(accuracy) == ["fp32", "O1-bf16", "O2-bf16", "O3-bf16", "O1-fp16", "O2-fp16"]
    assert accuracy["fp32"] > 0.8
    for name, value in accuracy.items():
        assert value > 0.8, (name, value)
        assert value >= accuracy["fp32"] - 0.05, (name, value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_demo_auto_runs_on_cuda(tmp_path: Path) -> None:
    settings = DemoSettings(epochs=1, configurations=demo_configurations(["fp32", "O2"],
                                                                         ["fp16"]))
    result = run_demo(settings)
    assert result.device.startswith("cuda")
    assert [run.name for run in result.runs] == ["fp32", "O2-fp16"]
    assert all(run.test_accuracy > 0.5 for run in result.runs)
