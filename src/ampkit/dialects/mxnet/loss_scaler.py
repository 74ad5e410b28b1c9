"""MXNet's ``LossScaler``: :class:`ampkit.GradScaler` with MXNet's numbers.

Example:
    >>> from ampkit.dialects.mxnet.loss_scaler import LossScaler
    >>> LossScaler(device="cpu").loss_scale
    65536.0
"""

from __future__ import annotations

import torch

from ampkit.scaling.grad_scaler import GradScaler

__all__ = ["LossScaler"]


# -- loss scaling --------------------------------------------------------------------------

class LossScaler(GradScaler):
    """MXNet's dynamic loss scaler: starts at 2**16, halves on overflow (the step is
    skipped), doubles after 2000 clean steps, never above 2**24. A
    :class:`ampkit.GradScaler` with those settings, plus MXNet's ``loss_scale``.

    Example:
        >>> import ampkit.mxnet as amp
        >>> scaler = amp.LossScaler(device="cpu")
        >>> scaler.loss_scale, scaler.schedule.max_scale, scaler.get_growth_interval()
        (65536.0, 16777216.0, 2000)
    """

    def __init__(self, *, device: str | torch.device | None = None) -> None:
        super().__init__(device, init_scale=2.0 ** 16, growth_interval=2000,
                         max_scale=2.0 ** 24)

    @property
    def loss_scale(self) -> float:
        """The current loss scale.

        Example:
            >>> import ampkit.mxnet as amp
            >>> amp.LossScaler(device="cpu").loss_scale
            65536.0
        """
        return self.get_scale()
