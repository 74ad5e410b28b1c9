"""Tiny models and data shared by the tests (import as ``helpers_models``).

* :class:`DigitsCNN`: a CNN with BatchNorm for scikit-learn's 8x8 digits (10 classes).
* :class:`TinyTransformer`: a GPT-style decoder (token + sinusoidal position buffer,
  pre-norm blocks with LayerNorm, causal attention, GELU MLP) whose output head is tied
  to the token embedding. Its forward takes integer token ids.
* :func:`digits_split`: the digits data as float tensors, split once with a fixed seed.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F


class DigitsCNN(nn.Module):
    """Conv-BN-ReLU twice, max-pool, then a two-layer classifier; input (N, 1, 8, 8)."""

    def __init__(self, width: int = 16, hidden: int = 64) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(2 * width * 16, hidden), nn.ReLU(), nn.Linear(hidden, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class Block(nn.Module):
    """A pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    """A GPT-style decoder with an output head tied to the token embedding."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 2, layers: int = 2,
                 max_len: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        position = torch.arange(max_len).unsqueeze(1)
        freq = torch.exp(torch.arange(0, dim, 2) * (-math.log(10000.0) / dim))
        table = torch.zeros(max_len, dim)
        table[:, 0::2] = torch.sin(position * freq)
        table[:, 1::2] = torch.cos(position * freq)
        self.register_buffer("positions", table, persistent=False)
        self.blocks = nn.Sequential(*(Block(dim, heads) for _ in range(layers)))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.positions[: ids.shape[1]]
        return self.head(self.ln_f(self.blocks(x)))


@functools.cache
def digits_split(seed: int = 0, test_fraction: float = 0.25
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x_train, y_train, x_test, y_test)``: images (N, 1, 8, 8) scaled to [0, 1]."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(y) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return x[train], y[train], x[test], y[test]


def console_script(name: str = "ampkit") -> str | None:
    """Path of an installed console script: next to this interpreter first (the venv's
    bin/, which is not on PATH when CI runs ``.venv/bin/python -m pytest``), then PATH."""
    import os
    import shutil
    import sys

    search = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    return shutil.which(name, path=search)


def on_forward(module: nn.Module, fn: Any) -> None:
    """Call ``fn(module, args)`` as ``module.forward`` starts: where it computes, after
    every forward pre-hook and inside O2's cast on use. For tests that look at what a
    forward computes with; a forward pre-hook sees the fp32 parameters, as in fp32
    training."""
    forward = module.forward

    def spy(*args: Any, **kwargs: Any) -> Any:
        fn(module, args)
        return forward(*args, **kwargs)

    module.forward = spy  # type: ignore[method-assign]
