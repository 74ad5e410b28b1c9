"""The ``ampkit`` command line: parsing, and every bad-input error of ``ampkit demo``.

Errors are checked in a real subprocess (``python -m ampkit`` and the ``ampkit``
console script), because "no traceback" only means something there.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers_models import console_script

import ampkit
from ampkit.tools.cli import build_parser, main


def _run(*args: str, env: dict[str, str] | None = None,
         script: bool = False) -> subprocess.CompletedProcess[str]:
    command = [console_script() or "ampkit"] if script else [
        sys.executable, "-m", "ampkit"]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=120,
                          env=full_env)


@pytest.mark.parametrize("option,value,choices", [
    ("--levels", "O4", "fp32, O0, O1, O2, O3; case does not matter"),
    ("--levels", "fp32,O2,fast", "fp32, O0, O1, O2, O3; case does not matter"),
    ("--dtypes", "fp8", "bf16|bfloat16, fp16|float16|half; case does not matter"),
    ("--dtypes", "bf16,fp32", "bf16|bfloat16, fp16|float16|half; case does not matter"),
    ("--device", "tpu", "auto, cpu, cuda, cuda:<index>"),
])
def test_unknown_choice_is_an_argparse_error_listing_the_choices(
        option: str, value: str, choices: str, tmp_path: Path) -> None:
    result = _run("demo", option, value, "--out", str(tmp_path / "r"))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    bad = value.split(",")[-1]
    assert (f"ampkit demo: error: argument {option}: invalid choice: {bad!r} "
            f"(choose from {choices})") in result.stderr
    assert result.stderr.startswith("usage: ampkit demo")
    assert result.stdout == ""
    assert not (tmp_path / "r").exists()


def test_console_script_reports_a_bad_level_the_same_way() -> None:
    result = _run("demo", "--levels", "O9", script=True)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "invalid choice: 'O9' (choose from fp32, O0, O1, O2, O3" in result.stderr


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_without_a_gpu_is_a_one_line_error(device: str, tmp_path: Path) -> None:
    result = _run("demo", "--device", device, "--out", str(tmp_path / "r"),
                  env={"CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"ampkit demo: error: device {device!r} was asked for, but "
                               f"no CUDA GPU is available")
    assert result.stdout == ""


def test_output_under_a_file_is_a_one_line_error_before_training(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    result = _run("demo", "--out", str(blocker / "report"))
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"ampkit demo: error: cannot write the report to '{blocker / 'report'}': "
        f"Not a directory"]
    assert result.stdout == ""  # no table: nothing was trained
    assert blocker.read_text() == "not a folder"


def test_output_that_is_a_file_is_a_one_line_error(tmp_path: Path) -> None:
    target = tmp_path / "report.html"
    target.write_text("x")
    result = _run("demo", "--out", str(target))
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"ampkit demo: error: cannot write the report to '{target}': a file of that name "
        f"exists, and the report needs a folder"]


def test_unwritable_output_folder_is_a_one_line_error() -> None:
    # /proc refuses new folders to everyone, root included (a chmod-ed folder would not
    # stop root, who runs CI here).
    result = _run("demo", "--out", "/proc/ampkit-report")
    assert result.returncode == 1
    assert len(result.stderr.splitlines()) == 1
    assert "cannot write the report to '/proc/ampkit-report'" in result.stderr


@pytest.mark.parametrize("option,value,message", [
    ("--epochs", "0", "argument --epochs: must be a positive integer, got '0'"),
    ("--epochs", "two", "argument --epochs: must be a positive integer, got 'two'"),
    ("--seed", "-1", "argument --seed: must be a non-negative integer, got '-1'"),
    ("--threads", "0", "argument --threads: must be a positive integer, got '0'"),
])
def test_bad_numbers_are_argparse_errors(option: str, value: str, message: str,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", f"{option}={value}"])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_version_names_ampkit_and_torch() -> None:
    import torch

    result = _run("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"ampkit {ampkit.__version__} (torch {torch.__version__})"


def test_a_command_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([])
    assert exit_info.value.code == 2
    assert "demo" in capsys.readouterr().err


def test_defaults_and_list_parsing() -> None:
    parser = build_parser()
    args = parser.parse_args(["demo"])
    assert (args.epochs, args.device, args.levels, args.dtypes, args.seed, args.out,
            args.threads, args.quiet) == (5, "auto", None, None, 0, "ampkit-report", 1, False)
    args = parser.parse_args(["demo", "--levels", "o1,FP32", "--levels", "O3",
                              "--dtypes", "BF16", "--quiet", "--device", "cuda:1"])
    assert args.levels == ["O1", "fp32", "O3"]
    assert args.dtypes == ["bf16"]
    assert args.quiet is True
    assert args.device == "cuda:1"  # a valid name; whether it exists is checked later


@pytest.mark.parametrize("spelling,dtype", [
    ("bf16", "bf16"), ("bfloat16", "bf16"), ("BF16", "bf16"), ("BFloat16", "bf16"),
    ("fp16", "fp16"), ("float16", "fp16"), ("half", "fp16"), ("Half", "fp16"),
    ("FLOAT16", "fp16"),
])
def test_dtypes_accept_torchs_names_in_any_case(spelling: str, dtype: str) -> None:
    assert build_parser().parse_args(["demo", "--dtypes", spelling]).dtypes == [dtype]


@pytest.mark.parametrize("spelling,level", [
    ("o1", "O1"), ("O2", "O2"), ("o0", "O0"), ("FP32", "fp32"), ("Fp32", "fp32"),
])
def test_levels_are_case_insensitive(spelling: str, level: str) -> None:
    assert build_parser().parse_args(["demo", "--levels", spelling]).levels == [level]


def test_help_lists_the_dtype_spellings(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "bf16|bfloat16, fp16|float16|half" in text
    assert "case does not matter" in text
