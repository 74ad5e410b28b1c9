"""fp8 for Hugging Face's ``Conv1D`` (the GPT-2 family's projections), in its own layout.

``transformers.pytorch_utils.Conv1D`` is a linear layer that stores its weight
transposed: ``(in_features, out_features)``, and computes ``x @ weight + bias``.
torchao's ``Float8Linear`` computes ``x @ weight.t()`` from an ``nn.Linear``'s
``(out_features, in_features)`` weight, and what it hands its fp8 matmul (an
autograd function that casts both operands and runs the forward and both gradients
in ``torch._scaled_mm``) is that transposed view, ``(in_features, out_features)``:
exactly a Conv1D's weight. So a Conv1D runs in fp8 by handing its own weight to the
same function, untransposed:

* the module keeps its class's identity (:data:`Float8Conv1D` is a subclass of
  ``Conv1D``, so ``isinstance(m, Conv1D)`` still holds), its ``weight`` and ``bias``
  ``nn.Parameter`` objects, their shapes and its ``state_dict`` keys: checkpoints of
  the plain model load into the fp8 one and back;
* the numbers are those of a ``Float8Linear`` holding the transposed weight (the casts
  see the same values, the scales reduce over the same axes);
* the swap is a change of class in place (:func:`to_float8_conv1d`), so hooks and
  references to the module survive it.

Nothing here imports ``transformers`` until a Conv1D is converted: a model can only
hold one once transformers is imported.

Example:
    >>> import torch
    >>> from transformers.pytorch_utils import Conv1D
    >>> from ampkit.fp8.conv1d import is_hf_conv1d, to_float8_conv1d
    >>> from ampkit.fp8.recipe import float8_linear_config
    >>> layer = Conv1D(48, 32)                   # nf (out) = 48, nx (in) = 32
    >>> weight = layer.weight
    >>> is_hf_conv1d(layer), tuple(weight.shape)
    (True, (32, 48))
    >>> to_float8_conv1d(layer, float8_linear_config("tensorwise"))
    >>> type(layer).__name__, isinstance(layer, Conv1D), layer.weight is weight
    ('Float8Conv1D', True, True)
    >>> layer(torch.randn(4, 32)).shape
    torch.Size([4, 48])
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch
import torch.nn as nn

from ampkit.fp8.linear import fp8_call

__all__ = ["conv1d_features", "float8_conv1d_class", "hf_conv1d_class", "is_float8_conv1d",
           "is_hf_conv1d", "to_float8_conv1d"]

_HF_MODULE = "transformers.pytorch_utils"
_FLOAT8_NAME = "Float8Conv1D"


def hf_conv1d_class() -> type | None:
    """``transformers.pytorch_utils.Conv1D``, or ``None`` while transformers is not
    imported (a model cannot hold a Conv1D then; nothing is imported here).

    Example:
        >>> import transformers.pytorch_utils
        >>> from ampkit.fp8.conv1d import hf_conv1d_class
        >>> hf_conv1d_class() is transformers.pytorch_utils.Conv1D
        True
    """
    module = sys.modules.get(_HF_MODULE)
    cls = getattr(module, "Conv1D", None)
    return cls if isinstance(cls, type) else None


def is_hf_conv1d(module: Any) -> bool:
    """Whether ``module`` is a Hugging Face ``Conv1D`` or a subclass of it (not
    importing transformers).

    Example:
        >>> import torch
        >>> from ampkit.fp8.conv1d import is_hf_conv1d
        >>> is_hf_conv1d(torch.nn.Linear(2, 2))
        False
    """
    cls = hf_conv1d_class()
    return cls is not None and isinstance(module, cls)


def is_float8_conv1d(module: Any) -> bool:
    """Whether ``module`` is a Conv1D that :func:`to_float8_conv1d` converted.

    Example:
        >>> import torch
        >>> from ampkit.fp8.conv1d import is_float8_conv1d
        >>> is_float8_conv1d(torch.nn.Linear(2, 2))
        False
    """
    return any(klass.__dict__.get("_ampkit_float8_conv1d", False)
               for klass in type(module).__mro__)


def conv1d_features(module: nn.Module) -> tuple[int, int]:
    """``(in_features, out_features)`` of a Conv1D, read from its ``(in, out)`` weight.

    Example:
        >>> from transformers.pytorch_utils import Conv1D
        >>> from ampkit.fp8.conv1d import conv1d_features
        >>> conv1d_features(Conv1D(48, 32))
        (32, 48)
    """
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    return int(weight.shape[0]), int(weight.shape[1])


def _forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    # Under torch.inference_mode() too, as under torch.no_grad(): see ampkit.fp8.linear.
    out: torch.Tensor = fp8_call(_fp8_forward, self, x)
    return out


def _fp8_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

    # As Float8Linear under an autocast region: torchao takes CUDA's autocast dtype.
    if torch.is_autocast_enabled():
        x = x.to(torch.get_autocast_dtype("cuda"))
    # The Conv1D weight is (in, out): the operand Float8Linear builds as weight.t().
    out: torch.Tensor = matmul_with_hp_or_float8_args.apply(
        x, self.weight, self.linear_mm_config, self.config)
    if self.bias is not None:
        out = out + self.bias.to(out.dtype)
    return out


def _extra_repr(self: Any) -> str:
    nx, nf = conv1d_features(self)
    return f"nf={nf}, nx={nx}, fp8 (torchao float8)"


@functools.cache
def float8_conv1d_class() -> type:
    """The ``Float8Conv1D`` class: HF's ``Conv1D`` with its matmuls in fp8 (made once;
    imports transformers). Pickles by reference as ``ampkit.fp8.conv1d.Float8Conv1D``.

    Example:
        >>> from transformers.pytorch_utils import Conv1D
        >>> from ampkit.fp8.conv1d import float8_conv1d_class
        >>> issubclass(float8_conv1d_class(), Conv1D)
        True
    """
    from transformers.pytorch_utils import Conv1D

    return type(_FLOAT8_NAME, (Conv1D,), {
        "forward": _forward, "extra_repr": _extra_repr,
        "__repr__": nn.Module.__repr__,  # Conv1D's own repr would hide the fp8
        "_ampkit_float8_conv1d": True, "__module__": __name__,
        "__qualname__": _FLOAT8_NAME,
        "__doc__": "Hugging Face's Conv1D with its three matmuls in fp8 (ampkit, torchao)."})


def __getattr__(name: str) -> Any:
    # ``ampkit.fp8.conv1d.Float8Conv1D`` made on first use (pickle finds it here).
    if name == _FLOAT8_NAME:
        return float8_conv1d_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def to_float8_conv1d(module: nn.Module, config: Any) -> None:
    """Turn an exact HF ``Conv1D`` into a :data:`Float8Conv1D` in place, with torchao's
    float8 ``config``: same object, same parameters and shapes. With
    ``config.enable_fsdp_float8_all_gather`` the weight becomes torchao's FSDP2 float8
    all-gather tensor (a new ``nn.Parameter`` around the same values), as torchao does
    for ``Float8Linear``.

    Raises:
        TypeError: ``module`` is not exactly HF's ``Conv1D``.

    Example:
        >>> import torch
        >>> from ampkit.fp8.conv1d import to_float8_conv1d
        >>> to_float8_conv1d(torch.nn.Linear(16, 16), None)
        Traceback (most recent call last):
        ...
        TypeError: to_float8_conv1d takes a transformers Conv1D, got Linear
    """
    cls = hf_conv1d_class()
    if cls is None or type(module) is not cls:
        raise TypeError(f"to_float8_conv1d takes a transformers Conv1D, got "
                        f"{type(module).__name__}")
    from torchao.float8.float8_linear import Float8Linear

    # The mm configs torchao derives from the config, built by torchao itself on a
    # throwaway meta-device Float8Linear, so both kinds of layer always agree.
    nx, nf = conv1d_features(module)
    with torch.device("meta"):
        template = Float8Linear(nx, nf, bias=False, config=config)
    module.__class__ = float8_conv1d_class()
    module.config = config
    module.linear_mm_config = template.linear_mm_config
    if config.enable_fsdp_float8_all_gather:
        from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

        weight = module.weight
        assert isinstance(weight, torch.Tensor)
        module.weight = nn.Parameter(
            WeightWithDynamicFloat8CastTensor(weight, module.linear_mm_config,
                                              config.cast_config_weight.target_dtype),
            requires_grad=weight.requires_grad)
