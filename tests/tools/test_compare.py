"""ampkit.compare: planted sensitive ops are found and ranked first, errors agree with
native torch computed by hand, RNG and weights are the same in both runs, the report
renders (in headless chromium when it is installed)."""

from __future__ import annotations

import io
import itertools
import json

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampkit
from ampkit.tools.accuracy.compare import Comparison, ErrorStats
from ampkit.tools.accuracy.tune import aggressive_policy


def _offset_model() -> nn.Sequential:
    # LayerNorm on raw features with a large offset: in bfloat16 the offset eats the
    # mantissa (spacing 0.5 at 100), so the normalised values are mostly rounding noise.
    torch.manual_seed(0)
    return nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def _offset_inputs() -> torch.Tensor:
    return 100 + torch.randn(16, 32, generator=torch.Generator().manual_seed(1))


class _Exp(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x)


def test_planted_bf16_layer_norm_is_ranked_first_and_where_divergence_starts() -> None:
    model, x = _offset_model(), _offset_inputs()
    c = ampkit.compare(model, x, precision=aggressive_policy("bfloat16"))
    ranked = c.ranked_ops()
    assert ranked[0].op == "layer_norm"
    assert ranked[0].worst_module == "0"
    # it adds far more than the other ops, which only round
    assert ranked[0].added > 10 * max(r.added for r in ranked[1:])
    assert c.divergence is not None and c.divergence.module == "0"
    assert c.divergence.kind == "LayerNorm"
    assert c.first_divergent_op.op == "layer_norm"
    assert c.ranked_modules()[0].name == "0"
    # every module and op call is recorded in the order it ran
    assert [m.module for m in c.modules] == ["", "0", "1", "2", "3"]
    assert [r.op for r in c.ops] == ["layer_norm", "linear", "relu", "linear"]
    assert {r.dtype for r in c.ops} == {"torch.bfloat16"}


def test_errors_match_a_hand_computed_bf16_layer_norm() -> None:
    model, x = _offset_model(), _offset_inputs()
    ln = model[0]
    c = ampkit.compare(model, x, precision="torch", dtype=torch.bfloat16,
                       custom_white_list={"layer_norm"})
    got = c.ops[0]
    assert (got.op, got.module, got.dtype) == ("layer_norm", "0", "torch.bfloat16")
    with torch.no_grad():
        ref = F.layer_norm(x, (32,), ln.weight, ln.bias).double()
        low = F.layer_norm(x.bfloat16(), (32,), ln.weight.bfloat16(),
                           ln.bias.bfloat16()).double()
    max_abs = float((low - ref).abs().max())
    assert got.error.max_abs == pytest.approx(max_abs, rel=1e-12)
    assert got.error.max_rel == pytest.approx(max_abs / float(ref.abs().max()), rel=1e-12)
    cosine = float(F.cosine_similarity(low.flatten(), ref.flatten(), dim=0))
    assert got.error.cosine == pytest.approx(cosine, rel=1e-9)
    assert got.input_rel == 0.0  # the model's own fp32 input, seen before the cast
    # its local error: against the same op in float32 on the same (fp32) inputs
    assert got.added == pytest.approx(got.error.max_rel, rel=1e-12)


def test_native_torch_policy_output_error_equals_torch_autocast() -> None:
    model, x = _offset_model(), _offset_inputs()
    c = ampkit.compare(model, x, precision="torch", dtype=torch.bfloat16)
    with torch.no_grad():
        ref = model(x).double()
        with torch.autocast("cpu", torch.bfloat16):
            low = model(x).double()
    assert c.output.max_abs == pytest.approx(float((low - ref).abs().max()), rel=1e-12)
    # native autocast on CPU keeps layer_norm in fp32 and runs linear in bf16
    assert [(r.op, r.dtype) for r in c.ops] == [
        ("layer_norm", "torch.float32"), ("linear", "torch.bfloat16"),
        ("relu", "torch.bfloat16"), ("linear", "torch.bfloat16")]


def test_gradients_per_parameter_match_torch_autocast_backward() -> None:
    model, x = _offset_model(), _offset_inputs()

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return out.float().pow(2).mean()

    c = ampkit.compare(model, x, precision="torch", dtype=torch.bfloat16, loss_fn=loss_fn)
    ref_model, low_model = _offset_model(), _offset_model()
    ref_loss = loss_fn(ref_model(x))
    ref_loss.backward()
    with torch.autocast("cpu", torch.bfloat16):
        out = low_model(x)
    low_loss = loss_fn(out)
    low_loss.backward()
    assert [g.parameter for g in c.grads] == [n for n, _ in model.named_parameters()]
    for g, p_ref, p_low in zip(c.grads, ref_model.parameters(), low_model.parameters()):
        expected = float((p_low.grad.double() - p_ref.grad.double()).abs().max())
        assert g.error.max_abs == pytest.approx(expected, rel=1e-12), g.parameter
        assert g.dtype == "torch.float32"
    assert c.loss == (pytest.approx(ref_loss.item()), pytest.approx(low_loss.item()))
    # the caller's model was not touched: no gradients, no hooks, its own forward
    assert all(p.grad is None for p in model.parameters())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert "forward" not in vars(model)


def test_o2_level_keeps_fp32_parameters_and_grads() -> None:
    model, x = _offset_model(), _offset_inputs()
    c = ampkit.compare(model, x, precision="O2", dtype="bfloat16",
                       loss_fn=lambda out: out.float().sum())
    dtypes = {g.parameter: g.dtype for g in c.grads}
    # the parameters are the fp32 truth at O2: gradients arrive in fp32 through autograd
    assert dtypes["1.weight"] == "torch.float32"
    assert dtypes["0.weight"] == "torch.float32"
    assert c.precision == "O2"


def test_same_rng_state_in_both_runs_and_caller_rng_untouched() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Dropout(0.5), nn.Linear(8, 8))
    x = torch.randn(4, 8)
    torch.manual_seed(123)
    c = ampkit.compare(model, x, precision="O1", dtype="bfloat16")
    after = torch.rand(3)
    torch.manual_seed(123)
    assert torch.equal(after, torch.rand(3))  # compare did not advance the caller's RNG
    dropout = next(m for m in c.modules if m.module == "0")
    assert dropout.error.max_abs == 0.0  # the same mask in both runs


def test_fp16_exp_overflow_is_ranked_first_with_inf_counts() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _Exp(), nn.Linear(8, 2))
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(8))
        model[0].bias.zero_()
    x = torch.linspace(0, 12, 32).reshape(4, 8)  # exp(12) > 65504, the fp16 maximum
    c = ampkit.compare(model, x, precision=aggressive_policy("float16"))
    assert c.ranked_ops()[0].op == "exp"
    assert c.ranked_ops()[0].added == float("inf")
    exp_call = next(r for r in c.ops if r.op == "exp")
    assert exp_call.error.num_inf == int((torch.exp(x) > 65504).sum()) > 0
    assert c.divergence.module == "1"
    data = json.loads(c.to_json())  # valid JSON: Inf written as null
    assert data["ranked_ops"][0]["name"] == "exp" and data["ranked_ops"][0]["added"] is None


def test_error_stats_by_hand() -> None:
    e = ErrorStats.between([torch.tensor([1.0, float("inf"), float("nan")])],
                           [torch.tensor([2.0, float("inf"), float("nan")])])
    assert (e.max_abs, e.max_rel, e.num_inf, e.num_nan) == (1.0, 0.5, 1, 1)
    e = ErrorStats.between([torch.tensor([float("inf"), 1.0])], [torch.tensor([3.0, 1.0])])
    assert e.max_abs == float("inf") and e.num_inf == 1


def test_nothing_sensitive_means_no_divergence() -> None:
    model = _offset_model()
    c = ampkit.compare(model, torch.randn(16, 32), precision="O1", dtype="bfloat16")
    assert c.divergence is None
    assert all(r.added < c.threshold for r in c.ops)
    assert "divergence starts: nowhere" in c.table()


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"threshold": -0.1}, ValueError, "threshold"),
    ({"precision": 3}, TypeError, "precision"),
    ({"precision": "no-such-policy"}, ValueError, "no-such-policy"),
    ({"dtype": "int8"}, ValueError, "dtype"),
])
def test_bad_arguments(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        ampkit.compare(nn.Linear(2, 2), torch.ones(1, 2), **kwargs)


def test_model_without_float_parameters_is_refused() -> None:
    with pytest.raises(ValueError, match="no floating-point parameters"):
        ampkit.compare(nn.ReLU(), torch.ones(2))
    with pytest.raises(TypeError, match="model"):
        ampkit.compare(lambda x: x, torch.ones(2))


def _comparison() -> Comparison:
    return ampkit.compare(_offset_model(), _offset_inputs(),
                          precision=aggressive_policy("bfloat16"),
                          loss_fn=lambda out: out.float().pow(2).mean())


def test_table_and_json_carry_the_ranking() -> None:
    c = _comparison()
    text = c.table()
    assert "divergence starts: module '0' (LayerNorm)" in text
    ops_section = text.split("ops ranked by error added")[1].splitlines()
    assert ops_section[2].split()[0] == "layer_norm"
    data = json.loads(c.to_json())
    assert data["divergence"] == {"module": "0", "call": 0}
    assert data["ranked_ops"][0]["name"] == "layer_norm"
    assert len(data["ops"]) == 4 and len(data["grads"]) == 6


def test_report_files(tmp_path) -> None:
    import matplotlib.image

    page = _comparison().write_report(tmp_path / "report")
    html = page.read_text()
    assert html.count("data:image/png;base64,") == 2
    for table in ("ranked-ops", "modules", "grads", "ops"):
        assert f'id="{table}"' in html
    assert 'class="diverged"' in html
    assert json.loads((tmp_path / "report" / "compare.json").read_text())["ranked_ops"][0][
        "name"] == "layer_norm"
    for name in ("error_per_layer.png", "op_error_histogram.png"):
        image = matplotlib.image.imread(tmp_path / "report" / name)
        assert image.shape[0] > 100 and image.shape[1] > 600
        assert len(np.unique(image.reshape(-1, image.shape[-1]), axis=0)) > 20


def test_report_page_renders_in_headless_chromium(tmp_path, headless_chromium) -> None:
    from PIL import Image

    page = _comparison().write_report(tmp_path / "report")
    chrome = headless_chromium
    chrome.get(page.resolve().as_uri())
    images = chrome.execute_script(
        "return Array.from(document.images).map(i => ({id: i.id, "
        "complete: i.complete, width: i.naturalWidth, "
        "box: i.getBoundingClientRect().toJSON()}))")
    ranked = chrome.execute_script(
        "return Array.from(document.querySelectorAll('#ranked-ops tbody tr'))"
        ".map(r => r.cells[0].textContent)")
    ratio = chrome.execute_script("return window.devicePixelRatio")
    shot = Image.open(io.BytesIO(chrome.get_screenshot_as_png())).convert("RGB")
    assert ranked[0] == "layer_norm"
    assert [i["id"] for i in images] == ["error-per-layer", "op-histogram"]
    for image in images:
        assert image["complete"] and image["width"] > 0, image
        box = image["box"]
        crop = shot.crop(tuple(int(v * ratio) for v in (
            box["left"], box["top"], box["right"], box["bottom"])))
        pixels = np.asarray(crop)
        assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 50, image["id"]


# -- nothing to compare is an error, not a report of no error ------------------------------

class _Yields(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor):  # type: ignore[override]
        yield self.fc(x)


def test_a_forward_that_returns_a_generator_is_refused_not_reported_as_exact() -> None:
    from ampkit.tools.accuracy.compare import NothingToCompareError

    with pytest.raises(NothingToCompareError, match="returned 'generator', which holds no "
                                                    "floating-point tensor"):
        ampkit.compare(_Yields(), torch.ones(3, 4), precision="O1", dtype=torch.bfloat16)


def test_nan_inputs_are_refused_not_reported_as_cosine_one() -> None:
    from ampkit.tools.accuracy.compare import NothingToCompareError

    x = torch.ones(3, 4)
    x[0, 0] = float("nan")
    # one NaN input row gives 2 NaN outputs (of 6); the message counts both
    with pytest.raises(NothingToCompareError,
                       match=r"output has 2 NaN \(of 6 values\).*the inputs have 1 NaN"):
        ampkit.compare(nn.Linear(4, 2), x, precision="O1", dtype=torch.bfloat16)
    # an output with infinities (masked logits) is still compared: equal infinities agree
    model = nn.Sequential(nn.Linear(1, 1), _Exp())
    with torch.no_grad():
        model[0].weight.fill_(1.0)
        model[0].bias.zero_()
    c = ampkit.compare(model, torch.tensor([[1.0], [1000.0]]), precision="O1",
                       dtype=torch.bfloat16)
    assert c.output.num_inf == 1 and 0 <= c.output.max_abs < 1


@pytest.mark.parametrize("depth", [6, 36, 120])
def test_the_error_plot_x_labels_do_not_overlap(depth: int) -> None:
    """About 35 leaf modules (a ViT's) once drew their x labels on top of each other;
    each drawn label's box stays apart from its neighbours' and inside the figure."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from ampkit.tools.accuracy.compare_report import layers_figure

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(depth)])
    c = ampkit.compare(model, torch.randn(2, 8), precision="O1", dtype=torch.bfloat16)
    figure = layers_figure(c)
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    renderer = canvas.get_renderer()
    labels = [t for t in figure.axes[0].get_xticklabels() if t.get_text()]
    boxes = [t.get_window_extent(renderer) for t in labels]
    # up to 40 leaves each has its label; past that every k-th one, at least 20 of them
    assert len(boxes) == depth if depth <= 40 else 20 <= len(boxes) < depth
    boxes.sort(key=lambda b: b.x0)
    for left, right in itertools.pairwise(boxes):
        assert left.x1 <= right.x0, (left, right)
    width, height = figure.bbox.width, figure.bbox.height
    assert all(b.x0 >= 0 and b.x1 <= width and b.y0 >= 0 and b.y1 <= height for b in boxes)
