"""A converted model's ``generate()`` runs inside the model's boundary (its region and
one forward pass; see ``ENTRY_METHODS`` in ``ampkit.conversion.classes``).

Hugging Face's ``generate`` calls an encoder-decoder's encoder directly
(``model.get_encoder()(...)``), outside the converted model's forward: before, T5's
encoder then computed in fp32 at O1 (native autocast around ``generate`` runs it low)
and failed at O2 (``expected m1 and m2 to have the same dtype`` in its feed-forward).
"""

from __future__ import annotations

import copy

import pytest
import torch

import ampkit
from ampkit.conversion.parameter_casts import is_cached

transformers = pytest.importorskip("transformers")

BF16, FP16 = torch.bfloat16, torch.float16
DEVICE = "cpu"


def _t5() -> torch.nn.Module:
    config = transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(config).to(DEVICE).eval()


def _gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2,
                                     n_head=2, attn_implementation="eager")
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).to(DEVICE).eval()


def _ids() -> torch.Tensor:
    return torch.randint(2, 64, (2, 6), generator=torch.Generator().manual_seed(1),
                         device=DEVICE)


def _generate(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy: the token ids and every step's scores."""
    ids = _ids()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                         max_new_tokens=4, min_new_tokens=4, do_sample=False,
                         output_scores=True, return_dict_in_generate=True,
                         pad_token_id=0)
    return out.sequences, torch.stack(out.scores)


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_t5_generate_at_o1_equals_native_autocast_around_generate(dtype):
    model = _t5()
    with torch.autocast(DEVICE, dtype):
        native_ids, native_scores = _generate(model)
    o1 = ampkit.initialize(copy.deepcopy(model), level="O1", dtype=dtype)
    ids, scores = _generate(o1)
    assert torch.equal(ids, native_ids)
    # Bit for bit (before: the encoder ran in fp32, outside the region).
    assert torch.equal(scores, native_scores)


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_t5_generate_at_o2_computes_low_and_close_to_fp32(dtype):
    model = _t5()
    fp32_ids, fp32_scores = _generate(model)
    o2 = ampkit.initialize(copy.deepcopy(model), level="O2", dtype=dtype)
    seen: list[torch.dtype] = []
    hook = o2.encoder.block[0].layer[1].DenseReluDense.wo.register_forward_hook(
        lambda module, args, out: seen.append(out.dtype))
    ids, scores = _generate(o2)  # before: RuntimeError (m1 and m2 dtypes) in the encoder
    hook.remove()
    assert seen == [dtype]  # the encoder, called once by generate, computed low
    assert torch.equal(ids, fp32_ids)
    torch.testing.assert_close(scores, fp32_scores, rtol=0.05, atol=0.05)
    assert all(p.dtype is torch.float32 for p in o2.parameters())  # the truth untouched
    # A deep copy (its class rebuilt) keeps the rule.
    again_ids, again_scores = _generate(copy.deepcopy(o2))
    assert torch.equal(again_ids, ids) and torch.equal(again_scores, scores)


def test_gpt2_generate_at_o1_still_equals_native_autocast():
    # A regression guard (it passed before too): a decoder-only model's generate,
    # which only calls the model itself, computes as it did.
    model = _gpt2()
    with torch.autocast(DEVICE, BF16):
        native_ids, native_scores = _generate(model)
    ids, scores = _generate(ampkit.initialize(copy.deepcopy(model), level="O1", dtype=BF16))
    assert torch.equal(ids, native_ids) and torch.equal(scores, native_scores)


def test_gpt2_generate_at_o2_is_one_pass_casting_each_weight_once():
    model = ampkit.initialize(_gpt2(), level="O2", dtype=BF16)
    later = model.transformer.h[1].mlp.c_fc.weight
    cached_at_step_start: list[bool] = []
    hook = model.transformer.h[0].register_forward_pre_hook(
        lambda module, args: cached_at_step_start.append(is_cached(later)))
    ids, scores = _generate(model)
    hook.remove()
    # The first step casts it; every later step reuses that copy (before: each decode
    # step was a pass of its own, casting every weight again).
    assert cached_at_step_start == [False, True, True, True]
    assert not is_cached(later)  # dropped when generate returns
    fp32_ids, fp32_scores = _generate(_gpt2())
    assert torch.equal(ids, fp32_ids)
    torch.testing.assert_close(scores, fp32_scores, rtol=0.05, atol=0.05)
