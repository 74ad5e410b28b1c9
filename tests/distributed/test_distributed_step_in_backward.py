"""The optimizer step inside backward on four CPU processes over gloo, under FSDP2
(``ampkit.fsdp.fully_shard``, 4 ranks), tensor parallelism (``parallelize_module``,
4 ranks) and FSDP2 + TP (a 2x2 mesh): at O2 and in pure bf16 (stochastic and Kahan),
through the public route (``initialize(..., step_in_backward=True)``, then
``ampkit.fsdp.prepare_optimizer``), each rank's parameter shards end bit for bit where
the ordinary step of the same sharded model ends. FSDP2 runs a sharded parameter's
post-accumulate-grad hooks after its reduce-scatter, so each shard steps on its
reduced gradient; tensor parallelism's DTensor gradients are complete when autograd
accumulates them.

One spawn (:mod:`distributed_harness`: bounded collectives, a deadline for the ranks)
runs every scenario on a tiny model for three steps.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from distributed_harness import run_ranks

pytestmark = pytest.mark.distributed

WORLD = 4
BF16 = torch.bfloat16
STEPS = 3
MODES = {"O2": {}, "stochastic": {"master_weights": "stochastic", "rounding_seed": 7},
         "kahan": {"master_weights": "kahan", "rounding_seed": 7}}
LAYOUTS = ("fsdp2", "tp", "fsdp2_tp")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block = Block()
        self.norm = nn.LayerNorm(8)  # kept fp32 at O2; a plain parameter under TP
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.block(x)))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g))
            for _ in range(STEPS)]


def _local(p: torch.Tensor) -> torch.Tensor:
    to_local = getattr(p, "to_local", None)
    return (to_local() if to_local is not None else p).detach().clone()


def _run(rank: int, layout: str, mode: str, in_backward: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    import ampkit
    import ampkit.fsdp
    from ampkit.step_in_backward import steps_in_backward

    net = ampkit.initialize(Net(), level="O2", dtype=BF16, step_in_backward=in_backward,
                            **MODES[mode])
    if layout == "fsdp2":
        dp, tp = init_device_mesh("cpu", (WORLD,)), None
    elif layout == "tp":
        dp, tp = None, init_device_mesh("cpu", (WORLD,))
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dp, tp = mesh["dp"], mesh["tp"]
    if tp is not None:
        parallelize_module(net.block, tp, {"up": ColwiseParallel(),
                                           "down": RowwiseParallel()})
    if dp is not None:
        ampkit.fsdp.fully_shard(net, blocks=[Block], mesh=dp)
    opt = ampkit.fsdp.prepare_optimizer(net, torch.optim.AdamW(net.parameters(), lr=1e-2,
                                                                weight_decay=0.1))
    dp_rank, dp_size = (0, 1) if dp is None else (dp.get_local_rank(), dp.size())
    freed = True
    for x, y in _batches():
        x, y = x.chunk(dp_size)[dp_rank], y.chunk(dp_size)[dp_rank]
        F.mse_loss(net(x).float(), y).backward()
        if in_backward:
            freed &= all(p.grad is None for p in net.parameters())
        else:
            opt.step()
            opt.zero_grad()
    return {"params": [_local(p) for p in net.parameters()],
            "dtypes": sorted({str(p.dtype) for p in net.parameters()}),
            "sharded": sum(type(p).__name__ == "DTensor" for p in net.parameters()),
            "in_backward": steps_in_backward(opt), "freed": freed}


def _ddp_refused(rank: int) -> dict[str, Any]:
    """DDP averages gradients after the hooks: refused at the first hook, before any
    parameter steps, naming DDP."""
    from torch.nn.parallel import DistributedDataParallel

    import ampkit

    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    net, opt = ampkit.initialize(net, opt, level="O2", dtype=BF16,
                                 master_weights="stochastic", step_in_backward=True)
    ddp = DistributedDataParallel(net)
    before = [p.detach().clone() for p in net.parameters()]
    x, y = _batches()[0]
    error = None
    try:
        F.mse_loss(ddp(x).float(), y).backward()
    except RuntimeError as e:
        error = str(e)
    return {"error": error, "unchanged": all(torch.equal(a, p) for a, p in
                                             zip(before, net.parameters()))}


def _worker(rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {"torch": torch.__version__}
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:  # torch < 2.6 has no public FSDP2
        return out
    for layout in LAYOUTS:
        for mode in MODES:
            for in_backward in (False, True):
                out[layout, mode, in_backward] = _run(rank, layout, mode, in_backward)
    out["ddp"] = _ddp_refused(rank)
    return out


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("gloo_in_backward")
    return run_ranks(out, _worker, timeout=300, world=WORLD)


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y)
                                    for x, y in zip(a, b))


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_steps_in_backward_bit_for_bit_like_the_ordinary_sharded_step(
        rank_results: list[dict[str, Any]], layout: str, mode: str) -> None:
    if (layout, mode, True) not in rank_results[0]:
        pytest.skip("FSDP2 (torch.distributed.fsdp.fully_shard) needs torch >= 2.6")
    start = [p.detach() for p in Net().parameters()]
    for rank, results in enumerate(rank_results):
        ordinary, in_backward = results[layout, mode, False], results[layout, mode, True]
        assert in_backward["in_backward"] and not ordinary["in_backward"]
        assert in_backward["freed"], "the gradients were freed as each stepped"
        assert in_backward["sharded"] > 0 and in_backward["sharded"] == ordinary["sharded"]
        assert _equal(in_backward["params"], ordinary["params"]), (rank, layout, mode)
        # it trained: some shard moved from the start
        assert any(p.shape != s.shape or not torch.equal(p.float(), s.float())
                   for p, s in zip(in_backward["params"], start))
    if mode != "O2":
        assert "torch.bfloat16" in rank_results[0][layout, mode, True]["dtypes"]


def test_ddp_is_refused_naming_why_before_anything_steps(
        rank_results: list[dict[str, Any]]) -> None:
    if "ddp" not in rank_results[0]:
        pytest.skip("FSDP2 (torch.distributed.fsdp.fully_shard) needs torch >= 2.6")
    for results in rank_results:
        run = results["ddp"]
        assert run["unchanged"]
        assert run["error"] is not None and "DistributedDataParallel" in run["error"]
        assert "averages the ranks' gradients after the gradient hooks" in run["error"]
