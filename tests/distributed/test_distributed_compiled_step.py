"""The compiled pure step (``compile_step=True``) on two gloo ranks: under DDP and under
FSDP2 (uneven ``Shard(0)`` shards), and stepping inside backward under FSDP2, each
rank's parameters after a few steps are bit for bit those of one process running the
same compiled step over both half-batches (the gradients accumulated). The random
bits are a hash of each element's position in the whole parameter, so a shard rounds
exactly as the unsharded parameter does.

One spawn (:mod:`distributed_harness`) runs every scenario."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from distributed_harness import run_ranks

pytestmark = [pytest.mark.distributed,
              pytest.mark.filterwarnings("ignore::UserWarning:torch")]

WORLD = 2
MODES = ("stochastic", "kahan")
BF16 = torch.bfloat16
STEPS = 3


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(8, 8, generator=g), torch.randn(8, 5, generator=g))
            for _ in range(STEPS)]


def _model() -> nn.Module:
    torch.manual_seed(0)
    # 5 output rows: uneven shards on two ranks; the LayerNorm stays fp32
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 5))


def _initialize(mode: str, *opt: torch.optim.Optimizer, **extra: Any) -> Any:
    import ampkit

    return ampkit.initialize(*opt, level="O2", dtype=BF16, master_weights=mode,
                             rounding_seed=7, compile_step=True, **extra)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x).float(), y)


def _train(rank: int, model: nn.Module, opt: Any, in_backward: bool = False) -> None:
    for x, y in _batches():
        x, y = x.chunk(WORLD)[rank], y.chunk(WORLD)[rank]
        if not in_backward:
            opt.zero_grad()
        _loss(model, x, y).backward()
        if not in_backward:
            opt.step()


def _worker(rank: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    import ampkit.fsdp

    out: dict[str, Any] = {}
    mesh = init_device_mesh("cpu", (WORLD,))
    for mode in MODES:
        net = _model()
        net, opt = _initialize(mode, net, torch.optim.AdamW(net.parameters(), lr=1e-2))
        _train(rank, DistributedDataParallel(net), opt)
        out[f"ddp_{mode}"] = [p.detach().clone() for p in net.parameters()]

        model = ampkit.fsdp.fully_shard(_initialize(mode, _model()), blocks=[nn.Linear],
                                        mesh=mesh)
        opt = ampkit.fsdp.prepare_optimizer(model,
                                            torch.optim.AdamW(model.parameters(), lr=1e-2))
        out[f"fsdp2_compiled_{mode}"] = opt._ampkit_pure.compile_step
        _train(rank, model, opt)
        out[f"fsdp2_{mode}"] = [p.full_tensor().detach().clone() for p in model.parameters()]
    mode = "kahan"
    model = ampkit.fsdp.fully_shard(_initialize(mode, _model(), step_in_backward=True),
                                    blocks=[nn.Linear], mesh=mesh)
    opt = ampkit.fsdp.prepare_optimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    _train(rank, model, opt, in_backward=True)
    out["in_backward"] = [p.full_tensor().detach().clone() for p in model.parameters()]
    return out


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("gloo_compiled_step")
    # a cold compile (tens of seconds per graph on a loaded CPU) may stand between two
    # collectives: the collective timeout must outlast it
    return run_ranks(out, _worker, timeout=300, collective_timeout=300)


def _one_process(mode: str) -> list[torch.Tensor]:
    """The same compiled step in one process over both half-batches, each loss halved
    (the ranks' average), the gradients accumulated."""
    net = _model()
    net, opt = _initialize(mode, net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    for x, y in _batches():
        opt.zero_grad()
        for xs, ys in zip(x.chunk(WORLD), y.chunk(WORLD)):
            (_loss(net, xs, ys) / WORLD).backward()
        opt.step()
    return [p.detach() for p in net.parameters()]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y)
                                    for x, y in zip(a, b))


@pytest.mark.parametrize("mode", MODES)
def test_ddp_and_fsdp2_compiled_steps_give_the_one_process_bits(
        rank_results: list[dict[str, Any]], mode: str) -> None:
    expected = _one_process(mode)
    start = [p.detach().to(q.dtype) for p, q in zip(_model().parameters(), expected)]
    assert not _equal(expected, start)
    for run in rank_results:
        assert run[f"fsdp2_compiled_{mode}"] is True
        assert _equal(run[f"ddp_{mode}"], expected)
        assert _equal(run[f"fsdp2_{mode}"], expected)


def test_fsdp2_step_in_backward_with_the_compiled_step(
        rank_results: list[dict[str, Any]]) -> None:
    expected = _one_process("kahan")
    for run in rank_results:
        assert _equal(run["in_backward"], expected)
