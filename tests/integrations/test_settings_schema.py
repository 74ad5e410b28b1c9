"""One settings schema: every surface's settings are made from ``AmpConfig``'s fields.

A field added to ``AmpConfig`` (here: a subclass with one more field put in its place,
as an edit of ``config.py`` would) must show up, with no other edit, in
``ampkit.initialize``'s keywords, the integrations' options (accelerate), the Hugging
Face flags, Lightning's typed parameters (as LightningCLI's jsonargparse reads them)
and the command line's flags. The surfaces made when a module is imported (the HF
dataclass, Lightning's signature) are made again by their own generator, as importing
the package would.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from typing import Any

import jsonargparse
import pytest
import torch
import torch.nn as nn
import transformers

import ampkit
import ampkit.config
from ampkit.config import AmpConfig
from ampkit.conversion.levels import MasterWeights, level_properties
from ampkit.front_door import initialize_keywords
from ampkit.integrations.accelerate import AmpkitAccelerator
from ampkit.integrations.lightning import AmpkitPrecision, precision_signature
from ampkit.integrations.transformers import AmpkitArguments, arguments_class
from ampkit.scaling import loss_scaling
from ampkit.tools.cli import build_parser
from ampkit.tools.cli.args import config_from_args

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

_HELP = "a knob this test adds"
_COMPARE = ["compare", "models:build", "--inputs", "models:batch"]


def _extended_schema(seen: list[Any]) -> type:
    """AmpConfig with one more field, ``new_knob`` (an int), whose check records each
    value it is made with."""

    def post_init(self: Any) -> None:
        AmpConfig.__post_init__(self)
        if self.new_knob is not None and (isinstance(self.new_knob, bool)
                                          or not isinstance(self.new_knob, int)):
            raise TypeError(f"new_knob must be an int, got {self.new_knob!r}")
        seen.append(self.new_knob)

    knob = dataclasses.field(default=None, metadata={"help": _HELP, "values": None})
    return dataclasses.make_dataclass("AmpConfig", [("new_knob", int | None, knob)],
                                      bases=(AmpConfig,), frozen=True,
                                      namespace={"__post_init__": post_init})


def test_a_field_added_to_ampconfig_shows_up_on_every_surface(monkeypatch, capsys) -> None:
    with pytest.raises(TypeError, match="unknown overrides \\['new_knob'\\]"):
        ampkit.initialize(nn.Linear(2, 2), level="O1", dtype="bfloat16", new_knob=3)
    seen: list[Any] = []
    monkeypatch.setattr(ampkit.config, "AmpConfig", _extended_schema(seen))

    # ampkit.initialize: a keyword, and it reaches the config made from the keywords
    assert "new_knob" in initialize_keywords()
    ampkit.initialize(nn.Linear(2, 2), level="O1", dtype="bfloat16", new_knob=3)
    assert seen[-1] == 3

    # accelerate's options
    accelerator = AmpkitAccelerator(level="O2", dtype="bfloat16", cpu=True, new_knob=4)
    assert accelerator.ampkit_config.new_knob == 4

    # the Hugging Face flags: a typed flag with the field's help
    flags = arguments_class()
    parser = transformers.HfArgumentParser(flags)
    (amp,) = parser.parse_args_into_dataclasses(["--ampkit_new_knob", "5",
                                                 "--ampkit_dtype", "bf16"])
    assert amp.ampkit_new_knob == 5 and amp.to_config().new_knob == 5
    assert _HELP in parser.format_help()
    with pytest.raises(SystemExit):  # argparse refuses the text: the flag is typed
        parser.parse_args_into_dataclasses(["--ampkit_new_knob", "five"])

    # Lightning: a typed parameter of the signature LightningCLI reads
    signature = precision_signature()
    assert signature.parameters["new_knob"].annotation == int | None
    monkeypatch.setattr(AmpkitPrecision.__init__, "__signature__", signature)
    cli = jsonargparse.ArgumentParser(exit_on_error=False)
    cli.add_class_arguments(AmpkitPrecision, "plugin")
    built = cli.instantiate_classes(cli.parse_args(["--plugin.level", "O2", "--plugin.dtype",
                                                    "bfloat16", "--plugin.new_knob", "6"]))
    assert built.plugin.config.new_knob == 6

    # the command line: a flag of ampkit compare, with the field's help
    cli_parser = build_parser()
    args = cli_parser.parse_args([*_COMPARE, "--new-knob", "7"])
    assert config_from_args(args).new_knob == 7
    with pytest.raises(SystemExit):
        cli_parser.parse_args(["compare", "--help"])
    assert f"--new-knob NEW_KNOB {_HELP}" in " ".join(capsys.readouterr().out.split())


def test_each_surface_names_exactly_ampconfigs_fields() -> None:
    fields = [f.name for f in dataclasses.fields(AmpConfig)]
    flags = [f.name for f in dataclasses.fields(AmpkitArguments)]
    assert flags == ["ampkit_config", *(f"ampkit_{n}" for n in fields)]
    params = list(inspect.signature(AmpkitPrecision).parameters)
    assert params == [*fields[:2], "config", *fields[2:], "step_scheduler_on_skip",
                      "options"]
    accepted = initialize_keywords()
    assert list(accepted[:len(fields) - 2]) == fields[2:]
    compare = vars(build_parser().parse_args(_COMPARE))
    own = ("dtype", "fp8", "custom_white_list", "custom_black_list")  # compare's own flags
    assert sorted(k.removeprefix("config_") for k in compare if k.startswith("config_")
                  ) == sorted(n for n in fields if n not in own)


def test_one_form_of_master_weights_everywhere() -> None:
    # True is MasterWeights.FP32 in a config, a dict, an HF flag, a Lightning parameter,
    # the command line; text says "true"/"false" or a member's value, in any case
    fp32, kahan = MasterWeights.FP32, MasterWeights.KAHAN
    assert AmpConfig("O2", "float16", master_weights="TRUE").master_weights is fp32
    assert AmpConfig.from_dict({"level": "O2", "master_weights": "false"}
                               ).master_weights is MasterWeights.NONE
    (amp,) = transformers.HfArgumentParser(AmpkitArguments).parse_args_into_dataclasses(
        ["--ampkit_master_weights", "true", "--ampkit_dtype", "fp16"])
    assert amp.to_config().master_weights is fp32
    assert AmpkitPrecision("O2", "float16", master_weights="true").config.master_weights \
        is fp32
    args = build_parser().parse_args([*_COMPARE, "--master-weights", "kahan", "--level",
                                      "O2"])
    assert config_from_args(args).master_weights is kahan
    with pytest.raises(ValueError, match=r"--master-weights must be True .*got 'yes'"):
        config_from_args(build_parser().parse_args([*_COMPARE, "--master-weights", "yes"]))


@pytest.mark.parametrize("mode", list(MasterWeights))
def test_every_master_weights_spelling_read_back_is_accepted_back(mode) -> None:
    # what a user reads back (the member, its value, a config file's entry, the level
    # tables' True/False) makes the same config again ("fp32" used to be refused)
    level, dtype = ("O2", "bfloat16") if mode is not MasterWeights.NONE else ("O3", "float16")
    cfg = AmpConfig(level, dtype, master_weights=mode)
    assert cfg.master_weights is mode
    spellings = [mode, mode.value, mode.value.upper(), cfg.to_dict()["master_weights"],
                 mode.spelled(), str(mode.spelled())]
    for spelling in spellings:
        assert AmpConfig(level, dtype, master_weights=spelling) == cfg, spelling
    assert AmpConfig.from_dict(cfg.to_dict()) == cfg
    props = level_properties(level, dtype, master_weights=mode)
    assert props.master_weights is mode
    shown = props.describe().splitlines()[3].split()[-1]  # the table's spelling
    assert level_properties(level, dtype, master_weights=shown).master_weights is mode


def test_master_weights_text_false_at_o1_is_no_request() -> None:
    # "false" (a flag's text) at O1 asks for nothing, as False does; it was refused as
    # a request for master weights because the text was read as truthy
    assert level_properties("O1", "float16", master_weights="false"
                            ).master_weights is MasterWeights.NONE
    with pytest.raises(ValueError, match="nothing for master_weights to copy"):
        level_properties("O1", "float16", master_weights="fp32")


def test_the_deprecated_names_warn_and_mean_the_one_name() -> None:
    with pytest.warns(FutureWarning, match="initialize: min_loss_scale is deprecated; "
                                           "pass min_scale"):
        ampkit.initialize(nn.Linear(2, 2), level="O2", dtype=torch.float16,
                          min_loss_scale=4.0)
    assert loss_scaling._current_state().config.min_scale == 4.0
    with pytest.warns(FutureWarning, match="configure_loss_scaling: max_loss_scale is "
                                           "deprecated; pass max_scale"):
        loss_scaling.configure_loss_scaling("dynamic", max_loss_scale=2.0 ** 20)
    assert loss_scaling.loss_scaler(0).schedule.max_scale == 2.0 ** 20
    with pytest.raises(ValueError, match="max_loss_scale and max_scale are the same "
                                         "setting; pass max_scale"):
        ampkit.initialize(nn.Linear(2, 2), level="O2", dtype=torch.float16,
                          max_loss_scale=2.0 ** 20, max_scale=2.0 ** 20)
    # the one name says it without a warning; so do the integrations, where the old
    # name is taken with the same warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ampkit.initialize(nn.Linear(2, 2), level="O2", dtype=torch.float16, min_scale=4.0)
    with pytest.warns(FutureWarning, match="AmpkitPrecision: max_loss_scale is "
                                           "deprecated; pass max_scale"):
        plugin = AmpkitPrecision("O2", "float16", max_loss_scale=2.0 ** 20)
    assert plugin.config.max_scale == 2.0 ** 20


def test_command_line_config_flags_agree_with_the_file(tmp_path) -> None:
    path = tmp_path / "amp.json"
    AmpConfig("O2", "bfloat16").to_file(path)
    parser = build_parser()
    args = parser.parse_args([*_COMPARE, "--config", str(path), "--level", "o2",
                              "--keep-norms-fp32", "true"])
    with pytest.raises(ValueError, match="--keep-norms-fp32 True contradicts the config's "
                                         "keep_norms_fp32=None; give it once"):
        config_from_args(args, args.config)
    args = parser.parse_args([*_COMPARE, "--config", str(path), "--level", "o2"])
    assert config_from_args(args, args.config) is args.config
    with pytest.raises(ValueError, match=r"--level must be one of \['O0', 'O1', 'O2', "
                                         r"'O3'\], got 'O7'"):
        config_from_args(parser.parse_args([*_COMPARE, "--level", "O7"]))
    with pytest.raises(SystemExit):  # a typed flag: argparse refuses the text
        parser.parse_args([*_COMPARE, "--hysteresis", "two"])
