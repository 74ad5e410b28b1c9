"""A GradScaler in a bfloat16 run: what ``docs/integrations.md`` says happens is what
happens. The README's loop (a float32 loss out of the bf16 region, ``scale()`` after
it) scales exactly as ``torch.amp.GradScaler`` does; a bfloat16 loss keeps the scale at
1.0 with a warning."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import ampkit

DOCS = Path(__file__).parents[2] / "docs"


def _losses_and_scales(scaler: object, level: str, bf16_loss: bool) -> list[tuple[float, float]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32),
                                torch.nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = ampkit.initialize(model, optimizer, level=level, dtype=torch.bfloat16)
    out = []
    for _ in range(3):
        x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
        optimizer.zero_grad(set_to_none=True)
        logits = model(x)
        loss = (logits.bfloat16().float().pow(2).mean().bfloat16() if bf16_loss
                else F.cross_entropy(logits, y))
        scaler.scale(loss).backward()  # type: ignore[attr-defined]
        scaler.step(optimizer)  # type: ignore[attr-defined]
        scaler.update()  # type: ignore[attr-defined]
        out.append((float(loss), scaler.get_scale()))  # type: ignore[attr-defined]
    return out


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_the_readme_loop_in_bf16_scales_as_torch_does(level: str) -> None:
    native = _losses_and_scales(torch.amp.GradScaler("cpu"), level, bf16_loss=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning: nothing says this run is bf16
        ours = _losses_and_scales(ampkit.GradScaler(), level, bf16_loss=False)
    assert ours == native
    assert native[0][1] == 65536.0


def test_a_bfloat16_loss_keeps_the_scale_at_one_with_a_warning() -> None:
    with pytest.warns(UserWarning, match="this is a bfloat16 run.*scale stays 1.0"):
        ours = _losses_and_scales(ampkit.GradScaler(), "O1", bf16_loss=True)
    assert [scale for _, scale in ours] == [1.0, 1.0, 1.0]


def test_the_guide_says_when_the_scale_stays_one_and_when_it_scales_as_torch() -> None:
    text = " ".join((DOCS / "integrations.md").read_text(encoding="utf-8").split())
    section = text[text.index("### A GradScaler in a bfloat16 run"):
                   text.index("### Records and logs")]
    assert re.search(r"only when its first `scale\(\)` can see the run is bfloat16", section)
    assert "does what `torch.amp.GradScaler` does: the scale starts at 65,536" in section
