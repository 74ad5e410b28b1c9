"""Two CPU processes over gloo: with DDP, the fp32 masters' gradients derived at the end
of a backward pass are the all-reduced ones, so clipping through the optimizer's
parameters (Lightning's way) clips the same gradients on every rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.distributed

WORLD = 2


def _worker(rank: int, store: str, out_dir: str) -> None:
    import os

    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # gloo on CPU tensors, whatever the machine has
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=WORLD)
    from torch.nn.parallel import DistributedDataParallel

    import ampkit
    from ampkit.master_weights import master_params

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8),
                              torch.nn.Linear(8, 3))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net, opt = ampkit.initialize(net, opt, level="O2", dtype=torch.bfloat16)
    model = DistributedDataParallel(net)
    gen = torch.Generator().manual_seed(100 + rank)  # each rank has its own data
    seen: list[dict[str, Any]] = []
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(6, 4, generator=gen)).float().pow(2).mean().backward()
        masters = [m.grad.clone() for m in master_params(opt)]
        models = [p.grad.float().clone() for p in net.parameters()]
        torch.nn.utils.clip_grad_norm_(list(master_params(opt)), 0.05)
        opt.step()
        seen.append({"masters": masters, "models": models,
                     "params": [p.detach().float().clone() for p in net.parameters()]})
    torch.save(seen, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


def test_master_gradients_are_the_all_reduced_ones(tmp_path: Path) -> None:
    mp.start_processes(_worker, args=(str(tmp_path / "store"), str(tmp_path)),
                       nprocs=WORLD, join=True, start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for step in range(3):
        for rank in ranks:
            # The masters hold the reduced gradient the model holds, in fp32.
            assert all(torch.equal(m, g) for m, g in zip(rank[step]["masters"],
                                                          rank[step]["models"]))
        a, b = ranks[0][step], ranks[1][step]
        assert all(torch.equal(x, y) for x, y in zip(a["masters"], b["masters"]))
        assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
