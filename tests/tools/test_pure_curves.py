"""The pure-bf16 curves tool (ampkit.tools.demo.pure_curves) and the demo's report of them:
pure bf16 converges as fp32 does on the demo's tasks, where round-to-nearest stalls."""

from __future__ import annotations

import warnings

import pytest
import torch

from ampkit.pure.compiled_step import CompiledStepFallbackWarning
from ampkit.tools.demo.pure_curves import digits_accuracy, train_curves

# -- convergence ----------------------------------------------------------------------

def test_digits_accuracy_matches_fp32():
    fp32 = digits_accuracy("fp32", epochs=2)
    for mode in ("stochastic", "kahan"):
        assert abs(digits_accuracy(mode, epochs=2) - fp32) <= 0.02, mode


def test_char_gpt_loss_tracks_fp32_where_round_to_nearest_stalls():
    curves = train_curves(("fp32", "nearest", "stochastic", "kahan"), steps=60, lr=3e-4,
                          dim=32, layers=1, context=32, batch=8)
    fp32 = curves["fp32"].eval_loss
    assert curves["nearest"].eval_loss > 1.01 * fp32
    for mode in ("stochastic", "kahan"):
        assert abs(curves[mode].eval_loss - fp32) <= 0.02 * fp32, mode


def test_digits_accuracy_with_the_compiled_step_matches_fp32():
    # The compiled step's bits and fused arithmetic differ from the eager step's: the
    # accuracy must still land within the eager step's margin of fp32. An optimizer that
    # fell back to the eager step would prove nothing: its warning fails the test.
    # Other tests of this process may have spent dynamo's recompile limit on the same
    # update with other options (a process-wide count): this test starts from none.
    torch.compiler.reset()
    fp32 = digits_accuracy("fp32", epochs=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompiledStepFallbackWarning)
        for mode in ("stochastic", "kahan"):
            accuracy = digits_accuracy(mode, epochs=2, compile_step=True)
            assert abs(accuracy - fp32) <= 0.02, mode


def test_char_gpt_loss_with_the_compiled_step_tracks_fp32():
    torch.compiler.reset()  # as above: dynamo's recompile count is the process's
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompiledStepFallbackWarning)
        curves = train_curves(("fp32", "nearest", "stochastic", "kahan"), steps=60, lr=3e-4,
                              dim=32, layers=1, context=32, batch=8, compile_step=True)
    fp32 = curves["fp32"].eval_loss
    assert curves["nearest"].eval_loss > 1.01 * fp32  # round to nearest, never compiled
    for mode in ("stochastic", "kahan"):
        assert abs(curves[mode].eval_loss - fp32) <= 0.02 * fp32, mode


# -- the demo report ------------------------------------------------------------------

def test_the_demo_report_plots_the_three_curves(tmp_path):
    import json

    from ampkit.tools.demo.report import write_report
    from ampkit.tools.demo.run import DemoSettings, demo_configurations, run_demo

    result = run_demo(DemoSettings(epochs=1, device="cpu", pure_bf16_steps=15,
                                   configurations=demo_configurations(["fp32"])))
    assert sorted(result.pure_bf16_curves) == ["fp32", "nearest", "stochastic"]
    assert all(len(v) == 15 for v in result.pure_bf16_curves.values())
    files = write_report(result, tmp_path)
    assert files.pure_bf16_png is not None and files.pure_bf16_png.stat().st_size > 1000
    assert 'id="pure-bf16"' in files.html.read_text()
    data = json.loads(files.json.read_text())
    assert len(data["pure_bf16_curves"]["nearest"]) == 15
    with pytest.raises(ValueError, match="pure_bf16_steps"):
        DemoSettings(pure_bf16_steps=-1)
