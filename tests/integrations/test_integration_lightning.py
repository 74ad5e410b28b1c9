"""ampkit.integrations.lightning: AmpkitPrecision inside a real Lightning Trainer (CPU).

Oracles: Lightning's own ``precision="bf16-mixed"`` (torch.autocast) for O1 with the
default policy, the README's hand-written ampkit loop for O2 fp16 with a scaler and
clipping, and an uninterrupted run for checkpoint resumption.
"""

from __future__ import annotations

import importlib
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

pl = pytest.importorskip("lightning.pytorch")

import ampkit  # noqa: E402
from ampkit.integrations.lightning import AmpkitPrecision  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

X = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
Y = (X[:, :4].argmax(dim=1))  # a learnable rule
LR = 1e-2


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.LayerNorm(32),
                               torch.nn.ReLU(), torch.nn.Linear(32, 4))


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _net()
        self.losses: list[float] = []
        self.seen: dict[str, torch.dtype] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.net[0](x)
        self.seen["hidden"] = hidden.dtype
        return self.net[3](self.net[2](self.net[1](hidden)))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        self.seen["logits"] = logits.dtype
        loss = F.cross_entropy(logits, y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=LR)


def _loader() -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=16)


def _trainer(epochs: int, **kwargs) -> pl.Trainer:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pl.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False,
                          enable_model_summary=False, num_sanity_val_steps=0, **kwargs)


def _full_loss(module: Classifier) -> float:
    with torch.no_grad():
        return F.cross_entropy(module(X).float(), Y).item()


@pytest.mark.parametrize("level,dtype,param_dtype,hidden_dtype", [
    ("O1", torch.bfloat16, torch.float32, torch.bfloat16),
    ("O2", torch.bfloat16, torch.float32, torch.bfloat16),  # fp32 truth, bf16 on use
    ("O2", torch.float16, torch.float32, torch.float16),
    ("O3", torch.bfloat16, torch.bfloat16, torch.bfloat16),
])
def test_trains_with_the_levels_dtypes(level, dtype, param_dtype, hidden_dtype) -> None:
    module = Classifier()
    before = _full_loss(module)
    plugin = AmpkitPrecision(level, dtype)
    _trainer(8, plugins=[plugin]).fit(module, _loader())
    after = _full_loss(module)
    assert after < 0.7 * before
    assert module.net[0].weight.dtype == param_dtype
    norm_dtype = param_dtype if level == "O3" else torch.float32
    assert module.net[1].weight.dtype == norm_dtype
    assert module.seen["hidden"] == hidden_dtype
    # every level casts the module's outputs to fp32 (O1 too, so the loss is fp32); the hidden
    # layer above computed in the level's dtype
    assert module.seen["logits"] == torch.float32
    opt = module.trainer.optimizers[0]
    master_dtypes = {p.dtype for g in opt.param_groups for p in g["params"]}
    assert master_dtypes == ({torch.float32} if level in ("O1", "O2") else {param_dtype})
    assert (plugin.scaler is not None) == (dtype == torch.float16 and level != "O3")


def test_o1_matches_lightnings_own_bf16_mixed() -> None:
    ours, native = Classifier(), Classifier()
    _trainer(3, plugins=[AmpkitPrecision("O1", torch.bfloat16)]).fit(ours, _loader())
    _trainer(3, precision="bf16-mixed").fit(native, _loader())
    assert ours.losses == native.losses
    for a, b in zip(ours.parameters(), native.parameters(), strict=True):
        assert torch.equal(a, b)


def test_o2_fp16_matches_the_hand_written_ampkit_loop() -> None:
    """Scaling, unscaling, clipping through the masters and skipping, step for step."""
    module = Classifier()
    plugin = AmpkitPrecision("O2", torch.float16, init_scale=2.0 ** 24, growth_interval=3)
    _trainer(3, plugins=[plugin], gradient_clip_val=0.5).fit(module, _loader())

    net = _net()
    opt = torch.optim.AdamW(net.parameters(), lr=LR)
    net, opt = ampkit.initialize(net, opt, level="O2", dtype=torch.float16)
    scaler = ampkit.GradScaler("cpu", init_scale=2.0 ** 24, growth_interval=3)
    losses = []
    for _ in range(3):
        for x, y in _loader():
            with ampkit.autocast("cpu", torch.float16):
                loss = F.cross_entropy(net(x), y)
            losses.append(loss.item())
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    assert plugin.scaler.skipped_steps == scaler.skipped_steps > 0  # overflows were skipped
    assert plugin.scaler.get_scale() == scaler.get_scale()
    assert module.losses == losses
    for a, b in zip(module.net.state_dict().values(), net.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_resuming_from_a_checkpoint_continues_exactly(tmp_path) -> None:
    def plugin() -> AmpkitPrecision:
        return AmpkitPrecision("O2", torch.float16, init_scale=2.0 ** 20, growth_interval=2)

    whole = Classifier()
    whole_plugin = plugin()
    _trainer(6, plugins=[whole_plugin]).fit(whole, _loader())

    first = Classifier()
    trainer = _trainer(3, plugins=[plugin()])
    trainer.fit(first, _loader())
    ckpt = tmp_path / "half.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=False)
    assert saved["state_dict"]["net.0.weight"].dtype == torch.float32  # the masters' values
    assert saved["AmpkitPrecision"]["scale"] == trainer.precision_plugin.scaler.get_scale()

    resumed = Classifier()
    resumed_plugin = plugin()
    _trainer(6, plugins=[resumed_plugin]).fit(resumed, _loader(), ckpt_path=ckpt)
    assert resumed.losses == whole.losses[len(first.losses):]
    assert resumed_plugin.scaler.state_dict() == whole_plugin.scaler.state_dict()
    for a, b in zip(resumed.state_dict().values(), whole.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(resumed.parameters(), whole.parameters(), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_refusals_are_clear() -> None:
    with pytest.raises(ValueError, match="precision=16-mixed"):
        _trainer(1, precision="16-mixed", plugins=[AmpkitPrecision("O2", torch.float16)])
    with pytest.raises(ValueError, match="level must be one of"):
        AmpkitPrecision("O4")
    with pytest.raises(TypeError, match="unknown options \\['loss_scaling'\\]"):
        AmpkitPrecision("O2", loss_scaling="dynamic")
    with pytest.raises(ValueError, match="scales no loss"):
        AmpkitPrecision("O2", torch.bfloat16, hysteresis=2)
    plugin = AmpkitPrecision("O2", torch.bfloat16)
    with pytest.raises(ValueError, match="does not scale the loss"):
        plugin.load_state_dict(ampkit.GradScaler("cpu").state_dict())


def test_without_lightning_the_import_error_names_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)
    monkeypatch.delitem(sys.modules, "ampkit.integrations.lightning")
    with pytest.raises(ImportError, match=r"pip install 'ampkit\[lightning\]'"):
        importlib.import_module("ampkit.integrations.lightning")


class ManualClassifier(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> None:
        opt = self.optimizers()
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.losses.append(loss.item())
        self.manual_backward(loss)  # scaled by the plugin
        opt.step()                  # unscaled, skipped on overflow
        opt.zero_grad()


def test_manual_optimization_steps_like_automatic() -> None:
    def plugin() -> AmpkitPrecision:
        return AmpkitPrecision("O2", torch.float16, init_scale=2.0 ** 20, growth_interval=2)

    auto, manual = Classifier(), ManualClassifier()
    auto_plugin, manual_plugin = plugin(), plugin()
    _trainer(3, plugins=[auto_plugin]).fit(auto, _loader())
    _trainer(3, plugins=[manual_plugin]).fit(manual, _loader())
    assert manual_plugin.scaler.skipped_steps == auto_plugin.scaler.skipped_steps > 0
    assert manual.losses == auto.losses
    for a, b in zip(manual.state_dict().values(), auto.state_dict().values(), strict=True):
        assert torch.equal(a, b)
