"""The one harness of the multi-process tests: ``WORLD`` CPU processes over gloo.

:func:`run_ranks` spawns the ranks, initialises the default process group in each
(gloo, a file store, the loopback interface, a bounded collective timeout), runs
``worker(rank, *args)`` and returns what each rank's worker returned. Each test file
makes one spawn (a module-scoped fixture) that runs all its scenarios, because starting
the processes is what costs.

The processes are CPU-only on purpose, also on a machine with CUDA: the children start
with ``CUDA_VISIBLE_DEVICES=""`` and FSDP2 gets an explicit CPU device mesh. With CUDA
visible a spawn died with SIGSEGV (torch 2.11, H100). The likely cause, read from
the code rather than reproduced (no GPU in the session that changed this): left to
itself, ``fully_shard`` builds its mesh on the accelerator when one is visible and moves
the shards there, both ranks onto GPU 0 (no ``set_device``), under a gloo group.

Nothing waits forever: a collective that no other rank joins fails after
``collective_timeout`` seconds inside the worker, and ranks that have not all finished
within their budget are killed and the test fails. The budget is ``timeout`` seconds of
an unloaded machine: a second of waiting counts for less while the machine is
oversubscribed (load average above its CPU count: spawning two processes that import
torch then takes minutes, not seconds), so set-up never fails merely from load; however
loaded, ``timeout * MAX_STRETCH`` wall seconds is the hard end.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
#: the most a loaded machine stretches a budget: a hang fails within timeout * this
MAX_STRETCH = 6.0


def _loopback() -> str | None:
    for _, name in socket.if_nameindex():
        if name.startswith("lo"):
            return name
    return None


def _entry(rank: int, worker: Callable[..., Any], out_dir: str, collective_timeout: float,
           args: tuple[Any, ...], world: int = WORLD) -> None:
    assert not torch.cuda.is_available()  # hidden by run_ranks, before any CUDA call
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{Path(out_dir) / 'store'}", rank=rank,
        world_size=world, timeout=datetime.timedelta(seconds=collective_timeout))
    try:
        result = worker(rank, *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def load_factor(load: float | None = None, cpus: int | None = None) -> float:
    """How many times slower than unloaded the machine runs now: its 1-minute load
    average per CPU, at least 1, at most :data:`MAX_STRETCH` (1 where the platform has
    no load average)."""
    if load is None:
        try:
            load = os.getloadavg()[0]
        except OSError:
            return 1.0
    cpus = cpus or os.cpu_count() or 1
    return min(MAX_STRETCH, max(1.0, load / cpus))


def run_ranks(out_dir: Path, worker: Callable[..., Any], *args: Any, timeout: float = 120.0,
              collective_timeout: float = 30.0, world: int = WORLD) -> list[Any]:
    """Run ``worker(rank, *args)`` on ``world`` gloo ranks (``WORLD`` unless a test
    needs a 2-D mesh); return each rank's result (anything ``torch.save`` takes).
    ``worker`` must be a module-level function of a test module (the children import
    it)."""
    if not dist.is_available():
        pytest.skip("torch.distributed is not available in this build")
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {"CUDA_VISIBLE_DEVICES": ""}  # the children never see a GPU
    loopback = _loopback()
    if loopback is not None and "GLOO_SOCKET_IFNAME" not in os.environ:
        env["GLOO_SOCKET_IFNAME"] = loopback  # 127.0.0.1: no network needed
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        context = mp.start_processes(
            _entry, args=(worker, str(out_dir), collective_timeout, args, world), nprocs=world,
            join=False, start_method="spawn")
    start = last = time.monotonic()
    used = 0.0  # unloaded-machine seconds spent
    stretch = 1.0
    while not context.join(timeout=1.0):
        now = time.monotonic()
        stretch = load_factor()
        used += (now - last) / stretch
        last = now
        if used >= timeout or now - start >= timeout * MAX_STRETCH:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            pytest.fail(f"the {world} ranks did not finish within {timeout:.0f} s of an "
                        f"unloaded machine ({now - start:.0f} s of wall time; load factor "
                        f"now {stretch:.1f}, at most {MAX_STRETCH:.0f}x {timeout:.0f} s)")
    return [torch.load(out_dir / f"rank{rank}.pt", weights_only=False)
            for rank in range(world)]
