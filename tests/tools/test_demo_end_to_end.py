"""``ampkit demo`` end to end: the console script on a tiny setting (one epoch, fp32 and
O2-fp16), its printed output, the report files, and the HTML page in a real headless
browser (Debian's chromium; ``.ci/run`` installs it; skipped without it, see the
``headless_chromium`` fixture in conftest.py)."""

import io
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers_models import console_script

from ampkit.tools.demo.run import RunConfig, training_code

STEPS = 1347 // 64  # one epoch of the 75% training split, last partial batch dropped


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    out = tmp_path_factory.mktemp("demo") / "report"
    script = console_script()
    assert script, "the ampkit console script is not installed (pip install -e .)"
    result = subprocess.run(
        [script, "demo", "--epochs", "1", "--levels", "fp32,O2", "--dtypes", "fp16",
         "--device", "cpu", "--pure-bf16-steps", "20", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    return out, result.stdout, result.stderr


def test_prints_a_table_row_per_run_and_the_o2_code(demo_run: tuple[Path, str, str]) -> None:
    out, stdout, stderr = demo_run
    assert "Traceback" not in stderr
    table_rows = [line for line in stdout.splitlines() if line.startswith("│")]
    assert [row.split("│")[1].strip() for row in table_rows] == ["fp32", "O2-fp16"]
    code = training_code(RunConfig("O2", torch.float16))
    assert code in stdout
    assert f"Report: {out / 'report.html'}" in stdout
    # one progress bar per run, each run to its last step
    for name in ("fp32", "O2-fp16"):
        assert any(name in line and f"{STEPS}/{STEPS}" in line
                   for line in stderr.splitlines()), stderr


def test_writes_pngs_html_and_json_with_real_numbers(demo_run: tuple[Path, str, str]) -> None:
    import matplotlib.image

    out, stdout, _ = demo_run
    for name in ("loss_curves.png", "loss_scale.png", "accuracy.png", "pure_bf16.png"):
        image = matplotlib.image.imread(out / name)
        assert image.shape[0] > 100 and image.shape[1] > 600, name
        assert _colours(image) > 20, name
    data = json.loads((out / "results.json").read_text())
    assert data["schema_version"] == 1
    assert data["device"] == "cpu" and data["epochs"] == 1
    assert "cores, 1 torch thread; torch CPU capability " in data["device_name"]  # --threads 1
    assert re.search(r"; native bf16: [\w, ]+; native fp16: [\w, ]+\)$", data["device_name"])
    assert sorted(data["files"]) == ["accuracy.png", "loss_curves.png", "loss_scale.png",
                                     "pure_bf16.png", "report.html", "results.json"]
    assert sorted(data["pure_bf16_curves"]) == ["fp32", "nearest", "stochastic"]
    fp32, o2 = data["runs"]
    assert (fp32["name"], o2["name"]) == ("fp32", "O2-fp16")
    for run in (fp32, o2):
        assert 0.5 < run["test_accuracy"] <= 1.0  # one epoch already learns the digits
        assert len(run["losses"]) == STEPS
        assert run["losses"][-1] < run["losses"][0]
        assert run["final_loss"] == pytest.approx(sum(run["losses"]) / STEPS)
        assert run["peak_memory_bytes"] > 0 and run["step_time_s"] > 0
        assert f"{run['test_accuracy']:.1%}" in stdout  # the table shows the JSON's numbers
    assert fp32["loss_scales"] == [] and fp32["final_loss_scale"] is None
    assert len(o2["loss_scales"]) == STEPS
    assert o2["final_loss_scale"] == o2["loss_scales"][-1]
    assert fp32["low_precision_share"] == 0.0 < o2["low_precision_share"]
    assert data["example_code"] == training_code(RunConfig("O2", torch.float16))
    page = (out / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 4
    assert "<img" in page and 'src="loss' not in page  # embedded, not linked


def _colours(pixels: np.ndarray) -> int:
    """Distinct colours in an (H, W, channels) image."""
    return len(np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0))


def test_report_page_renders_in_headless_chromium(demo_run: tuple[Path, str, str],
                                                  headless_chromium: Any) -> None:
    from PIL import Image

    out, _, _ = demo_run
    chrome = headless_chromium  # skips without the browser, fails under CI (conftest.py)
    chrome.get((out / "report.html").resolve().as_uri())
    images = chrome.execute_script(
        "return Array.from(document.images).map(i => ({id: i.id, "
        "complete: i.complete, width: i.naturalWidth, height: i.naturalHeight, "
        "box: i.getBoundingClientRect().toJSON()}))")
    rows = chrome.execute_script(
        "return Array.from(document.querySelectorAll('#results tbody tr'))"
        ".map(r => r.cells[0].textContent)")
    table_box = chrome.execute_script(
        "return document.getElementById('results').getBoundingClientRect().toJSON()")
    ratio = chrome.execute_script("return window.devicePixelRatio")
    screenshot = Image.open(io.BytesIO(chrome.get_screenshot_as_png())).convert("RGB")
    assert rows == ["fp32", "O2-fp16"]  # one row per configuration
    assert [i["id"] for i in images] == ["loss-curves", "accuracy", "loss-scale", "pure-bf16"]
    for image in images:
        assert image["complete"] and image["width"] > 0 and image["height"] > 0, image
    # the screenshot is not blank, and the table and every plot are drawn in it
    assert _colours(np.asarray(screenshot)) > 100

    def region_colours(box: dict) -> int:
        crop = screenshot.crop(tuple(int(v * ratio) for v in (
            box["left"], box["top"], box["right"], box["bottom"])))
        return _colours(np.asarray(crop))

    assert table_box["bottom"] * ratio <= screenshot.height
    assert region_colours(table_box) > 5
    for image in images:
        assert image["box"]["bottom"] * ratio <= screenshot.height, image
        assert region_colours(image["box"]) > 50, image["id"]


def test_browser_lookup_reports_a_missing_browser(monkeypatch: pytest.MonkeyPatch) -> None:
    from conftest import BROWSER_MISSING, find_browser

    monkeypatch.setenv("PATH", "")  # neither chromium nor chromedriver can be found
    assert find_browser() is None
    assert BROWSER_MISSING.startswith("chromium/chromedriver not found")
