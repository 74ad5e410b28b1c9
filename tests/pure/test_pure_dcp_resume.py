"""Resuming pure bf16 training through Distributed Checkpoint (``get_state_dict``,
``dcp.save``, ``dcp.load``, ``set_state_dict``), in one process (DCP needs no process
group for a checkpoint one process wrote; the two-rank runs are in
``tests/distributed/test_distributed_pure.py``).

* An O2 run's checkpoint (``master_weights=True``: an ordinary fp32 AdamW) cannot
  resume a pure optimizer: it has no ``rounding_step`` or ``rounding_seed``. torch's
  default planner says only ``Missing key in checkpoint state_dict: ...rounding_step``;
  ``ampkit.pure.PureLoadPlanner`` says why and what to do.
* What it says works: the model's state alone loads from the same checkpoint (the bf16
  parameters are the O2 run's fp32 weights cast by torch), and a fresh pure optimizer
  then trains bit for bit like one built over a model loaded with torch's own
  ``load_state_dict`` of the O2 model's ``state_dict``.
* A pure run's checkpoint loads through ``PureLoadPlanner`` as through torch's default
  planner: the resumed run ends bit for bit where the uninterrupted one did.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampkit

dcp = pytest.importorskip("torch.distributed.checkpoint")
from torch.distributed.checkpoint import DefaultLoadPlanner  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

BF16 = torch.bfloat16
MODES = ["stochastic", "kahan"]

pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled:UserWarning")


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g))
            for _ in range(n)]


def _train(model: nn.Module, opt: torch.optim.Optimizer,
           batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    dtype = model[0].weight.dtype
    for x, y in batches:
        opt.zero_grad()
        F.mse_loss(model(x.to(dtype)).float(), y).backward()
        opt.step()


def _o2_checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    """An O2 run (fp32 weights, an ordinary AdamW) trained 3 steps and saved by DCP;
    returns the model's state as saved."""
    model = _net(0)
    model, opt = ampkit.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                   level="O2", dtype=BF16)
    _train(model, opt, _batches(3))
    dcp.save(dict(zip(("model", "optim"), get_state_dict(model, opt))),
             checkpoint_id=str(folder))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _pure(mode: str, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _net(seed)
    return ampkit.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                             level="O2", dtype=BF16, master_weights=mode, rounding_seed=4)


def _load_error(state: dict, folder: Path, planner: DefaultLoadPlanner) -> str:
    with pytest.raises(CheckpointException) as caught:
        dcp.load(state, checkpoint_id=str(folder), planner=planner)
    (error, _), = caught.value.failures.values()  # one rank: one failure
    assert type(error) is RuntimeError  # the type torch's own missing-key error has
    return str(error)


@pytest.mark.parametrize("mode", MODES)
def test_resuming_pure_from_an_o2_checkpoint_says_why_and_the_way_across(
        tmp_path: Path, mode: str) -> None:
    from ampkit.pure import PureLoadPlanner

    _o2_checkpoint(tmp_path)
    model, opt = _pure(mode, seed=1)
    state = dict(zip(("model", "optim"), get_state_dict(model, opt)))
    # torch's default planner: the first missing key and nothing else
    bare = _load_error(state, tmp_path, DefaultLoadPlanner())
    assert bare.startswith("Missing key in checkpoint state_dict: optim.state.")
    assert "O2" not in bare and "model" not in bare
    message = _load_error(state, tmp_path, PureLoadPlanner())
    assert message.startswith("the checkpoint's optimizer state has no pure rounding "
                              "state: no 'rounding_step' and 'rounding_seed' (5 keys "
                              "missing, the first 'optim.state.0.weight.rounding_step')")
    for part in ("It was saved by an optimizer that is not pure", "O2 run's optimizer",
                 "ordinary fp32 one", "load the model's state alone",
                 "get_model_state_dict(model)", "set_model_state_dict",
                 "start the pure optimizer fresh"):
        assert part in message, part


@pytest.mark.parametrize("mode", MODES)
def test_the_way_across_the_model_alone_then_a_fresh_pure_optimizer(
        tmp_path: Path, mode: str) -> None:
    saved = _o2_checkpoint(tmp_path)
    model, _ = _pure(mode, seed=1)  # other weights: all must come from the checkpoint
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=str(tmp_path))
    set_model_state_dict(model, state["model"])
    loaded = {k: v.clone() for k, v in model.state_dict().items()}
    assert loaded.keys() == saved.keys()
    for name, value in loaded.items():
        assert torch.equal(value, saved[name].to(value.dtype)), name
    assert loaded["0.weight"].dtype is BF16 and saved["0.weight"].dtype is torch.float32

    # the fresh pure optimizer, built after the load as the message says
    opt = ampkit.pure.PureLowPrecisionOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2), mode, seed=4)
    # the twin: torch's own load_state_dict of the O2 model's state, no DCP
    twin, twin_opt = _pure(mode, seed=2)
    twin.load_state_dict(saved)
    batches = _batches(6)[3:]
    _train(model, opt, batches)
    _train(twin, twin_opt, batches)
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), name
    assert not torch.equal(model[0].weight, loaded["0.weight"])  # it trained
    assert opt.state[model[0].weight]["rounding_step"] == len(batches)


@pytest.mark.parametrize("mode", MODES)
def test_a_pure_checkpoint_resumes_exactly_through_the_pure_planner(
        tmp_path: Path, mode: str) -> None:
    from ampkit.pure import PureLoadPlanner

    batches = _batches(6)
    model, opt = _pure(mode, seed=0)
    _train(model, opt, batches[:3])
    dcp.save(dict(zip(("model", "optim"), get_state_dict(model, opt))),
             checkpoint_id=str(tmp_path))
    _train(model, opt, batches[3:])

    resumed, resumed_opt = _pure(mode, seed=5)
    for group in resumed_opt.param_groups:
        group["rounding_seed"] = 9  # the checkpoint's seed must win
    state = dict(zip(("model", "optim"), get_state_dict(resumed, resumed_opt)))
    dcp.load(state, checkpoint_id=str(tmp_path), planner=PureLoadPlanner())
    set_state_dict(resumed, resumed_opt, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    _train(resumed, resumed_opt, batches[3:])
    for (name, p), q in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name


def test_the_pure_planner_leaves_other_mismatches_and_partial_loads_to_torch(
        tmp_path: Path) -> None:
    from ampkit.pure import PureLoadPlanner

    plain = _net(0)  # a checkpoint of a model alone: no optimizer state to judge
    dcp.save({"model": get_model_state_dict(plain)}, checkpoint_id=str(tmp_path / "m"))
    model, opt = _pure("stochastic", seed=1)
    state = dict(zip(("model", "optim"), get_state_dict(model, opt)))
    message = _load_error(state, tmp_path / "m", PureLoadPlanner())
    assert message.startswith("Missing key in checkpoint state_dict: optim.")

    _o2_checkpoint(tmp_path / "o2")  # allow_partial_load keeps what the target had
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(tmp_path / "o2"),
                 planner=PureLoadPlanner(allow_partial_load=True))
    assert state["optim"]["param_groups"][0]["rounding_seed"] == 4
