"""Two CPU processes over gloo: pure bf16 training (master_weights="stochastic" / "kahan")
under DDP and FSDP2 trains bit for bit like one process stepping the same two
half-batches (the "accumulation twin").

One spawn runs every scenario; each rank saves what it saw, and the test compares the
ranks with each other and with the twin, which it trains itself.

* DDP: the ranks build their models from different seeds (DDP broadcasts rank 0's at
  construction) and draw from their global RNGs differently between steps. Neither may
  matter: the rounding's bits come from the optimizer's seed, the parameter, the step
  and the element, never from the global RNG, which a step leaves untouched. Rank 0
  checkpoints the model's and the optimizer's ``state_dict`` halfway; a run resumed
  from it, in models built from yet other seeds, ends bit for bit where the
  uninterrupted one did.
* FSDP2 (``fully_shard``): the parameters, gradients and optimizer state are sharded.
  The rounding's bits depend on each element's position in the whole parameter, so the
  sharded run ends bit for bit where the unsharded twin does, uneven shards included.
  A run resumed through Distributed Checkpoint (``get_state_dict``, ``dcp.load`` with
  ``ampkit.pure.PureLoadPlanner``, ``set_state_dict``) ends there too: the rounding
  seed is a parameter-group hyper-parameter and the counts are per-parameter state, the
  only parts of an optimizer state_dict that DCP keeps.

* ``step_in_backward`` under DDP, FSDP2 and tensor parallelism: see
  ``test_distributed_step_in_backward.py``.
* Wrong orders are errors before anything trains (never a run that trains nothing),
  each naming the order: ``DistributedDataParallel(net)`` then
  ``ampkit.initialize(net, master_weights=...)`` is refused at ``initialize``; with
  ``ampkit.fsdp.fully_shard``, an optimizer built before sharding (pure, and at O3)
  and a plain ``AdamW`` built after it over a pure model (sharded by ampkit's recipe or
  torch's own ``fully_shard``) raise at their first step and change nothing.
  The one documented call,
  ``ampkit.fsdp.prepare_optimizer(model, AdamW(model.parameters()))``, trains bit for
  bit like the unsharded twin that ``initialize(net, AdamW, ...)`` made pure, without
  the rounding or the seed given again.

One spawn (:mod:`distributed_harness`: bounded collectives, a deadline for the ranks)
runs every scenario.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from distributed_harness import run_ranks

pytestmark = pytest.mark.distributed

WORLD = 2
MODES = ("stochastic", "kahan")
BF16 = torch.bfloat16
STEPS, CHECKPOINT = 6, 3


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batches; rank r trains on half r of each."""
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(8, 8, generator=g), torch.randn(8, 5, generator=g))
            for _ in range(STEPS)]


def _ddp_model(seed: int, mode: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    import ampkit

    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 5))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    # no rounding_seed: the default must agree across ranks by itself
    return ampkit.initialize(net, opt, level="O2", dtype=BF16, master_weights=mode)


def _fsdp2_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    # uneven shards on two ranks: 5 output rows
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 5)).to(BF16)


def _pure_adamw(model: nn.Module, mode: str, seed: int) -> torch.optim.Optimizer:
    from ampkit.pure import PureLowPrecisionOptimizer

    return PureLowPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), mode,
                                     seed=seed)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x.to(next(model.parameters()).dtype)).float(), y)


def _ddp_run(rank: int, mode: str, out: Path) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    batches = _batches()
    checkpoint = out / f"ddp_{mode}.pt"

    def train(net: nn.Module, opt: torch.optim.Optimizer, steps: range) -> bool:
        model = DistributedDataParallel(net)
        untouched = True
        for step in steps:
            if step == CHECKPOINT and net is first:
                if rank == 0:
                    torch.save({"model": net.state_dict(), "opt": opt.state_dict()},
                               checkpoint)
                dist.barrier()
            x, y = (t.chunk(WORLD)[rank] for t in batches[step])
            torch.rand(rank + 1)  # each rank's global RNG on its own course
            opt.zero_grad()
            _loss(model, x, y).backward()
            rng = torch.get_rng_state()
            opt.step()
            untouched &= torch.equal(rng, torch.get_rng_state())
        return untouched

    first, opt = _ddp_model(rank + 1, mode)  # ranks built from different seeds
    untouched = train(first, opt, range(STEPS))
    resumed, resumed_opt = _ddp_model(rank + 10, mode)
    saved = torch.load(checkpoint)
    resumed.load_state_dict(saved["model"])
    resumed_opt.load_state_dict(saved["opt"])
    train(resumed, resumed_opt, range(CHECKPOINT, STEPS))
    return {"params": [p.detach().clone() for p in first.parameters()],
            "resumed": [p.detach().clone() for p in resumed.parameters()],
            "rng_untouched": untouched}


def _fsdp2_run(rank: int, mode: str, out: Path) -> dict[str, Any] | None:
    try:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch < 2.6 has no public FSDP2
        return None
    from ampkit.pure import PureLoadPlanner
    mesh = init_device_mesh("cpu", (WORLD,))  # not the accelerator's default mesh
    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)  # as the twin sums
    batches = _batches()

    def sharded(seed: int) -> nn.Module:
        model = _fsdp2_model(seed)
        for module in (model[0], model[2], model):
            fully_shard(module, mesh=mesh, mp_policy=policy)
        return model

    def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
        for step in steps:
            x, y = (t.chunk(WORLD)[rank] for t in batches[step])
            opt.zero_grad()
            _loss(model, x, y).backward()
            opt.step()

    model = sharded(0)
    opt = _pure_adamw(model, mode, seed=3)
    train(model, opt, range(CHECKPOINT))
    state = dict(zip(("model", "optim"), get_state_dict(model, opt)))
    dcp.save(state, checkpoint_id=str(out / f"dcp_{mode}"))
    train(model, opt, range(CHECKPOINT, STEPS))
    local_state = opt.state[model[0].weight]

    resumed = sharded(rank + 7)  # other weights, another seed: all comes from the files
    resumed_opt = _pure_adamw(resumed, mode, seed=99)
    state = dict(zip(("model", "optim"), get_state_dict(resumed, resumed_opt)))
    # ampkit's planner, as docs/pure-bf16.md advises for a pure resume: a pure run's
    # checkpoint loads through it as through torch's default planner
    dcp.load(state, checkpoint_id=str(out / f"dcp_{mode}"), planner=PureLoadPlanner())
    set_state_dict(resumed, resumed_opt, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    train(resumed, resumed_opt, range(CHECKPOINT, STEPS))
    return {
        "sharded": all(type(p).__name__ == "DTensor" and p.to_local().numel() < p.numel()
                       for p in model.parameters()),
        "state_sharded": local_state["exp_avg"].to_local().numel()
        < local_state["exp_avg"].numel(),
        "params": [p.full_tensor().detach().clone() for p in model.parameters()],
        "state": {k: v.full_tensor().clone() if isinstance(v, torch.Tensor) and hasattr(
            v, "full_tensor") else v for k, v in local_state.items()},
        "resumed": [p.full_tensor().detach().clone() for p in resumed.parameters()],
    }


ORDER_SEED = 5  # the rounding_seed given to initialize, and only there


def _order_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 5))


def _refused(call: Any) -> str | None:
    try:
        call()
    except RuntimeError as error:
        return str(error)
    return None


def _orders_run(rank: int) -> dict[str, Any] | None:
    """The wrong orders, each caught where it is refused, and the documented one."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6 has no public FSDP2
        return None
    from torch.nn.parallel import DistributedDataParallel

    import ampkit
    import ampkit.fsdp

    mesh = init_device_mesh("cpu", (WORLD,))
    batches = _batches()
    out: dict[str, Any] = {}

    def pure(net: nn.Module, *opt: torch.optim.Optimizer, mode: str = "stochastic") -> Any:
        return ampkit.initialize(net, *opt, level="O2", dtype=BF16, master_weights=mode,
                                 rounding_seed=ORDER_SEED)

    def shard(net: nn.Module) -> nn.Module:
        return ampkit.fsdp.fully_shard(net, blocks=[nn.Linear], mesh=mesh)

    def first_step(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
        x, y = (t.chunk(WORLD)[rank] for t in batches[0])
        before = [p.full_tensor().detach().clone() for p in model.parameters()]
        opt.zero_grad()
        _loss(model, x, y).backward()
        error = _refused(opt.step)
        after = [p.full_tensor() for p in model.parameters()]
        return {"error": error, "unchanged": all(torch.equal(a, b)
                                                 for a, b in zip(before, after))}

    # DDP before initialize: refused at initialize, the model left as it was
    net = _order_model()
    ddp = DistributedDataParallel(net)
    out["ddp_first"] = _refused(lambda: pure(net))
    out["ddp_first_untouched"] = {p.dtype for p in net.parameters()} == {torch.float32}
    del ddp

    # the optimizer built before sharding (given to initialize, so pure): at O2 pure and
    # at O3 (a plain optimizer there)
    net = _order_model()
    net, opt = pure(net, torch.optim.AdamW(net.parameters()))
    out["before_sharding"] = first_step(shard(net), opt)
    net = _order_model()
    opt = torch.optim.AdamW(net.parameters())
    net, opt = ampkit.initialize(net, opt, level="O3", dtype=BF16)
    out["before_sharding_o3"] = first_step(shard(net), opt)
    # a plain AdamW after sharding a pure model, with ampkit's recipe and torch's own
    model = shard(pure(_order_model()))
    out["plain_after"] = first_step(model, torch.optim.AdamW(model.parameters()))
    model = pure(_order_model())
    for module in (model[0], model[2], model):
        fully_shard(module, mesh=mesh)
    out["plain_after_torch"] = first_step(model, torch.optim.AdamW(model.parameters()))
    # the documented call, in both modes: trains
    for mode in MODES:
        model = shard(pure(_order_model(), mode=mode))
        opt = ampkit.fsdp.prepare_optimizer(
            model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        for step in range(STEPS):
            x, y = (t.chunk(WORLD)[rank] for t in batches[step])
            opt.zero_grad()
            _loss(model, x, y).backward()
            opt.step()
        out[f"prepared_{mode}"] = [p.full_tensor().detach().clone()
                                   for p in model.parameters()]
    return out


def _worker(rank: int, out_dir: str) -> dict[str, Any]:
    out = Path(out_dir)
    results: dict[str, Any] = {}
    for mode in MODES:
        results[f"ddp_{mode}"] = _ddp_run(rank, mode, out)
        results[f"fsdp2_{mode}"] = _fsdp2_run(rank, mode, out)
    results["orders"] = _orders_run(rank)
    return results


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("gloo_pure")
    return run_ranks(out, _worker, str(out), timeout=240)


def _twin(model: nn.Module, opt: torch.optim.Optimizer) -> nn.Module:
    """One process stepping both half-batches, each loss halved (DDP's and FSDP2's
    average over two ranks), the gradients accumulated."""
    for x, y in _batches():
        opt.zero_grad()
        for xs, ys in zip(x.chunk(WORLD), y.chunk(WORLD)):
            (_loss(model, xs, ys) / WORLD).backward()
        opt.step()
    return model


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y)
                                    for x, y in zip(a, b))


@pytest.mark.parametrize("mode", MODES)
def test_ddp_trains_like_the_accumulation_twin_and_resumes_exactly(
        rank_results: list[dict[str, Any]], mode: str) -> None:
    rank0, rank1 = (r[f"ddp_{mode}"] for r in rank_results)
    assert rank0["rng_untouched"] and rank1["rng_untouched"]
    assert _equal(rank0["params"], rank1["params"])  # from different seeds, equal
    twin = _twin(*_ddp_model(1, mode))  # rank 0's seed: DDP broadcast its weights
    expected = [p.detach() for p in twin.parameters()]
    assert {p.dtype for p in expected} == {BF16, torch.float32}  # Linears, LayerNorm
    assert _equal(rank0["params"], expected)
    assert _equal(rank0["resumed"], expected) and _equal(rank1["resumed"], expected)


@pytest.mark.parametrize("mode", MODES)
def test_fsdp2_trains_like_the_unsharded_twin_and_resumes_through_dcp(
        rank_results: list[dict[str, Any]], mode: str) -> None:
    runs = [r[f"fsdp2_{mode}"] for r in rank_results]
    if runs[0] is None:
        pytest.skip("FSDP2 (torch.distributed.fsdp.fully_shard) needs torch >= 2.6")
    assert all(run["sharded"] and run["state_sharded"] for run in runs)
    model = _fsdp2_model()
    opt = _pure_adamw(model, mode, seed=3)
    expected = [p.detach() for p in _twin(model, opt).parameters()]
    for run in runs:
        assert _equal(run["params"], expected)
        assert _equal(run["resumed"], expected)
    state = opt.state[model[0].weight]
    got = runs[0]["state"]
    assert sorted(got) == sorted(state)
    for key, value in state.items():  # the moments (and Kahan's compensation) too
        assert torch.equal(got[key], value) if isinstance(value, torch.Tensor) \
            else got[key] == value, key


def _orders(rank_results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    runs = [r["orders"] for r in rank_results]
    if runs[0] is None:
        pytest.skip("FSDP2 (torch.distributed.fsdp.fully_shard) needs torch >= 2.6")
    return runs


def test_ddp_before_initialize_is_refused_naming_the_order(
        rank_results: list[dict[str, Any]]) -> None:
    for run in _orders(rank_results):
        assert run["ddp_first"] is not None and run["ddp_first_untouched"]
        assert "DistributedDataParallel(model) was built before ampkit.initialize" in \
            run["ddp_first"]
        assert "then wrap the result in DistributedDataParallel" in run["ddp_first"]


@pytest.mark.parametrize("case", ["before_sharding", "before_sharding_o3", "plain_after",
                                  "plain_after_torch"])
def test_fsdp2_wrong_optimizer_order_fails_at_the_first_step_changing_nothing(
        rank_results: list[dict[str, Any]], case: str) -> None:
    for run in _orders(rank_results):
        got = run[case]
        assert got["error"] is not None and got["unchanged"], got
        assert "ampkit.fsdp.prepare_optimizer(model, torch.optim.AdamW(" in got["error"]
        if case.startswith("plain_after"):
            assert "round every update to nearest" in got["error"]
        else:
            assert "replaced it with a sharded DTensor parameter" in got["error"]


@pytest.mark.parametrize("mode", MODES)
def test_fsdp2_prepare_optimizer_trains_like_the_unsharded_twin(
        rank_results: list[dict[str, Any]], mode: str) -> None:
    import ampkit

    runs = _orders(rank_results)
    net = _order_model()
    net, opt = ampkit.initialize(net, torch.optim.AdamW(net.parameters(), lr=1e-2),
                                 level="O2", dtype=BF16, master_weights=mode,
                                 rounding_seed=ORDER_SEED)
    expected = [p.detach() for p in _twin(net, opt).parameters()]
    start = [p.detach() for p in _order_model().parameters()]
    for run in runs:
        got = run[f"prepared_{mode}"]
        assert _equal(got, expected)
        moved = sum(int((a.float() != b).sum()) for a, b in zip(got, start))
        assert moved > 0.5 * sum(p.numel() for p in start)
