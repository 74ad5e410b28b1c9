"""ampkit.integrations.accelerate: AmpkitAccelerator in an accelerate loop (CPU).

Oracle: the same loop written by hand with ampkit.initialize and ampkit.GradScaler (the
README's), and an uninterrupted run for save_state/load_state.
"""

from __future__ import annotations

import importlib
import sys

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("accelerate")

import ampkit
from ampkit.integrations.accelerate import AmpkitAccelerator

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

X = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
Y = X[:, :4].argmax(dim=1)
BATCHES = [(X[i:i + 16], Y[i:i + 16]) for i in range(0, 64, 16)]
FP16 = {"level": "O2", "dtype": torch.float16, "init_scale": 2.0 ** 24, "growth_interval": 3}


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.LayerNorm(32),
                               torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _accelerated(epochs: int, settings: dict, state_in=None, state_out=None):
    accelerator = AmpkitAccelerator(cpu=True, **settings)
    net = _net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    net, opt = accelerator.prepare(net, opt)
    if state_in is not None:
        accelerator.load_state(state_in)
    losses = []
    for _ in range(epochs):
        for x, y in BATCHES:
            with accelerator.autocast():
                loss = F.cross_entropy(net(x), y)
            losses.append(loss.item())
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(net.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
    if state_out is not None:
        accelerator.save_state(state_out)
    return accelerator, net, opt, losses


def test_fp16_o2_matches_the_hand_written_ampkit_loop() -> None:
    accelerator, net, opt, losses = _accelerated(3, FP16)
    # O2: the fp32 parameters are the truth (fp16 copies are made on use)
    assert net[0].weight.dtype == torch.float32 and net[1].weight.dtype == torch.float32
    assert {p.dtype for g in opt.param_groups for p in g["params"]} == {torch.float32}

    ref = _net()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref, ref_opt = ampkit.initialize(ref, ref_opt, level="O2", dtype=torch.float16)
    scaler = ampkit.GradScaler("cpu", init_scale=2.0 ** 24, growth_interval=3)
    ref_losses = []
    for _ in range(3):
        for x, y in BATCHES:
            with ampkit.autocast("cpu", torch.float16):
                loss = F.cross_entropy(ref(x), y)
            ref_losses.append(loss.item())
            scaler.scale(loss).backward()
            scaler.unscale_(ref_opt)
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
            scaler.step(ref_opt)
            scaler.update()
            ref_opt.zero_grad()
    assert accelerator.scaler.skipped_steps == scaler.skipped_steps > 0
    assert accelerator.scaler.get_scale() == scaler.get_scale()
    assert losses == ref_losses
    for a, b in zip(net.state_dict().values(), ref.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_fp16_clipping_sees_the_unscaled_fp32_gradient_norm() -> None:
    """The norm clip_grad_norm_ returns is an fp32 model's, up to fp16 rounding."""
    ref = _net()
    x, y = BATCHES[0]
    F.cross_entropy(ref(x), y).backward()
    want = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]).item()

    accelerator = AmpkitAccelerator(cpu=True, level="O2", dtype=torch.float16,
                                    init_scale=1024.0)
    net = _net()
    net, opt = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    accelerator.backward(F.cross_entropy(net(x), y))
    got = accelerator.clip_grad_norm_(net.parameters(), 1e-3).item()
    assert got == pytest.approx(want, rel=2e-2)
    master_norm = torch.nn.utils.get_total_norm([p.grad for g in opt.param_groups
                                                 for p in g["params"]])
    assert master_norm.item() == pytest.approx(1e-3, rel=1e-3)  # what the step will use


@pytest.mark.parametrize("level,dtype", [("O1", torch.bfloat16), ("O2", torch.bfloat16),
                                         ("O3", torch.bfloat16)])
def test_bf16_levels_train(level, dtype) -> None:
    accelerator, net, _, losses = _accelerated(8, {"level": level, "dtype": dtype})
    assert accelerator.scaler is None
    assert net[0].weight.dtype == (dtype if level == "O3" else torch.float32)
    seen = []
    net[0].register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    with torch.no_grad():
        assert net(X).dtype == torch.float32  # every level hands back fp32 for the loss
    assert seen == [dtype]  # the first linear computes in low precision at every level
    assert sum(losses[-4:]) < 0.7 * sum(losses[:4])


def test_save_state_and_load_state_continue_exactly(tmp_path) -> None:
    whole, whole_net, _, whole_losses = _accelerated(4, FP16)
    _accelerated(2, FP16, state_out=tmp_path / "state")
    resumed, net, _, losses = _accelerated(2, FP16, state_in=tmp_path / "state")
    assert losses == whole_losses[8:]
    assert resumed.scaler.state_dict() == whole.scaler.state_dict()
    for a, b in zip(net.state_dict().values(), whole_net.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_refusals_are_clear() -> None:
    with pytest.raises(ValueError, match=r"mixed_precision='fp16' asks for torch.float16, "
                                         r"but the ampkit config says dtype=torch\.bfloat16"):
        AmpkitAccelerator(level="O2", dtype=torch.bfloat16, mixed_precision="fp16", cpu=True)
    with pytest.raises(ValueError, match="level must be one of"):
        AmpkitAccelerator(level="O5", cpu=True)
    accelerator = AmpkitAccelerator(level="O2", dtype=torch.bfloat16, cpu=True)
    opt = torch.optim.SGD(_net().parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="prepare the model before"):
        accelerator.prepare(opt)
    with pytest.raises(TypeError, match="autocast_handler"), accelerator.autocast(object()):
        pass


def test_without_accelerate_the_import_error_names_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "accelerate", None)
    monkeypatch.delitem(sys.modules, "ampkit.integrations.accelerate")
    with pytest.raises(ImportError, match=r"pip install 'ampkit\[accelerate\]'"):
        importlib.import_module("ampkit.integrations.accelerate")


@pytest.mark.parametrize("level,dtype,expected", [
    ("O2", torch.bfloat16, "bf16"), ("O1", torch.float16, "fp16"), ("O3", torch.bfloat16, "bf16"),
    ("O0", None, "no")])
def test_mixed_precision_says_the_precision_ampkit_trains_in(level, dtype, expected,
                                                            monkeypatch) -> None:
    """A tracker logging ``accelerator.mixed_precision`` once recorded "no" (fp32) for a
    bf16 run; accelerate's own mode still stays off."""
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    accelerator = AmpkitAccelerator(level=level, dtype=dtype, cpu=True)
    assert accelerator.mixed_precision == expected
    assert accelerator.state.mixed_precision == "no"
    assert accelerator.scaler is None or expected == "fp16"
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = accelerator.prepare(model, opt)
    seen = []  # the dtype the Linear computed in (O2/O3 cast the model's output back)
    model[0].register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    with accelerator.autocast():
        model(torch.ones(2, 4))
    assert seen == [{"bf16": torch.bfloat16, "fp16": torch.float16,
                     "no": torch.float32}[expected]]
