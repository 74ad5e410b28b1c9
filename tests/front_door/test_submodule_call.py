"""A submodule of an O2 model called on its own (``model.net(x)``, as evaluation code
does), outside the model's forward: O2's parameters are the fp32 truth, so it computes
in fp32 from them, bit for bit like the same module never converted, gradients
included; inside an autocast region (the user's, a checkpoint's recomputation) it
uses the level's copies as in the model's forward. The same after a Lightning O2
``fit``."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampkit

BF16 = torch.bfloat16


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8, device="cpu"), nn.LayerNorm(8, device="cpu"),
                                 nn.ReLU(), nn.Linear(8, 3, device="cpu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _trained(level: str) -> tuple[nn.Module, nn.Module]:
    """An O2 model after one step, and the unconverted fp32 twin holding the same
    values (loaded from the model's state_dict: the fp32 parameters at O2)."""
    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ampkit.initialize(model, opt, level=level, dtype=BF16)
    model(torch.randn(5, 4)).float().square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    twin = Model()
    twin.load_state_dict(model.state_dict())
    return model, twin


X = torch.randn(6, 4, generator=torch.Generator().manual_seed(3))


SUBMODULES = {"net": lambda m: m.net, "net[0]": lambda m: m.net[0],  # a Linear
              "net[1]": lambda m: m.net[1]}  # the LayerNorm O2 keeps in fp32


@pytest.mark.parametrize("call", list(SUBMODULES))
def test_o2_submodule_called_on_its_own_computes_fp32(call: str) -> None:
    model, twin = _trained("O2")
    x = X if call != "net[1]" else torch.randn(6, 8)
    got = SUBMODULES[call](model)(x)
    want = SUBMODULES[call](twin)(x)
    assert got.dtype == torch.float32
    assert torch.equal(got, want)
    got.square().sum().backward()
    want.square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert p.grad.dtype == torch.float32 and torch.equal(p.grad, q.grad), name
    with torch.no_grad():
        assert torch.equal(model.net(X), twin.net(X))
    with torch.inference_mode():
        assert torch.equal(model.net(X), twin.net(X))


def test_o2_whole_model_unchanged_by_the_rule() -> None:
    """After a call on its own, the model's own forward still runs its Linear layers in
    bf16 (output fp32 after the model's cast), unlike the fp32 twin."""
    model, twin = _trained("O2")
    assert torch.equal(model.net(X), twin.net(X))
    seen: list[torch.dtype] = []
    hook = model.net[0].register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    out = model(X)
    hook.remove()
    assert seen == [BF16] and out.dtype == torch.float32
    assert not torch.equal(out, twin(X))


def test_o2_submodule_inside_autocast_uses_the_levels_copies() -> None:
    """Under the user's autocast the submodule computes as native autocast computes
    the unconverted module; outside it, in fp32 again."""
    model, twin = _trained("O2")
    assert torch.equal(model.net(X), twin.net(X))
    with torch.autocast("cpu", BF16):
        got, want = model.net(X), twin.net(X)
    assert got.dtype == want.dtype == BF16
    assert torch.equal(got, want)
    assert model.net(X).dtype == torch.float32


def test_o2_checkpointed_submodule_recomputes_like_its_forward() -> None:
    """A checkpointed block's recomputation (outside the model's forward, inside the
    region checkpoint restores) uses the copies, as its forward did: the gradients
    equal the uncheckpointed model's, with a call on its own (fp32) between the
    forward and the backward."""
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(Model):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(self.net, x, use_reentrant=False)

    grads = []
    for cls in (Model, Checkpointed):
        torch.manual_seed(0)
        model = ampkit.initialize(cls(), level="O2", dtype=BF16)
        loss = model(X).square().sum()
        with torch.no_grad():
            assert model.net(X).dtype == torch.float32
        loss.backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_lightning_o2_fit_then_submodule_call() -> None:
    pl = pytest.importorskip("lightning.pytorch")
    from ampkit.integrations.lightning import AmpkitPrecision

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = Model().net

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: list[torch.Tensor], _: int) -> torch.Tensor:
            return F.mse_loss(self(batch[0]).float(), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randn(8, 3))
    module = Module()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, num_sanity_val_steps=0,
                             plugins=[AmpkitPrecision("O2", BF16)])
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    twin = copy.deepcopy(Model().net)
    twin.load_state_dict(module.net.state_dict())
    module.eval()
    with torch.no_grad():
        got = module.net(X)
        assert got.dtype == torch.float32
        assert torch.equal(got, twin(X))
