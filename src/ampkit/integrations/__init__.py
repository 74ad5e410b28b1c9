"""ampkit inside the trainers people already use: Lightning, Hugging Face, accelerate.

Each module translates one framework's hooks into the front door (``ampkit.initialize``,
``ampkit.autocast``, ``ampkit.GradScaler``, ``torch.nn.utils.clip_grad_norm_``); none has
numerics of its own. A module imports only when its framework is installed, and
otherwise raises an ``ImportError`` naming the extra to install.

===========================================  ===========================  ========================
use                                          replaces                     extra
===========================================  ===========================  ========================
``lightning.AmpkitPrecision(level, dtype)``  ``Trainer(precision=...)``   ``ampkit[lightning]``
``transformers.AmpkitTrainer(level=...)``    ``bf16=True``/``fp16=True``  ``ampkit[transformers]``
``accelerate.AmpkitAccelerator(level=...)``  ``mixed_precision=...``      ``ampkit[accelerate]``
===========================================  ===========================  ========================

Details and limits: ``docs/integrations.md``.

Example:
    >>> import ampkit.integrations
    >>> sorted(ampkit.integrations.EXTRAS)
    ['accelerate', 'lightning', 'transformers']
"""

#: integration module -> the pip extra that installs its framework
EXTRAS: dict[str, str] = {
    "lightning": "lightning",
    "transformers": "transformers",
    "accelerate": "accelerate",
}

__all__ = ["EXTRAS"]
