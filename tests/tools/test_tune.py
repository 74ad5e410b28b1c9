"""ampkit.tune: the planted op (and only it) goes to fp32, a harmless model keeps the
aggressive policy, the policy found saves, loads and reproduces its metric under
ampkit.autocast, a spent budget is reported, bad inputs get clear errors; the
``ampkit tune`` command."""

from __future__ import annotations

import json
import time

import pytest
import torch
import torch.nn as nn

import ampkit
from ampkit.policies.policy import Policy
from ampkit.tools.accuracy.tune import BUDGET_EXHAUSTED, MetricError, TuneWarning


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def _data(offset: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs, and as targets the fp32 model's own outputs (plain torch): the metric is
    the mean squared distance from float32, 0 in float32."""
    x = offset + torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return x, _model()(x)


def _eval(x: torch.Tensor, y: torch.Tensor):
    def eval_fn(model: nn.Module) -> float:
        with torch.no_grad():
            return float(nn.functional.mse_loss(model(x).float(), y))
    return eval_fn


TOLERANCE = 1e-4  # the outputs' mean square is about 0.1


def _ran_low(out: torch.Tensor) -> bool:
    """Whether the Linear that made ``out`` ran in bfloat16. A trial's forward hands its
    floating outputs back in float32, as level O1 does in training, so the
    values tell, not the dtype: each value a bf16 Linear returns is a bfloat16 number,
    which an fp32 Linear's outputs (on these random inputs) are not."""
    return bool((out == out.to(torch.bfloat16).to(out.dtype)).all())


def test_planted_op_goes_to_fp32_and_nothing_else() -> None:
    # Raw features with a large offset: LayerNorm in bf16 loses them (planted op).
    x, y = _data(offset=100.0)
    result = ampkit.tune(_model(), _eval(x, y), torch.bfloat16, tolerance=TOLERANCE,
                         higher_is_better=False, budget=5)
    assert result.within_tolerance and result.stop_reason == "within tolerance"
    assert result.policy.fp32_ops == frozenset({"layer_norm"})
    # the lower rule written out for the ops the forward ran; all else native
    assert result.policy.unlisted == "native"
    assert result.policy.lower_precision_ops == frozenset({"linear", "relu"})
    first, last = result.trials[0], result.trials[-1]
    assert not first.within_tolerance  # the all-low policy really is too inaccurate
    assert first.moved == "layer_norm" and first.fp32_ops == ()
    assert len(result.trials) == 2 and last.fp32_ops == ("layer_norm",)
    assert first.low_precision_share == 1.0 and last.low_precision_share == 0.75
    assert result.reference_metric == 0.0  # the fp32 run is the targets' own model
    assert last.metric <= TOLERANCE < first.metric


def test_found_policy_saves_loads_and_reproduces_the_metric(tmp_path) -> None:
    x, y = _data(offset=100.0)
    result = ampkit.tune(_model(), _eval(x, y), "bfloat16", tolerance=TOLERANCE, budget=5)
    path = tmp_path / "policy.json"
    result.save(path)
    loaded = Policy.load(path)
    assert loaded == result.policy
    assert json.loads(path.read_text())["fp32_ops"] == ["layer_norm"]
    model = _model()
    with torch.no_grad():
        with ampkit.autocast("cpu", policy=loaded):
            out = model(x)
        metric = float(nn.functional.mse_loss(out.float(), y))
    assert metric == result.trials[-1].metric
    with torch.no_grad(), ampkit.autocast("cpu", policy=result.trials[0].policy):
        all_low = model(x)
    assert float(nn.functional.mse_loss(all_low.float(), y)) == result.trials[0].metric


def test_nothing_sensitive_keeps_the_aggressive_policy() -> None:
    x, y = _data(offset=0.0)
    result = ampkit.tune(_model(), _eval(x, y), torch.bfloat16, tolerance=TOLERANCE,
                         budget=5)
    assert result.within_tolerance and len(result.trials) == 1
    assert result.policy.fp32_ops == frozenset() and result.policy.unlisted == "native"
    assert result.policy.lower_precision_ops == frozenset({"layer_norm", "linear", "relu"})
    assert result.trials[0].low_precision_share == 1.0


def test_spent_budget_is_reported_with_a_warning() -> None:
    x, y = _data(offset=100.0)
    with pytest.warns(TuneWarning, match="budget exhausted"):
        result = ampkit.tune(_model(), _eval(x, y), torch.bfloat16, tolerance=0.0,
                             budget=2)
    assert not result.within_tolerance and result.stop_reason == BUDGET_EXHAUSTED
    assert len(result.trials) == 2
    # the closest trial is returned, and its description says the search failed
    assert result.policy.fp32_ops == result.trials[1].policy.fp32_ops
    assert "budget exhausted" in result.policy.description
    assert "stopped: budget exhausted" in result.table()
    assert json.loads(result.to_json())["within_tolerance"] is False


def test_relative_tolerance_scales_with_the_fp32_metric() -> None:
    x = torch.rand(4, 8)

    def eval_fn(m: nn.Module) -> float:  # 110 when the Linear ran in bf16, else 100
        return 100.0 + 10 * float(_ran_low(m(x)))

    loose = ampkit.tune(nn.Linear(8, 2), eval_fn, "bfloat16", tolerance=0.1, relative=True)
    assert loose.tolerance == pytest.approx(10.0) and len(loose.trials) == 1
    with pytest.warns(TuneWarning):
        tight = ampkit.tune(nn.Linear(8, 2), eval_fn, "bfloat16", tolerance=0.09,
                            relative=True, budget=1)
    assert not tight.within_tolerance


def test_one_sided_tolerance() -> None:
    x = torch.rand(4, 8)
    model = nn.Linear(8, 2)

    def eval_fn(m: nn.Module) -> float:  # 1.0 when the Linear ran in bf16
        return float(_ran_low(m(x)))

    up = ampkit.tune(model, eval_fn, "bfloat16", tolerance=0.5, higher_is_better=True)
    assert up.within_tolerance and len(up.trials) == 1  # a rise is no harm
    either = ampkit.tune(model, eval_fn, "bfloat16", tolerance=0.5)
    assert [t.metric for t in either.trials] == [1.0, 0.0]
    assert either.policy.fp32_ops == frozenset({"linear"})


def test_eval_fn_that_raises_is_named_with_its_trial() -> None:
    x = torch.rand(4, 8)

    def eval_fn(m: nn.Module) -> float:
        out = m(x)
        if _ran_low(out):
            raise KeyError("boom")
        return float(out.detach().sum())

    with pytest.raises(RuntimeError, match=r"eval_fn raised in trial 0 .*KeyError") as info:
        ampkit.tune(nn.Linear(8, 2), eval_fn, "bfloat16", tolerance=0.1)
    assert isinstance(info.value.__cause__, KeyError)

    def always(m: nn.Module) -> float:
        raise ValueError("no data")

    with pytest.raises(RuntimeError, match="float32 reference run"):
        ampkit.tune(nn.Linear(8, 2), always, "bfloat16", tolerance=0.1)


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"tolerance": -0.01}, ValueError, "tolerance"),
    ({"tolerance": float("nan")}, ValueError, "tolerance"),
    ({"tolerance": 0.1, "budget": 0}, ValueError, "budget"),
    ({"tolerance": 0.1, "higher_is_better": "yes"}, ValueError, "higher_is_better"),
])
def test_bad_arguments(kwargs: dict, error: type, match: str) -> None:
    x = torch.rand(2, 3)
    with pytest.raises(error, match=match):
        ampkit.tune(nn.Linear(3, 1), lambda m: m(x).sum(), "bfloat16", **kwargs)


def test_bad_model_dtype_and_eval_results() -> None:
    x = torch.rand(2, 3)
    with pytest.raises(ValueError, match="no floating-point parameters"):
        ampkit.tune(nn.ReLU(), lambda m: m(x).sum(), "bfloat16", tolerance=0.1)
    with pytest.raises(ValueError, match="dtype"):
        ampkit.tune(nn.Linear(3, 1), lambda m: m(x).sum(), "float32", tolerance=0.1)
    with pytest.raises(TypeError, match="eval_fn"):
        ampkit.tune(nn.Linear(3, 1), "not callable", "bfloat16", tolerance=0.1)
    with pytest.raises(TypeError, match="number"):
        ampkit.tune(nn.Linear(3, 1), lambda m: "high", "bfloat16", tolerance=0.1)


def test_cli_tune_on_the_digits(tmp_path, capsys) -> None:
    from ampkit.tools.cli import main

    start = time.perf_counter()
    out = tmp_path / "policy.json"
    assert main(["tune", "--epochs", "1", "--out", str(out)]) == 0
    elapsed = time.perf_counter() - start
    printed = capsys.readouterr()
    assert "fp32 test accuracy" in printed.out
    assert "trial 0" in printed.out and "float32 ops" in printed.out
    loaded = Policy.load(out)
    assert loaded.unlisted == "native" and loaded.dtype == torch.bfloat16
    assert elapsed < 60


def test_on_trial_sees_every_trial_and_start_policy_is_used() -> None:
    x, y = _data(offset=100.0)
    seen = []
    result = ampkit.tune(_model(), _eval(x, y), "bfloat16", tolerance=TOLERANCE, budget=5,
                         start="conservative", on_trial=seen.append)
    assert seen == list(result.trials)
    # conservative already keeps layer_norm in fp32: the first trial is within tolerance
    assert len(result.trials) == 1 and result.within_tolerance
    assert result.policy.unlisted == "keep" and "layer_norm" in result.policy.fp32_ops
    assert result.policy.dtype == torch.bfloat16 and result.policy.name == "tuned"
    with pytest.raises(TypeError, match="on_trial"):
        ampkit.tune(_model(), _eval(x, y), "bfloat16", tolerance=TOLERANCE, on_trial=3)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), torch.tensor(float("-inf"))])
def test_a_float32_metric_that_is_not_finite_is_refused(value: object) -> None:
    # NaN used to run every trial "outside the tolerance" and end with an empty policy,
    # blaming the ops ("no op that added error is left")
    calls = []

    def eval_fn(model: nn.Module) -> object:
        calls.append(model)
        return value

    with pytest.raises(MetricError, match=r"eval_fn returned (nan|inf|-inf) on the float32 "
                                          r"model .*it must be a finite number"):
        ampkit.tune(nn.Linear(4, 2), eval_fn, "bfloat16", tolerance=0.1)
    assert len(calls) == 1  # refused after the reference, before any trial
