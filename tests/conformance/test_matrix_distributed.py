"""The conformance matrix's distributed cells: DDP and FSDP2 on 2 gloo CPU ranks
(``tests/distributed_harness.py``), ``test_distributed_cell[<arch>-<mode>-<machinery>]``.

One spawn runs every scenario of the run (a module fixture); each cell reads its own.

* ``ddp``: ``initialize`` then ``DistributedDataParallel``; each rank trains on its half
  of every global batch. Bit for bit like the one-process twin, which steps once per
  global batch on both halves, each loss halved (DDP averages over the 2 ranks).
* ``fsdp2_dcp_resume``: ``initialize`` then ``ampkit.fsdp.fully_shard`` then the
  optimizer; two steps, a Distributed Checkpoint, two more. A run resumed from the
  checkpoint into a model built from other weights ends bit for bit where the
  uninterrupted one did, and that one bit for bit where the twin does.
* ``wrong_order_*``: each wrong order of wrapping, converting and building the optimizer
  is an error at ``initialize`` or at the first step, never a run that trains wrongly.
* ``tp_order``: tensor parallelism on the MLPs (``ColwiseParallel`` gate/up,
  ``RowwiseParallel`` down) before ``initialize`` and after it. Every parameter's
  local shard has the dtype the parameter reports, and four steps on the same batches
  end bit for bit alike in both orders.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import conformance_cells as C
import pytest
import torch
import torch.nn as nn
from distributed_harness import WORLD, run_ranks

pytestmark = pytest.mark.distributed
STEPS, HALF = 4, 2

TRAINING = [(a, m, mach) for a in ("gpt2", "cnn_batchnorm", "tied_embeddings")
            for m, mach in (("O2_bf16", "ddp"), ("pure_bf16_stochastic", "ddp"),
                            ("fp8_tensorwise", "ddp"), ("O2_bf16", "fsdp2_dcp_resume"),
                            ("fp8_tensorwise", "fsdp2_dcp_resume"))]
WRONG_ORDERS = [("gpt2", "pure_bf16_stochastic", "wrong_order_ddp_then_initialize"),
                ("gpt2", "pure_bf16_stochastic", "wrong_order_fsdp2_optimizer_before_sharding"),
                ("gpt2", "pure_bf16_kahan", "wrong_order_fsdp2_plain_optimizer_after_sharding"),
                ("gpt2", "O2_bf16", "wrong_order_fsdp2_optimizer_before_sharding"),
                ("gpt2", "O2_bf16", "wrong_order_fsdp2_before_initialize")]
TP_ORDERS = [("llama", m, "tp_order")
             for m in ("O2_bf16", "O3_bf16", "pure_bf16_stochastic")]
SUBSET = {("gpt2", "O2_bf16", "ddp"), ("gpt2", "O2_bf16", "fsdp2_dcp_resume"),
          ("gpt2", "pure_bf16_stochastic", "wrong_order_fsdp2_optimizer_before_sharding"),
          ("llama", "O3_bf16", "tp_order")}


def global_batch(arch: str, step: int) -> dict[str, torch.Tensor]:
    """Two of the architecture's batches side by side: each rank gets one whole batch
    (fp8's matmuls need 16 rows per rank)."""
    a, b = C.batch(arch, 2 * step), C.batch(arch, 2 * step + 1)
    return {k: torch.cat([a[k], b[k]]) for k in a}


def half(data: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    return {k: v.chunk(WORLD)[rank] for k, v in data.items()}


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [_full(p) for p in model.parameters()]


def _steps(arch: str, model: nn.Module, opt: torch.optim.Optimizer, rank: int,
           steps: range) -> None:
    for step in steps:
        opt.zero_grad(set_to_none=True)
        C.loss_of(arch, model, half(global_batch(arch, step), rank)).backward()
        opt.step()


def _ddp(arch: str, mode: str, rank: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    run = C.setup(arch, mode)
    _steps(arch, DistributedDataParallel(run.model), run.opt, rank, range(STEPS))
    return {"params": _params(run.model)}


def _sharded(arch: str, mode: str, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh

    import ampkit.fsdp

    model = C.fresh(arch)
    if seed:  # other weights, which the checkpoint must overwrite
        with torch.no_grad():
            for p in model.parameters():
                p.add_(seed)
    model = C.MODES[mode].setup(model, C.make_optimizer(model)).model
    ampkit.fsdp.fully_shard(model, mesh=init_device_mesh("cpu", (WORLD,)))
    return model, C.make_optimizer(model)  # after sharding, as the recipe says


def _fsdp2(arch: str, mode: str, rank: int, where: Path) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = _sharded(arch, mode, 0)
    _steps(arch, model, opt, rank, range(HALF))
    model_state, opt_state = get_state_dict(model, opt)
    dcp.save({"model": model_state, "opt": opt_state}, checkpoint_id=str(where))
    _steps(arch, model, opt, rank, range(HALF, STEPS))
    resumed, resumed_opt = _sharded(arch, mode, 1)
    model_state, opt_state = get_state_dict(resumed, resumed_opt)
    state = {"model": model_state, "opt": opt_state}
    dcp.load(state, checkpoint_id=str(where))
    set_state_dict(resumed, resumed_opt, model_state_dict=state["model"],
                   optim_state_dict=state["opt"])
    _steps(arch, resumed, resumed_opt, rank, range(HALF, STEPS))
    return {"params": _params(model), "resumed": _params(resumed)}


def _wrong_order(arch: str, mode: str, order: str, rank: int) -> dict[str, Any]:
    """Where the order failed (``initialize``, ``shard``, ``step``) and how, or that it
    trained; and whether any weight moved."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    import ampkit
    import ampkit.fsdp

    kwargs = {"O2_bf16": {}, "pure_bf16_stochastic": {"master_weights": "stochastic"},
              "pure_bf16_kahan": {"master_weights": "kahan"}}[mode]
    model = C.fresh(arch)
    before = _params(model)
    stage = "initialize"
    try:
        if order == "wrong_order_ddp_then_initialize":
            wrapped = DistributedDataParallel(model)
            opt = C.make_optimizer(model)
            model, opt = ampkit.initialize(model, opt, level="O2", dtype=torch.bfloat16,
                                           **kwargs)
            stage, trained = "step", wrapped
        elif order == "wrong_order_fsdp2_before_initialize":
            fully_shard(model, mesh=init_device_mesh("cpu", (WORLD,)))
            opt = C.make_optimizer(model)
            model, opt = ampkit.initialize(model, opt, level="O2", dtype=torch.bfloat16)
            stage, trained = "step", model
        else:
            opt = C.make_optimizer(model)
            model, opt = ampkit.initialize(model, opt, level="O2", dtype=torch.bfloat16,
                                           **kwargs)
            stage = "shard"
            ampkit.fsdp.fully_shard(model, mesh=init_device_mesh("cpu", (WORLD,)))
            if order == "wrong_order_fsdp2_plain_optimizer_after_sharding":
                opt = torch.optim.AdamW(model.parameters(), lr=C.LR)
            stage, trained = "step", model
        _steps(arch, trained, opt, rank, range(2))
    except Exception as error:  # the cell checks the stage and the message
        return {"raised": type(error).__name__, "stage": stage, "message": str(error),
                "moved": None}
    moved = sum(not torch.equal(a, b) for a, b in zip(before, _params(model)))
    return {"raised": None, "stage": "trained", "message": "", "moved": moved}


def _tp_order(arch: str, mode: str) -> dict[str, Any]:
    """Both orders of ``parallelize_module`` and the mode's set-up; what each trained
    to, and the parameters whose local shard disagrees with the dtype they report."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    import ampkit.fsdp

    mesh = init_device_mesh("cpu", (WORLD,))

    def parallelize(model: nn.Module) -> None:
        for layer in model.model.layers:
            parallelize_module(layer.mlp, mesh, {"gate_proj": ColwiseParallel(),
                                                 "up_proj": ColwiseParallel(),
                                                 "down_proj": RowwiseParallel()})

    out: dict[str, Any] = {}
    for order in ("initialize_first", "tp_first"):
        model = C.fresh(arch)
        if order == "tp_first":
            parallelize(model)
            run = C.MODES[mode].setup(model, C.make_optimizer(model))
            model, opt = run.model, run.opt
        else:
            model = C.MODES[mode].setup(model, C.make_optimizer(model)).model
            parallelize(model)
            opt = ampkit.fsdp.prepare_optimizer(model, C.make_optimizer(model))
        for step in range(STEPS):  # every rank the same batch: TP splits the layers
            opt.zero_grad(set_to_none=True)
            C.loss_of(arch, model, C.batch(arch, step)).backward()
            opt.step()
        local = {n: (p.dtype, (p.to_local() if hasattr(p, "to_local") else p).dtype)
                 for n, p in model.named_parameters()}
        out[order] = {"params": _params(model),
                      "mismatched": [n for n, (a, b) in local.items() if a != b],
                      "dtypes": sorted({str(a) for a, _ in local.values()})}
    return out


def _worker(rank: int, scenarios: list[tuple[str, str, str]], out_dir: str) -> dict[str, Any]:
    warnings.simplefilter("ignore")
    results: dict[str, Any] = {}
    for arch, mode, machinery in scenarios:
        key = f"{arch}-{mode}-{machinery}"
        try:
            if machinery == "ddp":
                results[key] = _ddp(arch, mode, rank)
            elif machinery == "fsdp2_dcp_resume":
                results[key] = _fsdp2(arch, mode, rank, Path(out_dir) / key)
            elif machinery == "tp_order":
                results[key] = _tp_order(arch, mode)
            else:
                results[key] = _wrong_order(arch, mode, machinery, rank)
        except Exception as error:  # a failing cell, not a failing spawn
            results[key] = {"error": f"{type(error).__name__}: {error}"}
        torch.distributed.barrier()
    return results


def _selected(config: pytest.Config) -> list[tuple[str, str, str]]:
    everything = config.getoption("--conformance-all")
    return [c for c in TRAINING + WRONG_ORDERS + TP_ORDERS if everything or c in SUBSET]


def _inapplicable(arch: str, mode: str, machinery: str) -> str | None:
    if C.MODES[mode].fp8 and not C.ARCHS[arch].fp8_layers:
        return f"{arch} has no Linear fp8 may convert"
    return None


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if metafunc.function.__name__ == "test_distributed_cell":
        cells = []
        for arch, mode, machinery in _selected(metafunc.config):
            why = _inapplicable(arch, mode, machinery)
            marks = [pytest.mark.skip(reason=f"inapplicable: {why}")] if why else []
            cells.append(pytest.param(arch, mode, machinery, marks=marks,
                                      id=f"{arch}-{mode}-{machinery}"))
        metafunc.parametrize(("arch", "mode", "machinery"), cells)


@pytest.fixture(scope="module")
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
          ) -> list[dict[str, Any]]:
    scenarios = [c for c in _selected(request.config) if not _inapplicable(*c)]
    out = tmp_path_factory.mktemp("conformance_gloo")
    return run_ranks(out, _worker, scenarios, str(out), timeout=600.0)


def _twin(arch: str, mode: str) -> list[torch.Tensor]:
    """One process, both halves of each global batch, each loss halved."""
    run = C.setup(arch, mode)
    for step in range(STEPS):
        run.opt.zero_grad(set_to_none=True)
        for rank in range(WORLD):
            (C.loss_of(arch, run.model, half(global_batch(arch, step), rank)) / WORLD
             ).backward()
        run.opt.step()
    return _params(run.model)


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[int]:
    """Indices of the parameters that differ (bit for bit)."""
    assert len(a) == len(b)
    return [i for i, (x, y) in enumerate(zip(a, b)) if not torch.equal(x, y)]


def test_distributed_cell(ranks: list[dict[str, Any]], arch: str, mode: str,
                          machinery: str) -> None:
    key = f"{arch}-{mode}-{machinery}"
    got = [r[key] for r in ranks]
    if machinery.startswith("wrong_order"):
        for r in got:
            assert "error" not in r, r["error"]
            assert r["raised"] is not None, (
                f"{machinery} in {mode} trained ({r['moved']} weights moved) instead of "
                "raising at initialize or at the first step")
            assert r["raised"] in ("RuntimeError", "ValueError", "TypeError"), r
            assert re.search(r"initialize|fully_shard|shard", r["message"]), (
                f"the error at {r['stage']} does not name the order: {r['message']!r}")
        return
    for r in got:
        assert "error" not in r, r["error"]
    if machinery == "tp_order":
        for r in got:
            for order in ("initialize_first", "tp_first"):
                assert not r[order]["mismatched"], (
                    f"{order}: local shards in another dtype than reported: "
                    f"{r[order]['mismatched']}")
            assert r["tp_first"]["dtypes"] == r["initialize_first"]["dtypes"], r
            differ = _same(r["tp_first"]["params"], r["initialize_first"]["params"])
            assert not differ, (f"{mode} with parallelize_module before initialize differs "
                                f"from initialize first in {len(differ)} parameters")
        return
    assert not _same(got[0]["params"], got[1]["params"]), "the ranks disagree"
    if machinery == "fsdp2_dcp_resume":
        assert not _same(got[0]["resumed"], got[0]["params"]), (
            "the run resumed from Distributed Checkpoint differs from the uninterrupted one")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        twin = _twin(arch, mode)
    differ = _same(got[0]["params"], twin)
    assert not differ, (f"{machinery} in {mode} differs from the one-process twin in "
                        f"{len(differ)} of {len(twin)} parameters")
