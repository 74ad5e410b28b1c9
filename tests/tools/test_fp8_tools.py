"""The tools know fp8: which layers run fp8 and why, per-layer fp8 error in
``ampkit.compare``, choosing fp8 layers within a tolerance, and the numerics checker
naming the layer whose fp8 cast saturated or underflowed.

The oracle for the cast counts is arithmetic on the layer's real input, written here:
tensorwise scaling multiplies by ``448 / max|x|`` (float8_e4m3fn's largest value over
the tensor's), and a value whose scaled magnitude is at most half the smallest
subnormal (``2**-10``) rounds to zero."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampkit
from ampkit.tools import Fp8CastWatch, fp8_report, tune_fp8
from conftest import NEEDS_CPU_ROWWISE_FP8

pytest.importorskip("torchao.float8")

DEVICE = "cpu"


def _outlier_net() -> nn.Sequential:
    """Layer 2's input has one huge column (1e6) that layer 2 ignores (zero weights):
    exact arithmetic does not care, tensorwise fp8 flushes the rest of that input."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 32),
                        nn.Linear(32, 16)).to(DEVICE)
    with torch.no_grad():
        net[1].bias[0] = 1e6
        net[2].weight[:, 0] = 0
    return net


def test_fp8_report_lists_every_linear_with_the_reason():
    net = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 24), nn.Linear(24, 32),
                        nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 16))
    net = ampkit.initialize(net, level="O2", dtype=torch.bfloat16, fp8="tensorwise",
                            fp8_exclude_modules=["4"])
    lines = fp8_report(net).splitlines()
    assert lines[0] == "fp8 (tensorwise): 1 of 6 linear layers"
    assert lines[1].split() == ["layer", "type", "shape", "fp8", "why", "not"]
    rows = {line.split()[0]: line for line in lines[2:]}
    assert rows["3"].split()[1:6] == ["Linear", "32", "x", "32", "yes"]
    assert "first linear layer" in rows["0"] and "last linear layer" in rows["5"]
    assert "out_features=24 is not a multiple of 16" in rows["1"]
    assert "in_features=24 is not a multiple of 16" in rows["2"]
    assert "excluded (fp8_exclude_modules)" in rows["4"]


def test_cast_watch_counts_the_underflow_in_the_layer_that_has_it():
    net = ampkit.initialize(_outlier_net(), level="O2", dtype=torch.bfloat16,
                            fp8="tensorwise")
    seen = {}

    def keep(module, args):
        seen.setdefault("x", args[0].detach().clone())

    net[2].register_forward_pre_hook(keep)
    x = torch.randn(8, 16, device=DEVICE)
    with ampkit.NumericsChecker(net, "nan_inf") as checker:
        net(x).float().sum().backward()
    worst = checker.fp8_casts.worst
    assert (worst.layer, worst.tensor, worst.dtype) == ("2", "input", "float8_e4m3fn")
    v = seen["x"].double()
    scaled = v.abs() * 448 / v.abs().max()
    expected = int(((v != 0) & (scaled <= 2.0 ** -10)).sum())
    assert expected > 100  # the scenario: most of the input is lost
    assert worst.underflowed == expected and worst.saturated == 0
    assert worst.numel == v.numel()
    assert {(r.layer, r.tensor) for r in checker.fp8_casts.records} == {
        (layer, t) for layer in ("1", "2") for t in ("input", "weight", "grad_output")}


def test_cast_watch_counts_an_inf_as_saturated_and_the_rest_as_flushed():
    net = ampkit.initialize(nn.Sequential(*[nn.Linear(16, 16) for _ in range(3)]),
                            level="O2", dtype=torch.bfloat16, fp8="tensorwise")
    x = torch.randn(4, 16, device=DEVICE)
    with torch.no_grad():
        net[0].bias[5] = float("inf")  # layer 1's input: one inf column (4 values)
    with Fp8CastWatch(net) as watch:
        net(x)
    record = next(r for r in watch.records if r.tensor == "input")
    assert record.layer == "1" and record.saturated == 4
    assert record.underflowed == 64 - 4  # the Inf makes the scale 0: all else flushed
    assert "1      input" in watch.table()


@NEEDS_CPU_ROWWISE_FP8
def test_numerics_checker_check_all_runs_through_fp8_layers():
    net = ampkit.initialize(nn.Sequential(*[nn.Linear(16, 16) for _ in range(3)]),
                            level="O2", dtype=torch.bfloat16, fp8="rowwise")
    with ampkit.NumericsChecker(net, "all") as checker:
        net(torch.randn(4, 16, device=DEVICE)).float().sum().backward()
    assert torch.float8_e4m3fn in {r.dtype for r in checker.records}
    assert checker.fp8_casts.worst is None  # nothing lost on plain random data


def test_compare_reports_fp8_error_per_layer_against_bf16_and_fp32():
    net = _outlier_net()
    x = torch.randn(8, 16, device=DEVICE)
    c = ampkit.compare(net, x, precision="O2", dtype=torch.bfloat16, fp8="tensorwise")
    rows = {r.layer: r for r in c.fp8_layers}
    assert list(rows) == ["0", "1", "2", "3"]
    # the flushed input: layer 2's fp8 output keeps little but its bias
    assert rows["2"].output_fp8.max_rel > 0.5 > rows["2"].output_low.max_rel
    for name in ("0", "1", "3"):
        assert rows[name].output_fp8.max_rel < 0.1
    for name in ("0", "3"):  # (1's output is its 1e6 bias, rounded alike by both)
        assert rows[name].output_low.max_rel < rows[name].output_fp8.max_rel
    assert "fp8 per layer (tensorwise" in c.table()
    assert c.to_dict()["fp8_layers"][2]["layer"] == "2"


@NEEDS_CPU_ROWWISE_FP8
def test_rowwise_with_gw_hp_keeps_the_weight_gradient_at_bf16_error():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    rows = ampkit.tools.fp8_layer_errors(net, torch.randn(8, 32), fp8="rowwise_with_gw_hp")
    for r in rows:  # that recipe leaves the weight gradient's matmul in high precision
        assert r.grad_weight_fp8.max_rel == pytest.approx(r.grad_weight_low.max_rel,
                                                          rel=0.5)
        assert r.grad_input_fp8.max_rel > 3 * r.grad_input_low.max_rel


def test_tune_fp8_leaves_out_the_layer_fp8_breaks():
    net = _outlier_net()
    x = torch.randn(16, 16, device=DEVICE)
    ref = net(x).detach()

    def eval_fn(model):
        return F.mse_loss(model(x).float(), ref)

    result = tune_fp8(net, eval_fn, "tensorwise", tolerance=0.01, higher_is_better=False)
    assert result.layers == ("0", "1", "3") and result.within_tolerance
    assert result.trials[0].layers == ("0", "1", "2", "3")
    assert not result.trials[0].within_tolerance
    model = ampkit.initialize(_outlier_net(), level="O2", dtype=torch.bfloat16,
                              **result.initialize_kwargs())
    assert ampkit.fp8.get_fp8_plan(model).converted == ("0", "1", "3")
    assert eval_fn(model).item() <= result.reference_metric + 0.01


def test_compare_refuses_a_per_row_recipe_where_the_cpu_kernel_takes_tensor_scales(
        monkeypatch):
    # torch 2.11's CPU torch._scaled_mm (pretended here on every torch): a clear error
    # before either run, as initialize gives, instead of a failure inside torchao.
    monkeypatch.setattr(ampkit.fp8.recipe, "cpu_scaled_mm_takes_rowwise_scales",
                        lambda: False)
    net = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32)).to("cpu")
    with pytest.raises(RuntimeError, match=r"fp8='rowwise' scales per row, but this "
                                           r"torch's .* use fp8='tensorwise' on CPU"):
        ampkit.compare(net, torch.randn(8, 32), precision="O2", dtype="bfloat16",
                       fp8="rowwise")
    rows = ampkit.compare(net, torch.randn(8, 32), precision="O2", dtype="bfloat16",
                          fp8="tensorwise").fp8_layers
    assert [r.layer for r in rows] == ["0", "2"]


def _with_conv1d(conv1d: bool) -> nn.Sequential:
    """The same two layers, the second a transformers Conv1D or the Linear it is."""
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    first, second = nn.Linear(32, 32), Conv1D(48, 32)  # Conv1D: weight (in, out)
    last = nn.Linear(48, 16)
    if not conv1d:
        linear = nn.Linear(32, 48)
        with torch.no_grad():
            linear.weight.copy_(second.weight.t())
            linear.bias.copy_(second.bias)
        second = linear
    return nn.Sequential(first, nn.ReLU(), second, nn.ReLU(), last).to(DEVICE)


def test_the_fp8_tools_see_transformers_conv1d_layers():
    pytest.importorskip("transformers")
    net = ampkit.initialize(_with_conv1d(True), level="O2", dtype=torch.bfloat16,
                            fp8="tensorwise", fp8_first_last=True)
    lines = fp8_report(net).splitlines()
    assert lines[0] == "fp8 (tensorwise): 3 of 3 linear layers"
    assert lines[3].split() == ["2", "Conv1D", "32", "x", "48", "yes"]

    # its casts are watched: the weight it casts is its own (32, 48) tensor
    x = torch.randn(8, 32, device=DEVICE)
    with Fp8CastWatch(net) as watch:
        net(x).float().sum().backward()
    weights = {r.layer: r.numel for r in watch.records if r.tensor == "weight"}
    assert weights == {"0": 32 * 32, "2": 32 * 48, "4": 48 * 16}

    # its per-layer fp8 error is the Linear's it is, to the bit
    conv_rows = ampkit.tools.fp8_layer_errors(_with_conv1d(True), x, fp8="tensorwise")
    linear_rows = ampkit.tools.fp8_layer_errors(_with_conv1d(False), x, fp8="tensorwise")
    assert [r.layer for r in conv_rows] == ["0", "2", "4"]
    assert conv_rows == linear_rows


def test_tune_fp8_trials_configure_nothing_process_wide():
    # each trial is prepared as initialize prepares a model, without its
    # loss-scaling set-up (initialize at O2 float16 replaced the process's scalers)
    from ampkit.scaling import configure_loss_scaling

    # the latest set-up's scaler, whatever other set-ups earlier tests of this worker
    # left bound to optimizers still alive (loss_scaler(0) refuses to guess then)
    from ampkit.scaling.loss_scaling import latest_loss_scaler

    configure_loss_scaling("dynamic", init_scale=8.0)
    try:
        torch.manual_seed(0)
        net = nn.Sequential(*[nn.Linear(32, 32) for _ in range(3)])
        x = torch.randn(16, 32)
        result = tune_fp8(net, lambda m: m(x).float().pow(2).mean(), "tensorwise",
                          tolerance=0.5, relative=True, dtype=torch.float16)
        assert result.trials  # the trials ran, at O2 float16
        assert latest_loss_scaler(0).get_scale() == 8.0
    finally:
        configure_loss_scaling("dynamic")
