"""Run by tests/integrations/test_integration_spawn.py in a process of its own: a
Lightning ``ddp_spawn`` fit on 2 CPU processes with ``AmpkitPrecision``, which Lightning
pickles into each spawned process. Prints one JSON line: what the run saw."""

from __future__ import annotations

import datetime
import json
import sys

import lightning.pytorch as pl
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.strategies import DDPStrategy

from ampkit.integrations.lightning import AmpkitPrecision


class AutocastCheckingModel(BoringModel):
    """BoringModel whose steps check the plugin's region is on, as Lightning's own
    models/test_amp.py::AMPTestModel does."""

    def step(self, batch: torch.Tensor) -> torch.Tensor:
        assert self.trainer.precision_plugin.device == "cpu"
        assert torch.is_autocast_enabled("cpu")
        output = self(batch)
        assert output.dtype == torch.bfloat16, output.dtype
        return self.loss(output)


def main(out: str) -> None:
    torch.manual_seed(0)
    plugin = AmpkitPrecision("O1", torch.bfloat16, cast_model_outputs=torch.bfloat16,
                             custom_black_list={"softmax"})
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, plugins=[plugin], max_epochs=2,
        strategy=DDPStrategy(start_method="spawn", process_group_backend="gloo",
                             timeout=datetime.timedelta(seconds=60)),
        limit_train_batches=2, limit_val_batches=1, logger=False,
        enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False)
    model = AutocastCheckingModel()
    before = model.layer.weight.detach().clone()
    trainer.fit(model)
    after = model.layer.weight.detach()  # rank 0's trained weights, sent back
    with open(out, "w") as f:
        json.dump({"finished": trainer.state.finished,
                   "changed": not torch.equal(before, after),
                   "finite": bool(torch.isfinite(after).all()),
                   "plugin": repr(trainer.precision_plugin)}, f)


if __name__ == "__main__":
    main(sys.argv[1])
