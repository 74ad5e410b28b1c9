"""Sparse embeddings at O2: ``nn.Embedding(sparse=True)`` and
``nn.EmbeddingBag(sparse=True)`` train with sparse fp32 gradients. (O2 used to cast
their weight on use; the bf16 copy's sparse gradient could not be cast back: "to(options)
doesn't support converting to a different layout".)

Oracle: native ``torch.autocast(bfloat16)`` over the fp32 model, which runs the lookup
in the weight's dtype (fp32) as O2 now does; the lookup's output is rounded to bf16 at
the next Linear in both, so the embedding's gradient is bit-equal, and the Linear's
matches at the default bf16 tolerance of ``assert_close`` (1.6e-2 relative)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampkit

BF16, FP32 = torch.bfloat16, torch.float32


class _Bag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(50, 8, mode="sum", sparse=True)
        self.head = nn.Linear(8, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.bag(ids))


def _embedding() -> nn.Module:
    return nn.Sequential(nn.Embedding(50, 8, sparse=True), nn.Flatten(), nn.Linear(24, 4))


@pytest.mark.parametrize("make", [_embedding, _Bag])
def test_sparse_embeddings_train_like_native_autocast(make) -> None:
    torch.manual_seed(0)
    fp32 = make()
    o2 = ampkit.initialize(copy.deepcopy(fp32), level="O2", dtype=BF16)
    gen = torch.Generator().manual_seed(1)
    ids, y = torch.randint(0, 50, (16, 3), generator=gen), torch.randint(0, 4, (16,), generator=gen)
    runs = []
    for model, native in ((fp32, True), (o2, False)):
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        losses, first = [], None
        for _ in range(3):
            with torch.autocast("cpu", BF16, enabled=native):
                out = model(ids)
            loss = F.cross_entropy(out.float(), y)
            opt.zero_grad()
            loss.backward()
            if first is None:
                first = [p.grad for p in model.parameters()]
            opt.step()
            losses.append(loss.item())
        runs.append((losses, first))
    (want_losses, want), (got_losses, got) = runs
    assert got[0].is_sparse and got[0].dtype is FP32  # the embedding's gradient
    torch.testing.assert_close(got[0].to_dense(), want[0].to_dense(), rtol=0, atol=0)
    for g, w in zip(got[1:], want[1:]):
        torch.testing.assert_close(g, w, rtol=1.6e-2, atol=1e-5)
    torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(want_losses),
                               rtol=1e-2, atol=0)
    assert all(p.dtype is FP32 for p in o2.parameters())

