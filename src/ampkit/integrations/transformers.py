"""Hugging Face transformers: ``AmpkitTrainer(model=..., args=..., level="O2",
dtype=torch.bfloat16)`` in place of ``Trainer`` with ``bf16=True``/``fp16=True``.

:class:`AmpkitTrainer` is a ``Trainer`` whose accelerator is an
:class:`~ampkit.integrations.accelerate.AmpkitAccelerator`: the model is converted with
``ampkit.initialize`` when the trainer is made (on the training device), the optimizer
``Trainer`` creates gets fp32 masters when it is prepared, fp16 levels scale the loss
with an ``ampkit.GradScaler`` (unscaled before ``max_grad_norm`` clipping, steps skipped
on inf/NaN, the LR scheduler left alone on a skipped step), and the scaler's state goes
into every checkpoint. The rest is ``Trainer``'s own: evaluation, gradient
accumulation, ``save_model``, ``resume_from_checkpoint``, callbacks, logging.

``model.state_dict()`` reports the fp32 masters at O2, so ``save_model`` writes fp32
values and records ``dtype="float32"`` in the saved config: ``from_pretrained`` loads
them back in fp32, bit for bit, and ``resume_from_checkpoint`` restores the masters
exactly.

The ``bf16``, ``fp16``, ``bf16_full_eval`` and ``fp16_full_eval`` training arguments
are refused (they would run accelerate's autocast or a cast of the whole model on top
of the level): choose the precision with ``level`` and ``dtype``.

Requires ``transformers`` and ``accelerate`` (``pip install 'ampkit[transformers]'``).

Example:
    >>> import torch
    >>> from transformers import TrainingArguments
    >>> from ampkit.integrations.transformers import AmpkitTrainer
    >>> args = TrainingArguments("out", bf16=True, use_cpu=True, report_to=[])
    >>> AmpkitTrainer(model=torch.nn.Linear(2, 2), args=args, level="O2")
    Traceback (most recent call last):
    ...
    ValueError: AmpkitTrainer: TrainingArguments(bf16=True) would add ...
"""

from __future__ import annotations

from typing import Any

import torch

from ampkit.integrations._settings import OPTIONS, AmpkitSettings, missing_framework

try:
    from transformers import Trainer
except ImportError as error:  # pragma: no cover - exercised without the extra
    raise ImportError(missing_framework("transformers", "transformers")) from error
try:
    from ampkit.integrations.accelerate import AmpkitAccelerator
except ImportError as error:  # pragma: no cover - transformers' Trainer needs it anyway
    raise ImportError(missing_framework("accelerate", "transformers")) from error

__all__ = ["AmpkitTrainer"]

_REFUSED_FLAGS = ("bf16", "fp16", "bf16_full_eval", "fp16_full_eval")


class AmpkitTrainer(Trainer):
    """A ``transformers.Trainer`` that trains at an ampkit level.

    Takes every ``Trainer`` argument, plus:

    Args:
        level: ``"O0"``-``"O3"``; ``"O2"`` by default.
        dtype: ``torch.float16`` or ``torch.bfloat16``; ``None`` is the device's
            autocast default (bfloat16 on CPU, float16 on CUDA).
        **kwargs: ``ampkit.initialize`` overrides (``custom_white_list``,
            ``custom_black_list``, ``policy``, ``keep_fp32_modules``, ``loss_scale``, ...)
            and ``ampkit.GradScaler`` options (``init_scale``, ``hysteresis``, ...);
            the other keywords go to ``Trainer``.

    Raises:
        ValueError: ``bf16``/``fp16``/``bf16_full_eval``/``fp16_full_eval`` set in the
            training arguments, or a bad level, dtype or option value.
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

    def __init__(self, model: Any = None, args: Any = None, *rest: Any, level: str = "O2",
                 dtype: torch.dtype | str | None = None, **kwargs: Any) -> None:
        options = {k: kwargs.pop(k) for k in list(kwargs) if k in OPTIONS}
        self._ampkit = AmpkitSettings.build(level, dtype, options, owner="AmpkitTrainer")
        given = [flag for flag in _REFUSED_FLAGS if getattr(args, flag, False)]
        if given:
            raise ValueError(f"AmpkitTrainer: TrainingArguments({given[0]}=True) would add "
                             f"accelerate's own mixed precision on top of the ampkit level; "
                             f"leave {', '.join(_REFUSED_FLAGS)} False and pass level= and "
                             f"dtype= (e.g. dtype=torch.bfloat16) to AmpkitTrainer")
        super().__init__(model, args, *rest, **kwargs)
        if self.model is not None:  # with model_init, the model is made (and converted) later
            self.accelerator.convert_model(self.model)

    def create_accelerator_and_postprocess(self) -> None:
        """``Trainer``'s accelerator, made an :class:`AmpkitAccelerator` in place."""
        super().create_accelerator_and_postprocess()
        AmpkitAccelerator.adopt(self.accelerator, self._ampkit.level, self._ampkit.dtype,
                                **self._ampkit.overrides, **self._ampkit.scaler_options)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        super()._save(output_dir, state_dict)
        # save_pretrained records the parameters' dtype, but with master weights the
        # values written are the fp32 masters: say float32, so that from_pretrained
        # (dtype="auto") loads them back without rounding.
        model = self.accelerator.unwrap_model(self.model)
        config = getattr(model, "config", None)
        if config is None or not self._ampkit.properties(None).master_weights:
            return
        out = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return
        saved = type(config).from_pretrained(out)
        saved.dtype = "float32"
        saved.save_pretrained(out)
