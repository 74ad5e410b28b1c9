"""ampkit.plan's exact rows: parameters, gradients and optimizer state per rank, to the
byte, for every mode under none, ddp and fsdp2 (stepping in backward included under
FSDP2; refused under DDP, as ampkit refuses it), against sizes computed here from the
model's shapes (FSDP2 shards dim 0 in ceil(rows / ranks) rows per rank, padding the
last ranks' shards; DDP keeps one flat bucket element per gradient element)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import ampkit
from ampkit.tools.plan import MODES

pytestmark = pytest.mark.filterwarnings("ignore")

WORLD = 7  # 48 and 16 rows do not divide by 7: the shards are padded

# the model's parameters (shape, is a norm's): the Linears are bfloat16 where the truth
# is low precision (O3, pure); the LayerNorm is bfloat16 at O3 only (the pure modes
# keep O2's fp32 norms)
SHAPES = [((48, 32), False), ((48,), False), ((48,), True), ((48,), True), ((48, 48), False),
          ((48,), False), ((16, 48), False), ((16,), False)]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(32, 48), nn.LayerNorm(48), nn.Linear(48, 48),
                                     nn.Linear(48, 16)])  # fp8 converts the middle one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def inputs() -> torch.Tensor:
    return torch.randn(16, 32)


PURE = {"pure-stochastic", "pure-kahan", "pure-stochastic+step-in-backward"}


def _elements(shape: tuple[int, ...], parallel: str) -> int:
    if parallel != "fsdp2":
        return math.prod(shape)
    rows = math.ceil(shape[0] / WORLD)  # rank 0's shard, as every rank's padded one
    return rows * math.prod(shape[1:])


def _element_size(mode: str, norm: bool) -> int:
    return 2 if mode == "O3" or (mode in PURE and not norm) else 4


def expected(mode: str, parallel: str) -> dict[str, int]:
    sizes = [_elements(shape, parallel) * _element_size(mode, norm) for shape, norm in SHAPES]
    params = sum(sizes)
    moments = 2 * params                          # exp_avg, exp_avg_sq in the param dtype
    if mode == "pure-kahan":                      # the compensation of each bf16 parameter
        moments += sum(size for size, (_, norm) in zip(sizes, SHAPES) if not norm)
    steps = 4 * len(SHAPES)                       # AdamW's float32 step counter each
    in_backward = mode.endswith("step-in-backward")
    return {"parameters": params, "gradients": 0 if in_backward else params,
            "optimizer_state": moments + steps,
            "layout_buffers": params if parallel == "ddp" else 0}


@pytest.fixture(scope="module")
def plans() -> dict[str, ampkit.tools.plan.Plan]:
    torch.manual_seed(0)
    return {parallel: ampkit.plan(Net, inputs, world_size=1 if parallel == "none" else WORLD,
                                  parallel=parallel)
            for parallel in ("none", "ddp", "fsdp2")}


@pytest.mark.parametrize("parallel", ["none", "ddp", "fsdp2"])
@pytest.mark.parametrize("mode", MODES)
def test_each_exact_row_equals_the_arithmetic_of_shapes_shards_and_dtypes(
        plans: dict[str, ampkit.tools.plan.Plan], parallel: str, mode: str) -> None:
    row = next(r for r in plans[parallel].rows if r["mode"] == mode)
    if mode.endswith("step-in-backward") and parallel == "ddp":
        # DDP averages after the gradient hooks: ampkit refuses stepping in backward
        # at the first hook, and the row follows the library and says so
        with pytest.raises(RuntimeError, match="step_in_backward") as refused:
            _real_ddp_refusal()
        assert row["note"] == f"refused: {' '.join(str(refused.value).split())}"
        assert row["peak"] is None
        return
    assert row["note"] is None, row["note"]
    assert {k: row[k] for k in ("parameters", "gradients", "optimizer_state",
                                "layout_buffers")} == expected(mode, parallel)
    assert row["peak"] >= row["parameters"] + row["optimizer_state"] + row["layout_buffers"]
    assert row["activations"] > 0


def _real_ddp_refusal() -> None:
    """What ampkit says when a real DistributedDataParallel (on a fake process group of
    several ranks: no communication is needed to be refused) holds parameters that
    step in backward: raised at the first gradient hook of the first backward."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("fake", rank=0, world_size=WORLD)
    try:
        net = Net()
        net, _ = ampkit.initialize(net, torch.optim.AdamW(net.parameters()), level="O2",
                                   dtype=torch.bfloat16, master_weights="stochastic",
                                   step_in_backward=True)
        ddp = DistributedDataParallel(net)  # alive through backward, as in training
        ddp(inputs()).float().sum().backward()
    finally:
        dist.destroy_process_group()


def test_fsdp2_with_tensor_parallelism_is_refused_naming_the_accepted_layouts() -> None:
    with pytest.raises(ValueError, match=r"parallel='fsdp2\+tp' is not supported yet") as no:
        ampkit.plan(Net, inputs, world_size=4, parallel="fsdp2+tp", modes=["O2"])
    assert all(f"'{layout}'" in str(no.value) for layout in ("none", "ddp", "fsdp2", "hsdp"))
