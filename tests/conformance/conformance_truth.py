"""The conformance matrix's cells for the truth during the forward (what touches a
parameter during the forward touches the fp32 truth, as in fp32 training): one
architecture, ``truth_probe``, that touches its parameters during the forward in every
way listed below, crossed with every core mode (each level and pure bf16) through
two pieces of machinery of its own, against fp32 training and native autocast.

* ``truth_in_forward``: an ``nn.Embedding(max_norm=1.0)`` (its forward renormalises the
  looked-up rows of its weight in place), a constraint forward pre-hook registered on a
  Linear *after* the mode is set up (``weight.data.clamp_``), and a regulariser over
  ``self.parameters()`` computed in ``forward`` (the model's own direct parameter
  among them). The cell's numbers: the losses, then the largest ``|W|`` of the
  constrained Linear and the largest norm of the embedding rows the last batch used,
  read from the stored parameters (the truth the optimizer steps).
* ``loss_outside_model``: the cross-entropy computed in the user's loop, outside the
  model (the references compute it inside their region, native autocast's contract);
  the cell also checks that it was computed in fp32.

Registered into :mod:`conformance_cells`' tables on import (``test_matrix`` imports it).
"""

from __future__ import annotations

from typing import Any

import conformance_cells as C
import torch
import torch.nn as nn
import torch.nn.functional as F

#: the machinery only ``truth_probe`` is crossed with
MACHINERY = ("truth_in_forward", "loss_outside_model")
CLAMP = 0.05


class TruthProbe(nn.Module):
    """An embedding with ``max_norm``, a direct parameter of the model's own, two
    Linears; ``forward`` returns the logits and a regulariser over its parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(C.VOCAB, C.HIDDEN, max_norm=1.0)
        self.scale = nn.Parameter(torch.ones(C.HIDDEN))
        self.proj = nn.Linear(C.HIDDEN, C.HIDDEN)
        self.head = nn.Linear(C.HIDDEN, C.VOCAB)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = F.gelu(self.proj(self.emb(x) * self.scale))
        penalty = 1e-3 * sum(p.pow(2).sum() for p in self.parameters())
        return self.head(h), penalty  # type: ignore[return-value]


def probe_loss(model: nn.Module, data: dict[str, torch.Tensor]) -> torch.Tensor:
    out, penalty = model(data["x"])
    return (F.cross_entropy(out.float().reshape(-1, C.VOCAB), data["y"].reshape(-1))
            + penalty.float())


def _constrain(module: nn.Module, args: Any) -> None:
    module.weight.data.clamp_(-CLAMP, CLAMP)


def m_truth_in_forward(arch: str, mode: str) -> list[float]:
    run = C.setup(arch, mode)
    try:
        run.model.proj.register_forward_pre_hook(_constrain)  # after the setup
        values = [C._train_step(arch, run, s) for s in range(C.STEPS)]
        ids = C.batch(arch, 10 * (C.STEPS - 1))["x"]
        with torch.no_grad():
            values.append(run.model.proj.weight.float().abs().max().item())
            rows = run.model.emb.weight[ids.unique()].float()
            values.append(rows.norm(dim=1).max().item())
        return values
    finally:
        run.close()


def m_loss_outside_model(arch: str, mode: str) -> list[float]:
    run = C.setup(arch, mode)
    inside = mode in C.REFERENCES  # fp32 and native autocast: the loss in the region
    values, dtypes = C.Values(), []
    try:
        for s in range(C.STEPS):
            data = C.batch(arch, 10 * s)
            with run.forward_ctx():
                out, penalty = run.model(data["x"])
                if inside:
                    ce = F.cross_entropy(out.reshape(-1, C.VOCAB), data["y"].reshape(-1))
            if not inside:  # the user's loop: on the model's output as handed back
                ce = F.cross_entropy(out.reshape(-1, C.VOCAB), data["y"].reshape(-1))
            dtypes.append(ce.dtype)
            loss = ce + penalty
            run.backward(loss)
            run.step()
            values.append(loss.item())
        values.dtypes = dtypes  # type: ignore[attr-defined]
        return values
    finally:
        run.close()


C.ARCHS["truth_probe"] = C.Arch(
    "truth_probe", TruthProbe,
    lambda g: {"x": C._ids(g), "y": C._ids(g)}, loss=probe_loss,
    machinery=("plain_steps", *MACHINERY, "dtype_invariants"))
C.MACHINERY["truth_in_forward"] = m_truth_in_forward
C.MACHINERY["loss_outside_model"] = m_loss_outside_model
