"""accelerate's ``kwargs_handlers`` on ``AmpkitAccelerator``: each one mapped or refused,
never ignored.

Oracles: ``torch.amp.GradScaler`` built with the handler's ``to_kwargs()`` (what
accelerate's own Accelerator builds in fp16 mode; on CPU accelerate makes no scaler, so
its Accelerator is no reference here), a plain fp32 loop for ``enabled=False``, and
accelerate's own handling of the handlers it passes through.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("accelerate")

from accelerate import Accelerator
from accelerate.utils import (
    AORecipeKwargs,
    AutocastKwargs,
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ProfileKwargs,
)

from ampkit import AmpConfig
from ampkit.integrations.accelerate import AmpkitAccelerator

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _scales(accelerator: Accelerator, losses: list[float]) -> list[float]:
    """The scale after each step of a loop whose loss is multiplied by each of ``losses``
    (``inf``: an overflowing step)."""
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, opt = accelerator.prepare(model, opt)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    scales = []
    for factor in losses:
        accelerator.backward(model(x).float().mean() * factor)
        opt.step()
        opt.zero_grad()
        scales.append(accelerator.scaler.get_scale())
    return scales


def _reference_scales(kwargs: dict, losses: list[float]) -> list[float]:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", **kwargs)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    scales = []
    for factor in losses:
        with torch.autocast("cpu", torch.float16):
            loss = model(x).float().mean() * factor
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return scales


@pytest.mark.parametrize("handler", [
    GradScalerKwargs(init_scale=1024, growth_factor=4),  # the silently dropped one
    GradScalerKwargs(init_scale=256.0, growth_factor=3.0, backoff_factor=0.25,
                     growth_interval=2),
], ids=["silently-dropped", "every-field"])
def test_grad_scaler_kwargs_set_the_scale_like_torchs_scaler(handler) -> None:
    losses = [1.0, 1.0, float("inf"), 1.0, 1.0, 1.0]
    accelerator = AmpkitAccelerator(level="O2", dtype="float16", cpu=True,
                                    kwargs_handlers=[handler])
    assert accelerator.scaler.get_scale() == float(handler.init_scale)
    assert accelerator.scaler.get_growth_factor() == float(handler.growth_factor)
    assert accelerator.scaler.get_backoff_factor() == handler.backoff_factor
    assert accelerator.scaler.get_growth_interval() == handler.growth_interval
    assert _scales(accelerator, losses) == _reference_scales(handler.to_kwargs(), losses)
    assert accelerator.ampkit_config.init_scale == float(handler.init_scale)


def test_grad_scaler_kwargs_enabled_false_trains_like_plain_fp32_loss() -> None:
    accelerator = AmpkitAccelerator(level="O1", dtype="float16", cpu=True,
                                    kwargs_handlers=[GradScalerKwargs(enabled=False)])
    assert accelerator.scaler is None
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = accelerator.prepare(model, opt)
    ref = _net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        accelerator.backward(model(x).float().mean())
        opt.step()
        opt.zero_grad()
        with torch.autocast("cpu", torch.float16):  # torch's O1: autocast, no scaler
            loss = ref(x).float().mean()
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)


def test_grad_scaler_kwargs_refusals_name_the_handler() -> None:
    with pytest.raises(ValueError, match=r"GradScalerKwargs\(init_scale=8.0.*scales no loss"):
        AmpkitAccelerator(level="O2", dtype="bfloat16", cpu=True,
                          kwargs_handlers=[GradScalerKwargs(init_scale=8.0)])
    with pytest.raises(ValueError, match=r"GradScalerKwargs.*contradicts the ampkit config "
                                         r"on \['init_scale'\]"):
        AmpkitAccelerator(config=AmpConfig("O2", "float16", init_scale=4.0), cpu=True,
                          kwargs_handlers=[GradScalerKwargs(init_scale=8.0)])
    with pytest.raises(ValueError, match=r"GradScalerKwargs.*turns loss scaling off but "
                                         r"sets scaler options"):
        AmpkitAccelerator(level="O2", dtype="float16", cpu=True, hysteresis=2,
                          kwargs_handlers=[GradScalerKwargs(enabled=False)])
    # a handler left at its defaults sets nothing, so it fits a level with no scaler
    accelerator = AmpkitAccelerator(level="O2", dtype="bfloat16", cpu=True,
                                    kwargs_handlers=[GradScalerKwargs()])
    assert accelerator.scaler is None


def test_autocast_kwargs_enabled_false_runs_a_block_in_fp32() -> None:
    # accelerate's own use: a block under autocast that reverts to fp32
    accelerator = AmpkitAccelerator(level="O1", dtype="bfloat16", cpu=True)
    a = torch.rand(8, 8)
    with accelerator.autocast():
        assert torch.mm(a, a).dtype == torch.bfloat16
        with accelerator.autocast(autocast_handler=AutocastKwargs(enabled=False)):
            assert torch.mm(a, a).dtype == torch.float32
        assert torch.mm(a, a).dtype == torch.bfloat16


def test_autocast_kwargs_cache_enabled_reaches_the_region() -> None:
    accelerator = AmpkitAccelerator(level="O1", dtype="bfloat16", cpu=True,
                                    kwargs_handlers=[AutocastKwargs(cache_enabled=False)])
    with accelerator.autocast():
        assert torch.is_autocast_cache_enabled() is False
    with accelerator.autocast(autocast_handler=AutocastKwargs(cache_enabled=True)):
        assert torch.is_autocast_cache_enabled() is True


def test_autocast_kwargs_enabled_false_is_refused_where_the_level_casts() -> None:
    with pytest.raises(ValueError, match=r"AutocastKwargs\(enabled=False.*level O2 decides.*"
                                         r"level='O0'"):
        AmpkitAccelerator(level="O2", dtype="bfloat16", cpu=True,
                          kwargs_handlers=[AutocastKwargs(enabled=False)])
    accelerator = AmpkitAccelerator(level="O0", dtype="bfloat16", cpu=True,
                                    kwargs_handlers=[AutocastKwargs(enabled=False)])
    with accelerator.autocast():
        assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("handler", [
    DistributedDataParallelKwargs(bucket_cap_mb=15, find_unused_parameters=True),
    InitProcessGroupKwargs(),
    ProfileKwargs(activities=["cpu"]),
], ids=lambda h: type(h).__name__)
def test_handlers_that_set_no_precision_pass_through_to_accelerate(handler) -> None:
    ours = AmpkitAccelerator(level="O2", dtype="bfloat16", cpu=True, kwargs_handlers=[handler])
    theirs = Accelerator(cpu=True, kwargs_handlers=[handler])
    for attribute in ("ddp_handler", "init_handler", "profile_handler"):
        assert getattr(ours, attribute) is getattr(theirs, attribute)


def test_other_handlers_are_refused_by_name() -> None:
    with pytest.raises(TypeError, match=r"AORecipeKwargs sets up accelerate's fp8 training.*"
                                        r"AmpConfig\(fp8=...\)"):
        AmpkitAccelerator(level="O2", dtype="bfloat16", cpu=True,
                          kwargs_handlers=[AORecipeKwargs()])
    with pytest.raises(TypeError, match=r"GradientAccumulationPlugin is not one ampkit knows"):
        AmpkitAccelerator(level="O2", dtype="bfloat16", cpu=True,
                          kwargs_handlers=[GradientAccumulationPlugin(num_steps=2)])
