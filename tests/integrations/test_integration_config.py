"""The integrations configured by one ampkit.AmpConfig: from LightningCLI YAML, from
HfArgumentParser flags, from accelerate's environment; the config in checkpoints and
hyperparameters; the loss scale and skipped steps in the frameworks' logs (CPU).

Oracles: hand-built AmpConfig values for what the files and flags say, the scale
trajectory of a forced overflow (2**24 halves to 2**23 on the first step), and the
LR a StepLR reaches when it steps only on the steps that ran.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import warnings

import pytest
import torch
import torch.nn.functional as F

os.environ["HF_HUB_OFFLINE"] = "1"
pl = pytest.importorskip("lightning.pytorch")
pytest.importorskip("jsonargparse")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
yaml = pytest.importorskip("yaml")

from accelerate.tracking import GeneralTracker  # noqa: E402
from lightning.pytorch.cli import LightningCLI  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402

from ampkit import AmpConfig  # noqa: E402
from ampkit.integrations.accelerate import AmpkitAccelerator  # noqa: E402
from ampkit.integrations.lightning import AmpkitPrecision  # noqa: E402
from ampkit.integrations.transformers import AmpkitArguments, AmpkitTrainer  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning",
                                        "ignore::FutureWarning",
                                        "ignore:.*does not have many workers:UserWarning",
                                        "ignore:.*LeafSpec.*")

X = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
Y = X[:, :4].argmax(dim=1)
LR = 0.1


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.LayerNorm(32),
                                       torch.nn.ReLU(), torch.nn.Linear(32, 4))

    def training_step(self, batch, _):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=LR)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y),
                                           batch_size=8)


# -- Lightning --------------------------------------------------------------------------

_CLI_YAML = """\
trainer:
  accelerator: cpu
  logger: false
  enable_checkpointing: false
  plugins:
    - class_path: ampkit.integrations.lightning.AmpkitPrecision
      init_args:
"""


def test_lightning_cli_builds_the_plugin_from_yaml_with_lists(tmp_path) -> None:
    (tmp_path / "cli.yaml").write_text(_CLI_YAML + """\
        level: O2
        dtype: float16
        custom_black_list: [softmax, exp]
        custom_white_list:
          - add
        hysteresis: 2
""")
    cli = LightningCLI(Classifier, run=False, args=["--config", str(tmp_path / "cli.yaml")])
    plugin = cli.trainer.precision_plugin
    expected = AmpConfig(level="O2", dtype=torch.float16, hysteresis=2,
                         custom_black_list=["exp", "softmax"], custom_white_list=["add"])
    assert isinstance(plugin, AmpkitPrecision) and plugin.config == expected
    assert cli.trainer.precision == "16-mixed"
    # the same from a config file named in the YAML
    expected.to_file(tmp_path / "amp.yaml")
    (tmp_path / "cli.yaml").write_text(_CLI_YAML + f"        config: {tmp_path / 'amp.yaml'}\n")
    cli = LightningCLI(Classifier, run=False, args=["--config", str(tmp_path / "cli.yaml")])
    assert cli.trainer.precision_plugin.config == expected


def test_the_fp8_and_output_fields_reach_every_integration(tmp_path) -> None:
    # The same fields from LightningCLI YAML, HfArgumentParser flags, accelerate
    # keywords and a config file (whose True is not contradicted by a flag left at
    # its False default) make one config, which then converts the model.
    pytest.importorskip("torchao.float8")
    expected = AmpConfig(level="O2", dtype="bfloat16", fp8="tensorwise",
                         fp8_exclude_modules=["1"], fp8_first_last=True,
                         cast_model_outputs=torch.bfloat16)
    (tmp_path / "cli.yaml").write_text(_CLI_YAML + """\
        level: O2
        dtype: bfloat16
        fp8: tensorwise
        fp8_exclude_modules: ["1"]
        fp8_first_last: true
        cast_model_outputs: bfloat16
""")
    cli = LightningCLI(Classifier, run=False, args=["--config", str(tmp_path / "cli.yaml")])
    assert cli.trainer.precision_plugin.config == expected
    (amp,) = transformers.HfArgumentParser(AmpkitArguments).parse_args_into_dataclasses([
        "--ampkit_level", "O2", "--ampkit_dtype", "bfloat16", "--ampkit_fp8", "tensorwise",
        "--ampkit_fp8_exclude_modules", "1", "--ampkit_fp8_first_last",
        "--ampkit_cast_model_outputs", "bfloat16"])
    assert amp.to_config() == expected
    accelerator = AmpkitAccelerator(level="O2", dtype="bfloat16", cpu=True, fp8="tensorwise",
                                    fp8_exclude_modules=["1"], fp8_first_last=True,
                                    cast_model_outputs="bf16")
    assert accelerator.ampkit_config == expected
    expected.to_file(tmp_path / "amp.json")
    assert AmpkitArguments(ampkit_config=str(tmp_path / "amp.json")).to_config() == expected
    plugin = AmpkitPrecision(config=str(tmp_path / "amp.json"))
    assert plugin.config == expected
    with pytest.raises(ValueError, match=r"^AmpkitPrecision: cast_model_outputs=float32 "
                                         r"contradicts the config's cast_model_outputs="
                                         r"bfloat16; give it once$"):
        AmpkitPrecision(config=expected, cast_model_outputs=torch.float32)
    torch.manual_seed(0)
    net = plugin.convert_module(torch.nn.Sequential(*[torch.nn.Linear(16, 16)
                                                      for _ in range(3)]))
    assert [type(m).__name__ for m in net] == ["Float8Linear", "Linear", "Float8Linear"]
    assert net(torch.randn(4, 16)).dtype is torch.bfloat16  # O2 alone: float32


def test_compile_step_reaches_every_entry_point(tmp_path) -> None:
    # one field, the same value from the command line, LightningCLI YAML, the Hugging
    # Face flags, accelerate's keywords and a config file; refused without pure weights
    import argparse

    from ampkit.tools.cli.args import add_config_options, config_from_args

    expected = AmpConfig(level="O2", dtype="bfloat16", master_weights="kahan",
                         compile_step=True)
    parser = argparse.ArgumentParser()
    add_config_options(parser)
    args = parser.parse_args(["--level", "O2", "--dtype", "bf16", "--master-weights",
                              "kahan", "--compile-step"])
    assert config_from_args(args) == expected
    (tmp_path / "cli.yaml").write_text(_CLI_YAML + """\
        level: O2
        dtype: bfloat16
        master_weights: kahan
        compile_step: true
""")
    cli = LightningCLI(Classifier, run=False, args=["--config", str(tmp_path / "cli.yaml")])
    assert cli.trainer.precision_plugin.config == expected
    (amp,) = transformers.HfArgumentParser(AmpkitArguments).parse_args_into_dataclasses([
        "--ampkit_level", "O2", "--ampkit_dtype", "bfloat16", "--ampkit_master_weights",
        "kahan", "--ampkit_compile_step"])
    assert amp.to_config() == expected
    accelerator = AmpkitAccelerator(level="O2", dtype="bfloat16", cpu=True,
                                    master_weights="kahan", compile_step=True)
    assert accelerator.ampkit_config == expected
    expected.to_file(tmp_path / "amp.json")
    assert AmpkitPrecision(config=str(tmp_path / "amp.json")).config == expected
    with pytest.raises(ValueError, match=r"compile_step=True compiles the pure bfloat16 "
                                         r"optimizer step"):
        AmpkitPrecision(level="O2", dtype="bfloat16", compile_step=True)


_SPELLINGS = [
    ("level", "O2", "O2"), ("level", "o2", "O2"), ("level", "o1", "O1"),
    ("dtype", "bf16", torch.bfloat16), ("dtype", "BF16", torch.bfloat16),
    ("dtype", "bfloat16", torch.bfloat16), ("dtype", "BFloat16", torch.bfloat16),
    ("dtype", "torch.bfloat16", torch.bfloat16), ("dtype", "fp16", torch.float16),
    ("dtype", "FP16", torch.float16), ("dtype", "half", torch.float16),
    ("dtype", "float16", torch.float16),
    ("fp8", "tensorwise", "tensorwise"), ("fp8", "RowWise", "rowwise"),
]
# each setting's flag on the ampkit command line (ampkit compare)
_CLI_FLAGS = {"level": "--precision", "dtype": "--dtype", "fp8": "--fp8"}


@pytest.mark.parametrize("field,spelling,expected", _SPELLINGS,
                         ids=[f"{f}={s}" for f, s, _ in _SPELLINGS])
def test_every_entry_point_takes_the_same_spellings(tmp_path, field, spelling,
                                                    expected) -> None:
    from ampkit.tools.cli import build_parser

    # 1. the ampkit command line
    cli_args = build_parser().parse_args(["compare", "m:f", "--inputs", "m:g",
                                          _CLI_FLAGS[field], spelling])
    assert getattr(cli_args, "precision" if field == "level" else field) == expected
    # 2. AmpConfig (and so initialize's config= and every config file)
    assert getattr(AmpConfig(**{field: spelling}), field) == expected
    # 3. the Hugging Face flags
    (amp,) = transformers.HfArgumentParser(AmpkitArguments).parse_args_into_dataclasses(
        [f"--ampkit_{field}", spelling])
    assert getattr(amp.to_config(), field) == expected
    # 4. Lightning's parameters, as LightningCLI reads them from YAML
    (tmp_path / "cli.yaml").write_text(_CLI_YAML + f"        {field}: '{spelling}'\n")
    cli = LightningCLI(Classifier, run=False, args=["--config", str(tmp_path / "cli.yaml")])
    assert getattr(cli.trainer.precision_plugin.config, field) == expected


def test_a_bad_hf_flag_is_refused_when_the_flags_are_parsed() -> None:
    parser = transformers.HfArgumentParser(AmpkitArguments)
    # each error names the flag given (the field's own check words it)
    with pytest.raises(ValueError, match=r"AmpkitArguments: --ampkit_dtype must be "
                                         r"torch.float16 or torch.bfloat16 .*got 'fp32'"):
        parser.parse_args_into_dataclasses(["--ampkit_dtype", "fp32"])
    with pytest.raises(ValueError, match=r"AmpkitArguments: --ampkit_level must be one of "
                                         r"\['O0', 'O1', 'O2', 'O3'\], got 'O5'"):
        parser.parse_args_into_dataclasses(["--ampkit_level", "O5"])


def test_hf_help_says_each_default_once_and_documents_every_flag(capsys) -> None:
    with pytest.raises(SystemExit):
        transformers.HfArgumentParser(AmpkitArguments).parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert text.count("(default") == len(dataclasses.fields(AmpkitArguments))
    for f in dataclasses.fields(AmpkitArguments):
        # the entry after the flag's hyphenated alias: METAVAR, its help, its default
        entry = text[text.index("--" + f.name.replace("_", "-") + " "):]
        words = entry[:entry.index("(default")].split(" ", 2)[2]
        assert len(words) > 20, (f.name, words)  # every flag has a help of its own
    assert ("--ampkit_backoff_factor AMPKIT_BACKOFF_FACTOR, --ampkit-backoff-factor "
            "AMPKIT_BACKOFF_FACTOR GradScaler: the factor the scale shrinks by on an "
            "overflow (default: None)") in text
    assert "bfloat16|bf16 (any case)" in text


def test_a_plugin_parameter_that_contradicts_its_config_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"AmpkitPrecision: level='O3' contradicts the "
                                         r"config's level='O2'"):
        AmpkitPrecision(level="O3", config=AmpConfig(level="O2"))


def test_lightning_logs_scale_and_skips_keeps_the_scheduler_and_records_config(
        tmp_path) -> None:
    steps = 8
    plugin = AmpkitPrecision("O2", torch.float16, init_scale=2.0 ** 24)
    trainer = pl.Trainer(accelerator="cpu", max_steps=steps, plugins=[plugin],
                         logger=CSVLogger(tmp_path, name="run"), log_every_n_steps=1,
                         enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=tmp_path)
    model = Classifier()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.fit(model)
    assert not [w for w in seen if "lr_scheduler.step()" in str(w.message)]
    skipped = plugin.scaler.skipped_steps
    assert 0 < skipped < steps  # 2**24 overflows fp16 gradients at first
    # the scheduler stepped only on the steps that ran
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(
        LR * 0.5 ** (steps - skipped))
    log_dir = trainer.logger.log_dir
    with open(os.path.join(log_dir, "metrics.csv")) as f:
        rows = [r for r in csv.DictReader(f) if r.get("amp/loss_scale")]
    assert len(rows) == steps
    assert float(rows[0]["amp/loss_scale"]) == 2.0 ** 23  # the first step overflowed
    assert float(rows[0]["amp/skipped_steps"]) == 1.0
    assert float(rows[-1]["amp/skipped_steps"]) == skipped
    with open(os.path.join(log_dir, "hparams.yaml")) as f:
        hparams = yaml.safe_load(f)
    # the fields that are set, as real values; unset ones are left out (not 'None'/'')
    assert hparams == {"ampkit/level": "O2", "ampkit/dtype": "float16",
                       "ampkit/policy": "torch", "ampkit/init_scale": 2.0 ** 24,
                       "ampkit/log_skipped_steps": False, "ampkit/fp8_first_last": False,
                       "ampkit/step_in_backward": False, "ampkit/compile_step": False}
    ckpt_dir = os.path.join(log_dir, "checkpoints")
    ckpt = torch.load(os.path.join(ckpt_dir, os.listdir(ckpt_dir)[0]), weights_only=False)
    saved = ckpt["AmpkitPrecision"]["ampkit_config"]
    assert AmpConfig.from_dict(saved) == plugin.config


# -- Hugging Face -------------------------------------------------------------------------

_BASE = torch.randint(0, 16, (8,), generator=torch.Generator().manual_seed(0))
DATA = [{"input_ids": torch.roll(_BASE, i % 8).repeat(2),
         "labels": torch.roll(_BASE, i % 8).repeat(2)} for i in range(16)]


def _gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=16,
                                     n_positions=16, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def test_hf_argument_parser_builds_the_config_from_flags(tmp_path) -> None:
    parser = transformers.HfArgumentParser((transformers.TrainingArguments,
                                            AmpkitArguments))
    args, amp = parser.parse_args_into_dataclasses([
        "--output_dir", str(tmp_path), "--use_cpu", "--report_to", "none",
        "--max_steps", "4", "--logging_steps", "2", "--save_steps", "4",
        "--per_device_train_batch_size", "4", "--learning_rate", "0.01",
        "--ampkit_level", "O2", "--ampkit_dtype", "float16",
        "--ampkit_custom_black_list", "softmax", "exp", "--ampkit_hysteresis", "2"])
    expected = AmpConfig(level="O2", dtype="float16", custom_black_list=["softmax", "exp"],
                         hysteresis=2)
    assert amp.to_config() == expected
    trainer = AmpkitTrainer(model=_gpt2(), args=args, train_dataset=DATA, config=amp)
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert len(logs) == 2 and all("amp/loss_scale" in e and "amp/skipped_steps" in e
                                  for e in logs)
    assert logs[-1]["amp/loss_scale"] == trainer.accelerator.scaler.get_scale()
    checkpoint = tmp_path / "checkpoint-4"
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    recorded = state["stateful_callbacks"]["AmpkitConfigRecord"]["args"]["config"]
    assert AmpConfig.from_dict(recorded) == expected
    assert AmpConfig.from_file(checkpoint / "ampkit_config.json") == expected
    assert json.loads((checkpoint / "config.json").read_text())["ampkit"]["level"] == "O2"


def test_hf_bf16_flag_is_mapped_onto_the_config(tmp_path) -> None:
    args = transformers.TrainingArguments(str(tmp_path), bf16=True, use_cpu=True,
                                          report_to=[])
    trainer = AmpkitTrainer(model=_gpt2(), args=args, level="O2")
    assert trainer.ampkit_config.dtype is torch.bfloat16
    assert trainer.accelerator.state.mixed_precision == "no"  # accelerate's autocast off
    assert trainer.accelerator.mixed_precision == "bf16"  # what ampkit trains in
    assert args.bf16  # the caller's arguments are left as given


# -- accelerate ---------------------------------------------------------------------------

def test_accelerate_environment_is_mapped_or_refused(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    accelerator = AmpkitAccelerator(level="O2", cpu=True)
    assert accelerator.ampkit_config.dtype is torch.float16
    assert accelerator.scaler is not None and accelerator.state.mixed_precision == "no"
    assert accelerator.mixed_precision == "fp16"  # what ampkit trains in
    with pytest.raises(ValueError, match=r"ACCELERATE_MIXED_PRECISION='fp16' asks for "
                                         r"torch.float16, but the ampkit config says "
                                         r"dtype=torch.bfloat16"):
        AmpkitAccelerator(config=AmpConfig(level="O2", dtype="bfloat16"), cpu=True)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")
    with pytest.raises(ValueError, match="ACCELERATE_MIXED_PRECISION='fp8' has no ampkit "
                                         "meaning"):
        AmpkitAccelerator(level="O2", cpu=True)


def test_accelerate_save_state_records_the_config(tmp_path) -> None:
    cfg = AmpConfig(level="O2", dtype="bfloat16", custom_black_list=["softmax"])
    accelerator = AmpkitAccelerator(config=cfg, cpu=True)
    net = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    accelerator.prepare(net, opt)
    accelerator.save_state(str(tmp_path / "state"))
    assert AmpConfig.from_file(tmp_path / "state" / "ampkit_config.json") == cfg


class _Recorder(GeneralTracker):
    """A tracker that keeps what it is given: the hyperparameters and each log call."""

    name = "recorder"
    requires_logging_directory = False

    def __init__(self) -> None:
        super().__init__()
        self.hparams: dict = {}
        self.logged: list[tuple[int | None, dict]] = []

    @property
    def tracker(self):
        return self

    def store_init_configuration(self, values: dict) -> None:
        self.hparams = dict(values)

    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        self.logged.append((step, dict(values)))


def _accelerate_run(accelerator, steps_with_inf: set[int], steps: int) -> None:
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net, opt = accelerator.prepare(net, opt)
    for step in range(steps):
        x = torch.ones(2, 4)
        if step in steps_with_inf:
            x[0, 0] = float("inf")  # an overflow: the step is skipped, the scale backs off
        with accelerator.autocast():
            loss = net(x).float().pow(2).mean()
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        accelerator.log({"step_loss": step}, step=step)


def test_accelerate_trackers_get_the_config_and_the_amp_values(tmp_path) -> None:
    recorder = _Recorder()
    cfg = AmpConfig(level="O2", dtype="float16", init_scale=1024.0, hysteresis=1,
                    custom_black_list=["softmax", "exp"])
    accelerator = AmpkitAccelerator(config=cfg, cpu=True, log_with=[recorder],
                                    project_dir=str(tmp_path))
    accelerator.init_trackers("amp", config={"lr": 0.1})
    # the config as flat scalars beside the caller's own hyperparameters
    assert recorder.hparams["lr"] == 0.1
    assert recorder.hparams["ampkit/level"] == "O2"
    assert recorder.hparams["ampkit/dtype"] == "float16"
    assert recorder.hparams["ampkit/init_scale"] == 1024.0
    assert recorder.hparams["ampkit/custom_black_list"] == "exp,softmax"
    # unset fields are left out: no 'None' or '' text stands in for them
    assert "ampkit/fp8" not in recorder.hparams
    assert "ampkit/backoff_factor" not in recorder.hparams
    assert "ampkit/custom_white_list" not in recorder.hparams
    assert not [v for v in recorder.hparams.values() if v in ("None", "")]
    assert all(isinstance(v, str | int | float | bool) for v in recorder.hparams.values())
    _accelerate_run(accelerator, steps_with_inf={1}, steps=3)
    # hand-written trajectory: 1024 until the overflow at step 1 halves it (hysteresis 1)
    assert recorder.logged == [
        (0, {"amp/loss_scale": 1024.0, "amp/skipped_steps": 0, "step_loss": 0}),
        (1, {"amp/loss_scale": 512.0, "amp/skipped_steps": 1, "step_loss": 1}),
        (2, {"amp/loss_scale": 512.0, "amp/skipped_steps": 1, "step_loss": 2}),
    ]
    accelerator.end_training()


def test_accelerate_log_adds_nothing_when_no_loss_is_scaled(tmp_path) -> None:
    recorder = _Recorder()
    accelerator = AmpkitAccelerator(level="O2", dtype="bfloat16", cpu=True,
                                    log_with=[recorder], project_dir=str(tmp_path))
    accelerator.init_trackers("amp")
    assert recorder.hparams["ampkit/dtype"] == "bfloat16"
    assert "ampkit/loss_scale" not in recorder.hparams  # unset: the level's (none)
    _accelerate_run(accelerator, steps_with_inf=set(), steps=1)
    assert recorder.logged == [(0, {"step_loss": 0})]
    accelerator.end_training()


def test_hf_loss_scale_text_is_parsed_with_the_one_wording():
    # The command line hands text: a number's text is the number; anything else gets
    # the loss-scale error every other entry point gives, naming the flag.
    args = AmpkitArguments(ampkit_dtype="float16", ampkit_loss_scale="128")
    assert args.to_config().loss_scale == 128.0
    with pytest.raises(ValueError, match=r"--ampkit_loss_scale must be 'dynamic', a "
                                         r"positive finite number .*got 'big'"):
        AmpkitArguments(ampkit_dtype="float16", ampkit_loss_scale="big").to_config()
    with pytest.raises(ValueError, match=r"--ampkit_loss_scale must be .*got -2.0"):
        AmpkitArguments(ampkit_dtype="float16", ampkit_loss_scale="-2").to_config()
