"""ampkit.plan's per-rank peak against the peak of the same step really run: in one
process, and on two gloo CPU ranks under DDP and FSDP2.

The real peak is read from the CPU allocator, not from tensors. Torch's profiler
(``profile_memory=True``) records each allocation made on the thread that runs it, with
the allocator's running total of bytes held (``total_allocated``). That total is the
whole process's only while c10's ``caffe2_report_cpu_memory_usage`` flag is on: without
it, a free made on another thread (gloo's worker threads release the buffers of a
finished collective) is never subtracted, and the total only grows. The step's peak is
the highest total inside the measured step (a ``record_function`` range, on the same
clock) less the total when the profile began, before the model was built. The set-up is
written here with ampkit's public API, as a user writes it, independently of the
planner's own."""

from __future__ import annotations

import contextlib
import ctypes
import gc
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

import ampkit
from tests.distributed_harness import WORLD, run_ranks

pytestmark = pytest.mark.filterwarnings("ignore")

MODES = ("O1", "O2", "pure-stochastic", "pure-stochastic+step-in-backward")
TOLERANCE = 0.10


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64), nn.LayerNorm(64))
            for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def inputs() -> torch.Tensor:
    return torch.randn(256, 64)


def loss_fn(output: torch.Tensor) -> torch.Tensor:
    return output.float().pow(2).mean()


_SETTINGS: dict[str, dict[str, Any]] = {
    "O1": {"level": "O1"}, "O2": {"level": "O2"},
    "pure-stochastic": {"level": "O2", "master_weights": "stochastic"},
    "pure-stochastic+step-in-backward": {"level": "O2", "master_weights": "stochastic",
                                         "step_in_backward": True},
}


def _real_step(mode: str, layout: str) -> tuple[Any, Any, Any, bool]:
    """The model (wrapped for the layout), optimizer and inputs, as a user sets them up."""
    settings = dict(_SETTINGS[mode], dtype=torch.bfloat16)
    model = Net()
    if layout == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh

        from ampkit.fsdp import fully_shard, prepare_optimizer
        from ampkit.step_in_backward import enable_step_in_backward

        in_backward = settings.pop("step_in_backward", False)
        model = ampkit.initialize(model, **settings)
        fully_shard(model, blocks=list(model.blocks), mesh=init_device_mesh("cpu", (WORLD,)))
        opt = prepare_optimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        if in_backward:
            opt = enable_step_in_backward(opt)
        return model, opt, inputs(), in_backward
    else:
        model, opt = ampkit.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                       **settings)
        if layout == "ddp":
            model = nn.parallel.DistributedDataParallel(model)
    return model, opt, inputs(), bool(settings.get("step_in_backward"))


def count_frees_of_every_thread() -> None:
    """Turn on c10's process-wide CPU memory accounting (see the module's docstring);
    on from then on, in this process."""
    library = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libc10.so"))
    ctypes.c_bool.in_dll(library, "FLAGS_caffe2_report_cpu_memory_usage").value = True


def _allocations(nodes: Any) -> Any:
    for node in nodes:
        if type(node.extra_fields).__name__ == "_ExtraFields_Allocation":
            yield node
        yield from _allocations(node.children)


def _mark(nodes: Any, name: str) -> Any:
    for node in nodes:
        if node.name == name:
            return node
        found = _mark(node.children, name)
        if found is not None:
            return found
    return None


def measured_peak(mode: str, layout: str) -> int | str:
    """The real peak of the second step (bytes), or ``"refused: ..."``."""
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.manual_seed(0)
    # garbage an earlier run in this process left is collected before the profile, not
    # inside it, where its frees would count against memory this run allocated
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        try:
            model, opt, x, in_backward = _real_step(mode, layout)
            for measured in (contextlib.nullcontext(), record_function("plan-measured-step")):
                with measured:
                    opt.zero_grad(set_to_none=True)
                    loss_fn(model(x)).backward()  # DDP + in backward: refused at 1st hook
                    if not in_backward:
                        opt.step()
        except (RuntimeError, ValueError) as error:
            return f"refused: {' '.join(str(error).split())}"
    tree = prof.profiler.kineto_results.experimental_event_tree()
    mark = _mark(tree, "plan-measured-step")
    events = sorted(_allocations(tree), key=lambda node: node.start_time_ns)
    first = events[0].extra_fields
    before = first.total_allocated - first.alloc_size  # held when the profile began
    return max(node.extra_fields.total_allocated for node in events
               if mark.start_time_ns <= node.start_time_ns <= mark.end_time_ns) - before


def _worker(rank: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    count_frees_of_every_thread()
    # one process's runs first, in this fresh process: measured inside a pytest worker,
    # memory that earlier tests left and that was freed during the measured step counted
    # as a negative allocation (O2 measured 1.94 MB against 2.74 MB, in CI only)
    alone = {f"none/{mode}": measured_peak(mode, "none") for mode in MODES}
    # the refused run (DDP, stepping in backward) last: a DDP whose backward raised
    # keeps its parameters alive outside Python (gc does not free them), and their
    # release inside a later run's profile would count as frees of memory that run never
    # allocated
    runs = [(layout, mode) for layout in ("ddp", "fsdp2") for mode in MODES]
    runs.sort(key=lambda run: run == ("ddp", "pure-stochastic+step-in-backward"))
    return alone | {f"{layout}/{mode}": measured_peak(mode, layout) for layout, mode in runs}


def _planned(layout: str) -> dict[str, Any]:
    report = ampkit.plan(Net, inputs, world_size=1 if layout == "none" else WORLD,
                         parallel=layout, modes=list(MODES), device_policy="cpu",
                         loss_fn=loss_fn)
    return {r["mode"]: r["peak"] if r["peak"] is not None else r["note"]
            for r in report.rows}


def _check(planned: dict[str, Any], real: dict[str, Any], layout: str) -> None:
    for mode in MODES:
        want, got = real[f"{layout}/{mode}"], planned[mode]
        if isinstance(want, str):  # ampkit refused the real run: the plan says the same
            assert got == want, (layout, mode)
            continue
        assert isinstance(got, int), (layout, mode, got)
        print(f"{layout} {mode}: planned {got}, measured {want} ({got / want - 1:+.1%})")
        assert abs(got - want) <= TOLERANCE * want, (layout, mode, got, want)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(tmp_path_factory.mktemp("plan"), _worker, timeout=240.0)


def test_the_planned_peak_of_one_process_is_within_ten_percent_of_the_measured(
        ranks: list[dict[str, Any]]) -> None:
    real = ranks[0]  # measured in a fresh process, before any process group was used
    assert all(isinstance(real[f"none/{mode}"], int) for mode in MODES)  # none refused
    _check(_planned("none"), real, "none")


@pytest.mark.parametrize("layout", ["ddp", "fsdp2"])
def test_the_planned_peak_per_rank_is_within_ten_percent_of_gloo_ranks(
        ranks: list[dict[str, Any]], layout: str) -> None:
    planned = _planned(layout)
    for rank in ranks:  # the plan is rank 0's; the other rank holds as much
        _check(planned, rank, layout)
