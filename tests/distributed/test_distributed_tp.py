"""Tensor parallelism in either order, on gloo CPU ranks: ``parallelize_module``
(``ColwiseParallel`` / ``RowwiseParallel``) before or after ``ampkit.initialize``.

* 2 ranks, TP alone: at every level (O1, O2, O3, pure bf16 with stochastic rounding and
  with Kahan compensation) ``initialize`` after ``parallelize_module`` stores each
  DTensor parameter's local shard in the dtype the parameter reports, and 3 AdamW
  steps end bit for bit where the documented order (``initialize``, then
  ``parallelize_module``, then ``ampkit.fsdp.prepare_optimizer``) ends.
* 4 ranks, a 2 x 2 mesh (``dp`` x ``tp``), FSDP2 + TP: ``parallelize_module`` then
  ``initialize`` then ``ampkit.fsdp.fully_shard`` trains the level's dtype (local
  shards and AdamW state), bit for bit like ``initialize`` first; torch's
  ``fully_shard`` before ``initialize`` is refused at ``initialize``, naming the order.

Each scenario runs both orders from the same seed on the same batches; the test
compares what the ranks saw.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from distributed_harness import run_ranks

pytestmark = pytest.mark.distributed

BF16 = torch.bfloat16
STEPS = 3
#: level and ``initialize`` keywords; the dtype the Linear layers' parameters train in
MODES: dict[str, tuple[str, dict[str, Any], torch.dtype]] = {
    "O1": ("O1", {}, torch.float32),
    "O2": ("O2", {}, torch.float32),
    "O3": ("O3", {}, BF16),
    "pure_stochastic": ("O2", {"master_weights": "stochastic"}, BF16),
    "pure_kahan": ("O2", {"master_weights": "kahan"}, BF16),
}
TP_PLAN = {"1": "colwise", "3": "rowwise"}


def _model(norm: bool = True) -> nn.Module:
    """A norm and two Linear layers; or (``norm=False``) an embedding and two Linear
    layers, every parameter sharded by TP, the model an LM starts as."""
    torch.manual_seed(0)
    # the norm stays a plain (replicated) parameter, kept fp32 by O2/O3
    return nn.Sequential(nn.LayerNorm(8) if norm else nn.Embedding(16, 8),
                         nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))


def _batch(step: int, part: int, norm: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + part)
    x = torch.randn(4, 8, generator=g) if norm else torch.randint(16, (4,), generator=g)
    return x, torch.randn(4, 8, generator=g)


def _parallelize(model: nn.Module, mesh: Any) -> None:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {k: styles[v]() for k, v in TP_PLAN.items()}
    if isinstance(model[0], nn.Embedding):  # sharded by vocabulary rows
        plan["0"] = RowwiseParallel(input_layouts=Replicate())
    parallelize_module(model, mesh, plan)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _build(mode: str, order: str, tp_mesh: Any, dp_mesh: Any, norm: bool
           ) -> tuple[nn.Module, torch.optim.Optimizer]:
    import ampkit
    import ampkit.fsdp

    level, kwargs, _ = MODES[mode]
    model = _model(norm)
    if order == "initialize_first":  # the documented order
        model = ampkit.initialize(model, level=level, dtype=BF16, **kwargs)
        _parallelize(model, tp_mesh)
    else:  # tensor parallelism first
        _parallelize(model, tp_mesh)
        if dp_mesh is None:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            return ampkit.initialize(model, opt, level=level, dtype=BF16, **kwargs)
        model = ampkit.initialize(model, level=level, dtype=BF16, **kwargs)
    if dp_mesh is not None:
        ampkit.fsdp.fully_shard(model, mesh=dp_mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, ampkit.fsdp.prepare_optimizer(model, opt)


def _train(mode: str, order: str, tp_mesh: Any, dp_mesh: Any, part: int, norm: bool
           ) -> dict[str, Any]:
    model, opt = _build(mode, order, tp_mesh, dp_mesh, norm)
    for step in range(STEPS):
        x, y = _batch(step, part, norm)
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x).float(), y).backward()
        opt.step()
    return {
        "dtypes": {n: (p.dtype, _local(p).dtype) for n, p in model.named_parameters()},
        "state": {n: {k: _local(v).dtype for k, v in opt.state[p].items()
                      if isinstance(v, torch.Tensor) and v.dim() > 0}
                  for n, p in model.named_parameters()},
        "params": {n: _full(p) for n, p in model.named_parameters()},
    }


def _scenario(mode: str, order: str, tp_mesh: Any, dp_mesh: Any, part: int,
              norm: bool = True) -> dict[str, Any]:
    try:
        return _train(mode, order, tp_mesh, dp_mesh, part, norm)
    except Exception as error:  # a failing scenario, not a failing spawn
        return {"error": f"{type(error).__name__}: {error}"}


def _fsdp_before_initialize(mesh: Any) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    import ampkit

    model = _model()
    _parallelize(model, mesh["tp"])
    fully_shard(model, mesh=mesh["dp"])
    try:
        ampkit.initialize(model, level="O3", dtype=BF16)
    except Exception as error:
        return {"raised": type(error).__name__, "message": str(error)}
    return {"raised": None, "message": ""}


def _worker_tp(rank: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    warnings.simplefilter("ignore")
    mesh = init_device_mesh("cpu", (2,))
    results = {}
    for mode in MODES:
        for order in ("initialize_first", "tp_first"):
            results[mode, order] = _scenario(mode, order, mesh, None, 0)
            dist.barrier()
    try:
        results["attributes"] = _attributes(mesh)
    except Exception as error:
        results["attributes"] = {"error": f"{type(error).__name__}: {error}"}
    dist.barrier()
    return results


def _worker_2d(rank: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    warnings.simplefilter("ignore")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    part = mesh.get_local_rank("dp")  # each dp replica trains on its own half
    results: dict[Any, Any] = {}
    for mode in ("O2", "O3", "pure_stochastic"):
        for order in ("initialize_first", "tp_first"):
            results[mode, order] = _scenario(mode, order, mesh["tp"], mesh["dp"], part)
            dist.barrier()
    # an embedding for a norm: every parameter a TP DTensor, and nothing (no input
    # cast) meets a local shard the conversion missed, which then trains in fp32
    for order in ("initialize_first", "tp_first"):
        results["O3_embedding", order] = _scenario("O3", order, mesh["tp"], mesh["dp"],
                                                 part, norm=False)
        dist.barrier()
    results["fsdp_before_initialize"] = _fsdp_before_initialize(mesh)
    dist.barrier()
    return results


@pytest.fixture(scope="module")
def tp_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(tmp_path_factory.mktemp("tp"), _worker_tp, timeout=240.0)


@pytest.fixture(scope="module")
def ranks_2d(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(tmp_path_factory.mktemp("tp2d"), _worker_2d, timeout=300.0, world=4)


def _check_order(ranks: list[dict[str, Any]], mode: str) -> None:
    trains_in = MODES[mode.removesuffix("_embedding")][2]
    for rank, results in enumerate(ranks):
        first, tp_first = results[mode, "initialize_first"], results[mode, "tp_first"]
        assert "error" not in first, first["error"]
        assert "error" not in tp_first, f"rank {rank}: {tp_first['error']}"
        for name, (reported, local) in tp_first["dtypes"].items():
            assert local == reported, (
                f"rank {rank}: {name} reports {reported} but its local shard is {local}")
            assert reported == first["dtypes"][name][0], name
        linear = {n: d for n, d in tp_first["dtypes"].items() if not n.startswith("0.")}
        assert {d for d, _ in linear.values()} == {trains_in}, linear
        assert tp_first["state"] == first["state"], (
            f"rank {rank}: optimizer state dtypes {tp_first['state']} differ from "
            f"initialize first's {first['state']}")
        differ = [n for n, p in tp_first["params"].items()
                  if not torch.equal(p, first["params"][n])]
        assert not differ, (f"rank {rank}: {mode} after parallelize_module differs from "
                            f"initialize first in {differ}")


@pytest.mark.parametrize("mode", list(MODES))
def test_initialize_after_tensor_parallel(tp_ranks: list[dict[str, Any]], mode: str) -> None:
    _check_order(tp_ranks, mode)


@pytest.mark.parametrize("mode", ["O2", "O3", "pure_stochastic", "O3_embedding"])
def test_initialize_after_tensor_parallel_then_fsdp2(ranks_2d: list[dict[str, Any]],
                                                      mode: str) -> None:
    _check_order(ranks_2d, mode)
    state = ranks_2d[0][mode, "tp_first"]["state"]
    trains_in = MODES[mode.removesuffix("_embedding")][2]
    assert state["1.weight"]["exp_avg"] == trains_in, state


def test_fully_shard_before_initialize_refused_with_tensor_parallel(
        ranks_2d: list[dict[str, Any]]) -> None:
    for results in ranks_2d:
        got = results["fsdp_before_initialize"]
        assert got["raised"] == "RuntimeError", got
        assert "ampkit.initialize" in got["message"], got["message"]
        assert "fully_shard" in got["message"], got["message"]


def test_initialize_after_tensor_parallel_keeps_parameter_attributes(
        tp_ranks: list[dict[str, Any]]) -> None:
    """The converted DTensor stays the same Python object, with what the user set on it
    (a weight-decay flag), and a gradient it already had, converted."""
    for results in tp_ranks:
        assert results["attributes"] == {"same_object": True, "flag": True,
                                         "grad": (BF16, BF16), "local": BF16}, results


def _attributes(mesh: Any) -> dict[str, Any]:
    import ampkit

    model = _model()
    _parallelize(model, mesh)
    weight = model[1].weight
    weight.no_weight_decay = True
    model(torch.ones(2, 8)).sum().backward()
    ampkit.initialize(model, level="O3", dtype=BF16)
    return {"same_object": model[1].weight is weight,
            "flag": getattr(model[1].weight, "no_weight_decay", False),
            "grad": (weight.grad.dtype, _local(weight.grad).dtype),
            "local": _local(weight).dtype}
