"""Run by tests/integrations/test_integration_spawn.py under ``accelerate launch`` on 2
CPU processes: each rank makes an ``AmpkitAccelerator`` with kwargs handlers, pickles it
and trains with the unpickled one, as a spawn launcher does. Writes one JSON file per rank.
"""

from __future__ import annotations

import json
import pickle
import sys

import torch
from accelerate.utils import DistributedDataParallelKwargs, GradScalerKwargs

from ampkit.integrations.accelerate import AmpkitAccelerator


def main(out: str) -> None:
    made = AmpkitAccelerator(level="O2", dtype="float16", cpu=True, kwargs_handlers=[
        DistributedDataParallelKwargs(bucket_cap_mb=15, find_unused_parameters=True),
        GradScalerKwargs(init_scale=1024.0, growth_factor=4.0, growth_interval=1)])
    accelerator = pickle.loads(pickle.dumps(made))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16),
                                torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = accelerator.prepare(model, opt)
    # the rank's share of the batches; DDP averages the gradients
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(accelerator.process_index))
    scales = []
    for _ in range(3):
        loss = model(x).float().pow(2).mean()
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        scales.append(accelerator.scaler.get_scale())
    weight = accelerator.unwrap_model(model)[0].weight
    with open(f"{out}.{accelerator.process_index}", "w") as f:
        json.dump({"same_settings": made._ampkit == accelerator._ampkit,
                   "distributed_type": str(accelerator.distributed_type.value),
                   "num_processes": accelerator.num_processes,
                   "bucket_cap_mb": model.bucket_bytes_cap // (1024 * 1024),
                   "find_unused_parameters": model.find_unused_parameters,
                   "scales": scales,
                   "weight": weight.detach().flatten().tolist()}, f)


if __name__ == "__main__":
    main(sys.argv[1])
