"""Two CPU processes over gloo: fp8 layers (``initialize(fp8=...)``) under FSDP2, with
torchao's float8 all-gather (``Float8LinearConfig(enable_fsdp_float8_all_gather=True)``),
and under ampkit's own recipe (:func:`ampkit.fsdp.fully_shard`).

torchao 0.18 supports it on CPU with gloo (checked here): the weights of the
fp8 layers become torchao's ``WeightWithDynamicFloat8CastTensor``, each rank casts its
shard to fp8 with a scale agreed over the ranks (the amax is all-reduced), and
``fully_shard`` all-gathers fp8 bytes. One spawn runs, per rank, ``STEPS`` SGD steps
of the same model twice: fp8 with the all-gather in fp32 (the default config) and fp8
with the all-gather in fp8. Tensorwise dynamic scaling with a global amax gives each
layer the same fp8 weight either way, so the two runs agree exactly; the all-gather
inputs of the fp8 layers are a quarter of the weight's fp32 bytes.

The same spawn also trains, per rank, on data both ranks share (so that FSDP2's
averaged gradient is the one-process gradient, bit for bit), a model with an
``nn.Linear`` and a transformers ``Conv1D`` in fp8: once in one process (no sharding),
and through :func:`ampkit.fsdp.fully_shard` with the default config (fp32 all-gathers)
and with the fp8 all-gather. Both sharded runs must train exactly like the one-process
run: the recipe must never all-gather an fp8 layer's weight in bf16, which torchao
would then cast to fp8 (rounding twice).
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


def _twin_model() -> nn.Module:
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(1)
    # 0: first, 3: last (both bf16 at O2); 1: Conv1D (nf=32, nx=32), 2: Linear, both fp8
    return nn.Sequential(nn.Linear(16, 32), Conv1D(32, 32), nn.Linear(32, 32),
                         nn.Linear(32, 16))


def _twin_run(rank: int, shard: str) -> dict[str, Any]:
    """``STEPS`` SGD steps on data both ranks share: ``shard`` is ``"none"`` (one
    process), ``"recipe"`` (ampkit.fsdp.fully_shard, fp32 all-gathers of the fp8
    layers) or ``"recipe_fp8_gather"`` (the same, torchao's fp8 all-gather)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torchao.float8 import Float8LinearConfig

    import ampkit.fsdp

    config = Float8LinearConfig(enable_fsdp_float8_all_gather=shard == "recipe_fp8_gather")
    model = ampkit.initialize(_twin_model(), level="O2", dtype=torch.bfloat16, fp8=config)
    assert ampkit.fp8.get_fp8_plan(model).converted == ("1", "2")
    if shard != "none":
        # "1" a block of its own (an fp8 block), "2" in the model's group: both paths
        ampkit.fsdp.fully_shard(model, blocks=["0", "1"], mesh=init_device_mesh("cpu", (WORLD,)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gathered: list[tuple[str, tuple[int, ...]]] = []
    name = "all_gather_single" if hasattr(dist, "all_gather_single") \
        else "all_gather_into_tensor"
    original = getattr(dist, name)

    def spy(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        gathered.append((str(input.dtype), input.numel()))
        return original(output, input, *args, **kwargs)

    setattr(dist, name, spy)
    losses = []
    try:
        for step in range(STEPS):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(7 + step))
            loss = model(x).float().pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    finally:
        setattr(dist, name, original)
    params = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    return {"losses": losses, "gathered": gathered,
            "params": [p.detach().clone() for p in params]}


def _worker(rank: int) -> dict[str, Any]:
    return {"fp32": _run(rank, False), "fp8": _run(rank, True),
            **{f"twin_{shard}": _twin_run(rank, shard)
               for shard in ("none", "recipe", "recipe_fp8_gather")}}


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


@pytest.mark.parametrize("shard", ["recipe", "recipe_fp8_gather"])
def test_ampkit_recipe_trains_fp8_layers_exactly_like_one_process(ranks, shard):
    # Old main all-gathered the fp8 layers in bf16 under the recipe's O2 policy, and
    # torchao cast those bf16 values to fp8: the loss moved at the first step.
    for result in ranks:
        one, sharded = result["twin_none"], result[f"twin_{shard}"]
        assert sharded["losses"] == one["losses"]
        assert len(sharded["params"]) == len(one["params"]) == 8
        for a, b in zip(sharded["params"], one["params"]):
            assert a.dtype == b.dtype == torch.float32
            assert torch.equal(a, b)
    assert ranks[0]["twin_recipe"]["losses"] == ranks[1]["twin_recipe"]["losses"]


def test_ampkit_recipe_gathers_fp8_layers_in_fp32_or_fp8_never_bf16(ranks):
    # per rank, the fp8 layers' shards: a (32, 32) weight's half (512 values) and a 32-bias
    # half (16); the bf16 all-gathers are the first and last layers' only
    fp8_layer_sizes = {512 + 16, 512, 16}
    for result in ranks:
        fp32 = result["twin_recipe"]["gathered"]
        fp8 = result["twin_recipe_fp8_gather"]["gathered"]
        assert not [g for g in fp32 + fp8 if g[0] == "torch.bfloat16"
                    and g[1] in fp8_layer_sizes]
        assert ("torch.float32", 512 + 16) in fp32  # weight and bias, one fp32 group
        assert {g[0] for g in fp8} >= {"torch.bfloat16", "torch.uint8"}  # fp8 as bytes
