"""The ``ampkit`` command line: ``compare`` and ``tune`` on a user's package, parsing,
and every bad input (one line on stderr, exit status 2, no traceback).

Most cases run ``main`` in this process, where an exception that escaped would fail
the test as surely as a traceback would show in a shell; a few run the ``ampkit``
console script and ``python -m ampkit`` in a real subprocess.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers_models import console_script

import ampkit
from ampkit.policies.policy import Policy
from ampkit.tools.cli import build_parser, main

# A user's own package, as it would sit next to the command: a model factory, its
# inputs, a metric and a loss; and references of every wrong kind.
_MODELS = '''
import sys

import torch

# raw features with a large offset: LayerNorm cancels it, and loses it in bf16
X = 100 + torch.randn(16, 32, generator=torch.Generator().manual_seed(1))


def build():
    return torch.nn.Sequential(torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))


built = build()


def batch():
    return (X,)


def one_tensor():
    return X


def score(model):
    with torch.no_grad():
        return model(X).float().pow(2).mean()


def loss(output):
    return output.float().pow(2).mean()


def not_a_model():
    return "a string"


def no_floats():
    return torch.nn.ReLU()


class Nested:
    build = staticmethod(build)


def mlp():
    # two Linears whose sizes are multiples of 16: both can run in fp8
    return torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 16))


def mlp_batch():
    return (torch.randn(8, 32, generator=torch.Generator().manual_seed(2)),)


NUMBER = 3


# the user's own code failing, each in its own way
def factory_raises():
    raise RuntimeError("no weights file")  # LINE factory


def inputs_raise():
    raise KeyError("batch")  # LINE inputs


class ForwardRaises(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.fc(x[:, :5])  # LINE forward


def eval_raises(model):
    return 1 / 0  # LINE eval


def eval_text(model):
    return "good"


def eval_nan(model):
    return float("nan")


def loss_raises(output):
    raise ValueError("no labels")  # LINE loss


# what once ended the command silently, or with a traceback
def factory_exits():
    sys.exit(0)  # LINE exit0


def factory_exits_3():
    sys.exit(3)  # LINE exit3


def inputs_empty():
    return ()


class Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no message")


def factory_unprintable():
    raise Unprintable()  # LINE unprintable


def nan_batch():
    return (X * float("nan"),)


class ForwardYields(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(32, 4)

    def forward(self, x):
        yield self.fc(x)


class ForwardExits(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(32, 4)

    def forward(self, x):
        sys.exit(0)  # LINE forward_exit
'''


def _line(tag: str) -> int:
    """The line of ``_MODELS`` (as written in userpkg/models.py) marked ``# LINE tag``."""
    lines = textwrap.dedent(_MODELS).splitlines()
    return next(i for i, text in enumerate(lines, 1) if text.endswith(f"# LINE {tag}"))


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("user")
    package = root / "userpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "models.py").write_text(textwrap.dedent(_MODELS))
    (package / "broken.py").write_text("import a_dependency_that_is_not_installed\n")
    return root


@pytest.fixture
def in_user_dir(user_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The current folder is the user's; sys.path is restored afterwards."""
    monkeypatch.chdir(user_dir)
    monkeypatch.setattr(sys, "path", list(sys.path))
    return user_dir


def _status(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exit_info:
        return int(exit_info.code or 0)


def _bad_input(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``ampkit argv``; check it is a one-line error with status 2; return it."""
    status = _status(argv)
    out, err = capsys.readouterr()
    assert status == 2, (out, err)
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"ampkit {argv[0]}: error: ")
    return lines[0]


def _subprocess(*args: str, cwd: Path | None = None, script: bool = False,
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    command = [console_script() or "ampkit"] if script else [sys.executable, "-m", "ampkit"]
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=300,
                          cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


# -- compare and tune on the user's model -------------------------------------------------

def test_tune_writes_a_policy_that_loads_and_compare_reads_it_back(
        user_dir: Path, tmp_path: Path) -> None:
    # The console script (not python -m): the user's package is found only because the
    # CLI puts the current folder on sys.path.
    policy_path = tmp_path / "tuned.json"
    tuned = _subprocess("tune", "userpkg.models:build", "--eval", "userpkg.models:score",
                        "--relative", "--tolerance", "0.005", "--out", str(policy_path),
                        cwd=user_dir, script=True)
    assert tuned.returncode == 0, tuned.stderr
    assert "Traceback" not in tuned.stderr
    trials = [line for line in tuned.stdout.splitlines() if line.startswith("trial ")]
    assert len(trials) == 2, tuned.stdout
    assert trials[0].endswith("; moving layer_norm to float32")
    assert "float32 ops: layer_norm" in trials[1]
    # progress bar: the trials, on stderr
    assert "trial 1: metric" in tuned.stderr
    # the written policy, loaded by path (as ampkit.autocast(policy=PATH) loads it)
    policy = Policy.load(policy_path)
    assert sorted(policy.fp32_ops) == ["layer_norm"]
    assert policy.dtype == torch.bfloat16 and policy.unlisted == "native"
    net = torch.nn.Sequential(torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))
    with ampkit.autocast("cpu", policy=policy):
        normed = net[0](100 + torch.randn(2, 32))
        assert normed.dtype == torch.float32
        assert net[1](normed).dtype == torch.bfloat16

    out = tmp_path / "report"
    compared = _subprocess("compare", "userpkg.models:build", "--inputs",
                           "userpkg.models:batch", "--precision", str(policy_path),
                           "--loss-fn", "userpkg.models:loss", "--out", str(out),
                           cwd=user_dir, script=True)
    assert compared.returncode == 0, compared.stderr
    assert compared.stdout.startswith(
        "ampkit.compare: policy 'tuned' (torch.bfloat16) against float32\n")
    data = json.loads((out / "compare.json").read_text())
    # layer_norm ran in float32 under the tuned policy: it added no error
    layer_norm = [r for r in data["ops"] if r["op"] == "layer_norm"]
    assert [r["dtype"] for r in layer_norm] == ["torch.float32"]
    assert layer_norm[0]["added"] == 0.0
    assert data["ranked_ops"][0]["name"] == "linear"
    assert [g["parameter"] for g in data["grads"]] == ["0.weight", "0.bias", "1.weight",
                                                       "1.bias"]
    assert sorted(p.name for p in out.iterdir()) == [
        "compare.html", "compare.json", "error_per_layer.png", "op_error_histogram.png"]


def _rich_table(lines: list[str], title: int) -> list[list[str]]:
    """The cells of the rich table printed under ``lines[title]``: its header, then
    its rows, read between the box's rules."""
    rows = []
    for line in lines[title + 1:]:
        line = line.strip()
        if line[:1] in ("┃", "│"):
            rows.append([cell.strip() for cell in line[1:-1].replace("┃", "│").split("│")])
        elif line[:1] == "└":
            return rows
    raise AssertionError(f"no table under {lines[title]!r}")


def test_compare_prints_the_table_and_writes_the_report(
        in_user_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cmp"
    status = _status(["compare", "userpkg.models:Nested.build", "--inputs",
                      "userpkg.models:one_tensor", "--precision", "o1", "--dtype", "BF16",
                      "--custom-white-list", "layer_norm", "--out", str(out)])
    printed = capsys.readouterr().out
    assert status == 0
    lines = printed.splitlines()
    assert lines[0] == "ampkit.compare: O1 (torch.bfloat16) against float32"
    assert lines[1].startswith("divergence starts: module '0' (LayerNorm)")
    header, *ranked = _rich_table(lines, lines.index("ops ranked by error added"))
    assert header == ["op", "added rel error", "calls", "worst in module"]
    assert ranked[0][0] == "layer_norm"
    assert f"Report: {out / 'compare.html'}" in printed
    page = (out / "compare.html").read_text()
    assert page.count('src="data:image/png;base64,') == 2
    assert json.loads((out / "compare.json").read_text())["divergence"]["module"] == "0"


def test_compare_draws_progress_on_stderr_in_a_terminal_and_none_otherwise(
        in_user_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    common = ["compare", "userpkg.models:build", "--inputs", "userpkg.models:batch",
              "--precision", "O1", "--dtype", "bf16"]
    monkeypatch.setenv("TTY_COMPATIBLE", "1")  # rich: stderr counts as a terminal
    assert _status([*common, "--out", str(tmp_path / "a")]) == 0
    out, err = capsys.readouterr()
    assert "float32 run" in err and "bfloat16 run" in err and "op calls" in err
    assert "float32 run" not in out  # the table alone on stdout
    assert _status([*common, "--out", str(tmp_path / "b"), "--quiet"]) == 0
    assert capsys.readouterr().err == ""
    monkeypatch.delenv("TTY_COMPATIBLE")  # a pipe or a log file: no bars
    assert _status([*common, "--out", str(tmp_path / "c")]) == 0
    assert capsys.readouterr().err == ""


def test_compare_fp8_prints_and_writes_the_per_layer_fp8_errors(
        in_user_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torchao.float8")
    out = tmp_path / "cmp"
    # tensorwise: the recipe every torch's CPU torch._scaled_mm takes
    status = _status(["compare", "userpkg.models:mlp", "--inputs", "userpkg.models:mlp_batch",
                      "--precision", "O2", "--dtype", "bf16", "--fp8", "TensorWise",
                      "--out", str(out)])
    printed = capsys.readouterr().out
    assert status == 0
    lines = printed.splitlines()
    header = lines.index("fp8 per layer (tensorwise; relative error against fp32, local "
                         "to each layer)")
    columns, *layers = _rich_table(lines, header)
    assert columns == ["layer", "out fp8", "out bfloat16", "fp8 vs bfloat16", "dx fp8",
                       "dx bfloat16", "dw fp8", "dw bfloat16"]
    assert [row[0] for row in layers] == ["0", "2"]
    rows = json.loads((out / "compare.json").read_text())["fp8_layers"]
    assert [(r["layer"], r["recipe"]) for r in rows] == [("0", "tensorwise"),
                                                         ("2", "tensorwise")]
    # fp8 rounds more than bf16: its output error is the larger one, on both layers
    assert all(r["output_fp8"]["max_rel"] > r["output_low"]["max_rel"] > 0 for r in rows)
    # the HTML report has the same table: a row per layer, its errors as compare.json's
    page = (out / "compare.html").read_text()
    assert "<h2>fp8 per layer (tensorwise)</h2>" in page
    table = page[page.index('<table id="fp8-layers">'):]
    table = table[:table.index("</table>")]
    assert "<th>Out fp8</th><th>Out bfloat16</th>" in table
    for r in rows:
        assert (f"<tr><td>{r['layer']}</td><td>{r['output_fp8']['max_rel']:.3g}</td>"
                f"<td>{r['output_low']['max_rel']:.3g}</td>") in table
    # without --fp8, neither the table nor rows
    assert _status(["compare", "userpkg.models:mlp", "--inputs", "userpkg.models:mlp_batch",
                    "--out", str(out), "--overwrite"]) == 0
    assert "fp8 per layer" not in capsys.readouterr().out
    assert json.loads((out / "compare.json").read_text())["fp8_layers"] == []
    assert "fp8-layers" not in (out / "compare.html").read_text()


def _op_rows(out: Path) -> list[tuple[str, str, str]]:
    return [(r["op"], r["module"], r["dtype"])
            for r in json.loads((out / "compare.json").read_text())["ops"]]


def test_compare_takes_an_ampkit_config_file_and_a_device(
        in_user_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    common = ["userpkg.models:build", "--inputs", "userpkg.models:batch"]
    # the flags' way ...
    assert _status(["compare", *common, "--precision", "O2", "--dtype", "bf16",
                    "--custom-black-list", "layer_norm", "--out", str(tmp_path / "a")]) == 0
    # ... and the same settings as a config file, on --device cpu
    (tmp_path / "amp.yaml").write_text("level: o2\ndtype: BF16\n"
                                       "custom_black_list: [layer_norm]\n")
    assert _status(["compare", *common, "--config", str(tmp_path / "amp.yaml"),
                    "--device", "cpu", "--out", str(tmp_path / "b")]) == 0
    flags = json.loads((tmp_path / "a" / "compare.json").read_text())
    config = json.loads((tmp_path / "b" / "compare.json").read_text())
    assert flags["ops"] == config["ops"]
    assert _op_rows(tmp_path / "a") == [("linear", "1", "torch.bfloat16")]
    # a field only a config holds: the Linear kept in float32 by keep_fp32_modules
    (tmp_path / "keep.json").write_text(json.dumps(
        {"level": "O2", "dtype": "bfloat16", "keep_fp32_modules": ["1"]}))
    assert _status(["compare", *common, "--config", str(tmp_path / "keep.json"),
                    "--out", str(tmp_path / "c")]) == 0
    assert _op_rows(tmp_path / "c") == [("linear", "1", "torch.float32")]
    capsys.readouterr()
    # a flag that contradicts the file, and --precision beside it, are refused
    line = _bad_input(["compare", *common, "--config", str(tmp_path / "amp.yaml"),
                       "--dtype", "fp16", "--out", str(tmp_path / "d")], capsys)
    assert line == ("ampkit compare: error: --dtype float16 contradicts the config's "
                    "dtype=bfloat16; give it once")
    line = _bad_input(["compare", *common, "--config", str(tmp_path / "amp.yaml"),
                       "--precision", "O1"], capsys)
    assert line == ("ampkit compare: error: argument --precision: not allowed with argument "
                    "--config (see: ampkit compare --help)")
    assert not (tmp_path / "d").exists()


def test_compare_takes_the_config_fields_as_flags(
        in_user_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # AmpConfig's fields are compare's flags too (made from the fields): --level and
    # --keep-fp32-modules convert the model as a config file with them does
    common = ["userpkg.models:build", "--inputs", "userpkg.models:batch"]
    assert _status(["compare", *common, "--level", "o2", "--dtype", "bf16",
                    "--keep-fp32-modules", "1", "--out", str(tmp_path / "a")]) == 0
    assert _op_rows(tmp_path / "a") == [("linear", "1", "torch.float32")]
    capsys.readouterr()
    (tmp_path / "amp.json").write_text(json.dumps({"level": "O2", "dtype": "bfloat16"}))
    line = _bad_input(["compare", *common, "--config", str(tmp_path / "amp.json"),
                       "--level", "O3", "--out", str(tmp_path / "b")], capsys)
    assert line == ("ampkit compare: error: --level O3 contradicts the config's "
                    "level='O2'; give it once")
    line = _bad_input(["compare", *common, "--precision", "O1", "--level", "O2"], capsys)
    assert line == ("ampkit compare: error: --precision and the config's flags both "
                    "choose the precision; give the level with --level")
    line = _bad_input(["compare", *common, "--master-weights", "maybe"], capsys)
    assert line.startswith("ampkit compare: error: --master-weights must be True")
    assert not (tmp_path / "b").exists()


def test_compare_on_a_cuda_device_this_machine_lacks_is_a_one_line_error(
        in_user_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    status = _status(["compare", "userpkg.models:build", "--inputs", "userpkg.models:batch",
                      "--device", "cuda", "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err.splitlines()
    assert status == 1
    assert len(err) == 1 and err[0].startswith(
        "ampkit compare: error: device 'cuda' was asked for, but no CUDA GPU is available")
    assert list(tmp_path.iterdir()) == []


def test_only_the_known_import_notes_are_silenced(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from ampkit.tools.cli.args import known_import_noise_silenced

    with caplog.at_level(logging.WARNING), known_import_noise_silenced():
        logging.getLogger("torchao").warning("Failed to load /x/_C_mxfp8.so: no such lib")
        logging.getLogger("torch.utils._pytree").warning(
            "%s is an Enum subclass and is now natively supported by torch.compile", "E")
        logging.getLogger("torchao").warning("a real torchao warning")
        logging.getLogger("torch.utils._pytree").warning("another pytree warning")
        logging.getLogger("other").warning("Failed to load something of the user's")
    logging.getLogger("torchao").warning("Failed to load /x/_C_mxfp8.so: after the block")
    assert [r.getMessage() for r in caplog.records] == [
        "a real torchao warning", "another pytree warning",
        "Failed to load something of the user's",
        "Failed to load /x/_C_mxfp8.so: after the block"]


def test_compare_fp8_without_torchao_names_the_extra(
        in_user_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # import fails, as uninstalled
    status = _status(["compare", "userpkg.models:mlp", "--inputs", "userpkg.models:mlp_batch",
                      "--fp8", "tensorwise", "--out", str(tmp_path / "cmp")])
    err = capsys.readouterr().err.splitlines()
    assert status == 1
    assert len(err) == 1 and err[0].startswith("ampkit compare: error: --fp8: ")
    assert "pip install 'ampkit[fp8]'" in err[0]
    assert not (tmp_path / "cmp").exists()  # refused before anything was written


def test_compare_refuses_an_out_holding_its_files_and_keeps_other_files(
        in_user_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cmp"
    out.mkdir()
    (out / "compare.html").write_text("mine")
    (out / "notes.txt").write_text("mine too")
    argv = ["compare", "userpkg.models:built", "--inputs", "userpkg.models:batch",
            "--out", str(out)]
    line = _bad_input(argv, capsys)
    assert line == (f"ampkit compare: error: cannot write the report to '{out}': it already "
                    f"holds compare.html; pass --overwrite to replace it, or choose another "
                    f"--out")
    assert (out / "compare.html").read_text() == "mine"
    assert _status([*argv, "--overwrite"]) == 0
    assert (out / "compare.html").read_text().startswith("<!doctype html>")
    assert (out / "notes.txt").read_text() == "mine too"


def test_tune_without_target_keeps_the_demo_behaviour(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "policy.json"
    status = _status(["tune", "--budget", "1", "--tolerance", "1", "--quiet",
                      "--out", str(out)])
    printed = capsys.readouterr().out
    assert status == 0
    assert printed.startswith("fp32 test accuracy ")
    assert "(450 held-out digits, 1 epoch(s) of training); tolerance: a drop of at most " \
           "100.00 points" in printed
    assert Policy.load(out).unlisted == "native"


def test_tune_outside_the_tolerance_exits_3_and_still_writes(
        in_user_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "policy.json"
    status = _status(["tune", "userpkg.models:build", "--eval", "userpkg.models:score",
                      "--tolerance", "0", "--budget", "1", "--quiet", "--out", str(out)])
    assert status == 3
    assert "NOT within tolerance (budget exhausted)" in capsys.readouterr().out
    assert Policy.load(out).name == "tuned"


def test_tune_refuses_to_replace_a_file_without_overwrite(
        in_user_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "policy.json"
    out.write_text("my notes")
    argv = ["tune", "userpkg.models:build", "--eval", "userpkg.models:score", "--quiet",
            "--out", str(out)]
    assert _bad_input(argv, capsys) == (
        f"ampkit tune: error: cannot write the policy to '{out}': it already exists: "
        f"pass --overwrite to replace it")
    assert out.read_text() == "my notes"
    assert _status([*argv, "--overwrite"]) == 0
    assert Policy.load(out).name == "tuned"


# -- the user's own code failing: one line, status 2, no folder left ---------------------------

_BATCH = ["--inputs", "userpkg.models:batch"]


def _torch_says(fn):
    """What torch's own error says for ``fn()`` (its wording changes between releases;
    what ampkit promises is to pass it on whole, in one line)."""
    try:
        fn()
    except RuntimeError as error:
        return str(error).replace("{", "{{").replace("}", "}}")
    raise AssertionError("expected torch to refuse")


#: ForwardRaises's forward on the batch: a (16x5) @ (32x4) product
_SHAPE_ERROR = _torch_says(lambda: torch.nn.Linear(32, 4)(torch.zeros(16, 32)[:, :5]))
_SCORE = ["--eval", "userpkg.models:score"]
_USER_CODE_ERRORS = [
    (["compare", "userpkg.models:factory_raises", *_BATCH],
     "TARGET 'userpkg.models:factory_raises' raised RuntimeError: no weights file "
     "(at userpkg/models.py:{factory})"),
    (["compare", "userpkg.models:build", "--inputs", "userpkg.models:inputs_raise"],
     "--inputs 'userpkg.models:inputs_raise' raised KeyError: 'batch' "
     "(at userpkg/models.py:{inputs})"),
    (["compare", "userpkg.models:ForwardRaises", *_BATCH],
     "the forward of TARGET 'userpkg.models:ForwardRaises' (ForwardRaises.forward) raised "
     f"RuntimeError: {_SHAPE_ERROR} (at userpkg/models.py:{{forward}})"),
    (["compare", "userpkg.models:build", *_BATCH, "--loss-fn", "userpkg.models:loss_raises"],
     "--loss-fn 'userpkg.models:loss_raises' raised ValueError: no labels "
     "(at userpkg/models.py:{loss})"),
    (["compare", "userpkg.models:build", *_BATCH, "--loss-fn", "userpkg.models:eval_text"],
     "--loss-fn 'userpkg.models:eval_text' returned a str: it must return a one-element "
     "tensor"),
    (["compare", "userpkg.models:factory_exits", *_BATCH],
     "TARGET 'userpkg.models:factory_exits' raised SystemExit: 0 "
     "(at userpkg/models.py:{exit0})"),
    (["compare", "userpkg.models:factory_exits_3", *_BATCH],
     "TARGET 'userpkg.models:factory_exits_3' raised SystemExit: 3 "
     "(at userpkg/models.py:{exit3})"),
    (["compare", "userpkg.models:build", "--inputs", "userpkg.models:inputs_empty"],
     "--inputs 'userpkg.models:inputs_empty' returned an empty tuple: it must return the "
     "forward's inputs (a tuple of its positional arguments, or the one argument)"),
    (["compare", "userpkg.models:factory_unprintable", *_BATCH],
     "TARGET 'userpkg.models:factory_unprintable' raised Unprintable: <message not "
     "printable: str() raised RuntimeError> (at userpkg/models.py:{unprintable})"),
    (["compare", "userpkg.models:ForwardExits", *_BATCH],
     "the forward of TARGET 'userpkg.models:ForwardExits' (ForwardExits.forward) raised "
     "SystemExit: 0 (at userpkg/models.py:{forward_exit})"),
    (["compare", "userpkg.models:build", "--inputs", "userpkg.models:nan_batch"],
     "TARGET 'userpkg.models:build' on --inputs 'userpkg.models:nan_batch': the float32 "
     "run's output has 64 NaN (of 64 values): compare measures low precision against a "
     "float32 reference that is a number; the inputs have 512 NaN: check them and the "
     "model in float32"),
    (["compare", "userpkg.models:ForwardYields", *_BATCH],
     "TARGET 'userpkg.models:ForwardYields' on --inputs 'userpkg.models:batch': the "
     "model's forward returned 'generator', which holds no floating-point tensor (tensors "
     "are read from tuples, lists, dicts and the types torch's pytree knows): there is "
     "nothing to compare; return the output tensors"),
    (["tune", "userpkg.models:factory_exits", *_SCORE, "--quiet"],
     "TARGET 'userpkg.models:factory_exits' raised SystemExit: 0 "
     "(at userpkg/models.py:{exit0})"),
    (["tune", "userpkg.models:factory_raises", *_SCORE, "--quiet"],
     "TARGET 'userpkg.models:factory_raises' raised RuntimeError: no weights file "
     "(at userpkg/models.py:{factory})"),
    (["tune", "userpkg.models:build", "--eval", "userpkg.models:eval_raises", "--quiet"],
     "--eval 'userpkg.models:eval_raises' raised ZeroDivisionError: division by zero "
     "(at userpkg/models.py:{eval})"),
    (["tune", "userpkg.models:build", "--eval", "userpkg.models:eval_text", "--quiet"],
     "--eval 'userpkg.models:eval_text' returned a str: it must return a number or a "
     "one-element tensor"),
    (["tune", "userpkg.models:build", "--eval", "userpkg.models:eval_nan", "--quiet"],
     "--eval 'userpkg.models:eval_nan': eval_fn returned nan on the float32 model (the "
     "reference every trial is measured against); it must be a finite number: check "
     "eval_fn and the model in float32"),
]


@pytest.mark.parametrize("argv,message", _USER_CODE_ERRORS,
                         ids=[f"{a[0]}-{a[-1] if a[0] == 'tune' else a[1]}-{i}"
                              for i, (a, _) in enumerate(_USER_CODE_ERRORS)])
def test_the_users_code_failing_is_one_line_and_leaves_no_folder(
        argv: list[str], message: str, in_user_dir: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    # compare: --out two folders deep, neither there before, both gone afterwards; tune
    # writes its file only at the end
    out = tmp_path / ("policy.json" if argv[0] == "tune" else "new/report")
    line = _bad_input([*argv, "--out", str(out)], capsys)
    lines = {tag: _line(tag) for tag in ("factory", "inputs", "forward", "eval", "loss",
                                         "exit0", "exit3", "unprintable", "forward_exit")}
    assert line == f"ampkit {argv[0]}: error: " + message.format(**lines)
    assert list(tmp_path.iterdir()) == []


def test_a_folder_that_was_there_stays_and_others_files_are_kept(
        in_user_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    _bad_input(["compare", "userpkg.models:factory_raises", *_BATCH, "--out", str(out)],
               capsys)
    assert out.is_dir() and list(out.iterdir()) == []
    # a folder this run made, holding a file of someone else's: the file and folder stay
    made = tmp_path / "made" / "report"
    real_mkdir = Path.mkdir

    def mkdir_then_someone_writes(self: Path, *args: object, **kwargs: object) -> None:
        real_mkdir(self, *args, **kwargs)  # type: ignore[arg-type]
        if self == made:
            (made / "notes.txt").write_text("not ampkit's")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Path, "mkdir", mkdir_then_someone_writes)
        _bad_input(["compare", "userpkg.models:factory_raises", *_BATCH, "--out",
                    str(made)], capsys)
    assert [p.name for p in made.iterdir()] == ["notes.txt"]


def test_a_demo_that_stops_removes_the_folder_it_made(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    import ampkit.tools.cli.demo as demo_command

    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(demo_command, "_run", interrupted)
    assert _status(["demo", "--quiet", "--out", str(tmp_path / "a" / "report")]) == 130
    assert capsys.readouterr().err == "ampkit: interrupted\n"
    assert list(tmp_path.iterdir()) == []


def test_a_real_process_reports_the_users_error_in_one_line(
        user_dir: Path, tmp_path: Path) -> None:
    # a user's failing factory, as a shell runs it; with --fp8, the command imports torchao
    # first (a fresh process): its notes about optional kernels built for other
    # machines and torch's pytree notice are not shown either, only ampkit's line
    fp8 = ["--fp8", "tensorwise"] if importlib.util.find_spec("torchao") else []
    result = _subprocess("compare", "userpkg.models:factory_raises", *_BATCH, *fp8,
                         "--out", str(tmp_path / "r1"), cwd=user_dir, script=True)
    assert result.returncode == 2, result.stderr
    assert result.stderr == (
        f"ampkit compare: error: TARGET 'userpkg.models:factory_raises' raised "
        f"RuntimeError: no weights file (at userpkg/models.py:{_line('factory')})\n")
    assert list(tmp_path.iterdir()) == []


# -- bad input: one line, status 2 ----------------------------------------------------------

_TARGET_ERRORS = [
    (["userpkg.nowhere:build"],
     "TARGET 'userpkg.nowhere:build': cannot import 'userpkg.nowhere' (from {cwd} or "
     "sys.path): ModuleNotFoundError: No module named 'userpkg.nowhere'"),
    (["userpkg.broken:build"],
     "TARGET 'userpkg.broken:build': cannot import 'userpkg.broken' (from {cwd} or "
     "sys.path): ModuleNotFoundError: No module named 'a_dependency_that_is_not_installed'"),
    (["userpkg.models:buildd"],
     "TARGET 'userpkg.models:buildd': 'userpkg.models' has no attribute 'buildd'; did you "
     "mean 'build', 'built'?"),
    (["userpkg.models:biuld"],
     "TARGET 'userpkg.models:biuld': 'userpkg.models' has no attribute 'biuld'; did you "
     "mean 'build', 'built'?"),
    (["userpkg.models:Nested.missing"],
     "TARGET 'userpkg.models:Nested.missing': 'userpkg.models.Nested' has no attribute "
     "'missing'"),
    (["userpkg.models"],
     "TARGET must be package.module:attribute (e.g. mypkg.models:build_model), got "
     "'userpkg.models'"),
    (["userpkg.models:NUMBER"],
     "TARGET 'userpkg.models:NUMBER' is an int: it must be an nn.Module or a callable "
     "returning one"),
    (["userpkg.models:not_a_model"],
     "TARGET 'userpkg.models:not_a_model' returned a str: it must return an nn.Module"),
    (["userpkg.models:no_floats"],
     "TARGET 'userpkg.models:no_floats': the model has no floating-point parameters: "
     "there is nothing to run in low precision"),
]


@pytest.mark.parametrize("target,message", _TARGET_ERRORS,
                         ids=[t[0][0].split(":")[-1] for t in _TARGET_ERRORS])
@pytest.mark.parametrize("command", ["compare", "tune"])
def test_a_bad_target_is_a_one_line_error(
        command: str, target: list[str], message: str, in_user_dir: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    extra = (["--inputs", "userpkg.models:batch"] if command == "compare"
             else ["--eval", "userpkg.models:score"])
    out = tmp_path / "out"
    line = _bad_input([command, *target, *extra, "--out", str(out)], capsys)
    assert line == f"ampkit {command}: error: " + message.format(cwd=in_user_dir)
    assert not out.exists()  # nothing written, no folder made


@pytest.mark.parametrize("argv,message", [
    (["compare", "userpkg.models:build", "--inputs", "userpkg.models:NUMBER"],
     "--inputs 'userpkg.models:NUMBER' is an int, not a callable"),
    (["compare", "userpkg.models:build", "--inputs", "userpkg.models:batch", "--loss-fn",
      "userpkg.models:X"], "--loss-fn 'userpkg.models:X' is a Tensor, not a callable"),
    (["tune", "userpkg.models:build", "--eval", "userpkg.models:NUMBER"],
     "--eval 'userpkg.models:NUMBER' is an int, not a callable"),
    (["tune", "userpkg.models:build", "--eval", "nowhere_at_all:f"],
     "--eval 'nowhere_at_all:f': cannot import 'nowhere_at_all' (from {cwd} or sys.path): "
     "ModuleNotFoundError: No module named 'nowhere_at_all'"),
    (["compare", "userpkg.models:build", "--inputs", "userpkg.models:batch", "--precision",
      "O3", "--custom-black-list", "softmax"],
     "policy, custom_white_list and custom_black_list choose how ops are cast, which level "
     "O3 with patch_ops=False does not do; use level O1 or O2"),
    (["tune", "userpkg.models:build"],
     "TARGET 'userpkg.models:build' needs --eval FN: eval_fn(model) -> number, as "
     "package.module:attribute"),
    (["tune", "--eval", "userpkg.models:score"],
     "--eval needs a TARGET (the model it evaluates)"),
    (["tune", "userpkg.models:build", "--eval", "userpkg.models:score", "--epochs", "2"],
     "--epochs trains the demo's CNN, and applies only without TARGET (train your model "
     "before tune sees it)"),
])
def test_a_bad_function_or_combination_is_a_one_line_error(
        argv: list[str], message: str, in_user_dir: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / ("out.json" if argv[0] == "tune" else "out")
    line = _bad_input([*argv, "--out", str(out)], capsys)
    assert line == f"ampkit {argv[0]}: error: " + message.format(cwd=in_user_dir)
    assert not out.exists()


_USER = ["userpkg.models:build", "--eval", "userpkg.models:score"]
_COMPARE = ["userpkg.models:build", "--inputs", "userpkg.models:batch"]


@pytest.mark.parametrize("command,args", [
    ("demo", []), ("tune", []), ("tune", _USER), ("compare", _COMPARE)])
@pytest.mark.parametrize("seed", ["4294967296", "-5", "1.5"])
def test_a_seed_outside_32_bits_is_a_one_line_error(
        command: str, args: list[str], seed: str, in_user_dir: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    line = _bad_input([command, *args, "--seed", seed], capsys)
    assert line == (f"ampkit {command}: error: argument --seed: must be an integer from 0 to "
                    f"4294967295 (2**32 - 1), got '{seed}' (see: ampkit {command} --help)")


@pytest.mark.parametrize("command,args", [
    ("demo", []), ("tune", []), ("tune", _USER), ("compare", _COMPARE)])
@pytest.mark.parametrize("out", ["", "  "])
def test_an_empty_out_is_a_one_line_error(
        command: str, args: list[str], out: str, in_user_dir: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    before = sorted(os.listdir(in_user_dir))
    line = _bad_input([command, *args, "--out", out], capsys)
    assert line == (f"ampkit {command}: error: argument --out: must name a file or folder; "
                    f"an empty name would write into the current folder (see: ampkit "
                    f"{command} --help)")
    assert sorted(os.listdir(in_user_dir)) == before


@pytest.mark.parametrize("command,args,out,what", [
    ("demo", [], "/proc/ampkit-report", "report"),
    ("compare", _COMPARE, "/proc/ampkit-report", "report"),
    ("tune", [], "/proc/tuned.json", "policy"),
    ("tune", _USER, "/proc/tuned.json", "policy"),
])
def test_an_unwritable_out_is_a_one_line_error(
        command: str, args: list[str], out: str, what: str, in_user_dir: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    # /proc refuses new files to everyone, root included (a chmod-ed folder would not
    # stop root, who runs CI here).
    line = _bad_input([command, *args, "--out", out], capsys)
    assert line.startswith(f"ampkit {command}: error: cannot write the {what} to '{out}': ")


def test_an_out_under_a_file_is_a_one_line_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    line = _bad_input(["demo", "--out", str(blocker / "report")], capsys)
    assert line == (f"ampkit demo: error: cannot write the report to "
                    f"'{blocker / 'report'}': Not a directory")
    assert blocker.read_text() == "not a folder"
    line = _bad_input(["demo", "--out", str(blocker)], capsys)
    assert line == (f"ampkit demo: error: cannot write the report to '{blocker}': a file "
                    f"of that name exists, and the report needs a folder")


@pytest.mark.parametrize("argv,message", [
    (["demo", "--levels", "O4"],
     "argument --levels: invalid choice: 'O4' (choose from fp32, O0, O1, O2, O3; case does "
     "not matter)"),
    (["demo", "--levels", "fp32,O2,fast"],
     "argument --levels: invalid choice: 'fast' (choose from fp32, O0, O1, O2, O3; case "
     "does not matter)"),
    (["demo", "--dtypes", "bf16,fp32"],
     "argument --dtypes: invalid choice: 'fp32' (choose from bf16|bfloat16, "
     "fp16|float16|half; case does not matter)"),
    (["demo", "--device", "tpu"],
     "argument --device: invalid choice: 'tpu' (choose from auto, cpu, cuda, cuda:<index>)"),
    (["demo", "--epochs", "0"], "argument --epochs: must be a positive integer, got '0'"),
    (["demo", "--threads", "two"], "argument --threads: must be a positive integer, got 'two'"),
    (["tune", "--dtype", "fp32"],
     "argument --dtype: invalid choice: 'fp32' (choose from bf16|bfloat16, fp16|float16|half;"
     " case does not matter)"),
    (["tune", "--tolerance", "nan"],
     "argument --tolerance: must be a finite number >= 0, got 'nan'"),
    (["tune", "--start", "fast"],
     "argument --start: invalid choice: 'fast' (choose from torch, conservative, "
     "torch-cpu-legacy, paddle-O1, paddle-OD, paddle-O2, paddle-O2-no-promote, "
     "mxnet-float16, mxnet-bfloat16, apex-O1, mindspore-auto)"),
    (["compare", "m:f", "--inputs", "m:g", "--custom-black-list", "softmx"],
     "argument --custom-black-list: unknown op name 'softmx': not a canonical PyTorch op "
     "name; did you mean 'softmax', 'softmin', 'log_softmax'?"),
    (["compare", "m:f", "--inputs", "m:g", "--precision", "O5"],
     "argument --precision: invalid choice: 'O5' (choose from a level, O1, O2, O3; a preset, "
     "torch, conservative, torch-cpu-legacy, paddle-O1, paddle-OD, paddle-O2, "
     "paddle-O2-no-promote, mxnet-float16, mxnet-bfloat16, apex-O1, mindspore-auto; or a "
     "policy file such as "
     "ampkit tune writes)"),
    (["compare", "m:f"], "the following arguments are required: --inputs"),
    (["compare", "m:f", "--inputs", "m:g", "--device", "tpu"],
     "argument --device: invalid choice: 'tpu' (choose from auto, cpu, cuda, cuda:<index>)"),
    (["compare", "m:f", "--inputs", "m:g", "--config", "amp.toml"],
     "argument --config: amp.toml: an ampkit config file is JSON (.json) or YAML (.yaml, "
     ".yml), and its suffix says which; got '.toml'"),
    (["compare", "m:f", "--inputs", "m:g", "--config", "no-such-amp.json"],
     "argument --config: cannot read the config file 'no-such-amp.json': No such file or "
     "directory"),
    (["compare", "m:f", "--inputs", "m:g", "--fp8", "e4m3"],
     "argument --fp8: invalid choice: 'e4m3' (choose from tensorwise, rowwise, "
     "rowwise_with_gw_hp; case does not matter)"),
])
def test_a_bad_option_is_a_one_line_error_listing_the_choices(
        argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    line = _bad_input(argv, capsys)
    assert line == f"ampkit {argv[0]}: error: {message} (see: ampkit {argv[0]} --help)"


def test_a_command_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    assert _status([]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "ampkit: error: the following arguments are required: {demo,compare,tune,plan} "
        "(see: ampkit --help)"]


@pytest.mark.parametrize("argv", [["demo", "--seed", "4294967296"], ["tune", "--seed", "-5"],
                                  ["compare", "nowhere:f", "--inputs", "nowhere:g"]])
def test_a_real_process_reports_bad_input_without_a_traceback(
        argv: list[str], tmp_path: Path) -> None:
    result = _subprocess(*argv, cwd=tmp_path)
    assert result.returncode == 2
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith(f"ampkit {argv[0]}: error: ")
    assert result.stdout == ""
    assert list(tmp_path.iterdir()) == []


# -- the machine: status 1 --------------------------------------------------------------------

@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_without_a_gpu_is_a_one_line_error(device: str, tmp_path: Path) -> None:
    # with every GPU hidden, also on a machine that has one
    result = _subprocess("demo", "--device", device, "--out", str(tmp_path / "r"),
                         script=True, env={"CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"ampkit demo: error: device {device!r} was asked for, but "
                               f"no CUDA GPU is available")
    assert result.stdout == ""


# -- parsing --------------------------------------------------------------------------------

def test_version_names_ampkit_and_torch(capsys: pytest.CaptureFixture[str]) -> None:
    assert _status(["--version"]) == 0
    assert capsys.readouterr().out.strip() == (f"ampkit {ampkit.__version__} "
                                               f"(torch {torch.__version__})")


def test_defaults_and_list_parsing() -> None:
    parser = build_parser()
    args = parser.parse_args(["demo"])
    assert (args.epochs, args.device, args.levels, args.dtypes, args.seed, args.out,
            args.threads, args.quiet, args.overwrite) == (
        5, "auto", None, None, 0, "ampkit-report", 1, False, False)
    args = parser.parse_args(["demo", "--levels", "o1,FP32", "--levels", "O3",
                              "--dtypes", "BF16", "--quiet", "--device", "cuda:1",
                              "--seed", "4294967295"])
    assert args.levels == ["O1", "fp32", "O3"]
    assert args.dtypes == ["bf16"]
    assert args.quiet is True
    assert args.device == "cuda:1"  # a valid name; whether it exists is checked later
    assert args.seed == 2**32 - 1
    tune = parser.parse_args(["tune"])
    assert (tune.target, tune.eval, tune.tolerance, tune.higher_is_better, tune.epochs,
            tune.out) == (None, None, None, None, None, "tuned-policy.json")
    tune = parser.parse_args(["tune", "a:b", "--eval", "a:c", "--lower-is-better"])
    assert tune.higher_is_better is False


@pytest.mark.parametrize("spelling,dtype", [
    ("bf16", "bf16"), ("bfloat16", "bf16"), ("BF16", "bf16"), ("BFloat16", "bf16"),
    ("fp16", "fp16"), ("float16", "fp16"), ("half", "fp16"), ("Half", "fp16"),
    ("FLOAT16", "fp16"),
])
def test_dtypes_accept_torchs_names_in_any_case(spelling: str, dtype: str) -> None:
    parser = build_parser()
    assert parser.parse_args(["demo", "--dtypes", spelling]).dtypes == [dtype]
    expected = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    assert parser.parse_args(["tune", "--dtype", spelling]).dtype == expected
    assert parser.parse_args(["compare", "a:b", "--inputs", "a:c", "--dtype",
                              spelling]).dtype == expected


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
