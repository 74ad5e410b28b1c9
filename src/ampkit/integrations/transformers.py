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

import copy
import dataclasses
import inspect
import os
from typing import Any, TypeVar, cast

import torch

from ampkit import config as schema
from ampkit.config import AmpConfig, field_help, text_kind
from ampkit.conversion.levels import MasterWeights
from ampkit.integrations._settings import (
    AmpkitSettings,
    accepted_options,
    missing_framework,
)
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

__all__ = ["AmpkitArguments", "AmpkitConfigRecord", "AmpkitTrainer", "arguments_class"]

_REFUSED_FLAGS = ("bf16_full_eval", "fp16_full_eval")
CONFIG_FILE = "ampkit_config.json"


_T = TypeVar("_T")


def _flag_type(f: dataclasses.Field[Any]) -> tuple[Any, Any]:
    """The type and default of the flag of AmpConfig's field ``f``: what a command line
    gives for it (:func:`ampkit.config.text_kind`), ``None`` when not given (a switch
    that is off by default stays ``False``)."""
    kind = text_kind(f.name)
    if kind is bool:
        return (bool, False) if f.default is False else (bool | None, None)
    if kind is list:
        return list[str] | None, None
    return kind | None, None


def _with_config_flags(cls: type[_T]) -> type[_T]:
    """``cls`` as a dataclass with an ``ampkit_<name>`` flag for each of
    :class:`ampkit.AmpConfig`'s fields, read when called: its help and accepted values
    from :func:`ampkit.config.field_help`, its type from the field's
    (:func:`_flag_type`); AmpConfig checks the values when the arguments are made."""
    annotations = dict(inspect.get_annotations(cls))  # the class's own, not its base's
    cls.__annotations__ = annotations
    for f in schema.config_fields():
        name = f"ampkit_{f.name}"
        annotations[name], default = _flag_type(f)
        setattr(cls, name, dataclasses.field(default=default,
                                             metadata={"help": field_help(f.name)}))
    return dataclasses.dataclass(cls)


@_with_config_flags
class AmpkitArguments:
    """The ampkit config as command-line flags for ``HfArgumentParser``: an
    ``ampkit_<name>`` flag for each :class:`ampkit.AmpConfig` field (made from the
    fields, with their help; ``None``: not given; ``--ampkit_level`` unset: the
    config's, else ``O2``). They accept the spellings ``AmpConfig`` accepts
    (``--ampkit_level o2``, ``--ampkit_dtype bf16``, ``--ampkit_master_weights true``),
    and are checked when made (a bad value or a flag that contradicts
    ``--ampkit_config`` is a ``ValueError`` then).

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

    def __post_init__(self) -> None:
        self.to_config()  # checked once, when the flags are parsed

    def to_config(self) -> AmpConfig:
        """The :class:`ampkit.AmpConfig` these flags stand for (level ``O2`` unless
        given, as ``AmpkitTrainer``'s).

        Raises:
            ValueError: a bad value (naming its flag), or a flag that contradicts
                ``--ampkit_config``.

        Example:
            >>> from ampkit.integrations.transformers import AmpkitArguments
            >>> AmpkitArguments(ampkit_master_weights="kahan", ampkit_dtype="bfloat16"
            ...                 ).to_config().master_weights
            <MasterWeights.KAHAN: 'kahan'>
        """
        fields = {f.name.removeprefix("ampkit_"): getattr(self, f.name)
                  for f in dataclasses.fields(cast(Any, self)) if f.name != "ampkit_config"}
        level, dtype = fields.pop("level"), fields.pop("dtype")
        owner = type(self).__name__
        try:
            return AmpkitSettings.build(level, dtype, fields, owner=owner,
                                        config=self.ampkit_config).config
        except (TypeError, ValueError) as error:
            text = str(error)
            for name in (*fields, "level", "dtype"):  # a field's check names the field:
                text = text.replace(f"{owner}: {name} ", f"{owner}: --ampkit_{name} ", 1)
            raise type(error)(text) from None


def arguments_class() -> type[AmpkitArguments]:
    """A fresh :class:`AmpkitArguments` made from :class:`ampkit.AmpConfig`'s fields as
    they are now (``AmpkitArguments`` itself is made when this module is imported).

    Example:
        >>> from ampkit.integrations.transformers import arguments_class
        >>> "ampkit_hysteresis" in arguments_class().__dataclass_fields__
        True
    """
    return _with_config_flags(type("AmpkitArguments", (AmpkitArguments,),
                                   {"__module__": __name__, "__doc__": AmpkitArguments.__doc__}))


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
        accepted = accepted_options()
        options = {k: kwargs.pop(k) for k in list(kwargs) if k in accepted}
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

    def _save(self, output_dir: str | None = None, state_dict: dict[str, Any] | None = None
              ) -> None:
        super()._save(output_dir, state_dict)
        out = output_dir if output_dir is not None else self.args.output_dir
        if self.args.should_save and out is not None:
            self._ampkit.config.to_file(os.path.join(out, CONFIG_FILE))
        # save_pretrained records the dtype the model computes in, but where the fp32
        # parameters are the truth (master_weights=True) the values written are fp32:
        # say float32, so that from_pretrained (dtype="auto") loads them back without
        # rounding.
        model = self.accelerator.unwrap_model(self.model)
        config = getattr(model, "config", None)
        truth = self._ampkit.properties(None).master_weights
        if config is None or truth is not MasterWeights.FP32:
            return
        if not self.args.should_save:
            return
        saved = type(config).from_pretrained(out)
        saved.dtype = "float32"
        saved.save_pretrained(out)
