"""Per-layer fp8 error against bf16 and fp32: :func:`fp8_layer_errors`.

For every Linear that can run in fp8 (shape and type, see
:func:`ampkit.fp8.select_fp8_layers`; the first and last are measured too, since the
point is to decide), the layer's own error is measured locally, on the input it really
receives: the model runs once in float32, each Linear's input is kept, and then each
layer computes its three matmuls three ways from that input:

* **fp32**: the reference (fp32 input, weight and output gradient);
* **low** (bf16 by default): input, weight and output gradient rounded to the low
  dtype, as O2 computes the layer;
* **fp8**: torchao's ``Float8Linear`` built from the layer with the recipe, given the
  same low-precision input and output gradient, as ``initialize(fp8=...)`` computes it.

For the output, the input gradient and the weight gradient, the fp8 and low errors
against fp32 are :class:`~ampkit.tools.accuracy.comparison.ErrorStats` (relative error: the largest
absolute error over the largest fp32 magnitude), and ``output_fp8_vs_low`` compares
fp8 with the low run directly. The output gradient is a fixed random tensor (seeded),
the same for all three. An error a layer only passes on is not charged to it: each
layer starts from the float32 run's input. ``ampkit.compare(..., fp8=...)`` adds these
rows to its :class:`~ampkit.tools.accuracy.comparison.Comparison`.

Example:
    >>> import torch
    >>> from ampkit.tools.accuracy.fp8_errors import fp8_layer_errors
    >>> _ = torch.manual_seed(0)
    >>> net = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(),
    ...                           torch.nn.Linear(32, 16))
    >>> rows = fp8_layer_errors(net, torch.randn(8, 32), fp8="tensorwise")
    >>> [r.layer for r in rows]
    ['0', '2']
    >>> all(r.output_fp8.max_rel > r.output_low.max_rel for r in rows)  # fp8 coarser
    True
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ampkit.fp8.conv1d import conv1d_features, is_hf_conv1d
from ampkit.fp8.recipe import float8_linear_config, recipe_name
from ampkit.fp8.selection import select_fp8_layers
from ampkit.policies.policy import as_dtype
from ampkit.tools.accuracy.comparison import ErrorStats, Fp8LayerError

__all__ = ["fp8_layer_errors"]


def _inputs_of(model: nn.Module, names: set[str], inputs: tuple[Any, ...]
               ) -> dict[str, torch.Tensor]:
    """The float32 input of each named Linear's first call, in a float32 run."""
    seen: dict[str, torch.Tensor] = {}
    handles = []
    for name, module in model.named_modules():
        if name in names:
            def keep(mod: nn.Module, args: Any, name: str = name) -> None:
                seen.setdefault(name, args[0].detach().to(torch.float32).clone())
            handles.append(module.register_forward_pre_hook(keep))
    try:
        with torch.no_grad():
            model(*inputs)
    finally:
        for h in handles:
            h.remove()
    return seen


def _as_linear(module: nn.Module) -> nn.Linear:
    if isinstance(module, nn.Linear):
        return module
    assert is_hf_conv1d(module)
    weight, bias = module.weight, module.bias
    assert isinstance(weight, torch.Tensor) and isinstance(bias, torch.Tensor)
    linear = nn.Linear(*conv1d_features(module), device=weight.device)
    with torch.no_grad():
        linear.weight.copy_(weight.t())
        linear.bias.copy_(bias)
    return linear


def _three_ways(layer: nn.Linear, x: torch.Tensor, low: torch.dtype, config: Any,
                seed: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(output, grad_input, grad_weight) in fp32, low precision and fp8."""
    from torchao.float8.float8_linear import Float8Linear

    out_shape = (*x.shape[:-1], layer.out_features)
    g = torch.randn(out_shape, generator=torch.Generator(x.device.type).manual_seed(seed),
                    device=x.device)
    results = []
    w, b = layer.weight.detach(), None if layer.bias is None else layer.bias.detach()
    for kind in ("fp32", "low", "fp8"):
        dtype = torch.float32 if kind == "fp32" else low
        xin = x.to(dtype).requires_grad_()
        if kind == "fp8":
            fp8 = Float8Linear.from_float(copy.deepcopy(layer), config=config)
            out = fp8(xin)
            weight = fp8.weight
        else:
            weight = w.to(dtype).requires_grad_()
            out = F.linear(xin, weight, None if b is None else b.to(dtype))
        grad_weight, = torch.autograd.grad(out, [weight], g.to(out.dtype), retain_graph=True)
        grad_input, = torch.autograd.grad(out, [xin], g.to(out.dtype))
        results.append((out.detach(), grad_input, grad_weight))
    return results


def fp8_layer_errors(model: nn.Module, *inputs: Any, fp8: Any = "tensorwise",
                     dtype: torch.dtype | str = torch.bfloat16, seed: int = 0
                     ) -> tuple[Fp8LayerError, ...]:
    """Measure every fp8-capable Linear of ``model`` on ``model(*inputs)``; see the
    module doc.

    Args:
        model: an fp32 model (not changed: a deep copy runs).
        inputs: the forward's positional arguments (a small batch).
        fp8: the recipe (as ``initialize``'s ``fp8=``).
        dtype: the low dtype the fp8 layer's activations come in, and of the low run.
        seed: seeds the output gradient.

    Returns:
        one :class:`Fp8LayerError` per Linear that can run fp8, in module order.

    Raises:
        ImportError: torchao is missing (names ``ampkit[fp8]``).
        ValueError: an unknown recipe or dtype.

    Example:
        >>> import torch
        >>> from ampkit.tools.accuracy.fp8_errors import fp8_layer_errors
        >>> fp8_layer_errors(torch.nn.Linear(3, 2), torch.ones(1, 3))  # 3: not fp8-able
        ()
    """
    config = float8_linear_config(fp8)
    name = recipe_name(fp8)
    low = as_dtype(dtype, allow_none=False)
    assert low is not None
    reference = copy.deepcopy(model).float()
    # the model itself is never an fp8 layer, so a wrapper lets a bare Linear be measured
    wrapped = nn.Sequential(reference)
    able = [x.name[2:] if x.name.startswith("0.") else "" for x in
            select_fp8_layers(wrapped, first_last=True) if x.fp8]
    # a Conv1D is measured as the Linear it is (its weight transposed): Float8Conv1D
    # computes exactly what Float8Linear computes from that weight
    modules = dict(reference.named_modules())
    seen = _inputs_of(reference, set(able), inputs)
    rows = []
    for layer in able:
        if layer not in seen:
            continue  # never called in this forward
        fp32, lowp, f8 = _three_ways(_as_linear(modules[layer]), seen[layer], low, config,
                                     seed)
        rows.append(Fp8LayerError(
            layer, name, str(low),
            ErrorStats.between([f8[0]], [fp32[0]]), ErrorStats.between([lowp[0]], [fp32[0]]),
            ErrorStats.between([f8[0]], [lowp[0].float()]),
            ErrorStats.between([f8[1]], [fp32[1]]), ErrorStats.between([lowp[1]], [fp32[1]]),
            ErrorStats.between([f8[2]], [fp32[2]]), ErrorStats.between([lowp[2]], [fp32[2]])))
    return tuple(rows)
