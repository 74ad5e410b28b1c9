"""Which linear layers train in fp8, and why the others do not.

The linear layers are ``nn.Linear`` and Hugging Face's ``Conv1D`` (the GPT-2 family's
projections, a Linear with its weight stored transposed; see
:mod:`ampkit.fp8.conv1d`). :func:`select_fp8_layers` looks at every one of them, in the
order of ``model.named_modules()``, and decides, without changing anything:

* a layer kept in fp32 (``keep_fp32_modules``, or inside a kept module, the norms of
  ``keep_norms_fp32`` included) computes in fp32, so not in fp8: the same selectors that
  decide everything else decide this;
* a layer named by ``exclude`` (``initialize(fp8_exclude_modules=...)``: module classes,
  qualified names or instances, as ``keep_fp32_modules`` takes them), or inside one,
  follows the level's policy instead of fp8 (bf16 at O2);
* a subclass of ``nn.Linear`` (``MultiheadAttention``'s ``out_proj``, whose weight the
  attention reads directly) or of ``Conv1D`` is left alone: its forward may not be its
  base class's;
* the model itself is never replaced (``initialize`` changes models in place): wrap a
  bare ``nn.Linear`` in a container;
* ``in_features`` and ``out_features`` must be multiples of 16, the shapes
  ``torch._scaled_mm`` takes;
* the first and the last linear layer of the model stay out by default, as torchao's
  own guidance advises (the input projection and the output head are the layers whose
  error costs most); ``first_last=True`` lets them in. The first is the input
  projection only where nothing else reads the input before it: after an embedding
  (``nn.Embedding``, ``nn.EmbeddingBag``), as in every token model, the input layer is
  the embedding, and the first linear layer (a block's attention projection) converts.

Example:
    >>> import torch
    >>> from ampkit.fp8 import select_fp8_layers
    >>> net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 32),
    ...                           torch.nn.Linear(32, 30), torch.nn.Linear(32, 16))
    >>> for layer in select_fp8_layers(net):
    ...     print(layer.name, layer.fp8, layer.reason)
    0 False first linear layer of the model (fp8_first_last=True converts it)
    1 True fp8
    2 False out_features=30 is not a multiple of 16 (torch._scaled_mm)
    3 False last linear layer of the model (fp8_first_last=True converts it)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch.nn as nn

from ampkit.common.module_selection import (
    ModuleSelector,
    parse_module_selectors,
    resolve_module_selectors,
    selects,
)
from ampkit.fp8.conv1d import (
    conv1d_features,
    hf_conv1d_class,
    is_float8_conv1d,
    is_hf_conv1d,
)

__all__ = ["FP8_DIM_MULTIPLE", "Fp8Layer", "is_float8", "select_fp8_layers"]

#: ``torch._scaled_mm`` takes matrices whose inner and output dimensions are multiples
#: of 16, so a Linear's ``in_features`` and ``out_features`` must be.
FP8_DIM_MULTIPLE = 16

_FP8 = "fp8"


@dataclasses.dataclass(frozen=True)
class Fp8Layer:
    """One linear layer of a model and whether it trains in fp8.

    Attributes:
        name: its qualified name, as in ``model.named_modules()``.
        in_features: its input size.
        out_features: its output size.
        fp8: True when its three matmuls (forward, input and weight gradients) run in
            fp8.
        reason: ``"fp8"``, or why it does not run in fp8.
        kind: ``"Linear"`` (``nn.Linear``) or ``"Conv1D"`` (Hugging Face's).

    Example:
        >>> from ampkit.fp8 import Fp8Layer
        >>> Fp8Layer("head", 64, 10, False, "last Linear of the model").fp8
        False
    """

    name: str
    in_features: int
    out_features: int
    fp8: bool
    reason: str
    kind: str = "Linear"


def _why_not_shape(features: tuple[int, int]) -> str | None:
    for attr, value in zip(("in_features", "out_features"), features):
        if value % FP8_DIM_MULTIPLE:
            return (f"{attr}={value} is not a multiple of {FP8_DIM_MULTIPLE} "
                    f"(torch._scaled_mm)")
    return None


def check_first_last(value: Any) -> bool:
    """``fp8_first_last`` checked: a bool, named in the ``TypeError`` otherwise.

    Example:
        >>> from ampkit.fp8.selection import check_first_last
        >>> check_first_last(True)
        True
        >>> check_first_last(1)  # a bool only, not a truthy value
        Traceback (most recent call last):
        ...
        TypeError: fp8_first_last must be a bool, got 1
    """
    if not isinstance(value, bool):
        raise TypeError(f"fp8_first_last must be a bool, got {value!r}")
    return value


def _kind(module: nn.Module) -> str | None:
    """``"Linear"``, ``"Conv1D"`` or ``None`` (not a linear layer)."""
    if isinstance(module, nn.Linear):
        return "Linear"
    if is_hf_conv1d(module):
        return "Conv1D"
    return None


def _features(module: nn.Module, kind: str) -> tuple[int, int]:
    if kind == "Conv1D":
        return conv1d_features(module)
    return int(module.in_features), int(module.out_features)  # type: ignore[arg-type]


def _why_not_type(module: nn.Module, kind: str) -> str | None:
    if kind == "Linear":
        if type(module) is not nn.Linear:
            return (f"{type(module).__name__} is a subclass of nn.Linear whose forward "
                    f"may not be Linear's")
        return None
    if type(module) is not hf_conv1d_class():
        return (f"{type(module).__name__} is a subclass of transformers' Conv1D whose "
                f"forward may not be Conv1D's")
    return None


_EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)


def select_fp8_layers(model: nn.Module, *,
                      keep_fp32_modules: Iterable[ModuleSelector] | ModuleSelector = (),
                      exclude: Iterable[ModuleSelector] | ModuleSelector | None = None,
                      first_last: bool = False) -> tuple[Fp8Layer, ...]:
    """Every linear layer of ``model`` (``nn.Linear`` and Hugging Face's ``Conv1D``,
    its own forward included), with whether it would train in fp8 and why not; see the
    module doc for the rules. Changes nothing.

    Args:
        model: the model ``initialize`` is given.
        keep_fp32_modules: the modules kept in fp32 (with everything inside them).
        exclude: modules (classes, qualified names, instances) that do not go to fp8.
        first_last: also convert the model's first and last linear layer.

    Raises:
        ValueError: a name or instance in ``keep_fp32_modules``/``exclude`` that is not
            in the model.
        TypeError: a selector of the wrong type, or ``first_last`` not a bool.

    Example:
        >>> import torch
        >>> from ampkit.fp8 import select_fp8_layers
        >>> net = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(3)])
        >>> [(x.name, x.fp8) for x in select_fp8_layers(net, exclude=["1"],
        ...                                                 first_last=True)]
        [('0', True), ('1', False), ('2', True)]
        >>> token_model = torch.nn.Sequential(torch.nn.Embedding(64, 16),
        ...                                   torch.nn.Linear(16, 16), torch.nn.Linear(16, 64))
        >>> [(x.name, x.fp8) for x in select_fp8_layers(token_model)]  # the input: 0
        [('1', True), ('2', False)]
    """
    check_first_last(first_last)
    keep = resolve_module_selectors(
        model, parse_module_selectors(keep_fp32_modules, "keep_fp32_modules") or (),
        "keep_fp32_modules")
    out = resolve_module_selectors(
        model, parse_module_selectors(exclude, "fp8_exclude_modules") or (),
        "fp8_exclude_modules")
    # (name, module, kind, why not, whether an embedding came before it)
    linears: list[tuple[str, nn.Module, str, str | None, bool]] = []
    embedded = False

    def walk(module: nn.Module, name: str, kept: bool, excluded: bool, seen: set[int]
             ) -> None:
        nonlocal embedded
        if id(module) in seen:
            return
        seen.add(id(module))
        kept = kept or selects(module, name, keep)
        excluded = excluded or selects(module, name, out)
        embedded = embedded or isinstance(module, _EMBEDDINGS)
        kind = _kind(module)
        if kind is not None:
            why = None
            if is_float8(module):
                why = None  # converted already (torchao, or ampkit): it runs fp8
            elif kept:
                why = "kept in fp32 (keep_fp32_modules)"
            elif excluded:
                why = "excluded (fp8_exclude_modules)"
            elif (why := _why_not_type(module, kind)) is not None:
                pass
            elif module is model and kind == "Linear":
                why = ("the model itself (fp8 replaces submodules; wrap it in a "
                       "container)")
            else:
                why = _why_not_shape(_features(module, kind))
            linears.append((name, module, kind, why, embedded))
        for child_name, child in module.named_children():
            walk(child, f"{name}.{child_name}" if name else child_name, kept, excluded,
                 seen)

    walk(model, "", False, False, set())
    layers = []
    for i, (name, module, kind, why, after_embedding) in enumerate(linears):
        if why is None and not first_last and not is_float8(module):
            if i == 0 and not after_embedding:
                why = "first linear layer of the model (fp8_first_last=True converts it)"
            elif i == len(linears) - 1:
                why = "last linear layer of the model (fp8_first_last=True converts it)"
        layers.append(Fp8Layer(name, *_features(module, kind), why is None, why or _FP8,
                               kind))
    return tuple(layers)


def is_float8(module: Any) -> bool:
    """Whether ``module`` already runs in fp8: torchao's ``Float8Linear`` (by name: no
    torchao import) or ampkit's ``Float8Conv1D``, FSDP2's subclasses of them included.

    Example:
        >>> import torch
        >>> from ampkit.fp8.selection import is_float8
        >>> is_float8(torch.nn.Linear(16, 16))
        False
    """
    return is_float8_conv1d(module) or any(
        cls.__name__ == "Float8Linear" and cls.__module__.startswith("torchao.")
        for cls in type(module).__mro__)
