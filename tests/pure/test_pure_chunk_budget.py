"""``chunk_bytes`` bounds the fp32 working memory of one chunk of a pure step (the
weights, gradients and per-element state the optimizer's own step sees at once), also
for an ``Adam``/``AdamW`` group that leaves the implementation to torch, whose bf16
parameters are stepped on copies padded to whole vectors per thread: the padding counts
against the budget."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn

from ampkit.pure import PureLowPrecisionOptimizer

IMPLEMENTATIONS = {"left_to_torch": {}, "loop": {"foreach": False}}


@pytest.mark.parametrize("implementation", list(IMPLEMENTATIONS))
def test_one_chunk_of_tiny_parameters_stays_within_chunk_bytes(
        monkeypatch: pytest.MonkeyPatch, implementation: str) -> None:
    torch.manual_seed(0)
    n = 513  # the fused kernel's smallest parameters, plus one: padded, 63 more at least
    params = [nn.Parameter(torch.randn(n).to(torch.bfloat16)) for _ in range(12)]
    budget = 16 * n * 4  # 16 bytes of fp32 copies per element: four parameters a chunk
    opt = PureLowPrecisionOptimizer(
        torch.optim.AdamW(params, lr=1e-2, **IMPLEMENTATIONS[implementation]),
        "stochastic", chunk_bytes=budget)
    seen: list[int] = []
    own_step = torch.optim.AdamW.step.__wrapped__  # torch's step without its hook wrapper

    def measuring_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        # what the optimizer's own step holds in fp32 at once, as it runs
        held = 0
        for group in self.param_groups:
            for w in group["params"]:
                held += w.nbytes + (0 if w.grad is None else w.grad.nbytes)
                held += sum(v.nbytes for v in self.state[w].values()
                            if isinstance(v, torch.Tensor) and v.dim() > 0)
        seen.append(held)
        return own_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", measuring_step)
    for _ in range(2):  # the second step holds the moments too
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    assert seen and max(seen) <= budget, (max(seen), budget)
