"""What the output rule costs in memory, against native autocast, on a small causal LM
whose logits dominate (the case where an fp32 copy of an output is expensive).

Oracle: native ``torch.autocast("cpu", bfloat16)`` around the same model: its outputs,
loss and gradients bit for bit, and its peak memory, read from the PyTorch profiler's
allocation events on the CPU (every allocation and free with its size: a deterministic
count, not a sampled one). The model computes its loss the Hugging Face way
(``logits.float()``, then cross entropy) when it is given labels."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

import ampkit
from ampkit.config import AmpConfig

BF16 = torch.bfloat16
VOCAB, HIDDEN, BATCH, SEQ = 8192, 16, 4, 32


class _TinyLM(nn.Module):
    """Embedding, one block, an untied head; with labels, the loss as HF computes it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.block = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor | None = None,
                aux: bool = False) -> dict[str, torch.Tensor]:
        h = self.embed(ids)
        h = h + torch.relu(self.block(h))
        logits = self.head(h)
        out = {"logits": logits}
        if labels is not None:
            up = logits.float()  # the model's own upcast for its loss
            out["loss"] = F.cross_entropy(up[:, :-1].reshape(-1, VOCAB),
                                          labels[:, 1:].reshape(-1))
        if aux:
            out["aux"] = self.block(h)  # low precision, never upcast by the model
        return out


IDS = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def _loss_outside(logits: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), IDS[:, 1:].reshape(-1))


def _step(model: nn.Module, region: Callable[[], Any], inside: bool,
          loss_region: Callable[[], Any]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Forward, loss, backward; the outputs are held through the backward, as a
    training loop holds them."""
    with region():
        out = model(IDS, labels=IDS) if inside else model(IDS)
        if inside:
            loss = out["loss"]
    if not inside:
        with loss_region():
            loss = _loss_outside(out["logits"])
    loss.backward()
    return out, loss


@contextlib.contextmanager
def _peak() -> Iterator[dict[str, int]]:
    result: dict[str, int] = {}
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield result
    changes = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]" and e.device_type() == DeviceType.CPU)
    running = highest = 0
    for _, nbytes in changes:
        running += nbytes
        highest = max(highest, running)
    result["peak"] = highest


def _measure(model: nn.Module, region: Callable[[], Any], inside: bool,
             loss_region: Callable[[], Any] = contextlib.nullcontext) -> int:
    # One thread: the pool's workers make scratch allocations of their own, which move
    # a peak by a few hundred kilobytes from run to run.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _step(model, region, inside, loss_region)  # warm-up: the same allocations after
        model.zero_grad(set_to_none=True)
        with _peak() as result:
            out, loss = _step(model, region, inside, loss_region)
            del out, loss
        model.zero_grad(set_to_none=True)
    finally:
        torch.set_num_threads(threads)
    return result["peak"]


def _native_region() -> Any:
    return torch.autocast("cpu", BF16)


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters()}


def test_loss_inside_the_model_costs_no_more_memory_than_native():
    base = _TinyLM()
    native = _measure(copy.deepcopy(base), _native_region, inside=True)
    o1 = ampkit.initialize(copy.deepcopy(base), level="O1", dtype=BF16)
    peak = _measure(o1, contextlib.nullcontext, inside=True)
    assert peak <= 1.02 * native, (peak, native, peak / native)


def test_loss_inside_the_model_equals_native_outputs_and_gradients():
    base = _TinyLM()
    native = copy.deepcopy(base)
    ref, ref_loss = _step(native, _native_region, True, contextlib.nullcontext)
    o1 = ampkit.initialize(copy.deepcopy(base), level="O1", dtype=BF16)
    out, loss = _step(o1, contextlib.nullcontext, True, contextlib.nullcontext)
    # the logits the model's own fp32 loss read come back as computed, as native's
    assert out["logits"].dtype is BF16 and torch.equal(out["logits"], ref["logits"])
    assert loss.dtype is torch.float32 and torch.equal(loss, ref_loss)
    for name, grad in _grads(o1).items():
        assert torch.equal(grad, _grads(native)[name]), name


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_loss_inside_the_model_keeps_its_logits_as_computed_at_every_level(level):
    model = ampkit.initialize(_TinyLM(), level=level, dtype=BF16)
    out = model(IDS, labels=IDS)
    assert out["loss"].dtype is torch.float32
    assert out["logits"].dtype is BF16
    out["loss"].backward()  # the kept logits' graph is whole
    assert model.head.weight.grad is not None


def test_outputs_the_model_did_not_upcast_still_come_back_fp32_for_a_loss_outside():
    base = _TinyLM()
    with _native_region():
        ref = copy.deepcopy(base)(IDS, labels=IDS, aux=True)
    model = ampkit.initialize(copy.deepcopy(base), level="O1", dtype=BF16)
    out = model(IDS, labels=IDS, aux=True)
    # the loss read the logits in fp32; nothing read "aux" in fp32: a loss computed
    # from it outside must not be computed below native's precision
    assert out["logits"].dtype is BF16
    assert out["aux"].dtype is torch.float32 and torch.equal(out["aux"], ref["aux"].float())
    # without labels nothing upcast the logits: fp32, native's values
    plain = model(IDS)
    assert plain["logits"].dtype is torch.float32
    assert torch.equal(plain["logits"], ref["logits"].float())
    # under no_grad autograd records nothing to read the model's use from: fp32
    with torch.no_grad():
        assert model(IDS, labels=IDS)["logits"].dtype is torch.float32
    # asked for by name, the cast is made on every low-precision output (apex's rule)
    explicit = ampkit.initialize(copy.deepcopy(base), level="O1", dtype=BF16,
                                 cast_model_outputs=torch.float32)
    assert explicit(IDS, labels=IDS)["logits"].dtype is torch.float32
    # a loss outside on those fp32 logits: native's loss in its region, bit for bit
    native = copy.deepcopy(base)
    _, ref_loss = _step(native, _native_region, False, _native_region)
    model.zero_grad(set_to_none=True)
    _, loss = _step(model, contextlib.nullcontext, False, contextlib.nullcontext)
    assert loss.dtype is torch.float32 and torch.equal(loss, ref_loss)
    for name, grad in _grads(model).items():
        assert torch.equal(grad, _grads(native)[name]), name


@pytest.mark.parametrize("inside", [True, False], ids=["loss-inside", "loss-outside"])
def test_as_computed_is_native_outputs_gradients_and_memory(inside):
    base = _TinyLM()
    native = copy.deepcopy(base)
    ref, ref_loss = _step(native, _native_region, inside, _native_region)
    model = ampkit.initialize(copy.deepcopy(base), level="O1", dtype=BF16,
                              cast_model_outputs="as_computed")
    # the loss outside in a region, as native computes it: native's precision
    out, loss = _step(model, contextlib.nullcontext, inside, _native_region)
    assert out["logits"].dtype is BF16 and torch.equal(out["logits"], ref["logits"])
    assert loss.dtype is torch.float32 and torch.equal(loss, ref_loss)
    for name, grad in _grads(model).items():
        assert torch.equal(grad, _grads(native)[name]), name
    native_peak = _measure(copy.deepcopy(base), _native_region, inside, _native_region)
    peak = _measure(model, contextlib.nullcontext, inside, _native_region)
    assert peak <= 1.02 * native_peak, (peak, native_peak, peak / native_peak)


def test_as_computed_is_a_config_value_that_round_trips():
    config = AmpConfig(level="O1", dtype="bfloat16", cast_model_outputs="As_Computed")
    assert config.cast_model_outputs == "as_computed"
    assert AmpConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match=r"cast_model_outputs must be .*'as_computed'"):
        AmpConfig(cast_model_outputs="computed")


def test_hugging_face_causal_lm_with_labels_hands_its_logits_back_as_native():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False)
    base = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
    native = copy.deepcopy(base)
    with _native_region():
        ref = native(ids, labels=ids)
    ref.loss.backward()
    model = ampkit.initialize(copy.deepcopy(base), level="O1", dtype=BF16)
    out = model(ids, labels=ids)
    out.loss.backward()
    assert type(out) is type(ref)
    assert out.logits.dtype is BF16 and torch.equal(out.logits, ref.logits)
    assert out.loss.dtype is torch.float32 and torch.equal(out.loss, ref.loss)
    for name, grad in _grads(model).items():
        assert torch.equal(grad, _grads(native)[name]), name
    # without labels the logits are fp32, native's values
    again = model(ids)
    assert again.logits.dtype is torch.float32
    assert torch.equal(again.logits, ref.logits.float())
