"""Fake tensors, for the memory planner (:mod:`ampkit.tools.plan`): a step run on
tensors that have shapes, dtypes and storages of the right size but no data.

``torch._subclasses.fake_tensor`` imports sympy and the symbolic-shapes machinery, so it
is imported when a plan starts, never at ``import ampkit``.

Example:
    >>> import torch
    >>> from ampkit.torch_internals.simulation import fake_tensor_mode
    >>> with fake_tensor_mode():
    ...     t = torch.empty(1024, 1024)
    >>> t.untyped_storage().nbytes(), type(t).__name__
    (4194304, 'FakeTensor')
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from ampkit.torch_internals.entries import fail, register_entry

__all__ = ["fake_tensor_mode", "is_fake"]


def _fake_module() -> Any:
    return importlib.import_module("torch._subclasses.fake_tensor")


def fake_tensor_mode(*, allow_real_inputs: bool = False) -> Any:
    """A new ``FakeTensorMode``: tensors made inside it have a storage of their real
    size in bytes and no data; ops compute shapes, dtypes and strides only. With
    ``allow_real_inputs`` an op may also take real tensors (meta ones: a model built on
    the meta device is given fake storages with ``to_empty``).

    Example:
        >>> import torch
        >>> from ampkit.torch_internals.simulation import fake_tensor_mode
        >>> with fake_tensor_mode():
        ...     (torch.ones(3, 4) @ torch.ones(4, 5)).shape
        torch.Size([3, 5])
    """
    return _fake_module().FakeTensorMode(allow_non_fake_inputs=allow_real_inputs)


def is_fake(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a fake tensor.

    Example:
        >>> import torch
        >>> from ampkit.torch_internals.simulation import is_fake
        >>> is_fake(torch.ones(1))
        False
    """
    return isinstance(tensor, _fake_module().FakeTensor)


@register_entry("fake_tensors", ("torch._subclasses.fake_tensor.FakeTensorMode",
                                 "torch._subclasses.fake_tensor.FakeTensor"),
                "the memory planner runs a training step on tensors without data, so a "
                "model far larger than the machine is sized by running its own code",
                "none: torch documents fake tensors (torch.compile's fake tensor guide) "
                "but exposes them only from torch._subclasses", lazy=True)
def check_fake_tensors() -> None:
    """The planner's needs of fake tensors: a storage of the real size, no data, and
    ops that compute shapes.

    Example:
        >>> from ampkit.torch_internals.simulation import check_fake_tensors
        >>> check_fake_tensors()
    """
    try:
        with fake_tensor_mode():
            t = torch.empty(256, 4, dtype=torch.bfloat16)
            out = t.float().sum(0)
    except (AttributeError, ImportError, TypeError) as error:
        raise fail("fake_tensors", f"cannot run a fake op ({type(error).__name__}: "
                   f"{error})") from error
    if not is_fake(t) or t.untyped_storage().nbytes() != 2048 or out.shape != (4,):
        raise fail("fake_tensors", "gives fake tensors without storages of their size")
