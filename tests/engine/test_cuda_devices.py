"""Device choices with a real GPU visible (skipped without CUDA).

The dialects whose region has no device argument in their framework (Paddle's
``auto_cast``, MXNet's ``init``) follow torch's default device, so a model on the CPU is
cast on a CUDA machine too, and a model on the GPU needs ``device_type="cuda"`` or
``torch.set_default_device("cuda")``. The demo's ``auto`` device is CUDA here.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import ampkit.mxnet as mx_amp
import ampkit.paddle as paddle_amp

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (torch.cuda.is_available() is False)")

FP16, FP32 = torch.float16, torch.float32


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_paddle_auto_cast_casts_where_it_says(device: str) -> None:
    conv = nn.Conv2d(3, 2, 3, bias=False).to(device)
    data = torch.rand(2, 3, 8, 8, device=device)
    with paddle_amp.auto_cast(device_type=device):
        assert conv(data).dtype is FP16
    with paddle_amp.auto_cast(device_type="cuda" if device == "cpu" else "cpu"):
        assert conv(data).dtype is FP32  # a region for the other device leaves it alone


def test_paddle_auto_cast_default_is_the_default_device() -> None:
    conv = nn.Conv2d(3, 2, 3, bias=False)
    with paddle_amp.auto_cast():  # the CPU: torch's default device
        assert conv(torch.rand(1, 3, 8, 8)).dtype is FP16
    with torch.device("cuda"):  # Paddle's paddle.set_device("gpu")
        gpu_conv = nn.Conv2d(3, 2, 3, bias=False)
        with paddle_amp.auto_cast():
            assert gpu_conv(torch.rand(1, 3, 8, 8)).dtype is FP16


def test_mxnet_init_on_cuda() -> None:
    mx_amp.init("float16", device_type="cuda")
    try:
        x, w = torch.rand(2, 3, device="cuda"), torch.rand(4, 3, device="cuda")
        assert torch.nn.functional.linear(x, w).dtype is FP16
        assert torch.nn.functional.linear(x.cpu(), w.cpu()).dtype is FP32
    finally:
        mx_amp.deinit()


def test_paddle_o2_training_step_on_cuda() -> None:
    net = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)).cuda()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net, opt = paddle_amp.decorate(net, opt, level="O2")
    scaler = paddle_amp.GradScaler(init_loss_scaling=1024.0)
    before = net[0].weight.detach().clone()
    seen = {}
    for i in (0, 1):  # the dtype each layer computes with
        net[i].register_forward_pre_hook(lambda m, a, i=i: seen.__setitem__(i, m.weight.dtype))
    with paddle_amp.auto_cast(level="O2", device_type="cuda"):
        loss = net(torch.randn(4, 8, device="cuda")).float().pow(2).mean()
    scaled = scaler.scale(loss)
    scaled.backward()
    scaler.minimize(opt, scaled)
    # master_weight (the default): the fp32 parameters are the truth and the Linear
    # computes with an fp16 copy, as on the CPU (test_dialect_paddle.py)
    assert {p.dtype for p in net.parameters()} == {FP32}
    assert seen == {0: FP16, 1: FP32}
    assert not torch.equal(before, net[0].weight.detach())
