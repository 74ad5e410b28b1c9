"""Two CPU processes over gloo: an overflow on one rank skips the step on every rank.

One spawn runs every scenario (DDP with a plain and a fused optimizer, FSDP2
``fully_shard``), each rank saving what it saw; the test then compares the ranks. NaN is
injected on rank 1 only, either into its loss (DDP's all-reduce spreads it anyway) or
into its gradients *after* backward (only the scaler's agreement can spread it). A run
with ``torch.amp.GradScaler`` under the same injection is the control: its ranks drift
apart, which shows the check can fail.

The processes are CPU-only on purpose, also on a machine with CUDA: the children start
with ``CUDA_VISIBLE_DEVICES=""`` and FSDP2 gets an explicit CPU device mesh. With CUDA
visible this spawn died with SIGSEGV (torch 2.11, H100). The likely cause, read from
the code rather than reproduced (no GPU in the session that changed this): left to
itself, ``fully_shard`` builds its mesh on the accelerator when one is visible and moves
the shards there, both ranks onto GPU 0 (no ``set_device``), under a gloo group.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ampkit import GradScaler

pytestmark = pytest.mark.distributed

WORLD = 2
# What happens on rank 1 at each step: None, NaN in the loss, NaN in a gradient after
# backward (post all-reduce for DDP; in the local shard for FSDP2).
PLAN: list[str | None] = [None, "grad", None, "loss", None, "grad", None, None]


def _inject_grad(param: torch.Tensor) -> None:
    with torch.no_grad():
        grad = param.grad
        assert grad is not None
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        local.view(-1)[0] = math.nan
        assert local.isnan().any()  # the injection reached the storage the scaler reads


def _run(model: torch.nn.Module, opt: torch.optim.Optimizer, scaler: Any, rank: int,
         full: Any) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(100 + rank)  # each rank has its own data
    history = []
    for inject in PLAN:
        x = torch.randn(6, 4, generator=gen)
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        if inject == "loss" and rank == 1:
            loss = loss * math.nan
        scaler.scale(loss).backward()
        if inject == "grad" and rank == 1:
            _inject_grad(next(iter(model.parameters())))
        before = [full(p).clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        after = [full(p).clone() for p in model.parameters()]
        history.append({
            "scale": scaler.get_scale(),
            "skipped": all(torch.equal(a, b) for a, b in zip(before, after)),
            "params": after,
        })
    return history


def _worker(rank: int, store: str, out_dir: str) -> None:
    assert not torch.cuda.is_available()  # hidden by rank_results, before any CUDA call
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=WORLD)
    from torch.nn.parallel import DistributedDataParallel

    results: dict[str, Any] = {}

    def plain(p: torch.Tensor) -> torch.Tensor:
        return p.detach()

    def ddp_run(scaler: Any, fused: bool) -> list[dict[str, Any]]:
        torch.manual_seed(0)
        model = DistributedDataParallel(torch.nn.Linear(4, 3))
        if fused:
            opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=0.05,
                                                          fused=True)
        else:
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        return _run(model, opt, scaler, rank, plain)

    settings = {"init_scale": 2.0 ** 8, "growth_interval": 2}
    results["ddp"] = ddp_run(GradScaler("cpu", **settings), fused=False)
    results["ddp_fused"] = ddp_run(GradScaler("cpu", **settings), fused=True)
    results["ddp_hysteresis"] = ddp_run(
        GradScaler("cpu", hysteresis=2, max_scale=2.0 ** 9, **settings), fused=False)
    results["ddp_torch_control"] = ddp_run(torch.amp.GradScaler("cpu", **settings),
                                           fused=False)

    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6 has no public FSDP2
        results["fsdp2"] = results["fsdp2_unscaled_in_place"] = None
    else:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                                    torch.nn.Linear(8, 3))
        mesh = init_device_mesh("cpu", (WORLD,))  # not the accelerator's default mesh
        fully_shard(model[0], mesh=mesh)
        fully_shard(model[2], mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
        results["fsdp2"] = _run(model, opt, GradScaler("cpu", **settings), rank,
                                lambda p: p.full_tensor().detach())
        # unscale_ must divide the shards FSDP2 keeps, not copies of them
        scaler = GradScaler("cpu", init_scale=2.0 ** 10)
        opt.zero_grad()
        scaler.scale(model(torch.ones(2, 4)).pow(2).sum()).backward()
        scaled = [p.grad.to_local().clone() for p in model.parameters()]
        scaler.unscale_(opt)
        results["fsdp2_unscaled_in_place"] = all(
            torch.equal(p.grad.to_local(), s / 2.0 ** 10)
            for p, s in zip(model.parameters(), scaled))
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    if not dist.is_available():
        pytest.skip("torch.distributed is not available in this build")
    out = tmp_path_factory.mktemp("gloo")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("CUDA_VISIBLE_DEVICES", "")  # the children never see a GPU
        mp.spawn(_worker, args=(str(out / "store"), str(out)), nprocs=WORLD, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _assert_ranks_agree(runs: list[list[dict[str, Any]]]) -> None:
    rank0, rank1 = runs
    for step, (a, b) in enumerate(zip(rank0, rank1)):
        assert a["scale"] == b["scale"], f"scales differ at step {step}"
        assert a["skipped"] == b["skipped"], f"skip decisions differ at step {step}"
        assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"])), step
        assert a["skipped"] is (PLAN[step] is not None), f"step {step}"


@pytest.mark.parametrize("scenario", ["ddp", "ddp_fused", "ddp_hysteresis", "fsdp2"])
def test_nan_on_rank_1_skips_every_rank(rank_results: list[dict[str, Any]],
                                        scenario: str) -> None:
    runs = [r[scenario] for r in rank_results]
    if runs[0] is None:
        pytest.skip("FSDP2 (torch.distributed.fsdp.fully_shard) needs torch >= 2.6")
    _assert_ranks_agree(runs)
    scales = [s["scale"] for s in runs[0]]
    assert len(set(scales)) > 1  # the scale moved (backed off and grew) in lockstep


def test_fsdp2_shards_are_unscaled_in_place(rank_results: list[dict[str, Any]]) -> None:
    if rank_results[0]["fsdp2_unscaled_in_place"] is None:
        pytest.skip("FSDP2 (torch.distributed.fsdp.fully_shard) needs torch >= 2.6")
    assert all(r["fsdp2_unscaled_in_place"] is True for r in rank_results)


def test_hysteresis_scales_agree(rank_results: list[dict[str, Any]]) -> None:
    scales = [s["scale"] for s in rank_results[0]["ddp_hysteresis"]]
    assert max(scales) == 2.0 ** 9  # the ceiling held


def test_control_torch_scaler_lets_ranks_drift(rank_results: list[dict[str, Any]]) -> None:
    rank0, rank1 = (r["ddp_torch_control"] for r in rank_results)
    grad_step = PLAN.index("grad")
    assert rank1[grad_step]["skipped"] and not rank0[grad_step]["skipped"]
    assert not all(torch.equal(x, y) for x, y in zip(rank0[-1]["params"],
                                                     rank1[-1]["params"]))
