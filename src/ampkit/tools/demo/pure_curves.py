"""Pure bf16 training on real text: fp32 vs round-to-nearest vs stochastic rounding/Kahan.

A tiny GPT-style character model (:class:`CharGPT`) learns the dataset descriptions
that scikit-learn ships (``sklearn/datasets/descr/*.rst``, about 43 KB of English prose
and tables, BSD-3-licensed with scikit-learn; :func:`load_text`). :func:`train_curves`
trains it from the same initial weights on the same batches, once per mode:

* ``"fp32"``: plain fp32 training, the reference;
* ``"nearest"``: level O2 with bf16 parameters and bf16 AdamW state, each update
  computed in fp32 and rounded to nearest: small updates are lost, so it stalls;
* ``"stochastic"`` / ``"kahan"``: the same with stochastic rounding or Kahan
  compensation (``master_weights="stochastic"`` / ``"kahan"``), which should track fp32.

The demo report plots the curves; ``benchmarks/pure_bf16.py`` and the tests compare the
final held-out losses.

Example:
    >>> from ampkit.tools.demo.pure_curves import train_curves
    >>> curves = train_curves(("fp32", "stochastic"), steps=3, dim=16, layers=1)
    >>> sorted(curves), len(curves["fp32"].losses)
    (['fp32', 'stochastic'], 3)
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["CURVE_MODES", "PURE_DEMO_CURVES", "CharGPT", "Curve", "digits_accuracy", "load_text",
           "train_curves"]

#: The modes :func:`train_curves` accepts.
CURVE_MODES: tuple[str, ...] = ("fp32", "nearest", "stochastic", "kahan")

#: The three curves of the demo report.
PURE_DEMO_CURVES: tuple[str, ...] = ("fp32", "nearest", "stochastic")


def load_text() -> str:
    """The dataset descriptions shipped with scikit-learn, concatenated in file-name
    order (the corpus of :func:`train_curves`).

    Raises:
        ImportError: scikit-learn is not installed (``pip install ampkit[demo]``).

    Example:
        >>> from ampkit.tools.demo.pure_curves import load_text
        >>> text = load_text()
        >>> len(text) > 30_000, "digits" in text
        (True, True)
    """
    import sklearn.datasets

    folder = Path(sklearn.datasets.__file__).parent / "descr"
    files = sorted(folder.glob("*.rst"))
    if not files:
        raise FileNotFoundError(f"no dataset descriptions (*.rst) in {folder}")
    return "\n".join(f.read_text(encoding="utf-8") for f in files)


class _Block(nn.Module):
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
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class CharGPT(nn.Module):
    """A tiny GPT-style decoder over characters: token and position embeddings,
    ``layers`` pre-norm blocks (causal attention, GELU MLP), a final LayerNorm and a
    linear head.

    Example:
        >>> import torch
        >>> from ampkit.tools.demo.pure_curves import CharGPT
        >>> CharGPT(vocab=20, dim=16, heads=2, layers=1, context=8)(
        ...     torch.zeros(2, 8, dtype=torch.long)).shape
        torch.Size([2, 8, 20])
    """

    def __init__(self, vocab: int, dim: int = 64, heads: int = 4, layers: int = 2,
                 context: int = 64) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        self.blocks = nn.Sequential(*[_Block(dim, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        out: torch.Tensor = self.head(self.ln(self.blocks(self.tok(ids) + self.pos(pos))))
        return out


@dataclasses.dataclass(frozen=True)
class Curve:
    """One mode's training losses (one per step) and its held-out loss at the end."""

    mode: str
    losses: tuple[float, ...]
    eval_loss: float


def _check_modes(modes: Iterable[str]) -> tuple[str, ...]:
    out = tuple(modes)
    bad = [m for m in out if m not in CURVE_MODES]
    if bad or not out:
        raise ValueError(f"modes must be a non-empty selection of {list(CURVE_MODES)}, "
                         f"got {list(out)!r}")
    return out


def _make_pure(model: nn.Module, opt: torch.optim.Optimizer, mode: str,
               rounding_seed: int, compile_step: bool = False
               ) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``mode``'s model and optimizer (fp32: as they are)."""
    import ampkit
    from ampkit.pure import PureLowPrecisionOptimizer

    if mode == "nearest":
        model, opt = ampkit.initialize(model, opt, level="O2", dtype=torch.bfloat16,
                                       master_weights=False)
        # __new__ hands back the same optimizer, made pure.
        opt = PureLowPrecisionOptimizer(opt, "nearest", seed=rounding_seed)  # type: ignore[assignment]
    elif mode != "fp32":
        model, opt = ampkit.initialize(model, opt, level="O2", dtype=torch.bfloat16,
                                       master_weights=mode, rounding_seed=rounding_seed,
                                       compile_step=compile_step)
    return model, opt


def digits_accuracy(mode: str, *, seed: int = 0, epochs: int = 5, lr: float = 0.05,
                    batch_size: int = 64, compile_step: bool = False) -> float:
    """Test accuracy of the demo's :class:`~ampkit.tools.demo.digits.DigitsCNN` trained like
    the demo (SGD with momentum 0.9, its data split and batch order) in ``mode``
    (``compile_step``: the pure modes' step compiled, see
    :mod:`ampkit.pure.compiled_step`).

    Example:
        >>> from ampkit.tools.demo.pure_curves import digits_accuracy
        >>> digits_accuracy("stochastic", epochs=1) > 0.5
        True
    """
    from ampkit.tools.demo.digits import DigitsCNN, batch_order, load_digits_data

    _check_modes([mode])
    data = load_digits_data(seed)
    torch.manual_seed(seed)
    model: nn.Module = DigitsCNN()
    opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    model, opt = _make_pure(model, opt, mode, seed,
                            compile_step=compile_step and mode in ("stochastic", "kahan"))
    for epoch in batch_order(len(data.y_train), batch_size, epochs, seed):
        for index in epoch:
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(data.x_train[index]).float(),
                            data.y_train[index]).backward()
            opt.step()
    model.eval()
    with torch.no_grad():
        predictions = model(data.x_test).float().argmax(dim=1)
    accuracy: float = (predictions == data.y_test).double().mean().item()
    return accuracy


def train_curves(modes: Iterable[str] = ("fp32", "nearest", "stochastic"), *,
                 steps: int = 200, lr: float = 1e-3, seed: int = 0, batch: int = 16,
                 context: int = 64, dim: int = 64, heads: int = 4, layers: int = 2,
                 rounding_seed: int = 0, compile_step: bool = False) -> dict[str, Curve]:
    """Train :class:`CharGPT` on :func:`load_text` once per mode (see the module
    docstring) and return each mode's :class:`Curve`.

    All modes start from the same fp32 initial weights (``seed``) and see the same
    batches; AdamW (``lr``, weight decay 0) with bf16 and level O2 for the pure modes
    (LayerNorms stay fp32). The last 10% of the text is held out; ``eval_loss`` is the
    mean cross-entropy over 8 of its windows after training. ``compile_step``: the
    ``"stochastic"`` and ``"kahan"`` modes step with the compiled step (see
    :mod:`ampkit.pure.compiled_step`); ``"fp32"`` and ``"nearest"`` are unchanged.

    Raises:
        ValueError: an unknown mode (the accepted ones are listed), or ``steps`` < 1.

    Example:
        >>> from ampkit.tools.demo.pure_curves import train_curves
        >>> train_curves(["fp16"], steps=1)
        Traceback (most recent call last):
        ...
        ValueError: modes must be a non-empty selection of ['fp32', 'nearest', ...
    """
    modes = _check_modes(modes)
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    text = load_text()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    split = int(0.9 * len(data))
    train, held = data[:split], data[split:]
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(train) - context - 1, (steps, batch), generator=gen)
    eval_starts = torch.linspace(0, len(held) - context - 2, 8).long()
    torch.manual_seed(seed)
    base = CharGPT(len(chars), dim, heads, layers, context)

    def windows(source: torch.Tensor, at: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = at[:, None] + torch.arange(context + 1)
        chunk = source[idx]
        return chunk[:, :-1], chunk[:, 1:]

    curves: dict[str, Curve] = {}
    for mode in modes:
        model: nn.Module = copy.deepcopy(base)
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=lr,
                                                       weight_decay=0.0)
        model, opt = _make_pure(model, opt, mode, rounding_seed,
                                compile_step=compile_step and mode in ("stochastic", "kahan"))
        losses = []
        for s in range(steps):
            x, y = windows(train, starts[s])
            loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        with torch.no_grad():
            x, y = windows(held, eval_starts)
            eval_loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten()).item()
        curves[mode] = Curve(mode, tuple(losses), eval_loss if math.isfinite(eval_loss)
                             else float("nan"))
    return curves
