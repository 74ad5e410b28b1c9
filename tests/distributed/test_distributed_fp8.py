"""Two CPU processes over gloo: fp8 Linears (``initialize(fp8=...)``) under FSDP2, with
torchao's float8 all-gather (``Float8LinearConfig(enable_fsdp_float8_all_gather=True)``).

torchao 0.18 supports it on CPU with gloo (checked here, issue 27): the weights of the
fp8 layers become torchao's ``WeightWithDynamicFloat8CastTensor``, each rank casts its
shard to fp8 with a scale agreed over the ranks (the amax is all-reduced), and
``fully_shard`` all-gathers fp8 bytes. One spawn runs, per rank, ``STEPS`` SGD steps
of the same model twice: fp8 with the all-gather in fp32 (the default config) and fp8
with the all-gather in fp8. Tensorwise dynamic scaling with a global amax gives each
layer the same fp8 weight either way, so the two runs agree exactly; the all-gather
inputs of the fp8 layers are a quarter of the weight's fp32 bytes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from distributed_harness import WORLD, run_ranks

import ampkit

pytestmark = pytest.mark.distributed
pytest.importorskip("torchao.float8")

STEPS = 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 32),
                         nn.Linear(32, 16))


def _run(rank: int, fp8_gather: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig(enable_fsdp_float8_all_gather=fp8_gather)
    model = ampkit.initialize(_model(), level="O2", dtype=torch.bfloat16, fp8=config)
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gathered: list[tuple[str, int]] = []
    # what fully_shard all-gathers with: all_gather_single on torch 2.13,
    # all_gather_into_tensor before (both take the output first, then the input)
    name = "all_gather_single" if hasattr(dist, "all_gather_single") \
        else "all_gather_into_tensor"
    original = getattr(dist, name)

    def spy(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        gathered.append((str(input.dtype), input.numel() * input.element_size()))
        return original(output, input, *args, **kwargs)

    setattr(dist, name, spy)
    losses = []
    try:
        for step in range(STEPS):
            gen = torch.Generator().manual_seed(100 * step + rank)
            x = torch.randn(8, 16, generator=gen)
            loss = model(x).float().pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    finally:
        setattr(dist, name, original)
    return {"losses": losses, "gathered": gathered,
            "weights": [type(layer.weight._local_tensor).__name__ for layer in model],
            "params": [p.full_tensor().detach() for p in model.parameters()]}


def _worker(rank: int) -> dict[str, Any]:
    return {"fp32": _run(rank, False), "fp8": _run(rank, True)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(tmp_path_factory.mktemp("fp8_fsdp"), _worker, timeout=240)


def test_fp8_layers_weights_are_torchaos_float8_all_gather_tensors(ranks):
    for result in ranks:
        assert result["fp8"]["weights"] == [
            "Tensor", "WeightWithDynamicFloat8CastTensor",
            "WeightWithDynamicFloat8CastTensor", "Tensor"]
        assert result["fp32"]["weights"] == ["Tensor"] * 4


def test_fp8_all_gather_moves_fp8_bytes_for_the_fp8_layers(ranks):
    # per rank and layer 1: a 32x32 weight shard (512 values) and a 32-bias shard (16)
    shard_weight, shard_bias = 32 * 32 // WORLD, 32 // WORLD
    for result in ranks:
        plain = {b for _, b in result["fp32"]["gathered"]}
        fp8 = {b for _, b in result["fp8"]["gathered"]}
        assert (shard_weight + shard_bias) * 4 in plain  # fp32 weight and bias
        assert shard_weight * 1 + shard_bias * 4 in fp8  # fp8 weight, fp32 bias
        assert (shard_weight + shard_bias) * 4 not in fp8


def test_fp8_all_gather_trains_exactly_like_the_fp32_all_gather(ranks):
    for result in ranks:
        assert result["fp8"]["losses"] == result["fp32"]["losses"]
        for a, b in zip(result["fp8"]["params"], result["fp32"]["params"]):
            assert torch.equal(a, b)
    assert ranks[0]["fp8"]["losses"] != ranks[1]["fp8"]["losses"]  # each its own data
