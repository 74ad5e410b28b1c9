"""Two CPU ranks over gloo: a replicated bf16 DTensor parameter whose gradient is
``Partial`` (what ``SequenceParallel`` gives a norm's weight: each rank holds its part of
the sum) is stepped by a pure ``AdamW`` on the summed gradient, on every rank, like one
process stepping the same parameter on that sum; in a group that leaves ``foreach`` and
``fused`` to torch as in one that names the loop (``foreach=False``).

The reference is one process, which takes the sum itself; the ranks must also agree with
each other in the optimizer state, or the replicas drift apart from the next step on.

The same holds for a sharded (``Shard(0)``) parameter whose gradient is a DTensor of
another placement (``Shard(1)``, ``Replicate``): the step pairs each weight with its own
gradient element, as DTensor's redistribution does for the loop.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from distributed_harness import run_ranks

pytestmark = pytest.mark.distributed

BF16 = torch.bfloat16
N = 1000  # above ampkit.pure.fused.MIN_ELEMENTS: the fused kernel's path (not a multiple of 64)
IMPLEMENTATIONS = {"left_to_torch": {}, "loop": {"foreach": False}}


def _weight() -> torch.Tensor:
    return torch.linspace(-1, 1, N).to(BF16)


def _part(rank: int, step: int) -> torch.Tensor:
    """Rank ``rank``'s part of the gradient at ``step`` (exact in bf16, and so is the sum)."""
    return torch.full((N,), float((rank + 1) * (step + 1)), dtype=BF16)


ROWS, COLS = 26, 22  # 572 elements: the fused kernel's path; shards of 13 rows, 11 columns


def _square() -> torch.Tensor:
    return torch.linspace(-1, 1, ROWS * COLS).reshape(ROWS, COLS).to(BF16)


def _square_grad() -> torch.Tensor:
    return torch.linspace(-3, 5, ROWS * COLS).reshape(ROWS, COLS).to(BF16)


#: the gradient's placement on a Shard(0) parameter: (DTensor placement class, its args)
PLACEMENTS: dict[str, tuple[str, tuple[int, ...]]] = {"shard1": ("Shard", (1,)),
                                                       "replicate": ("Replicate", ())}


def _worker(rank: int) -> dict[str, Any]:
    import torch.distributed.tensor
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    from ampkit.pure import PureLowPrecisionOptimizer

    mesh = init_device_mesh("cpu", (2,))
    out: dict[str, Any] = {}
    # where such gradients come from: SequenceParallel's norm, its input split by sequence
    norm = nn.LayerNorm(4).to(BF16)
    parallelize_module(norm, mesh, SequenceParallel())
    x = torch.randn(1, 2, 4, generator=torch.Generator().manual_seed(rank)).to(BF16)
    y = norm(x)
    (y.to_local() if isinstance(y, DTensor) else y).float().square().sum().backward()
    out["natural"] = (norm.weight.placements, norm.weight.grad.placements)
    for name, implementation in IMPLEMENTATIONS.items():
        w = nn.Parameter(distribute_tensor(_weight(), mesh, [Replicate()]))
        opt = PureLowPrecisionOptimizer(torch.optim.AdamW([w], lr=0.1, **implementation),
                                        "stochastic", seed=0)
        for step in range(2):
            w.grad = DTensor.from_local(_part(rank, step), mesh, [Partial()])
            opt.step()
        out[name] = {"weight": w.to_local().clone(),
                     **{k: v.to_local().clone() for k, v in opt.state[w].items()
                        if isinstance(v, DTensor)}}
    for placement in PLACEMENTS:
        for name, implementation in IMPLEMENTATIONS.items():
            w = nn.Parameter(distribute_tensor(_square(), mesh, [Shard(0)]))
            opt = PureLowPrecisionOptimizer(
                torch.optim.AdamW([w], lr=0.1, **implementation), "stochastic", seed=0)
            kind, args = PLACEMENTS[placement]
            place = getattr(torch.distributed.tensor, kind)(*args)
            w.grad = distribute_tensor(_square_grad(), mesh, [place])
            opt.step()
            out[f"{placement}_{name}"] = {
                "weight": w.full_tensor().clone(),
                **{k: v.full_tensor().clone() for k, v in opt.state[w].items()
                   if isinstance(v, DTensor)}}
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out: Path = tmp_path_factory.mktemp("gloo_pure_partial")
    return run_ranks(out, _worker, timeout=120)


def _one_process() -> dict[str, torch.Tensor]:
    from ampkit.pure import PureLowPrecisionOptimizer

    w = nn.Parameter(_weight())
    opt = PureLowPrecisionOptimizer(torch.optim.AdamW([w], lr=0.1), "stochastic", seed=0)
    for step in range(2):
        w.grad = _part(0, step) + _part(1, step)
        opt.step()
    return {"weight": w.detach(), "exp_avg": opt.state[w]["exp_avg"],
            "exp_avg_sq": opt.state[w]["exp_avg_sq"]}


def test_sequence_parallel_gives_a_replicated_norm_weight_a_partial_gradient(
        ranks: list[dict[str, Any]]) -> None:
    from torch.distributed.tensor import Partial, Replicate

    for run in ranks:  # the case below is what torch's own plan produces
        assert run["natural"] == ((Replicate(),), (Partial(),))


@pytest.mark.parametrize("implementation", list(IMPLEMENTATIONS))
def test_a_partial_gradient_of_a_replicated_parameter_steps_on_its_sum_like_one_process(
        ranks: list[dict[str, Any]], implementation: str) -> None:
    expected = _one_process()
    for run in ranks:
        got = run[implementation]
        assert sorted(got) == sorted(expected)
        for key, value in expected.items():
            assert torch.equal(got[key], value), (implementation, key)


@pytest.mark.parametrize("implementation", list(IMPLEMENTATIONS))
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_a_sharded_parameter_steps_on_a_gradient_of_another_placement_like_one_process(
        ranks: list[dict[str, Any]], placement: str, implementation: str) -> None:
    from ampkit.pure import PureLowPrecisionOptimizer

    w = nn.Parameter(_square())
    opt = PureLowPrecisionOptimizer(torch.optim.AdamW([w], lr=0.1), "stochastic", seed=0)
    w.grad = _square_grad()
    opt.step()
    expected = {"weight": w.detach(), "exp_avg": opt.state[w]["exp_avg"],
                "exp_avg_sq": opt.state[w]["exp_avg_sq"]}
    for run in ranks:
        got = run[f"{placement}_{implementation}"]
        assert sorted(got) == sorted(expected)
        for key, value in expected.items():
            assert torch.equal(got[key], value), (placement, implementation, key)
