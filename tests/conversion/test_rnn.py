"""An RNN at O2 (found by the conformance matrix): its forward points its
``_flat_weights`` at the low-precision copies; after the forward they point at the fp32
parameters again, so the trained model saves, loads and deep-copies as an fp32 one does,
and the copy computes what the original computes."""

from __future__ import annotations

import copy
import io

import torch
import torch.nn as nn

import ampkit


class _Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(8, 16, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0])


def _trained() -> nn.Module:
    torch.manual_seed(0)
    model = ampkit.initialize(_Tagger(), level="O2", dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(2, 5, 8)
    model(x).float().pow(2).mean().backward()
    opt.step()
    return model


def test_the_flat_weights_are_the_parameters_after_a_forward() -> None:
    model = _trained()
    rnn = model.rnn
    assert [w is p for w, p in zip(rnn._flat_weights, rnn.parameters())] == [True] * 4
    assert {w.dtype for w in rnn._flat_weights} == {torch.float32}


def test_a_trained_o2_rnn_saves_loads_and_deep_copies() -> None:
    model = _trained()
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(1))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        expected = model(x)
        assert torch.equal(loaded(x), expected) and torch.equal(twin(x), expected)
    assert {p.dtype for p in twin.parameters()} == {torch.float32}
