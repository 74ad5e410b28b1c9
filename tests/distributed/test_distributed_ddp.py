"""Two CPU processes over gloo: O1 and O2 under DistributedDataParallel train exactly
like one process, because the fp32 parameters DDP broadcasts and reduces are the truth.

For each case (O1 bf16, O2 bf16, O2 fp16 with ``ampkit.GradScaler``), one spawn
(:mod:`distributed_harness`) runs, per rank:

* **the accumulation twin**: DDP over two ranks, each with half of every batch, against
  one process (no DDP) that steps after accumulating the same two half-batches, each
  loss halved. Ranks are built from different seeds: DDP's broadcast at construction
  makes them one model (rank 0's), the twin is built from rank 0's seed.
* **no_sync**: two micro-batches per rank and step, the first under ``no_sync``; the
  expected result is each rank's gradients accumulated on its own, then averaged.
* **resume**: two steps, a checkpoint (``torch.save`` of the state dicts, and Distributed
  Checkpoint's ``get_state_dict``/``save``/``load``/``set_state_dict``), a fresh model
  from another seed loading it, two more steps: equal to four uninterrupted steps.

Everything is compared bit for bit: parameters, optimizer state, scales.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed_harness import WORLD, run_ranks

pytestmark = pytest.mark.distributed

STEPS = 4
CASES = {  # name: (level, dtype, loss scaling)
    "O1-bf16": ("O1", torch.bfloat16, False),
    "O2-bf16": ("O2", torch.bfloat16, False),
    "O2-fp16-scaler": ("O2", torch.float16, True),
}


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)  # the same global batch everywhere
    return torch.randn(16, 8, generator=gen), torch.randint(0, 4, (16,), generator=gen)


def _half(step: int, rank: int, parts: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s half of the step's batch, in ``parts`` micro-batches."""
    x, y = _batch(step)
    size = x.shape[0] // WORLD
    x, y = x[rank * size:(rank + 1) * size], y[rank * size:(rank + 1) * size]
    return list(zip(x.chunk(parts), y.chunk(parts)))


def _build(case: str, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    import ampkit

    level, dtype, scaled = CASES[case]
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16),
                                torch.nn.GELU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = ampkit.initialize(model, opt, level=level, dtype=dtype)
    scaler = ampkit.GradScaler("cpu", init_scale=2.0 ** 10) if scaled else None
    return model, opt, scaler


def _backward(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, weight: float,
              scaler: Any) -> None:
    loss = F.cross_entropy(model(x).float(), y) * weight
    (loss if scaler is None else scaler.scale(loss)).backward()


def _step(opt: torch.optim.Optimizer, scaler: Any) -> None:
    if scaler is None:
        opt.step()
    else:
        scaler.step(opt)
        scaler.update()


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer, scaler: Any) -> dict[str, Any]:
    module = getattr(model, "module", model)  # DDP's inner module
    params = {n: p.detach().clone() for n, p in module.named_parameters()}
    names = {id(p): n for n, p in module.named_parameters()}
    moments = {names[id(p)]: {k: v.clone() for k, v in s.items()}
               for p, s in opt.state.items()}
    return {"params": params, "moments": moments,
            "scale": None if scaler is None else scaler.get_scale()}


def _ddp_steps(ddp: Any, opt: torch.optim.Optimizer, scaler: Any, rank: int,
               steps: range) -> None:
    for step in steps:
        opt.zero_grad()
        (x, y), = _half(step, rank)
        _backward(ddp, x, y, 1.0, scaler)
        _step(opt, scaler)


def _twin(case: str, seed: int) -> dict[str, Any]:
    model, opt, scaler = _build(case, seed)
    for step in range(STEPS):
        opt.zero_grad()
        for rank in range(WORLD):
            (x, y), = _half(step, rank)
            _backward(model, x, y, 1.0 / WORLD, scaler)
        _step(opt, scaler)
    return _state(model, opt, scaler)


def _no_sync_expected(case: str, seed: int) -> dict[str, Any]:
    """Each rank's two micro-batches accumulated on its own, then averaged: what DDP
    computes when the first backward runs under no_sync."""
    model, opt, scaler = _build(case, seed)
    for step in range(STEPS):
        local = []
        for rank in range(WORLD):
            opt.zero_grad()
            for x, y in _half(step, rank, parts=2):
                _backward(model, x, y, 0.5, scaler)
            local.append([p.grad.clone() for p in model.parameters()])
        for p, *grads in zip(model.parameters(), *local):
            p.grad = sum(g / WORLD for g in grads)
        _step(opt, scaler)
    return _state(model, opt, scaler)


def _resume(case: str, rank: int, out_dir: Path, how: str) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    model, opt, scaler = _build(case, seed=10 + rank)
    ddp = DistributedDataParallel(model)
    _ddp_steps(ddp, opt, scaler, rank, range(STEPS // 2))
    where = out_dir / f"{case}-{how}"
    scaler_state = None if scaler is None else scaler.state_dict()
    if how == "torch.save":
        if rank == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, where)
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, opt_state = get_state_dict(ddp, opt)
        dcp.save({"model": model_state, "opt": opt_state}, checkpoint_id=str(where))
    dist.barrier()
    del ddp, model, opt, scaler

    model, opt, scaler = _build(case, seed=77 + rank)  # fresh weights, other seeds
    ddp = DistributedDataParallel(model)
    if how == "torch.save":
        saved = torch.load(where, weights_only=True)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, opt_state = get_state_dict(ddp, opt)
        state = {"model": model_state, "opt": opt_state}
        dcp.load(state, checkpoint_id=str(where))
        set_state_dict(ddp, opt, model_state_dict=state["model"],
                       optim_state_dict=state["opt"])
    if scaler is not None:
        scaler.load_state_dict(scaler_state)
    _ddp_steps(ddp, opt, scaler, rank, range(STEPS // 2, STEPS))
    return _state(ddp, opt, scaler)


def _worker(rank: int, out_dir: str) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    results: dict[str, Any] = {}
    for case in CASES:
        out: dict[str, Any] = {}
        model, opt, scaler = _build(case, seed=10 + rank)  # DDP broadcasts rank 0's
        out["built_equal"] = [p.detach().clone() for p in model.parameters()]
        ddp = DistributedDataParallel(model)
        _ddp_steps(ddp, opt, scaler, rank, range(STEPS))
        out["ddp"] = _state(ddp, opt, scaler)
        out["twin"] = _twin(case, seed=10)

        model, opt, scaler = _build(case, seed=10 + rank)
        ddp = DistributedDataParallel(model)
        deferred = []
        for step in range(STEPS):
            opt.zero_grad()
            first, second = _half(step, rank, parts=2)
            with ddp.no_sync():
                _backward(ddp, *first, 0.5, scaler)
            deferred.append([p.grad.clone() for p in model.parameters()])
            _backward(ddp, *second, 0.5, scaler)
            _step(opt, scaler)
        out["no_sync"] = _state(ddp, opt, scaler)
        out["no_sync_local_grads"] = deferred
        out["no_sync_expected"] = _no_sync_expected(case, seed=10)

        for how in ("torch.save", "dcp"):
            out[f"resume {how}"] = _resume(case, rank, Path(out_dir), how)
        results[case] = out
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("ddp")
    return run_ranks(out, _worker, str(out))


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(
            _equal(a[k], b[k]) for k in a)
    return a == b


def _assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    for name in a["params"]:
        assert _equal(a["params"][name], b["params"][name]), name
    assert _equal(a["moments"], b["moments"])
    assert a["scale"] == b["scale"]


@pytest.mark.parametrize("case", CASES)
def test_ddp_equals_the_accumulation_twin(ranks: list[dict[str, Any]], case: str) -> None:
    built = [r[case]["built_equal"] for r in ranks]
    assert not all(torch.equal(a, b) for a, b in zip(*built))  # the seeds differed
    for rank in ranks:
        _assert_same(rank[case]["ddp"], rank[case]["twin"])
    moved = ranks[0][case]["ddp"]["params"]["0.weight"]
    assert moved.dtype is torch.float32  # the fp32 truth is what DDP trained


@pytest.mark.parametrize("case", CASES)
def test_no_sync_defers_the_reduction(ranks: list[dict[str, Any]], case: str) -> None:
    local0, local1 = (r[case]["no_sync_local_grads"] for r in ranks)
    # inside no_sync each rank kept its own fp32 gradient
    assert all(g.dtype is torch.float32 for g in local0[0])
    assert not all(torch.equal(a, b) for a, b in zip(local0[0], local1[0]))
    for rank in ranks:
        _assert_same(rank[case]["no_sync"], rank[case]["no_sync_expected"])


@pytest.mark.parametrize("how", ["torch.save", "dcp"])
@pytest.mark.parametrize("case", CASES)
def test_resume_is_exact(ranks: list[dict[str, Any]], case: str, how: str) -> None:
    for rank in ranks:
        _assert_same(rank[case][f"resume {how}"], rank[case]["ddp"])

