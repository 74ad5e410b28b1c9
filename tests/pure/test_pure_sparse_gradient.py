"""A sparse gradient (``nn.Embedding(sparse=True)``) under a pure ``Adam``/``AdamW``:
torch's own step refuses it, naming the problem and the optimizer to use instead
(``SparseAdam``); the pure step refuses it the same way, whichever implementation the
group names or leaves to torch, and changes nothing."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from ampkit.pure import PureLowPrecisionOptimizer

IMPLEMENTATIONS = {"left_to_torch": {}, "loop": {"foreach": False}}


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
@pytest.mark.parametrize("implementation", list(IMPLEMENTATIONS))
def test_a_sparse_gradient_is_refused_with_torchs_message_and_changes_nothing(
        cls: type[torch.optim.Optimizer], implementation: str) -> None:
    torch.manual_seed(0)
    plain = nn.Embedding(130, 4, sparse=True)  # 520 elements: fused-sized
    plain(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError) as torch_refusal:  # the reference: torch's own step
        cls(plain.parameters(), lr=1e-2, **IMPLEMENTATIONS[implementation]).step()

    emb = nn.Embedding(130, 4, sparse=True).to(torch.bfloat16)
    opt = PureLowPrecisionOptimizer(
        cls(emb.parameters(), lr=1e-2, **IMPLEMENTATIONS[implementation]), "stochastic")
    emb(torch.tensor([1, 2])).sum().backward()
    before = emb.weight.detach().clone()
    with pytest.raises(RuntimeError) as refusal:
        opt.step()
    assert str(refusal.value) == str(torch_refusal.value)
    assert "SparseAdam" in str(refusal.value)
    assert torch.equal(emb.weight.detach(), before)
    assert all(g["fused"] is None and g["foreach"] is IMPLEMENTATIONS[implementation].get(
        "foreach") for g in opt.param_groups)
    assert not opt.state or all(not s for s in opt.state.values())
