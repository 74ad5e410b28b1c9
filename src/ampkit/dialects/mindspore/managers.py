"""MindSpore's loss-scale managers, which ``build_train_network`` takes:
``LossScaleManager`` (the base), ``FixedLossScaleManager`` and
``DynamicLossScaleManager``.

Example:
    >>> from ampkit.dialects.mindspore.managers import FixedLossScaleManager
    >>> FixedLossScaleManager(128.0).get_loss_scale()
    128.0
"""

from __future__ import annotations

import abc

from ampkit.dialects.mindspore.loss_scalers import (
    check_loss_scale,
    check_scale_factor,
    check_scale_window,
)

__all__ = ["DynamicLossScaleManager", "FixedLossScaleManager", "LossScaleManager"]


class LossScaleManager(abc.ABC):
    """The base of MindSpore's loss-scale managers (for ``build_train_network``).

    Example:
        >>> import ampkit.mindspore as amp
        >>> isinstance(amp.FixedLossScaleManager(), amp.LossScaleManager)
        True
    """

    @abc.abstractmethod
    def get_loss_scale(self) -> float:
        """The starting loss scale.

        Example:
            >>> import ampkit.mindspore as amp
            >>> amp.DynamicLossScaleManager().get_loss_scale()
            16777216.0
        """

    @abc.abstractmethod
    def get_drop_overflow_update(self) -> bool:
        """Whether a step with inf/NaN gradients is skipped.

        Example:
            >>> import ampkit.mindspore as amp
            >>> amp.FixedLossScaleManager(drop_overflow_update=False).get_drop_overflow_update()
            False
        """


class FixedLossScaleManager(LossScaleManager):
    """A constant loss scale; ``drop_overflow_update`` skips steps with inf/NaN
    gradients (``False``: they are applied, as in MindSpore).

    Raises:
        ValueError: ``loss_scale`` < 1.

    Example:
        >>> import ampkit.mindspore as amp
        >>> amp.FixedLossScaleManager(128).get_loss_scale()
        128.0
    """

    def __init__(self, loss_scale: float = 128.0, drop_overflow_update: bool = True) -> None:
        self._loss_scale = check_loss_scale(loss_scale, "loss_scale")
        if not isinstance(drop_overflow_update, bool):
            raise TypeError(f"drop_overflow_update must be a bool, got "
                            f"{type(drop_overflow_update).__name__}")
        self._drop = drop_overflow_update

    def get_loss_scale(self) -> float:
        """The loss scale.

        Example:
            >>> import ampkit.mindspore as amp
            >>> amp.FixedLossScaleManager().get_loss_scale()
            128.0
        """
        return self._loss_scale

    def get_drop_overflow_update(self) -> bool:
        """Whether overflowing steps are skipped.

        Example:
            >>> import ampkit.mindspore as amp
            >>> amp.FixedLossScaleManager().get_drop_overflow_update()
            True
        """
        return self._drop


class DynamicLossScaleManager(LossScaleManager):
    """A dynamic loss scale: start ``init_loss_scale``, ``max(1, scale / scale_factor)``
    on overflow (the step is skipped), times ``scale_factor`` after ``scale_window``
    clean steps.

    Raises:
        ValueError: ``init_loss_scale`` < 1, ``scale_factor`` <= 1, ``scale_window`` < 1.

    Example:
        >>> import ampkit.mindspore as amp
        >>> manager = amp.DynamicLossScaleManager(init_loss_scale=2 ** 12)
        >>> manager.get_loss_scale(), manager.scale_factor, manager.scale_window
        (4096.0, 2.0, 2000)
    """

    def __init__(self, init_loss_scale: float = 2.0 ** 24, scale_factor: float = 2,
                 scale_window: int = 2000) -> None:
        self._loss_scale = check_loss_scale(init_loss_scale, "init_loss_scale")
        self.scale_factor = check_scale_factor(scale_factor, "scale_factor")
        self.scale_window = check_scale_window(scale_window, "scale_window")

    def get_loss_scale(self) -> float:
        """The starting loss scale.

        Example:
            >>> import ampkit.mindspore as amp
            >>> amp.DynamicLossScaleManager(1024).get_loss_scale()
            1024.0
        """
        return self._loss_scale

    def get_drop_overflow_update(self) -> bool:
        """Always ``True``: a dynamic scale skips overflowing steps.

        Example:
            >>> import ampkit.mindspore as amp
            >>> amp.DynamicLossScaleManager().get_drop_overflow_update()
            True
        """
        return True
