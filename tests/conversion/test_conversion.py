"""Model conversion: dtypes per level, casts at module boundaries, nesting, tied weights,
module white lists, state dicts, converting twice, bad input."""

import copy
import dataclasses
import io
import pickle
import threading
from typing import NamedTuple

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers_models import DigitsCNN, TinyTransformer, on_forward

import ampkit
from ampkit.conversion import ConversionConfig, get_conversion
from ampkit.conversion.levels import conversion_for_level
from ampkit.front_door import convert_model

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
NORMS = (nn.BatchNorm2d, nn.LayerNorm)

# What the level table says is *stored*, per kind of tensor: (norm modules, other
# modules, output). O1's output is "as computed": the last op is a Linear, which
# autocast runs in bf16. O2 stores the fp32 truth and computes with copies made on use.
# Floating buffers keep their dtype (fp32) at every level; a BatchNorm, whose fp32
# running statistics stay, keeps fp32 parameters at O3 too (torch's kernels want them
# in the statistics' dtype).
EXPECTED = {
    "O0": (FP32, FP32, FP32),
    "O1": (FP32, FP32, FP32),  # outputs handed back in fp32, for a loss outside the model
    "O2": (FP32, FP32, FP32),
    "O3": (BF16, BF16, FP32),
}


def _inputs(model):
    if isinstance(model, DigitsCNN):
        return torch.rand(4, 1, 8, 8)
    return torch.randint(0, 64, (2, 12))


@pytest.mark.parametrize("make", [DigitsCNN, TinyTransformer])
@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_every_parameter_buffer_and_output_dtype_matches_the_level_table(level, make):
    model = convert_model(make(), level, BF16)
    norm_dtype, other_dtype, out_dtype = EXPECTED[level]
    for module in model.modules():
        want = norm_dtype if isinstance(module, NORMS) else other_dtype
        if isinstance(module, nn.BatchNorm2d):
            want = FP32
        for name, p in module.named_parameters(recurse=False):
            assert p.dtype is want, (level, type(module).__name__, name)
        for name, b in module.named_buffers(recurse=False):
            expected = torch.int64 if name == "num_batches_tracked" else FP32
            assert b.dtype is expected, (level, type(module).__name__, name)
    assert model(_inputs(model)).dtype is out_dtype


@pytest.mark.parametrize(("level", "make"), [("O2", DigitsCNN), ("O3", DigitsCNN),
                                             ("O3", TinyTransformer)])
def test_every_module_receives_inputs_in_its_parameters_dtype(level, make):
    # (At O2 TinyTransformer adds its fp32 position buffer to the embeddings, which
    # promotes the residual stream to fp32: buffers keep their dtype. Its Linears then
    # get fp32 inputs that autocast casts, as under native autocast.)
    model = convert_model(make(), level, BF16)
    seen = []

    def check(module, args):
        params = [p for p in module._parameters.values() if p is not None]
        floats = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
        if params and floats:
            seen.append((type(module).__name__, floats[0].dtype, params[0].dtype))

    for module in model.modules():
        on_forward(module, check)
    model(_inputs(model)).float().sum().backward()
    assert seen, "no module with parameters saw a floating input"
    # Except the kept-fp32 norms at O2: BatchNorm and LayerNorm take the bf16 activation
    # as it is, with fp32 parameters (their kernels compute in fp32 inside, so O2 saves
    # the cast);
    # at O3 BatchNorm, which keeps its fp32 statistics and so fp32 parameters, too.
    low_input = {"BatchNorm2d", "LayerNorm"} if level == "O2" else {"BatchNorm2d"}
    assert all(got is (BF16 if name in low_input else want) for name, got, want in seen), seen
    # gradients come back in each parameter's own (stored) dtype
    assert all(p.grad.dtype is p.dtype for p in model.parameters() if p.grad is not None)
    if level == "O2":  # the other modules computed with bf16 copies of fp32 parameters
        assert {want for name, _, want in seen if name not in low_input} == {BF16}
        assert {p.dtype for p in model.parameters()} == {FP32}


def test_o1_is_native_autocast_bit_for_bit():
    torch.manual_seed(1)
    model = TinyTransformer()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 64, (2, 12))
    convert_model(model, "O1", BF16)
    with torch.autocast("cpu", BF16):
        expected = reference(ids)
    got = model(ids)
    # the same values; handed back in fp32 (so a loss computed outside the model
    # is never computed in lower precision than native computes it inside its region)
    assert expected.dtype is BF16 and got.dtype is FP32
    assert torch.equal(got, expected.float())
    assert not torch.is_autocast_enabled("cpu")  # the region closed with the forward


def test_o1_uses_the_policy_and_custom_lists():
    lin = nn.Sequential(nn.Linear(4, 4))
    convert_model(lin, "O1", BF16, custom_black_list=[nn.Linear])
    assert lin(torch.rand(2, 4)).dtype is FP32
    conservative = convert_model(nn.Sequential(nn.Linear(4, 4), nn.Softmax(-1)), "O1", BF16,
                                 policy="conservative")
    assert conservative(torch.rand(2, 4)).dtype is FP32  # softmax on its fp32 list
    assert get_conversion(conservative).policy.name == "conservative"


def test_o3_is_the_model_cast_to_low_precision_bit_for_bit():
    # Parameters low, buffers as they were: the BatchNorms keep fp32 statistics, and so
    # fp32 parameters (torch's kernel takes the bf16 activation with them).
    torch.manual_seed(2)
    model = DigitsCNN()
    reference = copy.deepcopy(model).to(BF16)
    for module in reference.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.float()
    x = torch.rand(8, 1, 8, 8)
    convert_model(model, "O3", BF16)
    expected = reference(x.to(BF16)).float()
    assert torch.equal(model(x), expected)


def test_o3_with_cast_buffers_is_model_half_bit_for_bit():
    torch.manual_seed(2)
    model = DigitsCNN()
    reference = copy.deepcopy(model).to(BF16)  # buffers too
    x = torch.rand(8, 1, 8, 8)
    convert_model(model, "O3", BF16, cast_buffers=True)
    assert {b.dtype for b in model.buffers() if b.is_floating_point()} == {BF16}
    expected = reference(x.to(BF16)).float()
    assert torch.equal(model(x), expected)


def test_o2_matches_a_hand_written_reference_bit_for_bit():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 3))
    w1, b1 = model[0].weight.detach().clone(), model[0].bias.detach().clone()
    g, beta = model[1].weight.detach().clone(), model[1].bias.detach().clone()
    w2, b2 = model[2].weight.detach().clone(), model[2].bias.detach().clone()
    x = torch.rand(5, 6)
    convert_model(model, "O2", BF16)
    with torch.autocast("cpu", BF16):
        h = F.linear(x.to(BF16), w1.to(BF16), b1.to(BF16))
    h = F.layer_norm(h.float(), (8,), g, beta).to(BF16)  # the kept-fp32 norm, in fp32
    with torch.autocast("cpu", BF16):
        y = F.linear(h, w2.to(BF16), b2.to(BF16))
    assert torch.equal(model(x), y.float())


def test_kept_fp32_modules_really_compute_in_fp32_under_autocast():
    seen = []
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4)))
    model[1][0].register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    convert_model(model, "O2", BF16, keep_fp32_modules=["1"])
    assert model[1][0].weight.dtype is FP32
    assert model(torch.rand(2, 4)).dtype is FP32
    assert seen == [FP32]  # autocast would have made this Linear bf16


@pytest.mark.parametrize("selector", [nn.Linear, "head", "lambda"])
def test_keep_fp32_modules_by_type_name_or_instance(selector):
    model = nn.Sequential()
    model.add_module("body", nn.Conv1d(2, 2, 1))
    model.add_module("head", nn.Linear(2, 2))
    if selector == "lambda":
        selector = model.head
    seen = {}
    for name in ("body", "head"):
        on_forward(getattr(model, name),
                   lambda m, a, name=name: seen.__setitem__(name, m.weight.dtype))
    convert_model(model, "O2", BF16, keep_fp32_modules=[selector])
    model.body(torch.rand(3, 2, 1, dtype=BF16))
    model.head(torch.rand(3, 2))
    assert seen == {"body": BF16, "head": FP32}  # what each computed with
    assert model.body.weight.dtype is FP32 and model.head.weight.dtype is FP32


def test_kept_container_keeps_everything_inside_it():
    model = nn.Sequential(nn.Linear(3, 3), nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3)))
    convert_model(model, "O3", BF16, keep_fp32_modules="1")
    assert model[0].weight.dtype is BF16
    assert {p.dtype for p in model[1].parameters()} == {FP32}
    assert model(torch.rand(2, 3)).dtype is FP32


def test_keep_norms_off_at_o2():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.BatchNorm1d(4))
    convert_model(model, "O2", BF16, keep_norms_fp32=False)
    seen = []
    for norm in model[1:]:
        on_forward(norm, lambda m, a: seen.append(m.weight.dtype))
    assert model(torch.rand(3, 4)).dtype is FP32
    # LayerNorm computes with bf16 copies; BatchNorm updates fp32 running statistics in
    # place, which a bf16 copy could not hold, so it keeps its fp32 parameters.
    assert seen == [BF16, FP32]
    assert {p.dtype for p in model.parameters()} == {FP32}


def test_unknown_module_name_suggests_close_ones():
    model = nn.Sequential()
    model.add_module("encoder", nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"no module named 'encodr'; did you mean \['encoder'\]"):
        convert_model(model, "O2", BF16, keep_fp32_modules=["encodr"])
    assert model.encoder.weight.dtype is FP32  # nothing changed


def test_foreign_module_instance_is_refused():
    with pytest.raises(ValueError, match="not part of the model"):
        convert_model(nn.Linear(2, 2), "O2", BF16, keep_fp32_modules=[nn.Linear(2, 2)])


def test_bad_selector_type():
    with pytest.raises(TypeError, match=r"keep_fp32_modules: expected nn.Module subclasses"):
        convert_model(nn.Linear(2, 2), "O2", BF16, keep_fp32_modules=[3])


# -- structures in and out -----------------------------------------------------------------

@dataclasses.dataclass
class Batch:
    image: torch.Tensor
    label: torch.Tensor


class Pair(NamedTuple):
    logits: torch.Tensor
    ids: torch.Tensor


class Structured(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.ln = nn.LayerNorm(3)
        self.seen = {}

    def forward(self, batch, extras, *, scale):
        self.seen = {"image": batch.image.dtype, "label": batch.label.dtype,
                     "extra": extras["x"][0].dtype, "mask": extras["mask"].dtype,
                     "scale": scale.dtype}
        h = self.ln(self.lin(batch.image) * scale)
        return {"out": Pair(h, batch.label), "list": [h, extras["mask"]],
                "data": Batch(h, batch.label)}


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_nested_dict_tuple_dataclass_inputs_and_outputs(level):
    model = convert_model(Structured(), level, BF16)
    batch = Batch(torch.rand(2, 4), torch.tensor([1, 2]))
    extras = {"x": (torch.rand(2),), "mask": torch.tensor([True, False])}
    out = model(batch, extras, scale=torch.tensor(2.0))
    assert model.seen == {"image": BF16, "label": torch.int64, "extra": BF16,
                          "mask": torch.bool, "scale": BF16}
    assert isinstance(out["out"], Pair) and isinstance(out["data"], Batch)
    assert out["out"].logits.dtype is FP32 and out["out"].ids.dtype is torch.int64
    assert out["list"][0].dtype is FP32 and out["list"][1].dtype is torch.bool
    assert out["data"].image.dtype is FP32
    assert torch.equal(out["out"].ids, batch.label)


def test_token_ids_are_left_alone():
    model = convert_model(TinyTransformer(), "O3", BF16)
    ids = torch.randint(0, 64, (1, 5))
    seen = []
    model.embed.register_forward_pre_hook(lambda m, a: seen.append(a[0].dtype))
    model(ids)
    assert seen == [torch.int64]


# -- tied weights ---------------------------------------------------------------------------

def test_tied_weights_stay_one_parameter_cast_once_per_forward():
    model = TinyTransformer()
    tied = model.embed.weight
    used = []
    for name in ("embed", "head"):
        on_forward(getattr(model, name), lambda m, a: used.append(m._parameters["weight"]))
    convert_model(model, "O3", BF16)
    assert model.head.weight is model.embed.weight is tied and tied.dtype is BF16
    model = TinyTransformer()
    tied, before = model.embed.weight, model.embed.weight.detach().clone()
    for name in ("embed", "head"):
        on_forward(getattr(model, name), lambda m, a: used.append(m._parameters["weight"]))
    used.clear()
    convert_model(model, "O2", BF16)
    model(torch.randint(0, 64, (2, 5))).sum().backward()
    assert model.head.weight is model.embed.weight is tied and tied.dtype is FP32
    assert len(used) == 2 and used[0] is used[1]  # one bf16 copy, one autograd node
    assert torch.equal(used[0], before.to(BF16))
    names = [n for n, _ in model.named_parameters()]
    assert names.count("embed.weight") == 1 and "head.weight" not in names


def test_tied_weight_asked_to_be_in_two_dtypes_is_an_error():
    model = TinyTransformer()
    with pytest.raises(ValueError, match=r"head.weight and embed.weight are one shared "
                                         r"tensor.*keep both modules in fp32"):
        convert_model(model, "O3", BF16, keep_fp32_modules=["head"])
    assert model.embed.weight.dtype is FP32  # nothing changed
    # At O2 nothing is stored twice: the kept head uses the fp32 truth, the embedding a
    # bf16 copy of it.
    convert_model(model, "O2", BF16, keep_fp32_modules=["head"])
    assert model.embed.weight.dtype is FP32 and model(torch.randint(0, 64, (1, 3))).dtype \
        is FP32


class _TiedPair(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.embed(ids))


def test_cast_shared_on_use_keeps_the_kept_modules_parameter_fp32():
    # No policy and no input/output casts: the stored bf16 embedding would meet an fp32
    # weight without the copy made on use; the kept head computes in fp32.
    torch.manual_seed(0)
    model, ids = _TiedPair(), torch.tensor([[1, 2, 5]])
    tied = model.embed.weight
    config = ConversionConfig(param_dtype=BF16, keep_fp32_modules=("head",),
                              cast_shared_on_use=True)
    convert_model(model, config)
    assert model.head.weight is model.embed.weight is tied and tied.dtype is FP32
    out = model(ids)
    w = tied.detach().clone()
    assert out.dtype is FP32
    assert torch.equal(out, F.linear(F.embedding(ids, w.to(BF16)).float(), w))
    out.sum().backward()
    assert tied.grad.dtype is FP32 and tied.dtype is FP32
    # The copy lives for one forward of the model: an edit through .data (no version
    # bump) is seen by the next forward.
    assert not ampkit.conversion.parameter_casts.is_cached(tied)
    tied.data.mul_(2)
    assert torch.equal(model(ids), F.linear(F.embedding(ids, (2 * w).to(BF16)).float(), 2 * w))


def test_cast_shared_on_use_errors():
    with pytest.raises(ValueError, match="cast_shared_on_use applies to parameters that "
                                         "param_dtype stores in low precision"):
        ConversionConfig(param_compute_dtype=BF16, cast_shared_on_use=True)
    with pytest.raises(TypeError, match="cast_shared_on_use must be a bool"):
        ConversionConfig(param_dtype=BF16, cast_shared_on_use=1)
    # Without it the error names the option; a shared buffer is refused either way.
    with pytest.raises(ValueError, match=r"head.weight and embed.weight are one shared "
                                         r"tensor.*cast_shared_on_use=True"):
        convert_model(_TiedPair(), ConversionConfig(param_dtype=BF16,
                                                    keep_fp32_modules=("head",)))
    a, b = nn.BatchNorm1d(3), nn.BatchNorm1d(3)
    b.running_mean = a.running_mean
    model = nn.Sequential(a, b)
    with pytest.raises(ValueError, match=r"1.running_mean and 0.running_mean are one "
                                         r"shared tensor.*or neither$"):
        convert_model(model, ConversionConfig(param_dtype=BF16, keep_fp32_modules=("1",),
                                              cast_shared_on_use=True))
    assert a.weight.dtype is FP32 and get_conversion(model) is None  # nothing changed


def test_parameters_keep_their_identity():
    model = DigitsCNN()
    params = list(model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    convert_model(model, "O3", BF16)
    assert all(a is b for a, b in zip(params, model.parameters()))
    batch_norms = {id(p) for m in model.modules() if isinstance(m, nn.BatchNorm2d)
                   for p in m.parameters()}
    assert all(p.dtype is (FP32 if id(p) in batch_norms else BF16)
               for p in optimizer.param_groups[0]["params"])


def test_shared_buffers_stay_shared():
    a, b = nn.BatchNorm1d(3), nn.BatchNorm1d(3)
    b.running_mean = a.running_mean
    model = nn.Sequential(a, b)
    convert_model(model, "O3", BF16, cast_buffers=True)
    assert a.running_mean is b.running_mean and a.running_mean.dtype is BF16


# -- module white list (MindSpore O1) ------------------------------------------------------

def test_module_white_list_runs_only_listed_modules_in_low_precision():
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(4, 6), nn.Softmax(-1), nn.Linear(6, 2))
    w, bias = model[0].weight.detach().clone(), model[0].bias.detach().clone()
    seen = []
    for m in model:
        m.register_forward_pre_hook(lambda m, a: seen.append(a[0].dtype))
    config = ConversionConfig(low_precision_modules=(nn.Linear,), compute_dtype=BF16)
    convert_model(model, config)
    x = torch.rand(3, 4)
    y = model(x)
    assert {p.dtype for p in model.parameters()} == {FP32}  # cast on use, stored fp32
    assert seen == [FP32, FP32, FP32]  # every listed module's output went back to fp32
    expected = F.linear(x.to(BF16), w.to(BF16), bias.to(BF16)).float()
    assert torch.equal(model[0](x), expected)
    assert y.dtype is FP32
    y.sum().backward()
    assert model[0].weight.grad.dtype is FP32


def test_module_white_list_covers_ops_that_native_autocast_keeps_fp32():
    # prelu is on native CPU autocast's fp32 list; a white-listed PReLU runs in bf16.
    out = []
    model = nn.Sequential(nn.PReLU())
    model[0].register_forward_hook(lambda m, a, o: out.append(o.dtype))
    convert_model(model, ConversionConfig(low_precision_modules=[nn.PReLU], compute_dtype=BF16,
                                          white_list_output_dtype=None))
    assert model(torch.rand(3)).dtype is BF16 and out == [BF16]


def test_white_list_with_low_precision_parameters_is_refused():
    with pytest.raises(ValueError, match=r"param_dtype must be None or torch.float32"):
        ConversionConfig(low_precision_modules=(nn.Linear,), compute_dtype=BF16,
                         param_dtype=BF16)
    with pytest.raises(ValueError, match="low_precision_modules needs compute_dtype"):
        ConversionConfig(low_precision_modules=(nn.Linear,))


# -- kept-module outputs (MindSpore O2 vs fp32 kept outputs) ------------------------------

@pytest.mark.parametrize(("kept_output", "expected"), [(BF16, BF16), (None, FP32)])
def test_kept_modules_output_dtype_is_configurable(kept_output, expected):
    seen = []
    model = nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3), nn.Identity())
    model[2].register_forward_pre_hook(lambda m, a: seen.append(a[0].dtype))
    config = ConversionConfig(param_dtype=BF16, keep_fp32_modules=(nn.LayerNorm,),
                              kept_output_dtype=kept_output, input_dtype=BF16)
    convert_model(model, config)
    model(torch.rand(2, 3))
    assert seen == [expected]


# -- state dicts -----------------------------------------------------------------------------

def test_o2_state_dict_holds_the_exact_fp32_values_and_loads_into_fp32():
    torch.manual_seed(5)
    model = DigitsCNN()
    original = copy.deepcopy(model.state_dict())
    convert_model(model, "O2", BF16)
    state = model.state_dict()
    assert state.keys() == original.keys()
    for key, value in original.items():
        assert state[key].dtype is value.dtype, key
        assert torch.equal(state[key], value), key  # the fp32 truth: nothing rounded
    fresh = DigitsCNN()
    fresh.load_state_dict(state)
    for key, value in original.items():
        assert torch.equal(fresh.state_dict()[key], value)


def test_fp32_state_dict_loads_into_an_o2_model_exactly():
    torch.manual_seed(6)
    source = TinyTransformer()
    model = convert_model(TinyTransformer(), "O2", BF16)
    model.load_state_dict(source.state_dict())
    for name, p in source.named_parameters():
        target = model.get_parameter(name)
        assert target.dtype is FP32 and torch.equal(target, p.detach()), name
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                source.state_dict().values()))


def test_o3_state_dict_is_low_precision_and_loads_into_fp32():
    model = convert_model(DigitsCNN(), "O3", BF16)
    state = model.state_dict()
    assert state["classifier.1.weight"].dtype is BF16
    fresh = DigitsCNN()
    fresh.load_state_dict(state)
    assert fresh.classifier[1].weight.dtype is FP32
    assert torch.equal(fresh.classifier[1].weight, model.classifier[1].weight.float())


def test_state_dict_round_trips_through_torch_save():
    model = convert_model(TinyTransformer(), "O2", BF16)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)
    assert loaded["embed.weight"].dtype is FP32
    assert torch.equal(loaded["embed.weight"], model.embed.weight)


def test_keep_vars_state_dict_gives_the_parameters_themselves():
    model = convert_model(nn.Linear(2, 2), "O2", BF16)
    assert model.state_dict(keep_vars=True)["weight"] is model.weight


def test_state_dict_dtype_option():
    config = ConversionConfig(param_dtype=BF16, input_dtype=BF16, state_dict_dtype=FP16)
    model = convert_model(nn.Linear(2, 2), config)
    assert model.state_dict()["weight"].dtype is FP16


# -- converting twice, copies, threads ----------------------------------------------------

def test_converting_again_with_the_same_settings_is_a_no_op():
    model = convert_model(DigitsCNN(), "O2", BF16)
    weight = model.classifier[1].weight.detach().clone()
    hooks = len(model._forward_pre_hooks)
    assert convert_model(model, "O2", BF16) is model
    assert len(model._forward_pre_hooks) == hooks
    assert torch.equal(model.classifier[1].weight, weight)


def test_converting_again_differently_is_an_error():
    model = convert_model(DigitsCNN(), "O2", BF16)
    with pytest.raises(RuntimeError, match="already converted with different settings"):
        convert_model(model, "O3", BF16)
    with pytest.raises(RuntimeError, match=r"part of a model converted earlier \(as 'features'\)"):
        convert_model(model.features, "O2", BF16)
    with pytest.raises(RuntimeError, match=r"its submodule '0' is part of a model converted"):
        convert_model(nn.Sequential(model), "O2", BF16)


def test_deepcopy_of_a_converted_model_works_on_its_own():
    model = convert_model(DigitsCNN(), "O2", BF16)
    clone = copy.deepcopy(model)
    x = torch.rand(2, 1, 8, 8)
    assert torch.equal(clone(x), model(x))
    with torch.no_grad():
        clone.classifier[3].bias.add_(1.0)
    assert not torch.equal(clone(x), model(x))


class _WithBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)
        self.register_buffer("pos", torch.randn(4))

    def forward(self, x):
        return self.b(self.a(x) + self.pos)


def _pickled_models():
    """Converted models whose state names every kind of object the conversion pickles:
    boundaries and regions, records, cast-on-use and input-cast calls, a legacy
    spectral norm hook, a state_dict dtype hook."""
    o2 = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8),
                       nn.utils.spectral_norm(nn.Linear(8, 8)), nn.Linear(8, 2))
    white = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    config = ConversionConfig(low_precision_modules=(nn.Linear,), compute_dtype=BF16,
                              state_dict_dtype=FP16)
    ampkit.conversion.apply_conversion(
        white, config, ampkit.conversion.prepare_conversion(white, config))
    return [convert_model(o2, "O2", BF16).eval(), convert_model(_WithBuffer(), "O3", BF16),
            white]


# What each name a pickle of a converted model refers to was called in the single-file
# ampkit/conversion.py, the module that pickles made before the package named.
_SINGLE_FILE_NAMES = {
    "Boundary": "_Boundary", "Region": "_Region", "Record": "_Record",
    "ReportDtype": "_ReportDtype", "SpectralNormInFp32": "_SpectralNormInFp32",
    "WeightNormInFp32": "_WeightNormInFp32", "converted_call": "_converted_call",
    "cast_call": "_cast_call", "input_cast_call": "_input_cast_call",
    "cast_inputs_hook": "_cast_inputs_hook", "rebuild_converted": "_rebuild_converted",
}


def test_a_pickled_converted_model_names_the_package_only():
    # Pickles name ampkit.conversion, not the file inside it that defines an object, so
    # a definition can move between the package's files without breaking a pickle.
    import pickletools

    for model in _pickled_models():
        data = pickle.dumps(model, protocol=2)  # GLOBAL opcodes: "module name"
        named = {arg for op, arg, _ in pickletools.genops(data) if op.name == "GLOBAL"}
        ours = {n for n in named if n.startswith("ampkit.conversion")}
        assert ours and all(n.split()[0] == "ampkit.conversion" for n in ours), ours


def test_a_pickle_made_by_the_single_file_module_loads():
    x = torch.randn(3, 4)
    for model in _pickled_models():
        with torch.no_grad():
            expected = model(x)
        data = pickle.dumps(model, protocol=2)
        for new, old in _SINGLE_FILE_NAMES.items():  # spelled as the old module did
            data = data.replace(f"ampkit.conversion\n{new}\n".encode(),
                                f"ampkit.conversion\n{old}\n".encode())
        assert b"ampkit.conversion\n_" in data
        loaded = pickle.loads(data)
        with torch.no_grad():
            assert torch.equal(loaded(x), expected)
        assert get_conversion(loaded) == get_conversion(model)


def test_an_exception_in_forward_closes_the_regions():
    class Boom(nn.Module):
        def forward(self, x):
            raise KeyError("boom")

    model = convert_model(nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2), Boom()), "O2", BF16)
    with pytest.raises(KeyError):
        model(torch.rand(1, 2))
    assert not torch.is_autocast_enabled("cpu")
    assert ampkit.current_policy("cpu") is None
    # its boundary still works: low in, low out (an fp32 input, on its own: fp32 out)
    assert model[1](torch.rand(1, 2, dtype=BF16)).dtype is BF16


def test_threads_run_converted_models_independently():
    model = convert_model(TinyTransformer(), "O1", BF16)
    ids = torch.randint(0, 64, (1, 6))
    expected = model(ids)
    results, errors = [], []

    def run():
        try:
            for _ in range(3):
                results.append(torch.equal(model(ids), expected))
        except Exception as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == [True] * 6
    assert not torch.is_autocast_enabled("cpu")


# -- bad input -------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [None, "model", torch.ones(2), [nn.Linear(2, 2)]])
def test_not_a_module_is_a_type_error(bad):
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module"):
        convert_model(bad, "O2", BF16)


def test_unknown_level_and_dtype():
    with pytest.raises(ValueError, match=r"level must be one of \['O0', 'O1', 'O2', 'O3'\]"):
        convert_model(nn.Linear(2, 2), "O5", BF16)
    with pytest.raises(ValueError, match=r"dtype must be torch.float16 or torch.bfloat16"):
        convert_model(nn.Linear(2, 2), "O2", torch.int8)


def test_non_fp32_model_is_refused():
    model = nn.Linear(2, 2).to(FP16)
    with pytest.raises(ValueError, match=r"expects an fp32 model, but parameter 'weight' is "
                                         r"torch.float16; call model.float\(\) first"):
        convert_model(model, "O2", BF16)
    assert convert_model(nn.Linear(2, 2).double(), "O0").weight.dtype is FP32


def test_lazy_modules_must_be_initialized_first():
    with pytest.raises(ValueError, match="uninitialized"):
        convert_model(nn.LazyLinear(2), "O2", BF16)


def test_wrapped_models_are_refused():
    wrapped = nn.DataParallel(nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match=r"wrapped in DataParallel; call ampkit.initialize / "
                                           r"convert_model on the bare model first"):
        convert_model(wrapped, "O2", BF16)
    inner = nn.Sequential(nn.DataParallel(nn.Linear(2, 2)))
    with pytest.raises(RuntimeError, match=r"its submodule '0'\) is wrapped in DataParallel"):
        convert_model(inner, "O2", BF16)


def test_config_and_overrides_together_are_refused():
    with pytest.raises(TypeError, match="either a ConversionConfig or a level"):
        convert_model(nn.Linear(2, 2), ConversionConfig(), BF16)


def test_config_field_checks():
    with pytest.raises(ValueError, match="param_dtype must be None or one of"):
        ConversionConfig(param_dtype=torch.int32)
    with pytest.raises(ValueError, match="param_compute_dtype casts fp32 parameters"):
        ConversionConfig(param_dtype=BF16, param_compute_dtype=BF16)
    with pytest.raises(ValueError, match="param_compute_dtype must be None or one of"):
        ConversionConfig(param_compute_dtype=FP32)
    with pytest.raises(TypeError, match="cast_buffers must be a bool"):
        ConversionConfig(cast_buffers=1)
    with pytest.raises(ValueError, match="policy needs compute_dtype"):
        ConversionConfig(policy="torch")
    with pytest.raises(ValueError, match="patch_ops=False does not do"):
        conversion_for_level("O3", BF16, custom_white_list=["add"])


# -- kept-fp32 modules save their low-precision input, not its fp32 copy ----------------

def _o2_block():
    # RMSNorm: a kept norm whose input is still cast to fp32 (BatchNorm and LayerNorm
    # take the bf16 input as it is, see the tests in test_o2_cast_traffic.py).
    torch.manual_seed(8)
    return convert_model(nn.Sequential(nn.Linear(6, 6), nn.RMSNorm(6), nn.Linear(6, 2),
                                       nn.BatchNorm1d(2)), "O2", BF16)


def _grads(model, x, outer_hooks):
    model.zero_grad()
    if outer_hooks:  # another saved-tensor hook active: ampkit stays out of the way
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            out = model(x)
    else:
        out = model(x)
    out.pow(2).sum().backward()
    return out, [p.grad.clone() for p in model.parameters()]


def test_saving_the_low_precision_input_changes_no_bit():
    model, x = _o2_block(), torch.rand(5, 6)
    out_a, grads_a = _grads(model, x, outer_hooks=False)
    out_b, grads_b = _grads(model, x, outer_hooks=True)
    assert torch.equal(out_a, out_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))


def test_the_fp32_copy_of_a_kept_modules_input_is_freed_after_forward():
    import weakref

    model = _o2_block()
    seen = []
    model[1].register_forward_pre_hook(lambda m, a: seen.append(weakref.ref(a[0])))
    out = model(torch.rand(5, 6))
    assert seen and seen[0]() is None  # only the bf16 input is kept for backward
    out.sum().backward()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        out = model(torch.rand(5, 6))
    assert seen[1]() is not None and seen[1]().dtype is FP32  # the plain way keeps it


def test_modifying_the_saved_low_precision_input_in_place_is_caught():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.ln = nn.Linear(4, 4), nn.RMSNorm(4)  # input cast to fp32

        def forward(self, x):
            h = self.lin(x)
            out = self.ln(h)
            h.mul_(2)  # changes what the norm's backward needs
            return out

    model = convert_model(Net(), "O2", BF16)
    out = model(torch.rand(3, 4))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.pow(2).sum().backward()


def test_activation_checkpointing_still_works():
    from torch.utils.checkpoint import checkpoint

    model, x = _o2_block(), torch.rand(5, 6)
    model.eval()  # no BatchNorm statistics update twice in the recomputation
    _, expected = _grads(model, x, outer_hooks=False)
    model.zero_grad()
    out = checkpoint(model, x, use_reentrant=False)
    out.pow(2).sum().backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), expected))


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_cast_model_type_false_takes_a_float16_model_as_given(level: str) -> None:
    """``cast_model_type=False``: the model as given, float16 parameters included;
    nothing is cast and the float16 parameter trains in place."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).half())
    model[1].register_forward_pre_hook(lambda m, a: tuple(t.half() for t in a))
    weights = [p for p in model.parameters()]
    model = ampkit.initialize(model, level=level, dtype=torch.float16, cast_model_type=False,
                              cast_model_outputs=torch.float32)
    assert [p.dtype for p in model.parameters()] == [torch.float32] * 2 + [torch.float16] * 2
    assert all(p is q for p, q in zip(model.parameters(), weights))
    out = model(torch.rand(2, 4, device="cpu"))
    assert out.dtype == torch.float32
    out.sum().backward()
    assert model[1].weight.grad.dtype == torch.float16
