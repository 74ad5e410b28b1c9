"""ampkit.integrations.transformers: AmpkitTrainer with a tiny GPT-2 built from a config
(no downloads: HF_HUB_OFFLINE=1), on CPU.

Oracles: Trainer's own ``bf16=True`` (accelerate's torch.autocast) for O1 with the
default policy; an uninterrupted run for ``resume_from_checkpoint``; the saved fp32
masters for the save_model/from_pretrained round trip.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from ampkit.conversion import get_conversion  # noqa: E402
from ampkit.integrations.transformers import AmpkitTrainer  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning",
                                        "ignore::FutureWarning")

_BASE = torch.randint(0, 16, (8,), generator=torch.Generator().manual_seed(0))
DATA = [{"input_ids": torch.roll(_BASE, i % 8).repeat(2),
         "labels": torch.roll(_BASE, i % 8).repeat(2)} for i in range(32)]


def _gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=16,
                                     n_positions=16, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def _args(out, **kwargs) -> transformers.TrainingArguments:
    defaults = {"use_cpu": True, "report_to": [], "per_device_train_batch_size": 8,
                "per_device_eval_batch_size": 16, "learning_rate": 1e-2, "max_steps": 8,
                "save_strategy": "no", "logging_steps": 1, "disable_tqdm": True,
                "max_grad_norm": 1.0, "seed": 0}
    return transformers.TrainingArguments(str(out), **{**defaults, **kwargs})


def _losses(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_o2_bf16_trains_evaluates_and_round_trips(tmp_path) -> None:
    model = _gpt2()
    trainer = AmpkitTrainer(model=model, args=_args(tmp_path, gradient_accumulation_steps=2,
                                                    max_steps=12),
                            train_dataset=DATA, eval_dataset=DATA[:16], level="O2",
                            dtype=torch.bfloat16, custom_black_list={"softmax"})
    attn = model.transformer.h[0].attn.c_attn
    assert attn.weight.dtype == torch.float32  # O2: the fp32 truth, bf16 copies on use
    assert get_conversion(model).param_compute_dtype is torch.bfloat16  # converted
    assert model.transformer.h[0].ln_1.weight.dtype == torch.float32
    before = trainer.evaluate()["eval_loss"]
    seen = {}

    def record(_module, _inputs, out) -> None:
        seen.setdefault("attn", out.dtype)

    attn.register_forward_hook(record)
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    assert after < 0.7 * before
    assert seen["attn"] == torch.bfloat16
    with torch.no_grad():
        assert model(DATA[0]["input_ids"][None]).logits.dtype == torch.float32
    masters = {p.dtype for g in trainer.optimizer.param_groups for p in g["params"]}
    assert masters == {torch.float32}
    assert all(entry["grad_norm"] > 0 for entry in trainer.state.log_history
               if "grad_norm" in entry)

    trainer.save_model(tmp_path / "saved")
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "saved")
    state = model.state_dict()  # O2 reports the fp32 masters
    for name, value in loaded.state_dict().items():
        assert value.dtype == torch.float32 and torch.equal(value, state[name]), name


def test_o1_matches_trainers_own_bf16(tmp_path) -> None:
    # no clipping: ampkit clips over the optimizer's parameter order, Trainer over the
    # model's, and the norms' last bits differ with the summation order
    ours = AmpkitTrainer(model=_gpt2(), args=_args(tmp_path / "a", max_steps=4,
                                                   max_grad_norm=0.0),
                         train_dataset=DATA, level="O1", dtype=torch.bfloat16)
    ours.train()
    native = transformers.Trainer(model=_gpt2(), args=_args(tmp_path / "b", max_steps=4,
                                                            max_grad_norm=0.0, bf16=True),
                                  train_dataset=DATA)
    native.train()
    assert _losses(ours) == _losses(native)
    for a, b in zip(ours.model.parameters(), native.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_fp16_resume_from_checkpoint_continues_exactly(tmp_path) -> None:
    options = {"level": "O2", "dtype": torch.float16, "init_scale": 2.0 ** 20,
               "growth_interval": 2}
    args = _args(tmp_path / "run", max_steps=8, save_strategy="steps", save_steps=4,
                 gradient_accumulation_steps=2)
    whole = AmpkitTrainer(model=_gpt2(), args=args, train_dataset=DATA, **options)
    whole.train()
    scaler = whole.accelerator.scaler
    assert scaler.skipped_steps > 0  # the first steps overflowed and were skipped
    # the LR scheduler only moved on the steps that were taken
    assert whole.lr_scheduler.last_epoch == whole.state.global_step - scaler.skipped_steps

    resumed = AmpkitTrainer(model=_gpt2(), args=args, train_dataset=DATA, **options)
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-4"))
    assert _losses(resumed) == _losses(whole)  # the first 4 come from the checkpoint
    assert resumed.accelerator.scaler.state_dict() == scaler.state_dict()
    for (name, a), b in zip(resumed.model.state_dict().items(),
                            whole.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("flag", ["bf16", "fp16_full_eval"])
def test_contradicting_precision_flags_are_refused(tmp_path, flag) -> None:
    # --bf16 against a float16 config, and a whole-model cast for evaluation
    args = _args(tmp_path, **{flag: True}) if flag == "bf16" else _args(tmp_path)
    if flag != "bf16":
        args.fp16_full_eval = True
    with pytest.raises(ValueError, match=f"TrainingArguments\\({flag}=True\\)"):
        AmpkitTrainer(model=_gpt2(), args=args, train_dataset=DATA, level="O2",
                      dtype=torch.float16)


def test_without_transformers_the_import_error_names_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.delitem(sys.modules, "ampkit.integrations.transformers")
    with pytest.raises(ImportError, match=r"pip install 'ampkit\[transformers\]'"):
        importlib.import_module("ampkit.integrations.transformers")


def test_pure_bf16_save_records_the_bf16_parameters_it_writes(tmp_path) -> None:
    # Only where the fp32 parameters are the truth does the trainer record float32 for
    # save_pretrained; pure bf16 writes bf16 parameters and must say so (it recorded
    # float32 while master_weights was compared by truthiness: "kahan" is truthy).
    model = _gpt2()
    trainer = AmpkitTrainer(model=model, args=_args(tmp_path, max_steps=2),
                            train_dataset=DATA, level="O2", dtype=torch.bfloat16,
                            master_weights="kahan", rounding_seed=0)
    trainer.train()
    trainer.save_model(tmp_path / "saved")
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "saved", dtype="auto")
    attn = "transformer.h.0.attn.c_attn.weight"
    assert model.state_dict()[attn].dtype == torch.bfloat16
    assert loaded.state_dict()[attn].dtype == torch.bfloat16
    assert torch.equal(loaded.state_dict()[attn], model.state_dict()[attn])
