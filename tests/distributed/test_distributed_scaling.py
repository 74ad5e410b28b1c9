"""Two CPU processes over gloo: an overflow skips the step on exactly the ranks that
share the parameters, and a scaler no other rank uses waits for no one.

One spawn (:mod:`distributed_harness`) runs every scenario, each rank saving what it
saw; the tests then compare the ranks. NaN is injected on rank 1 only, either into its
loss (DDP's all-reduce spreads it to every rank's gradients) or into its gradients
*after* backward (past DDP's reduction, in FSDP2's local shard: only the scaler's
agreement can spread it). A run with ``torch.amp.GradScaler`` under the same injection
is the control: its ranks drift apart, which shows the check can fail.

The scaler's own collectives are counted (``torch.distributed.all_reduce`` calls during
``unscale_``/``step``; DDP and FSDP2 reduce gradients through other entry points).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from distributed_harness import run_ranks

from ampkit import GradScaler

pytestmark = pytest.mark.distributed

# What happens on rank 1 at each step: None, NaN in the loss, NaN in a gradient after
# backward (post all-reduce for DDP; in the local shard for FSDP2).
PLAN: list[str | None] = [None, "grad", None, "loss", None, "grad", None, None]
# Only overflows that reach every replica through the gradients' own reduction.
LOSS_PLAN: list[str | None] = [None, "loss", None, None, "loss", None, None, None]
# The side model's steps (rank 0 only): NaN in its loss at the second.
SIDE_PLAN: list[str | None] = [None, "loss", None]


class _ScalerCollectives:
    """Counts ``torch.distributed.all_reduce`` calls made while the scaler checks
    gradients (DDP's reducer and FSDP2's reduce-scatter are not counted: they run in
    backward)."""

    def __init__(self) -> None:
        self.count = 0
        self._inside = False
        self._all_reduce = dist.all_reduce

        def counting(*args: Any, **kwargs: Any) -> Any:
            if self._inside:
                self.count += 1
            return self._all_reduce(*args, **kwargs)

        dist.all_reduce = counting  # the scaler calls torch.distributed.all_reduce

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        self._inside = True
        try:
            yield
        finally:
            self._inside = False


def _inject_grad(param: torch.Tensor) -> None:
    with torch.no_grad():
        grad = param.grad
        assert grad is not None
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        local.view(-1)[0] = math.nan
        assert local.isnan().any()  # the injection reached the storage the scaler reads


def _run(model: torch.nn.Module, opt: torch.optim.Optimizer, scaler: Any, rank: int,
         full: Any, plan: list[str | None], collectives: _ScalerCollectives,
         inject_on: int = 1) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(100 + rank)  # each rank has its own data
    history = []
    collectives.count = 0
    for inject in plan:
        x = torch.randn(6, 4, generator=gen)
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        if inject == "loss" and rank == inject_on:
            loss = loss * math.nan
        scaler.scale(loss).backward()
        if inject == "grad" and rank == inject_on:
            _inject_grad(next(iter(model.parameters())))
        before = [full(p).clone() for p in model.parameters()]
        with collectives.watching():
            scaler.step(opt)
        scaler.update()
        after = [full(p).clone() for p in model.parameters()]
        history.append({
            "scale": scaler.get_scale(),
            "skipped": all(torch.equal(a, b) for a, b in zip(before, after)),
            "params": after,
        })
    return {"history": history, "collectives": collectives.count}


def _side_model(rank: int, out_dir: str, collectives: _ScalerCollectives) -> dict[str, Any]:
    """Rank 0 trains a model of its own with its own scaler; rank 1 waits for it
    through a file store, joining no collective meanwhile."""
    store = dist.FileStore(str(Path(out_dir) / "side_store"), 2)
    result: dict[str, Any] = {}
    if rank == 0:
        start = time.monotonic()
        try:
            torch.manual_seed(1)
            side = torch.nn.Linear(4, 2)
            opt = torch.optim.SGD(side.parameters(), lr=0.1)
            result = _run(side, opt, GradScaler("cpu", init_scale=2.0 ** 8), rank,
                          lambda p: p.detach(), SIDE_PLAN, collectives, inject_on=0)
        except RuntimeError as error:  # a collective nobody joined, timed out
            result = {"error": str(error).splitlines()[0]}
        result["seconds"] = time.monotonic() - start
        store.set("side_done", "1")
    else:
        store.wait(["side_done"])
    return result


def _worker(rank: int, out_dir: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    collectives = _ScalerCollectives()
    results: dict[str, Any] = {}

    def plain(p: torch.Tensor) -> torch.Tensor:
        return p.detach()

    def full(p: torch.Tensor) -> torch.Tensor:
        return p.full_tensor().detach()

    def ddp_run(scaler: Any, fused: bool, plan: list[str | None]) -> dict[str, Any]:
        torch.manual_seed(0)
        model = DistributedDataParallel(torch.nn.Linear(4, 3))
        if fused:
            opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=0.05,
                                                          fused=True)
        else:
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        return _run(model, opt, scaler, rank, plain, plan, collectives)

    def mlp() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                                   torch.nn.Linear(8, 3))

    settings = {"init_scale": 2.0 ** 8, "growth_interval": 2}
    world = dist.group.WORLD
    results["ddp"] = ddp_run(GradScaler("cpu", **settings), False, LOSS_PLAN)
    results["ddp_world"] = ddp_run(GradScaler("cpu", process_group=world, **settings),
                                   False, PLAN)
    results["ddp_fused_world"] = ddp_run(
        GradScaler("cpu", process_group=world, **settings), True, PLAN)
    results["ddp_hysteresis_world"] = ddp_run(
        GradScaler("cpu", hysteresis=2, max_scale=2.0 ** 9, process_group=world,
                   **settings), False, PLAN)
    results["ddp_torch_control"] = ddp_run(torch.amp.GradScaler("cpu", **settings),
                                           False, PLAN)

    model = mlp()
    mesh = init_device_mesh("cpu", (2,))  # not the accelerator's default mesh
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    results["fsdp2"] = _run(model, opt, GradScaler("cpu", **settings), rank, full, PLAN,
                            collectives)
    # unscale_ must divide the shards FSDP2 keeps, not copies of them
    scaler = GradScaler("cpu", init_scale=2.0 ** 10)
    opt.zero_grad()
    scaler.scale(model(torch.ones(2, 4)).pow(2).sum()).backward()
    scaled = [p.grad.to_local().clone() for p in model.parameters()]
    scaler.unscale_(opt)
    results["fsdp2_unscaled_in_place"] = all(
        torch.equal(p.grad.to_local(), s / 2.0 ** 10)
        for p, s in zip(model.parameters(), scaled))

    # HSDP: two replicas of a model "sharded" over one rank each. The replicas' gradients
    # are all-reduced by FSDP2 (its replicate dimension); the shard groups hold one rank.
    model = mlp()
    hsdp = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    fully_shard(model, mesh=hsdp)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    results["hsdp"] = _run(model, opt, GradScaler("cpu", **settings), rank, full,
                           LOSS_PLAN, collectives)

    dist.barrier()
    results["side_model"] = _side_model(rank, out_dir, collectives)
    return results


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("gloo")
    # A collective that another rank never joins fails after 15 s, not 30 minutes.
    return run_ranks(out, _worker, str(out), collective_timeout=15.0)


def _assert_ranks_agree(runs: list[list[dict[str, Any]]], plan: list[str | None]) -> None:
    rank0, rank1 = runs
    for step, (a, b) in enumerate(zip(rank0, rank1)):
        assert a["scale"] == b["scale"], f"scales differ at step {step}"
        assert a["skipped"] == b["skipped"], f"skip decisions differ at step {step}"
        assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"])), step
        assert a["skipped"] is (plan[step] is not None), f"step {step}"


@pytest.mark.parametrize(("scenario", "plan"), [
    ("ddp", LOSS_PLAN), ("ddp_world", PLAN), ("ddp_fused_world", PLAN),
    ("ddp_hysteresis_world", PLAN), ("fsdp2", PLAN), ("hsdp", LOSS_PLAN)])
def test_nan_on_rank_1_skips_every_rank(rank_results: list[dict[str, Any]],
                                        scenario: str, plan: list[str | None]) -> None:
    runs = [r[scenario]["history"] for r in rank_results]
    _assert_ranks_agree(runs, plan)
    scales = [s["scale"] for s in runs[0]]
    assert len(set(scales)) > 1  # the scale moved (backed off and grew) in lockstep


@pytest.mark.parametrize(("scenario", "per_step"), [
    ("ddp", 0),  # DDP's reduced gradients are equal on every rank: nothing to agree on
    ("hsdp", 0),  # the shard groups hold one rank; FSDP2 all-reduced the replicas
    ("fsdp2", 1),  # one all-reduce over the mesh, not a second one on top
    ("ddp_world", 1),  # the process_group given
])
def test_the_scaler_communicates_only_with_ranks_sharing_parameters(
        rank_results: list[dict[str, Any]], scenario: str, per_step: int) -> None:
    plan = LOSS_PLAN if scenario in ("ddp", "hsdp") else PLAN
    for rank in rank_results:
        assert rank[scenario]["collectives"] == per_step * len(plan)


def test_a_side_model_on_one_rank_does_not_wait_for_the_others(
        rank_results: list[dict[str, Any]]) -> None:
    side = rank_results[0]["side_model"]
    assert "error" not in side, side.get("error")  # e.g. a timed-out all-reduce
    assert [s["skipped"] for s in side["history"]] == [p is not None for p in SIDE_PLAN]
    assert side["collectives"] == 0
    assert side["seconds"] < 5.0  # the collective timeout is 15 s


def test_fsdp2_shards_are_unscaled_in_place(rank_results: list[dict[str, Any]]) -> None:
    assert all(r["fsdp2_unscaled_in_place"] is True for r in rank_results)


def test_hysteresis_scales_agree(rank_results: list[dict[str, Any]]) -> None:
    scales = [s["scale"] for s in rank_results[0]["ddp_hysteresis_world"]["history"]]
    assert max(scales) == 2.0 ** 9  # the ceiling held


def test_control_torch_scaler_lets_ranks_drift(rank_results: list[dict[str, Any]]) -> None:
    rank0, rank1 = (r["ddp_torch_control"]["history"] for r in rank_results)
    grad_step = PLAN.index("grad")
    assert rank1[grad_step]["skipped"] and not rank0[grad_step]["skipped"]
    assert not all(torch.equal(x, y) for x, y in zip(rank0[-1]["params"],
                                                     rank1[-1]["params"]))


def test_process_group_must_be_a_process_group() -> None:
    with pytest.raises(TypeError, match=r"process_group must be None .* or a "
                                        r"torch\.distributed\.ProcessGroup, got str"):
        GradScaler("cpu", process_group="world")
