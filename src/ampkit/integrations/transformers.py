"""Hugging Face transformers: ``AmpkitTrainer(model=..., args=..., level="O2",
dtype=torch.bfloat16)`` in place of ``Trainer`` with ``bf16=True``/``fp16=True``.

:class:`AmpkitTrainer` is a ``Trainer`` whose accelerator is an
:class:`~ampkit.integrations.accelerate.AmpkitAccelerator`: the model is converted with
``ampkit.initialize`` when the trainer is made (on the training device), the optimizer
``Trainer`` creates is handed to ``ampkit.initialize`` when it is prepared, fp16 levels
scale the loss with an ``ampkit.GradScaler`` (unscaled before ``max_grad_norm``
clipping, steps skipped on inf/NaN, the LR scheduler left alone on a skipped step), and
the scaler's state goes into every checkpoint. The rest is ``Trainer``'s own: evaluation, gradient
accumulation, ``save_model``, ``resume_from_checkpoint``, callbacks, logging.

``model.state_dict()`` reports the fp32 parameters at O2, so ``save_model`` writes fp32
values and records ``dtype="float32"`` in the saved config: ``from_pretrained`` loads
them back in fp32, bit for bit, and ``resume_from_checkpoint`` restores the fp32 parameters
exactly.

Configure it with an :class:`ampkit.AmpConfig` (``config=``: one, the path of a config
file, or an :class:`AmpkitArguments`), or with ``level=``, ``dtype=`` and the config's
fields as keywords. :class:`AmpkitArguments` is a dataclass that ``HfArgumentParser``
reads, so a training script takes ``--ampkit_level O2 --ampkit_dtype bfloat16`` or
``--ampkit_config amp.yaml`` beside the ``TrainingArguments`` flags.

The host's precision settings are mapped, never ignored: ``--bf16``/``--fp16`` (and
``ACCELERATE_MIXED_PRECISION``, which ``TrainingArguments`` reads) set the config's
dtype when it has none, and are refused, naming both settings, when it says otherwise;
accelerate's own mixed precision is then switched off (the trainer runs on a copy of
the arguments with ``bf16``/``fp16`` False, which ``training_args.bin`` records).
``bf16_full_eval``/``fp16_full_eval`` (a cast of the whole model for evaluation) are
refused.

The config is saved in every checkpoint (``trainer_state.json``'s
``stateful_callbacks.AmpkitConfigRecord``, and ``ampkit_config.json`` beside the
model) and, for a model with a Hugging Face ``config``, recorded there as ``ampkit``
(which the hyperparameter logs of the reporting integrations include). With loss
scaling, every training log (``logging_steps``) gets ``amp/loss_scale`` and
``amp/skipped_steps``; the LR scheduler does not step on a skipped step (Trainer's own
rule, through ``optimizer_step_was_skipped``).

Requires ``transformers`` and ``accelerate`` (``pip install 'ampkit[transformers]'``).

Example:
    >>> import torch
    >>> from transformers import TrainingArguments
    >>> from ampkit.integrations.transformers import AmpkitTrainer
    >>> args = TrainingArguments("out", bf16=True, use_cpu=True, report_to=[])
    >>> AmpkitTrainer(model=torch.nn.Linear(2, 2), args=args, dtype="float16")
    Traceback (most recent call last):
    ...
    ValueError: AmpkitTrainer: TrainingArguments(bf16=True) asks for torch.bfloat16, but ...
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
from typing import Any

import torch

from ampkit.arguments import parse_loss_scale
from ampkit.config import AmpConfig, field_help
from ampkit.integrations._settings import OPTIONS, AmpkitSettings, missing_framework
from ampkit.integrations._versions import require_hooks

try:
    from transformers import Trainer, TrainerCallback
    from transformers.trainer_callback import ExportableState
except ImportError as error:  # pragma: no cover - exercised without the extra
    raise ImportError(missing_framework("transformers", "transformers")) from error
try:
    from ampkit.integrations.accelerate import AmpkitAccelerator
except ImportError as error:  # pragma: no cover - transformers' Trainer needs it anyway
    raise ImportError(missing_framework("accelerate", "transformers")) from error

require_hooks("transformers", "transformers", Trainer,
              ("_save", "create_accelerator_and_postprocess"))

__all__ = ["AmpkitArguments", "AmpkitConfigRecord", "AmpkitTrainer"]

_REFUSED_FLAGS = ("bf16_full_eval", "fp16_full_eval")
CONFIG_FILE = "ampkit_config.json"


def _flag(name: str, unset: str = "") -> dict[str, str]:
    """The metadata of the ``--ampkit_<name>`` flag of AmpConfig's field ``name``: its
    help and accepted values come from AmpConfig (:func:`ampkit.config.field_help`), so
    the flags take every spelling AmpConfig takes; the values are checked when the
    arguments are made."""
    return {"help": field_help(name) + unset}


@dataclasses.dataclass
class AmpkitArguments:
    """The ampkit config as command-line flags for ``HfArgumentParser`` (each field is
    an :class:`ampkit.AmpConfig` field with an ``ampkit_`` prefix; ``None``: not given).
    They accept the spellings ``AmpConfig`` accepts (``--ampkit_level o2``,
    ``--ampkit_dtype bf16``), and are checked when made (a bad value or a flag that
    contradicts ``--ampkit_config`` is a ``ValueError`` then).

    Example:
        >>> from transformers import HfArgumentParser
        >>> from ampkit.integrations.transformers import AmpkitArguments
        >>> (amp,) = HfArgumentParser(AmpkitArguments).parse_args_into_dataclasses(
        ...     ["--ampkit_level", "o2", "--ampkit_dtype", "fp16",
        ...      "--ampkit_custom_black_list", "softmax", "exp"])
        >>> amp.to_config().custom_black_list, amp.to_config().level
        (('exp', 'softmax'), 'O2')
    """

    ampkit_config: str | None = dataclasses.field(
        default=None, metadata={"help": "an ampkit config file (.json, .yaml or .yml); the "
                                         "other --ampkit_* flags must agree with it"})
    ampkit_level: str | None = dataclasses.field(
        default=None, metadata=_flag("level", unset="; unset: the config's, else O2"))
    ampkit_dtype: str | None = dataclasses.field(
        default=None, metadata=_flag("dtype"))
    ampkit_policy: str | None = dataclasses.field(
        default=None, metadata=_flag("policy"))
    ampkit_custom_white_list: list[str] | None = dataclasses.field(
        default=None, metadata=_flag("custom_white_list"))
    ampkit_custom_black_list: list[str] | None = dataclasses.field(
        default=None, metadata=_flag("custom_black_list"))
    ampkit_keep_fp32_modules: list[str] | None = dataclasses.field(
        default=None, metadata=_flag("keep_fp32_modules"))
    ampkit_keep_norms_fp32: bool | None = dataclasses.field(
        default=None, metadata=_flag("keep_norms_fp32"))
    ampkit_master_weights: str | None = dataclasses.field(
        default=None, metadata=_flag("master_weights"))
    ampkit_rounding_seed: int | None = dataclasses.field(
        default=None, metadata=_flag("rounding_seed"))
    ampkit_loss_scale: str | None = dataclasses.field(
        default=None, metadata=_flag("loss_scale"))
    ampkit_init_scale: float | None = dataclasses.field(
        default=None, metadata=_flag("init_scale"))
    ampkit_growth_factor: float | None = dataclasses.field(
        default=None, metadata=_flag("growth_factor"))
    ampkit_backoff_factor: float | None = dataclasses.field(
        default=None, metadata=_flag("backoff_factor"))
    ampkit_growth_interval: int | None = dataclasses.field(
        default=None, metadata=_flag("growth_interval"))
    ampkit_hysteresis: int | None = dataclasses.field(
        default=None, metadata=_flag("hysteresis"))
    ampkit_min_scale: float | None = dataclasses.field(
        default=None, metadata=_flag("min_scale"))
    ampkit_max_scale: float | None = dataclasses.field(
        default=None, metadata=_flag("max_scale"))
    ampkit_log_skipped_steps: bool = dataclasses.field(
        default=False, metadata=_flag("log_skipped_steps"))
    ampkit_fp8: str | None = dataclasses.field(
        default=None, metadata=_flag("fp8"))
    ampkit_fp8_exclude_modules: list[str] | None = dataclasses.field(
        default=None, metadata=_flag("fp8_exclude_modules"))
    ampkit_fp8_first_last: bool = dataclasses.field(
        default=False, metadata=_flag("fp8_first_last"))
    ampkit_cast_model_outputs: str | None = dataclasses.field(
        default=None, metadata=_flag("cast_model_outputs"))

    def __post_init__(self) -> None:
        self.to_config()  # checked once, when the flags are parsed

    def to_config(self) -> AmpConfig:
        """The :class:`ampkit.AmpConfig` these flags stand for (level ``O2`` unless
        given, as ``AmpkitTrainer``'s).

        Raises:
            ValueError: a bad value, or a flag that contradicts ``--ampkit_config``.

        Example:
            >>> from ampkit.integrations.transformers import AmpkitArguments
            >>> AmpkitArguments(ampkit_master_weights="kahan", ampkit_dtype="bfloat16"
            ...                 ).to_config().master_weights
            'kahan'
        """
        fields = {f.name.removeprefix("ampkit_"): getattr(self, f.name)
                  for f in dataclasses.fields(self) if f.name != "ampkit_config"}
        master = fields["master_weights"]
        if isinstance(master, str) and master.lower() in ("true", "false"):
            fields["master_weights"] = master.lower() == "true"
        scale = fields["loss_scale"]
        if isinstance(scale, str) and scale != "dynamic":
            # a command line gives text: a number's text becomes the number, and what
            # is neither gets the one loss-scale wording
            with contextlib.suppress(ValueError):
                scale = float(scale)
        fields["loss_scale"] = parse_loss_scale(scale, "--ampkit_loss_scale")
        level, dtype = fields.pop("level"), fields.pop("dtype")
        return AmpkitSettings.build(level, dtype, fields, owner="AmpkitArguments",
                                    config=self.ampkit_config).config


class AmpkitConfigRecord(TrainerCallback, ExportableState):
    """Keeps the ampkit config in ``trainer_state.json`` (``stateful_callbacks``) of
    every checkpoint; it changes nothing in training.

    Example:
        >>> from ampkit.integrations.transformers import AmpkitConfigRecord
        >>> AmpkitConfigRecord({"level": "O2"}).state()["args"]
        {'config': {'level': 'O2'}}
    """

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = dict(config)

    def state(self) -> dict[str, Any]:
        """``{"args": {"config": ...}, "attributes": {}}``, as Trainer stores it."""
        return {"args": {"config": self.config}, "attributes": {}}


class AmpkitTrainer(Trainer):
    """A ``transformers.Trainer`` that trains at an ampkit level.

    Takes every ``Trainer`` argument, plus:

    Args:
        level: ``"O0"``-``"O3"``; ``None``: the config's, else ``"O2"``.
        dtype: ``torch.float16`` or ``torch.bfloat16``; ``None``: the config's, or what
            ``--bf16``/``--fp16`` say, else the device's autocast default (bfloat16 on
            CPU, float16 on CUDA).
        config: an :class:`ampkit.AmpConfig`, the path of a config file, or
            :class:`AmpkitArguments`; keywords given as well must agree with it.
        **kwargs: :class:`ampkit.AmpConfig` fields (``custom_white_list``,
            ``custom_black_list``, ``policy``, ``keep_fp32_modules``, ``loss_scale``,
            ``init_scale``, ``hysteresis``, ...) and the rarer ``initialize``
            overrides; the other keywords go to ``Trainer``.

    Raises:
        ValueError: ``--bf16``/``--fp16``/``ACCELERATE_MIXED_PRECISION`` contradicting the
            config's dtype, ``bf16_full_eval``/``fp16_full_eval`` set, a bad level, dtype
            or option value, or a keyword contradicting ``config``.
        TypeError: an unknown option (the accepted ones are listed).

    Example:
        >>> import torch
        >>> from transformers import TrainingArguments
        >>> from ampkit.integrations.transformers import AmpkitTrainer
        >>> args = TrainingArguments("out", use_cpu=True, report_to=[])
        >>> trainer = AmpkitTrainer(model=torch.nn.Linear(2, 2), args=args, level="O2",
        ...                         dtype=torch.bfloat16)
        >>> trainer.model.weight.dtype, type(trainer.accelerator).__name__
        (torch.float32, 'AmpkitAccelerator')
    """

    accelerator: AmpkitAccelerator

    def __init__(self, model: Any = None, args: Any = None, *rest: Any,
                 level: str | None = None, dtype: torch.dtype | str | None = None,
                 config: AmpConfig | AmpkitArguments | str | os.PathLike[str] | None = None,
                 **kwargs: Any) -> None:
        options = {k: kwargs.pop(k) for k in list(kwargs) if k in OPTIONS}
        if isinstance(config, AmpkitArguments):
            config = config.to_config()
        settings = AmpkitSettings.build(level, dtype, options, owner="AmpkitTrainer",
                                        config=config)
        given = [flag for flag in _REFUSED_FLAGS if getattr(args, flag, False)]
        if given:
            raise ValueError(f"AmpkitTrainer: TrainingArguments({given[0]}=True) casts the "
                             f"whole model for evaluation, on top of the ampkit config "
                             f"({settings.describe()}); leave {' and '.join(_REFUSED_FLAGS)} "
                             f"False: evaluation runs at the ampkit level")
        if args is not None and getattr(args, "mixed_precision", "no") != "no":
            host = args.mixed_precision
            source = ("TrainingArguments(fp16=True)" if args.fp16 else
                      "TrainingArguments(bf16=True)" if args.bf16 else
                      "ACCELERATE_MIXED_PRECISION")
            settings = settings.with_host_precision(source, host)
            # The precision now lives in the config: accelerate's own autocast and
            # scaler stay off. A copy, so the caller's arguments are left as given.
            args = copy.copy(args)
            args.bf16 = args.fp16 = False
            args.mixed_precision = "no"
        self._ampkit = settings
        super().__init__(model, args, *rest, **kwargs)
        self.add_callback(AmpkitConfigRecord(settings.config.to_dict()))
        if self.model is not None:  # with model_init, the model is made (and converted) later
            self.accelerator.convert_model(self.model)
            hf_config = getattr(self.model, "config", None)
            if hf_config is not None and hasattr(hf_config, "to_json_string"):
                # recorded where the reporting callbacks read hyperparameters from
                hf_config.ampkit = settings.config.to_dict()

    @property
    def ampkit_config(self) -> AmpConfig:
        """The :class:`ampkit.AmpConfig` this trainer trains with (host flags mapped).

        Example:
            >>> import torch
            >>> from transformers import TrainingArguments
            >>> from ampkit.integrations.transformers import AmpkitTrainer
            >>> args = TrainingArguments("out", use_cpu=True, report_to=[], bf16=True)
            >>> AmpkitTrainer(model=torch.nn.Linear(2, 2), args=args).ampkit_config.dtype
            torch.bfloat16
        """
        return self._ampkit.config

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """``Trainer.log``, with ``amp/loss_scale`` and ``amp/skipped_steps`` added to
        the training logs when the level scales the loss."""
        scaler = self.accelerator.scaler
        if scaler is not None and "loss" in logs:
            logs["amp/loss_scale"] = scaler.get_scale()
            logs["amp/skipped_steps"] = scaler.skipped_steps
        super().log(logs, start_time)

    def create_accelerator_and_postprocess(self) -> None:
        """``Trainer``'s accelerator, made an :class:`AmpkitAccelerator` in place."""
        super().create_accelerator_and_postprocess()
        AmpkitAccelerator.adopt(self.accelerator, config=self._ampkit.config,
                                **self._ampkit.extra)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        super()._save(output_dir, state_dict)
        out = output_dir if output_dir is not None else self.args.output_dir
        if self.args.should_save and out is not None:
            self._ampkit.config.to_file(os.path.join(out, CONFIG_FILE))
        # save_pretrained records the parameters' dtype, but with master weights the
        # values written are the fp32 parameters: say float32, so that from_pretrained
        # (dtype="auto") loads them back without rounding.
        model = self.accelerator.unwrap_model(self.model)
        config = getattr(model, "config", None)
        if config is None or not self._ampkit.properties(None).master_weights:
            return
        if not self.args.should_save:
            return
        saved = type(config).from_pretrained(out)
        saved.dtype = "float32"
        saved.save_pretrained(out)
