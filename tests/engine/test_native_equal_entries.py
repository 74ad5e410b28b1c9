"""A list entry whose rule is native autocast's own for that op registers no kernel: native's
kernel already computes it, so it costs no Python call and the numerics stay native's, bit
for bit."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import ampkit
from ampkit.engine.kernels import registered, same_as_native
from ampkit.engine.regions import release_kernels

BF16, F32 = torch.bfloat16, torch.float32

# Native CPU autocast runs these in bf16, and these in fp32. (Promote entries keep
# ampkit's kernel: native's promote refuses a second low dtype, ampkit's does not.)
SAME_WHITE = {"linear", "matmul", "bmm", "baddbmm", "addmm", "conv2d"}
SAME_BLACK = {"mse_loss", "l1_loss", "binary_cross_entropy_with_logits"}


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3)
        self.lin = nn.Linear(12, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.conv(x).flatten(1)[:, :12]
        h = torch.cat([self.lin(h), h[:, :4]], 1)
        a = torch.bmm(h[:, None, :], h[:, :, None]).flatten()
        b = torch.addmm(h[:, :4], h, torch.ones(8, 4)).sum(1)
        return F.mse_loss(a, y) + F.l1_loss(b, y) + F.binary_cross_entropy_with_logits(a, y)


def _step(region: object) -> list[torch.Tensor]:
    torch.manual_seed(0)
    net = _Net()
    x, y = torch.randn(2, 2, 6, 6), torch.rand(2)
    with region:  # type: ignore[attr-defined]
        loss = net(x, y)
    loss.backward()
    return [loss.detach(), *(p.grad for p in net.parameters())]


def test_native_equal_entries_register_no_kernel_and_compute_natively() -> None:
    release_kernels()
    region = ampkit.autocast("cpu", BF16, custom_white_list=SAME_WHITE,
                             custom_black_list=SAME_BLACK)
    got = _step(region)
    names = {op for _, op in registered()}
    for op in ("linear", "matmul", "bmm", "baddbmm", "addmm", "conv2d", "mse_loss",
               "l1_loss", "binary_cross_entropy_with_logits"):
        assert f"aten::{op}" not in names, op  # the default overloads: native's kernels
    expected = _step(torch.autocast("cpu", BF16))
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and torch.equal(g, e)


def test_an_entry_that_differs_from_native_keeps_its_kernel() -> None:
    release_kernels()
    with ampkit.autocast("cpu", BF16, custom_black_list={"linear"}):
        assert F.linear(torch.rand(2, 3), torch.rand(4, 3)).dtype == F32
    assert ("AutocastCPU", "aten::linear") in registered()
    assert same_as_native("linear", "cpu", "fp32") == {"aten::linear": False}
    assert same_as_native("linear", "cpu", "lower") == {"aten::linear": True}


def test_probing_an_op_native_runs_in_fp32_prints_none_of_its_warnings() -> None:
    """Asking whether native lowers qr, lu_solve or stft (``ampkit tune``'s aggressive
    trial asks it of every op) once ran their bodies, and torch printed its deprecation
    and no-window warnings for ops the program never called. In a fresh process: torch
    prints each of them once per process."""
    import subprocess
    import sys

    code = ("from ampkit.engine.kernels import same_as_native\n"
            "for name in ('qr', 'lu_solve', 'stft'):\n"
            "    print(name, sorted(same_as_native(name, 'cpu', 'lower').values()))\n"
            "    print(name, sorted(same_as_native(name, 'cpu', 'fp32').values()))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    # CPU autocast runs these in fp32 (its own list): never lowered. Its list changes
    # between releases (2.14 dropped qr): where the running torch registers no CPU
    # autocast kernel for qr, there is nothing native to be the same as.
    from ampkit.torch_internals import has_kernel

    try:
        qr_listed = has_kernel("aten::qr", "AutocastCPU")
    except RuntimeError:  # torch 2.14.1 answers "operator aten::qr does not exist" here
        qr_listed = False
    qr = ["qr [False]", "qr [True]"] if qr_listed else ["qr []", "qr []"]
    assert done.stdout.split("\n")[:6] == [
        *qr, "lu_solve [False]", "lu_solve [True]",
        "stft [False, False]", "stft [True, True]"], done.stdout
    noise = [line for line in done.stderr.splitlines()
             if "Warning" in line or "deprecated" in line]
    assert not noise, done.stderr
