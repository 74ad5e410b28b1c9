"""The digits task every tool trains on: scikit-learn's 8x8 digits (shipped with
scikit-learn, no download), the small CNN of the demo, and the batch order.

The demo, the pure-bf16 curves and ``ampkit tune`` without a TARGET share it, so that
their numbers describe the same model on the same split.

Example:
    >>> from ampkit.tools.demo.digits import DigitsCNN, load_digits_data
    >>> data = load_digits_data(seed=0)
    >>> DigitsCNN()(data.x_test[:2]).shape
    torch.Size([2, 10])
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

__all__ = ["DigitsCNN", "DigitsData", "batch_order", "load_digits_data"]


class DigitsCNN(nn.Module):
    """The demo's model: two 3x3 conv layers (8 and 16 channels) with BatchNorm and
    ReLU, a 2x2 max-pool and a linear classifier, for 8x8 single-channel images (3,866
    parameters). It is kept this small for CPUs without native half precision, where a
    float16 convolution's backward pass runs tens of times slower than in float32.

    Example:
        >>> import torch
        >>> from ampkit.tools.demo.digits import DigitsCNN
        >>> DigitsCNN()(torch.zeros(2, 1, 8, 8)).shape
        torch.Size([2, 10])
    """

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Linear(16 * 4 * 4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.classifier(self.features(x).flatten(1))
        return out


@dataclasses.dataclass(frozen=True)
class DigitsData:
    """scikit-learn's ``load_digits`` split 75/25 (stratified, by ``seed``), pixels
    scaled to [0, 1], as tensors of shape ``(N, 1, 8, 8)`` on one device."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


def load_digits_data(seed: int = 0, device: torch.device | str = "cpu") -> DigitsData:
    """Load and split the digits (1,797 images, shipped with scikit-learn).

    Example:
        >>> from ampkit.tools.demo.digits import load_digits_data
        >>> data = load_digits_data()
        >>> tuple(data.x_train.shape), tuple(data.x_test.shape)
        ((1347, 1, 8, 8), (450, 1, 8, 8))
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    train_idx, test_idx = train_test_split(range(len(digits.target)), test_size=0.25,
                                           random_state=seed, stratify=digits.target)
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.int64)
    train, test = torch.tensor(train_idx), torch.tensor(test_idx)
    return DigitsData(images[train].to(device), labels[train].to(device),
                      images[test].to(device), labels[test].to(device))


def batch_order(num_train: int, batch_size: int, epochs: int,
                 seed: int) -> list[list[torch.Tensor]]:
    """Per epoch, the index batches: one shuffle per epoch from ``seed``, the last
    partial batch dropped so that every step costs the same.

    Example:
        >>> from ampkit.tools.demo.digits import batch_order
        >>> epochs = batch_order(10, 4, epochs=2, seed=0)
        >>> [len(epoch) for epoch in epochs], [len(batch) for batch in epochs[0]]
        ([2, 2], [4, 4])
    """
    generator = torch.Generator().manual_seed(seed)
    order = []
    for _ in range(epochs):
        perm = torch.randperm(num_train, generator=generator)
        full = num_train // batch_size * batch_size
        order.append(list(perm[:full].split(batch_size)))
    return order
