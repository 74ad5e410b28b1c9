"""Which fp8 layer's cast saturated or underflowed: :class:`Fp8CastWatch`.

A ``Float8Linear`` (``initialize(fp8=...)``) casts three tensors to fp8 on every step:
its input and its weight in the forward, the gradient of its output in the backward.
Each cast multiplies the tensor by a scale (torchao's dynamic scaling: the format's
largest value over the tensor's, or each row's, largest magnitude) and rounds. Two
things can go wrong, and this watch counts both, per layer and per tensor, recomputing
each cast with torchao's own scale function on the same values:

* **saturated**: a value whose scaled magnitude is beyond the format's largest finite
  value by more than rounding would cover (torchao clamps it there), or is not
  finite. Dynamic scaling prevents it for finite tensors; an Inf in the tensor
  saturates, and the zero scale it causes flushes every other value to zero;
* **underflowed**: a non-zero value that became zero in fp8. One large outlier in a
  tensor (or a row, with rowwise scaling) pushes the small values below fp8's
  smallest subnormal.

:class:`~ampkit.tools.ops.numerics_checker.NumericsChecker` runs one for a model that has
fp8 layers (its ``fp8_casts``); this class is the same, on its own.

Example:
    >>> import torch
    >>> import ampkit
    >>> from ampkit.tools.ops.fp8_casts import Fp8CastWatch
    >>> net = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(3)])
    >>> net = ampkit.initialize(net, level="O2", dtype=torch.bfloat16, fp8="tensorwise")
    >>> x = torch.randn(4, 16)
    >>> with torch.no_grad():
    ...     net[0].weight[0, 0] = 1e4  # an outlier: net[1] sees it in its input
    >>> with Fp8CastWatch(net) as watch:
    ...     net(x).float().sum().backward()
    >>> worst = watch.worst
    >>> worst.layer, worst.tensor, worst.underflowed > 0
    ('1', 'input', True)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn as nn

from ampkit.fp8.conv1d import is_float8_conv1d
from ampkit.fp8.selection import is_float8
from ampkit.torch_internals import disable_current_modes as _disable_current_modes

__all__ = ["Fp8CastRecord", "Fp8CastWatch"]


@dataclasses.dataclass(frozen=True)
class Fp8CastRecord:
    """One cast to fp8 in one layer.

    Attributes:
        layer: the Float8Linear's qualified name.
        tensor: ``"input"``, ``"weight"`` or ``"grad_output"``.
        dtype: the fp8 dtype (``"float8_e4m3fn"``, ``"float8_e5m2"``).
        numel: how many values were cast.
        saturated: values beyond the format's largest finite value, or not finite.
        underflowed: non-zero values that became zero.
        call: the n-th cast of this tensor in this layer while watching (from 0).

    Example:
        >>> from ampkit.tools.ops.fp8_casts import Fp8CastRecord
        >>> r = Fp8CastRecord("1", "input", "float8_e4m3fn", 100, 0, 25, 0)
        >>> r.saturated_fraction, r.underflowed_fraction
        (0.0, 0.25)
    """

    layer: str
    tensor: str
    dtype: str
    numel: int
    saturated: int
    underflowed: int
    call: int

    @property
    def saturated_fraction(self) -> float:
        """``saturated / numel`` (0.0 for an empty cast)."""
        return self._share(self.saturated)

    @property
    def underflowed_fraction(self) -> float:
        """``underflowed / numel`` (0.0 for an empty cast)."""
        return self._share(self.underflowed)

    def _share(self, count: int) -> float:
        return count / self.numel if self.numel else 0.0


def _count(hp: torch.Tensor, cast: Any, axiswise_dim: int, pow2: bool
           ) -> tuple[str, int, int, int]:
    from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated

    gran = cast.scaling_granularity
    scale = tensor_to_scale(hp, cast.target_dtype, scaling_granularity=gran,
                            axiswise_dim=get_maybe_axiswise_dim(axiswise_dim, gran),
                            round_scales_to_power_of_2=pow2)
    scaled = hp.to(torch.float32) * scale  # as torchao scales it
    info = torch.finfo(cast.target_dtype)
    # Beyond the largest value by more than rounding covers (half its spacing there):
    # dynamic scaling lands the largest magnitude on the largest value, give or take
    # the scale's own rounding, which is no saturation.
    limit = info.max + 2.0 ** math.floor(math.log2(info.max)) * info.eps / 2
    saturated = int((~torch.isfinite(scaled) | (scaled.abs() >= limit)).sum())
    low = to_fp8_saturated(scaled, cast.target_dtype).to(torch.float32)
    underflowed = int(((hp != 0) & torch.isfinite(hp) & (low == 0)).sum())
    return str(cast.target_dtype).removeprefix("torch."), hp.numel(), saturated, underflowed


class Fp8CastWatch:
    """Context manager counting saturated and underflowed values in every fp8 cast of
    the ``Float8Linear`` layers of ``model``; see the module doc.

    Args:
        model: a model with fp8 layers (``initialize(fp8=...)``).

    Example:
        >>> import torch
        >>> from ampkit.tools.ops.fp8_casts import Fp8CastWatch
        >>> with Fp8CastWatch(torch.nn.Linear(2, 2)) as watch:  # no fp8 layer
        ...     pass
        >>> watch.records, watch.worst
        ([], None)
    """

    def __init__(self, model: nn.Module) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        self.model = model
        self.records: list[Fp8CastRecord] = []
        self._handles: list[Any] = []
        self._calls: dict[tuple[str, str], int] = {}

    def _add(self, layer: str, tensor: str, hp: torch.Tensor, config: Any, role: str,
             axiswise_dim: int) -> None:
        from torchao.float8.config import ScalingType

        cast = getattr(config, role)
        if cast.scaling_type is ScalingType.DISABLED or hp.numel() == 0:
            return
        with _disable_current_modes(), torch.no_grad():
            dtype, numel, saturated, underflowed = _count(
                hp.detach(), cast, axiswise_dim, config.round_scales_to_power_of_2)
        call = self._calls.get((layer, tensor), 0)
        self._calls[(layer, tensor)] = call + 1
        self.records.append(Fp8CastRecord(layer, tensor, dtype, numel, saturated,
                                          underflowed, call))

    def __enter__(self) -> Fp8CastWatch:
        for name, module in self.model.named_modules():
            if not is_float8(module):
                continue
            config = module.config

            def forward(mod: Any, args: Any, name: str = name, config: Any = config
                        ) -> None:
                self._add(name, "input", args[0], config, "cast_config_input", -1)
                # the matmul's weight operand: (in, out), Linear's transposed (a
                # Conv1D stores it so)
                weight = mod.weight if is_float8_conv1d(mod) else mod.weight.t()
                self._add(name, "weight", weight, config, "cast_config_weight", 0)

            def output(mod: nn.Module, args: Any, out: Any, name: str = name,
                       config: Any = config) -> None:
                # The gradient reaching the output is the one torchao casts (the bias
                # add passes it through); a tensor hook, not a module backward hook,
                # which would wrap the module's inputs and outputs.
                if isinstance(out, torch.Tensor) and out.requires_grad:
                    def grad(g: torch.Tensor) -> None:
                        self._add(name, "grad_output", g.reshape(-1, g.shape[-1]),
                                  config, "cast_config_grad_output", -1)
                    out.register_hook(grad)

            self._handles.append(module.register_forward_pre_hook(forward))
            self._handles.append(module.register_forward_hook(output))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @property
    def worst(self) -> Fp8CastRecord | None:
        """The cast with the largest saturated fraction, else the largest underflowed
        fraction; ``None`` when no cast lost a value.

        Example:
            >>> import torch
            >>> from ampkit.tools.ops.fp8_casts import Fp8CastWatch
            >>> Fp8CastWatch(torch.nn.Linear(2, 2)).worst is None
            True
        """
        bad = [r for r in self.records if r.saturated or r.underflowed]
        if not bad:
            return None
        return max(bad, key=lambda r: (r.saturated_fraction, r.underflowed_fraction))

    def table(self) -> str:
        """The casts that lost values, worst first, as a plain-text table.

        Example:
            >>> import torch
            >>> from ampkit.tools.ops.fp8_casts import Fp8CastWatch
            >>> Fp8CastWatch(torch.nn.Linear(2, 2)).table()
            'fp8 casts: none saturated or underflowed'
        """
        from ampkit.common.text import text_table

        bad = sorted((r for r in self.records if r.saturated or r.underflowed),
                     key=lambda r: (-r.saturated_fraction, -r.underflowed_fraction))
        if not bad:
            return "fp8 casts: none saturated or underflowed"
        return "fp8 casts that lost values\n" + text_table(
            ("layer", "tensor", "call", "dtype", "saturated", "underflowed", "of"),
            [(r.layer, r.tensor, r.call, r.dtype, r.saturated, r.underflowed, r.numel)
             for r in bad], align="llrlrrr")
