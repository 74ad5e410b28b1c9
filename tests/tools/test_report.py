"""The report writer on hand-made results (no training): files, JSON, HTML, table."""

import html
import json
import math
import re
from pathlib import Path

import matplotlib.image
import pytest
import torch

from ampkit.tools.demo.report import (
    identical_runs,
    report_data,
    report_file_names,
    summary_table,
    write_report,
)
from ampkit.tools.demo.run import DemoResult, DemoSettings, RunConfig, RunResult
from ampkit.tools.pages.html import check_output_dir


def _run(name: str, *, accuracy: float = 0.9, scales: tuple[float, ...] = (),
         losses: tuple[float, ...] = (2.0, 1.0, 0.5, 0.25), skipped: int = 0,
         op_counts: tuple[tuple[str, int, int, int, int], ...] = ()) -> RunResult:
    level, _, short = name.partition("-")
    return RunResult(
        name=name, level=level, dtype={"": None, "bf16": "bfloat16", "fp16": "float16"}[short],
        test_accuracy=accuracy, final_loss=losses[-1], step_time_s=0.0125,
        samples_per_second=64 / 0.0125, peak_memory_bytes=3 * 2**20 + 2**19,
        skipped_steps=skipped, final_loss_scale=scales[-1] if scales else None,
        low_precision_share=0.4 if short else 0.0, losses=losses, loss_scales=scales,
        op_table="Op Name | FP16 Calls\n<mm> | 1", op_counts=op_counts)


def _result(*runs: RunResult, device: str = "cpu") -> DemoResult:
    configs = tuple(RunConfig(r.level, None if r.dtype is None else getattr(torch, r.dtype))
                    for r in runs)
    return DemoResult(settings=DemoSettings(epochs=2, device="cpu", configurations=configs),
                      device=device, device_name="Test <CPU> & co", runs=runs,
                      wall_time_s=12.5, torch_version=torch.__version__,
                      ampkit_version="0.1.0", memory_measure="a measure")


def test_summary_table_formats_every_column() -> None:
    table = summary_table(_result(
        _run("fp32", accuracy=0.98125),
        _run("O2-fp16", accuracy=0.97905, scales=(65536.0, 32768.0), skipped=3)))
    assert table.columns == ("Configuration", "Test accuracy", "vs fp32", "Final loss",
                             "Time / step", "Peak memory", "Skipped steps",
                             "Final loss scale", "Low-precision ops")
    assert table.rows == (
        ("fp32", "98.1%", "-", "0.2500", "12.50 ms", "3.50 MiB", "-", "-", "0%"),
        ("O2-fp16", "97.9%", "-0.22", "0.2500", "12.50 ms", "3.50 MiB", "3", "32,768",
         "40%"),
    )


def test_summary_table_without_fp32_has_no_difference_column() -> None:
    table = summary_table(_result(_run("O1-bf16"), _run("O2-bf16")))
    assert "vs fp32" not in table.columns
    assert table.columns[:3] == ("Configuration", "Test accuracy", "Final loss")


def test_summary_table_adds_throughput_on_cuda() -> None:
    table = summary_table(_result(_run("fp32"), device="cuda:0"))
    assert table.columns[5] == "Samples / s"
    assert table.rows[0][5] == "5,120"


def test_write_report_without_fp16_runs_writes_no_loss_scale_plot(tmp_path: Path) -> None:
    files = write_report(_result(_run("fp32"), _run("O1-bf16")), tmp_path)
    assert files.loss_scale_png is None
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "accuracy.png", "loss_curves.png", "report.html", "results.json"]
    page = files.html.read_text()
    assert page.count("<img") == 2 and 'id="loss-scale"' not in page


def test_write_report_leaves_files_it_did_not_write_alone(tmp_path: Path) -> None:
    # a user's files of the report's optional names, and of others: this run makes no
    # loss-scale plot and no pure-bf16 plot, so it must neither replace nor delete them
    foreign = {"loss_scale.png": b"my plot", "pure_bf16.png": b"mine too",
               "notes.txt": b"notes"}
    for name, data in foreign.items():
        (tmp_path / name).write_bytes(data)
    result = _result(_run("fp32"), _run("O1-bf16"))
    files = write_report(result, tmp_path)
    for name, data in foreign.items():
        assert (tmp_path / name).read_bytes() == data, name
    written = sorted(path.name for path in files.all())
    assert written == sorted(report_file_names(result.settings))
    assert sorted(json.loads(files.json.read_text())["files"]) == written


def test_report_file_names_follow_the_settings() -> None:
    settings = DemoSettings(configurations=(RunConfig("fp32"),), pure_bf16_steps=3)
    assert report_file_names(settings) == ("loss_curves.png", "accuracy.png",
                                           "pure_bf16.png", "report.html", "results.json")


def test_check_output_dir_refuses_report_files_already_there(tmp_path: Path) -> None:
    (tmp_path / "report.html").write_text("mine")
    with pytest.raises(FileExistsError) as info:
        check_output_dir(tmp_path, ("report.html", "results.json"), overwrite=False)
    assert str(info.value) == (f"cannot write the report to '{tmp_path}': it already holds "
                               f"report.html; pass --overwrite to replace it, or choose "
                               f"another --out")
    assert check_output_dir(tmp_path, ("report.html",), overwrite=True) == tmp_path
    assert (tmp_path / "report.html").read_text() == "mine"


_O1_COUNTS = (("_to_copy", 0, 8, 7, 0), ("addmm", 0, 1, 0, 0), ("detach", 0, 4, 22, 0),
              ("relu", 0, 2, 0, 0))
_O2_COUNTS = (("_foreach_copy_", 0, 1, 1, 0), ("_to_copy", 0, 2, 1, 0),
              ("addmm", 0, 1, 0, 0), ("detach", 0, 10, 16, 0), ("empty_like", 0, 0, 6, 0),
              ("relu", 0, 2, 0, 0))


def test_identical_runs_are_found_and_explained_by_their_op_counts() -> None:
    same = (2.0, 1.0, 0.5)
    result = _result(_run("fp32", losses=(2.0, 1.0, 0.4)),
                     _run("O1-bf16", losses=same, op_counts=_O1_COUNTS),
                     _run("O2-bf16", losses=same, op_counts=_O2_COUNTS),
                     _run("O3-bf16", losses=(2.0, 1.0, 0.5000001)))
    [group] = identical_runs(result)
    assert group.names == ("O1-bf16", "O2-bf16")
    assert group.differing_ops == (("_foreach_copy_", "copy"), ("_to_copy", "copy"),
                                   ("detach", "view"), ("empty_like", "new"))
    assert group.sentence() == (
        "O1-bf16 and O2-bf16 trained bit-identically: the same training loss at all 3 "
        "steps and the same test accuracy (90.0%). Their first training steps ran the same "
        "compute ops in the same precisions, the same number of times; they differ only in "
        "casts and copies (_foreach_copy_, _to_copy), views (detach) and new tensors "
        "(empty_like), which compute nothing.")


def test_identical_runs_with_different_compute_ops_say_so() -> None:
    other = (*_O1_COUNTS[:1], ("addmm", 0, 0, 1, 0), *_O1_COUNTS[2:])
    result = _result(_run("O1-bf16", op_counts=_O1_COUNTS), _run("O3-bf16", op_counts=other))
    [group] = identical_runs(result)
    assert group.sentence().endswith(
        "Their first training steps differ in compute ops (addmm), whose results matched "
        "here nonetheless.")


def test_runs_differing_anywhere_are_not_identical() -> None:
    assert identical_runs(_result(_run("O1-bf16", accuracy=0.9),
                                  _run("O2-bf16", accuracy=0.91))) == []
    nan = (2.0, math.nan)  # NaN never equals: diverged runs are not "identical"
    assert identical_runs(_result(_run("O1-fp16", losses=nan),
                                  _run("O2-fp16", losses=nan))) == []


def test_page_and_json_say_which_runs_were_identical(tmp_path: Path) -> None:
    result = _result(_run("fp32", losses=(2.0, 1.0, 0.4)), _run("O1-bf16"), _run("O2-bf16"))
    files = write_report(result, tmp_path)
    page = files.html.read_text()
    assert '<section id="identical">' in page
    assert "O1-bf16 and O2-bf16 trained bit-identically" in page
    data = json.loads(files.json.read_text())
    assert [entry["names"] for entry in data["identical_runs"]] == [["O1-bf16", "O2-bf16"]]


def test_plots_are_real_pngs(tmp_path: Path) -> None:
    files = write_report(_result(_run("fp32"), _run("O1-fp16", scales=(2.0**16,) * 4)),
                         tmp_path)
    for png in (files.loss_curves_png, files.loss_scale_png, files.accuracy_png):
        assert png is not None and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        image = matplotlib.image.imread(png)
        assert image.shape[1] == 800  # 8 inches at 100 dpi


def test_json_holds_the_results_and_writes_non_finite_numbers_as_null(
        tmp_path: Path) -> None:
    diverged = _run("O3-fp16", losses=(2.0, math.inf, math.nan, math.nan),
                    scales=(1.0, 1.0, 1.0, 1.0))
    diverged = RunResult(**{**diverged.__dict__, "final_loss": math.nan})
    files = write_report(_result(_run("fp32"), diverged), tmp_path)
    text = files.json.read_text()
    assert "NaN" not in text and "Infinity" not in text
    data = json.loads(text)
    run = data["runs"][1]
    assert run["losses"] == [2.0, None, None, None]
    assert run["final_loss"] is None
    assert run["loss_scales"] == [1.0] * 4
    assert {k: data[k] for k in ("device", "device_name", "epochs", "seed", "batch_size")} == {
        "device": "cpu", "device_name": "Test <CPU> & co", "epochs": 2, "seed": 0,
        "batch_size": 64}
    assert data["runs"][0] == report_data(_result(_run("fp32")))["runs"][0]
    assert data["example_code"].startswith('model, optimizer = ampkit.initialize(model, '
                                           'optimizer, level="O3", dtype=torch.float16)')


def test_html_escapes_text_and_embeds_every_plot(tmp_path: Path) -> None:
    files = write_report(_result(_run("fp32"), _run("O2-bf16")), tmp_path)
    page = files.html.read_text()
    assert "Test <CPU>" not in page and html.escape("Test <CPU> & co") in page
    assert "<mm>" not in page and "&lt;mm&gt;" in page
    assert page.count('src="data:image/png;base64,') == 2
    assert page.count("<tr>") == 3  # header and one row per run
    assert "<script" not in page
    assert 'level="O2"' not in page  # quotes escaped too
    assert 'level="O2", dtype=torch.bfloat16' in html.unescape(page)


def test_check_output_dir_creates_nested_folders(tmp_path: Path) -> None:
    folder = check_output_dir(tmp_path / "a" / "b")
    assert folder.is_dir() and list(folder.iterdir()) == []  # the probe file is gone


@pytest.mark.parametrize("make,error,reason", [
    (lambda p: p / "file" / "sub", NotADirectoryError, "Not a directory"),
    (lambda p: p / "file", FileExistsError, "a file of that name exists"),
])
def test_check_output_dir_errors_name_the_folder(tmp_path: Path, make, error,
                                                 reason: str) -> None:
    (tmp_path / "file").write_text("x")
    target = make(tmp_path)
    with pytest.raises(error, match=re.escape(f"cannot write the report to '{target}': {reason}")):
        check_output_dir(target)
    assert (tmp_path / "file").read_text() == "x"
