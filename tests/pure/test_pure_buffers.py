"""Floating buffers keep their dtype in pure bf16 and at O3, as at O2: rotary
frequencies, position tables and running statistics stay fp32 and compute as in the
fp32 model; ``cast_buffers=True`` asks for them to follow the parameters, and the apex
dialect's O3 casts them as ``model.half()`` does."""

import copy
import io

import pytest
import torch
import torch.nn as nn

import ampkit
import ampkit.apex as amp

BF16, FP32 = torch.bfloat16, torch.float32

# The low-precision modes that store parameters in bf16.
LOW_MODES = {
    "pure-stochastic": dict(level="O2", master_weights="stochastic", rounding_seed=0),
    "pure-kahan": dict(level="O2", master_weights="kahan", rounding_seed=0),
    "O3": dict(level="O3"),
}


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    return transformers.LlamaForCausalLM(config).eval()


def _rotary_outputs(model, ids, positions):
    seen = []
    handle = model.model.rotary_emb.register_forward_hook(
        lambda module, args, out: seen.append(out))
    try:
        logits = model(input_ids=ids, position_ids=positions).logits
    finally:
        handle.remove()
    (cos, sin), = seen
    return cos, sin, logits


@pytest.mark.parametrize("mode", list(LOW_MODES))
def test_llama_rotary_is_the_fp32_models_at_far_positions(mode):
    reference = _tiny_llama()
    model = ampkit.initialize(copy.deepcopy(reference), dtype=BF16, **LOW_MODES[mode])
    assert model.model.embed_tokens.weight.dtype is BF16
    assert model.model.rotary_emb.inv_freq.dtype is FP32
    assert torch.equal(model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
    ids = torch.randint(0, 64, (1, 32), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(4064, 4096).unsqueeze(0)  # where a bf16 inv_freq is 5 rad off
    cos32, sin32, logits32 = _rotary_outputs(reference, ids, positions)
    cos, sin, logits = _rotary_outputs(model, ids, positions)
    # The converted model hands its bf16 activations the fp32 model's angles, rounded
    # once (HF casts cos/sin to the activations' dtype).
    assert cos.dtype is BF16
    assert torch.equal(cos, cos32.to(BF16)) and torch.equal(sin, sin32.to(BF16))
    assert torch.isfinite(logits).all() and logits.dtype is FP32
    torch.testing.assert_close(logits, logits32, atol=0.1, rtol=0.1)


@pytest.mark.parametrize("mode", ["pure-stochastic", "pure-kahan"])
def test_llama_trains_in_pure_mode_with_fp32_rotary(mode):
    reference = _tiny_llama().train()
    model = copy.deepcopy(reference)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = ampkit.initialize(model, opt, dtype=BF16, **LOW_MODES[mode])
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(2):
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    assert model.model.rotary_emb.inv_freq.dtype is FP32
    assert torch.equal(model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


class _Norms(nn.Module):
    """Conv, BatchNorm, GroupNorm, a LayerNorm head: the norms a CNN and a transformer
    bring, with BatchNorm's running statistics."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.gn = nn.GroupNorm(2, 4)
        self.fc = nn.Linear(4 * 5 * 5, 6)
        self.ln = nn.LayerNorm(6)

    def forward(self, x):
        x = torch.relu(self.gn(self.bn(self.conv(x))))
        return self.ln(self.fc(x.flatten(1)))


@pytest.mark.parametrize("mode", [
    dict(level="O3"),
    dict(level="O2", master_weights="stochastic", keep_norms_fp32=False),
    dict(level="O3", master_weights="kahan")])
def test_norms_keep_fp32_statistics_that_fp32_batch_norm_computes(mode):
    torch.manual_seed(3)
    model = ampkit.initialize(_Norms(), dtype=BF16, **mode)
    fed = []
    model.bn.register_forward_pre_hook(lambda module, args: fed.append(args[0].detach()))
    x = torch.randn(8, 3, 5, 5)
    for _ in range(3):
        out = model(x)
        out.float().sum().backward()
    assert model.bn.running_mean.dtype is FP32 and model.bn.running_var.dtype is FP32
    assert torch.isfinite(out).all()
    assert all(p.grad is not None and torch.isfinite(p.grad).all()
               for p in model.parameters())
    # The running statistics are those a plain fp32 BatchNorm computes from the same
    # (bf16) activations: nothing about them was rounded to bf16.
    twin = nn.BatchNorm2d(4)
    for a in fed:
        twin(a.float())
    torch.testing.assert_close(model.bn.running_mean, twin.running_mean, rtol=1e-6,
                               atol=1e-7)
    torch.testing.assert_close(model.bn.running_var, twin.running_var, rtol=1e-6,
                               atol=1e-7)
    model.eval()
    assert torch.isfinite(model(x)).all()


class _PositionTable(nn.Module):
    """A tutorial-style positional encoding: an fp32 buffer added to the activations."""

    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.randn(7, 8) * 100)

    def forward(self, x):
        return x + self.table


def test_o3_position_table_stays_fp32_and_the_next_layer_gets_its_dtype():
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(8, 8), _PositionTable(), nn.Linear(8, 3))
    first, second = (copy.deepcopy(model[i]).to(BF16) for i in (0, 2))
    table = model[1].table.clone()
    model = ampkit.initialize(model, level="O3", dtype=BF16)
    assert model[1].table.dtype is FP32
    x = torch.randn(7, 8)
    # by hand: the sum follows torch's promotion (fp32), the next Linear takes bf16
    expected = second((first(x.to(BF16)) + table).to(BF16)).float()
    assert torch.equal(model(x), expected)
    saved = io.BytesIO()
    torch.save(model, saved)
    saved.seek(0)
    for twin in (copy.deepcopy(model), torch.load(saved, weights_only=False)):
        assert torch.equal(twin(x), expected)


def test_cast_buffers_asks_for_buffers_in_the_parameters_dtype():
    model = ampkit.initialize(_tiny_llama(), level="O2", dtype=BF16,
                              master_weights="stochastic", cast_buffers=True)
    assert model.model.rotary_emb.inv_freq.dtype is BF16
    with pytest.raises(TypeError, match="cast_buffers must be a bool"):
        ampkit.initialize(nn.Linear(2, 2), level="O3", dtype=BF16, cast_buffers="yes")


def test_apex_o3_casts_buffers_as_model_half_does():
    # (It passed too when every level cast buffers: it pins that the
    # dialect still asks for it now that the core keeps them.)
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(8, 8), _PositionTable(), nn.BatchNorm1d(7),
                          nn.Linear(8, 3))
    reference = copy.deepcopy(model).to(BF16)  # apex's O3: model.half(), buffers too
    model = amp.initialize(model, opt_level="O3", cast_model_type=BF16, verbosity=0)
    assert {t.dtype for t in [*model.parameters(), *model.buffers()]
            if t.is_floating_point()} == {BF16}
    x = torch.randn(4, 7, 8)
    assert torch.equal(model(x), reference(x.to(BF16)).float())
