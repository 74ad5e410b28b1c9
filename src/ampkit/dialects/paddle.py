"""``ampkit.paddle``: ``paddle.amp``'s API on PyTorch.

``paddle.amp.auto_cast`` becomes ``ampkit.paddle.auto_cast`` (and so on); Paddle's
tensors and layers become torch's. Op names may be Paddle's (``conv2d``, ``matmul_v2``,
``elementwise_add``, ``softmax_with_cross_entropy``, ``lookup_table_v2``, ...) or
torch's (``linear``, ``add``, a callable, an ``nn.Module`` class).

=============================  ===========================================================
Paddle                         ampkit core
=============================  ===========================================================
``auto_cast(level='O1')``      :class:`ampkit.autocast` with the ``"paddle-O1"`` preset:
                               white list low precision, black list float32, every other
                               op float32 if any input is float32, else low precision
``auto_cast(level='OD')``      preset ``"paddle-OD"``: only the white list low precision
``auto_cast(level='O2')``      preset ``"paddle-O2"`` (``use_promote=True``: like O1 with
                               only the extra black list in float32) or
                               ``"paddle-O2-no-promote"`` (everything low precision
                               except the extra black list)
``decorate(level='O2')``       :func:`ampkit.convert_model`: fp32 parameters (the
                               truth), layers compute with low-precision copies
                               made on use; BatchNorm and, for float16, LayerNorm fp32
``GradScaler``                 :class:`ampkit.GradScaler` with Paddle's names, a scale
                               floor of 1 and ``decr_every_n_nan_or_inf`` as hysteresis
=============================  ===========================================================

Custom lists follow Paddle's rule: an op put in the white list leaves the black list
and the other way round; an op in both custom lists is a ``ValueError``. The lists are
those of Paddle's ``python/paddle/amp/amp_lists.py`` (see ``docs/migration.md``).

Devices: Paddle's region casts on its global place (``paddle.set_device``), where its
tensors are created too. torch's counterpart is the default device, so
``auto_cast()`` casts ops on ``torch.get_default_device()`` (the CPU unless
``torch.set_default_device`` says otherwise), whether or not CUDA is present; a model
moved with ``.cuda()`` needs ``auto_cast(device_type="cuda")``.

As in Paddle, ``nn.Linear``/``F.linear`` run Paddle's own ``linear`` op, on none of the
lists (not ``matmul_v2``): float32 at OD, and at O1/O2 promoted to the widest input
(float32 with float32 weights). ``GradScaler.scale`` after a bfloat16 ``auto_cast``
turns a dynamic scaler off (Paddle's global AMP dtype, recorded by each ``auto_cast``
region on entry). ``white_list()``/``black_list()`` are Paddle's default lists.

What differs from Paddle, on purpose: ``auto_cast`` and ``GradScaler`` work on CPU too
(Paddle's scaler disables itself off the GPU); ``decorate``'s ``state_dict`` holds the
exact fp32 master values (cast to ``save_dtype`` when given); bfloat16 uses float16's
lists.

Example:
    >>> import torch
    >>> import ampkit.paddle as amp
    >>> conv = torch.nn.Conv2d(3, 2, 3, bias=False)
    >>> data = torch.rand(10, 3, 32, 32)
    >>> with amp.auto_cast():
    ...     conv(data).dtype
    torch.float16
    >>> with amp.auto_cast(custom_black_list={"conv2d"}):
    ...     conv(data).dtype
    torch.float32
"""

from __future__ import annotations

import numbers
import threading
import warnings
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn

from ampkit import conversion
from ampkit.arguments import parse_dtype
from ampkit.autocast_mode import autocast
from ampkit.conversion import ConversionConfig
from ampkit.dialects._errors import framework_errors
from ampkit.policy import Policy
from ampkit.presets import (
    PADDLE_BLACK_LIST,
    PADDLE_EXTRA_BLACK_LIST,
    PADDLE_O1,
    PADDLE_O2,
    PADDLE_O2_NO_PROMOTE,
    PADDLE_OD,
    PADDLE_WHITE_LIST,
)
from ampkit.registry import OpEntry
from ampkit.scaling.grad_scaler import GradScaler as _CoreGradScaler
from ampkit.scaling.schedule import check_scale_value

__all__ = ["GradScaler", "auto_cast", "black_list", "decorate", "is_bfloat16_supported",
           "is_float16_supported", "white_list"]

_DTYPES: dict[str, torch.dtype] = {"float16": torch.float16, "bfloat16": torch.bfloat16}
_SAVE_DTYPES: dict[str, torch.dtype] = {"float16": torch.float16, "bfloat16": torch.bfloat16,
                                        "float32": torch.float32}
_LEVELS = ("O0", "OD", "O1", "O2")


def _low_dtype(dtype: Any) -> torch.dtype:
    try:
        return parse_dtype(dtype, "dtype", accept=_DTYPES.values(), aliases=False)
    except ValueError:  # Paddle's wording
        raise ValueError(f"dtype should be 'float16' or 'bfloat16' (or torch.float16 / "
                         f"torch.bfloat16), got {dtype!r}") from None


def _check_bool(value: Any, argument: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{argument} must be a bool, got {type(value).__name__}")
    return value


def _level_policy(level: str, use_promote: bool) -> Policy:
    if level == "OD":
        return PADDLE_OD
    if level == "O2":
        return PADDLE_O2 if use_promote else PADDLE_O2_NO_PROMOTE
    return PADDLE_O1  # O1, and O0 (a disabled region)


def auto_cast(enable: bool = True, custom_white_list: Iterable[OpEntry] | None = None,
              custom_black_list: Iterable[OpEntry] | None = None, level: str = "O1",
              dtype: str | torch.dtype = "float16", use_promote: bool = True, *,
              device_type: str | None = None) -> autocast:
    """Paddle's ``auto_cast``: a context manager (and decorator) that runs ops in mixed
    precision by Paddle's lists and level.

    Args:
        enable: ``False`` runs everything as it is (float32 stays float32).
        custom_white_list: ops to run in ``dtype`` (set, list or tuple of Paddle or
            torch op names, callables, module classes).
        custom_black_list: ops to run in float32.
        level: ``'O1'`` (mixed), ``'OD'`` (only the white list low precision),
            ``'O2'`` (pure low precision, with :func:`decorate`) or ``'O0'`` (off).
        dtype: ``'float16'`` or ``'bfloat16'`` (or the torch dtype).
        use_promote: at O2, an op with a float32 input runs in float32.
        device_type: an ampkit extra: the device whose ops are cast. ``None`` follows
            torch's global default device (``torch.get_default_device()``, ``"cpu"``
            unless ``torch.set_default_device`` changed it), as Paddle's region follows
            its global place: on a machine with CUDA, ``auto_cast()`` casts the ops of a
            model on the CPU; pass ``device_type="cuda"`` (or set the default device,
            Paddle's ``paddle.set_device("gpu")``) for a model on the GPU.

    Raises:
        ValueError: a bad ``level`` or ``dtype``, an op in both custom lists, an
            unknown op name (with the closest known names).
        TypeError: ``enable`` or ``use_promote`` not a bool; a list that is not a set,
            list or tuple.

    Example:
        >>> import torch
        >>> import ampkit.paddle as amp
        >>> a, b = torch.rand(2, 3), torch.rand(2, 3)
        >>> with amp.auto_cast(custom_white_list={"elementwise_add"}, level="O2"):
        ...     (a + b).dtype
        torch.float16
        >>> with amp.auto_cast(level="OD"):
        ...     torch.softmax(a.half(), -1).dtype     # OD: all but the white list fp32
        torch.float32
    """
    _check_bool(enable, "enable")
    _check_bool(use_promote, "use_promote")
    if level not in _LEVELS:
        raise ValueError(f"level should be one of {list(_LEVELS)}, got {level!r}")
    low = _low_dtype(dtype)
    policy = _level_policy(level, use_promote).with_lists(
        custom_white_list, custom_black_list, framework="paddle")
    device = device_type or torch.get_default_device().type
    return _Region(device, low, enabled=enable and level != "O0", policy=policy)


# Paddle's global AMP state: the dtype of the auto_cast entered last (enabled or not),
# which GradScaler.scale reads.
_amp_lock = threading.Lock()
_amp_dtype = "float16"


def _last_amp_dtype() -> str:
    with _amp_lock:
        return _amp_dtype


class _Region(autocast):
    """``auto_cast``'s region: ``ampkit.autocast`` that, like Paddle's ``amp_guard``,
    records its dtype as the global AMP dtype on entry."""

    def __enter__(self) -> autocast:
        global _amp_dtype
        with _amp_lock:
            _amp_dtype = str(self.dtype).removeprefix("torch.")
        return super().__enter__()


def white_list() -> dict[str, dict[str, set[str]]]:
    """Paddle's default white lists, ``{dtype: {level: set of op names}}`` (copies):
    the ops ``auto_cast`` runs in low precision at each level, in Paddle's names. The
    names without a torch counterpart are left out (``docs/migration.md``); bfloat16
    uses float16's lists.

    Example:
        >>> import ampkit.paddle as amp
        >>> "matmul_v2" in amp.white_list()["float16"]["OD"]
        True
    """
    return {dtype: {level: set(PADDLE_WHITE_LIST) for level in ("OD", "O1", "O2")}
            for dtype in ("float16", "bfloat16")}


def black_list() -> dict[str, dict[str, set[str]]]:
    """Paddle's default black lists, ``{dtype: {level: set of op names}}`` (copies):
    the ops ``auto_cast`` keeps in float32 (none at OD, where every op off the white
    list is float32; only the extra black list at O2).

    Example:
        >>> import ampkit.paddle as amp
        >>> sorted(amp.black_list()["float16"]["O2"])[:2]
        ['bicubic_interp_v2', 'bilinear_interp_v2']
    """
    levels = {"OD": set(), "O1": {*PADDLE_BLACK_LIST, *PADDLE_EXTRA_BLACK_LIST},
              "O2": set(PADDLE_EXTRA_BLACK_LIST)}
    return {dtype: {level: set(ops) for level, ops in levels.items()}
            for dtype in ("float16", "bfloat16")}


def _supported(dtype: torch.dtype, device: str | None) -> bool:
    device_type = device or torch.get_default_device().type
    if not isinstance(device_type, str):
        raise TypeError(f"device must be None or a device name such as 'cpu' or 'gpu', "
                        f"got {device!r}")
    device_type = {"gpu": "cuda"}.get(device_type.split(":")[0], device_type.split(":")[0])
    try:
        return bool(torch.amp.is_autocast_available(device_type)) and (
            device_type != "cuda" or dtype is torch.float16
            or torch.cuda.is_bf16_supported())
    except RuntimeError:  # not a device type torch knows
        return False


def is_float16_supported(device: str | None = None) -> bool:
    """Whether ``auto_cast`` can run float16 on ``device`` (``None``: torch's default
    device; Paddle's ``'gpu'`` is torch's ``'cuda'``).

    Example:
        >>> import ampkit.paddle as amp
        >>> amp.is_float16_supported("cpu")
        True
    """
    return _supported(torch.float16, device)


def is_bfloat16_supported(device: str | None = None) -> bool:
    """Whether ``auto_cast`` can run bfloat16 on ``device`` (see
    :func:`is_float16_supported`).

    Example:
        >>> import ampkit.paddle as amp
        >>> amp.is_bfloat16_supported("cpu")
        True
    """
    return _supported(torch.bfloat16, device)


# -- decorate ------------------------------------------------------------------------------

def _as_list(value: Any, kind: type, argument: str) -> tuple[list[Any], bool]:
    if isinstance(value, kind):
        return [value], True
    if isinstance(value, list | tuple) and value and all(isinstance(v, kind) for v in value):
        return list(value), False
    raise TypeError(f"{argument} must be a {kind.__module__}.{kind.__qualname__} or a "
                    f"non-empty list of them, got {type(value).__name__}")


def _excluded(excluded_layers: Any) -> tuple[Any, ...]:
    if excluded_layers is None:
        return ()
    items = (excluded_layers if isinstance(excluded_layers, list | tuple)
             else [excluded_layers])
    for item in items:
        if not (isinstance(item, nn.Module)
                or (isinstance(item, type) and issubclass(item, nn.Module))):
            raise TypeError(f"excluded_layers must be a layer, a layer class, or a list of "
                            f"them, got {item!r}")
    return tuple(items)


def decorate(models: nn.Module | list[nn.Module],
             optimizers: torch.optim.Optimizer | list[torch.optim.Optimizer] | None = None,
             level: str = "O1", dtype: str | torch.dtype = "float16",
             master_weight: bool | None = None, save_dtype: str | torch.dtype | None = None,
             master_grad: bool = False,
             excluded_layers: nn.Module | type | list[Any] | None = None) -> Any:
    """Paddle's ``decorate``: at O2, store the models' parameters in ``dtype`` (except
    BatchNorm, LayerNorm for float16, and ``excluded_layers``) and let the optimizers
    update fp32 master weights; at O1 (or OD) change nothing.

    Args:
        models: a module or a list of modules (fp32).
        optimizers: an optimizer, a list of them, or ``None``.
        level: ``'O1'``, ``'OD'`` or ``'O2'``.
        dtype: ``'float16'`` or ``'bfloat16'``.
        master_weight: O2 keeps fp32 master weights unless ``False``.
        save_dtype: ``model.state_dict()`` reports floating values in this dtype
            (``'float16'``, ``'bfloat16'``, ``'float32'``) instead of as stored.
        master_grad: Paddle's fp32 master gradients; ampkit's master weights always
            receive the gradients in fp32, so both values train the same.
        excluded_layers: layers (instances or classes) kept in fp32.

    Returns:
        ``models``, or ``(models, optimizers)`` when optimizers are given, each in the
        shape given (the same objects, changed in place).

    Raises:
        ValueError: a bad ``level``, ``dtype`` or ``save_dtype``; a model that is not
            fp32.
        TypeError: models or optimizers of the wrong type; ``master_weight`` not a bool
            or ``None``; ``master_grad`` not a bool; bad ``excluded_layers``.

    Example:
        >>> import torch
        >>> import ampkit.paddle as amp
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
        >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
        >>> net, opt = amp.decorate(net, opt, level="O2", dtype="bfloat16")
        >>> net[0].weight.dtype, net[1].weight.dtype  # fp32 truth, bf16 copies on use
        (torch.float32, torch.float32)
        >>> {p.dtype for g in opt.param_groups for p in g["params"]}
        {torch.float32}
    """
    if level not in ("O1", "OD", "O2"):
        raise ValueError(f"level should be 'O1', 'OD' or 'O2' (O1: mixed precision, O2: "
                         f"pure low precision), got {level!r}")
    model_list, one_model = _as_list(models, nn.Module, "models")
    opt_list, one_opt = (([], True) if optimizers is None else
                         _as_list(optimizers, torch.optim.Optimizer, "optimizers"))
    low = _low_dtype(dtype)
    if master_weight is not None:
        _check_bool(master_weight, "master_weight")
    _check_bool(master_grad, "master_grad")
    try:
        saved = parse_dtype(save_dtype, "save_dtype", accept=_SAVE_DTYPES.values(),
                            allow_none=True, aliases=False)
    except ValueError:  # Paddle's wording
        raise ValueError(f"save_dtype should be None or one of {list(_SAVE_DTYPES)}, got "
                         f"{save_dtype!r}") from None
    excluded = _excluded(excluded_layers)
    if level == "O2":
        from torch.nn.modules.batchnorm import _BatchNorm

        kept: tuple[Any, ...] = (_BatchNorm,) + ((nn.LayerNorm,) if low is torch.float16
                                                 else ()) + excluded
        # master_weight (the default): the fp32 parameters stay the truth and the
        # layers compute with low-precision copies made on use; False: the
        # parameters themselves are stored in low precision (Paddle's pure fp16).
        masters = master_weight is not False
        config = ConversionConfig(param_dtype=None if masters else low,
                                  param_compute_dtype=low if masters else None,
                                  keep_fp32_modules=kept, kept_output_dtype=low,
                                  state_dict_dtype=saved)
        # Check every model before changing any, so a refused call changes nothing.
        plans = [conversion.prepare_conversion(m, config) for m in model_list]
        for model, plan in zip(model_list, plans):
            if plan is not None:
                conversion.apply_conversion(model, config, plan)
    out_models = model_list[0] if one_model else type(models)(model_list)
    if optimizers is None:
        return out_models
    kind: Any = type(optimizers)  # the list or tuple type the optimizers came in
    out_opts = opt_list[0] if one_opt else kind(opt_list)
    return out_models, out_opts


# -- GradScaler ----------------------------------------------------------------------------

# Paddle's names for the core scaler's settings and state (its state_dict keys, in
# Paddle's order): the one table the constructor's errors, state_dict and
# load_state_dict translate by.
_SETTINGS = {"incr_ratio": "growth_factor", "decr_ratio": "backoff_factor",
             "incr_every_n_steps": "growth_interval",
             "decr_every_n_nan_or_inf": "hysteresis"}
_STATE = {"scale": "scale", **_SETTINGS, "incr_count": "_growth_tracker",
          "decr_count": "_overflow_tracker", "use_dynamic_loss_scaling": "dynamic"}

# ampkit's argument names in the core's errors -> Paddle's.
_RENAMES = {"init_scale": "init_loss_scaling", **{core: paddle for paddle, core in
                                                   _SETTINGS.items()}}


def _as_float(value: Any, argument: str) -> float:
    if isinstance(value, torch.Tensor):
        value = value.detach().reshape(-1)[0].item()
    elif hasattr(value, "item"):  # numpy arrays and scalars, as Paddle saves them
        value = value.item() if getattr(value, "size", 1) == 1 else value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{argument} must be a number, got {type(value).__name__}")
    return float(value)


class GradScaler:
    """Paddle's ``GradScaler``: scales the loss, unscales and checks the gradients,
    skips the step on inf/NaN and adjusts the scale.

    Args:
        enable: ``False`` makes every method a pass-through.
        init_loss_scaling: the starting scale.
        incr_ratio: the factor the scale grows by; > 1.
        decr_ratio: the factor it shrinks by; in (0, 1).
        incr_every_n_steps: clean steps in a row before it grows.
        decr_every_n_nan_or_inf: overflows in a row before it shrinks (each one skips
            its step).
        use_dynamic_loss_scaling: ``False`` keeps ``init_loss_scaling`` (overflowing
            steps are still skipped).

    The scale never goes below 1, as in Paddle.

    Raises:
        ValueError, TypeError: a bad value, named with Paddle's argument names.

    Example:
        >>> import torch
        >>> import ampkit.paddle as amp
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> scaler = amp.GradScaler(init_loss_scaling=1024)
        >>> with amp.auto_cast():
        ...     loss = model(torch.rand(4, 2)).float().mean()
        >>> scaled = scaler.scale(loss)
        >>> scaled.backward()
        >>> _ = scaler.minimize(opt, scaled)
        >>> opt.zero_grad()
        >>> scaler.state_dict()["scale"]
        1024.0
    """

    def __init__(self, enable: bool = True, init_loss_scaling: float = 65536.0,
                 incr_ratio: float = 2.0, decr_ratio: float = 0.5,
                 incr_every_n_steps: int = 2000, decr_every_n_nan_or_inf: int = 1,
                 use_dynamic_loss_scaling: bool = True) -> None:
        _check_bool(enable, "enable")
        _check_bool(use_dynamic_loss_scaling, "use_dynamic_loss_scaling")
        with framework_errors(names=_RENAMES):
            self._scaler = _CoreGradScaler(
                None, init_scale=init_loss_scaling, growth_factor=incr_ratio,
                backoff_factor=decr_ratio, growth_interval=incr_every_n_steps,
                enabled=enable, hysteresis=decr_every_n_nan_or_inf, min_scale=1.0,
                dynamic=use_dynamic_loss_scaling)
        self._init_loss_scaling = float(init_loss_scaling)

    # -- the training step ---------------------------------------------------------------

    def scale(self, var: torch.Tensor) -> torch.Tensor:
        """The loss times the current scale (``var`` itself when disabled).

        Example:
            >>> import torch
            >>> import ampkit.paddle as amp
            >>> amp.GradScaler(init_loss_scaling=8.0).scale(torch.tensor(2.0))
            tensor(16.)
        """
        if not isinstance(var, torch.Tensor):
            raise TypeError(f"var must be a torch.Tensor, got {type(var).__name__}")
        dtype = _last_amp_dtype()
        if self._scaler.is_enabled() and self._scaler.schedule.dynamic and (
                dtype != "float16"):
            # Paddle's rule: dynamic loss scaling is for float16 only; after a bfloat16
            # auto_cast the scaler turns itself off for good (a pass-through).
            warnings.warn(f"GradScaler: dynamic loss scaling is not used with {dtype} "
                          f"(the last auto_cast's dtype), so the scaler disables itself, "
                          f"as Paddle's does", UserWarning, stacklevel=2)
            self._scaler = _CoreGradScaler(None, enabled=False, dynamic=False)
        return self._scaler.scale(var)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale and check them for inf/NaN.

        Raises:
            RuntimeError: called twice for one optimizer before ``update()``, or after
                ``step()``.

        Example:
            >>> import torch
            >>> import ampkit.paddle as amp
            >>> w = torch.nn.Parameter(torch.ones(1))
            >>> opt = torch.optim.SGD([w], lr=0.1)
            >>> scaler = amp.GradScaler(init_loss_scaling=4.0)
            >>> scaler.scale(w.sum()).backward()
            >>> scaler.unscale_(opt)
            >>> w.grad.item()
            1.0
        """
        self._scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale (unless done) and run ``optimizer.step()`` unless a gradient is
        inf/NaN. Call :meth:`update` after it.

        Raises:
            RuntimeError: called twice for one optimizer before ``update()``.

        Example:
            >>> import torch
            >>> import ampkit.paddle as amp
            >>> w = torch.nn.Parameter(torch.ones(1))
            >>> opt = torch.optim.SGD([w], lr=0.5)
            >>> scaler = amp.GradScaler()
            >>> scaler.scale(w.sum()).backward()
            >>> scaler.step(opt)
            >>> scaler.update()
            >>> w.item()
            0.5
        """
        self._scaler.step(optimizer)

    def update(self) -> None:
        """Adjust the scale after the step(s) of this iteration.

        Example:
            >>> import torch
            >>> import ampkit.paddle as amp
            >>> w = torch.nn.Parameter(torch.ones(1))
            >>> opt = torch.optim.SGD([w], lr=0.5)
            >>> scaler = amp.GradScaler(init_loss_scaling=8.0)
            >>> scaler.scale(w.sum() * float("inf")).backward()
            >>> scaler.step(opt)
            >>> scaler.update()
            >>> w.item(), scaler.state_dict()["scale"]
            (1.0, 4.0)
        """
        self._scaler.update()

    def minimize(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any
                 ) -> tuple[list[Any], list[tuple[torch.Tensor, torch.Tensor]]] | tuple[
                     None, None]:
        """:meth:`step` then :meth:`update`, returning what Paddle's ``minimize``
        returns in dynamic graph mode: ``(optimize_ops, params_grads)``, that is ``[]``
        and the ``(parameter, gradient)`` pairs the step applied (unscaled), or
        ``(None, None)`` when an overflow skipped the step. Paddle passes the remaining
        arguments (the scaled loss) to ``optimizer.minimize``, which in dynamic graph
        mode only applies the gradients already computed; torch's ``step()`` does the
        same, so they are not used.

        Example:
            >>> import torch
            >>> import ampkit.paddle as amp
            >>> w = torch.nn.Parameter(torch.ones(1))
            >>> opt = torch.optim.SGD([w], lr=0.5)
            >>> scaler = amp.GradScaler()
            >>> scaled = scaler.scale(w.sum())
            >>> scaled.backward()
            >>> ops, params_grads = scaler.minimize(opt, scaled)
            >>> ops, params_grads[0][0] is w, params_grads[0][1].item(), w.item()
            ([], True, 1.0, 0.5)
        """
        self._scaler.step(optimizer)
        self._scaler.update()
        if self._scaler.last_step_skipped:
            return None, None
        return [], [(p, p.grad) for group in optimizer.param_groups for p in group["params"]
                    if p.grad is not None]

    # -- settings ------------------------------------------------------------------------

    def is_enable(self) -> bool:
        """Whether the scaler is enabled.

        Example:
            >>> import ampkit.paddle as amp
            >>> amp.GradScaler(enable=False).is_enable()
            False
        """
        return self._scaler.is_enabled()

    def is_use_dynamic_loss_scaling(self) -> bool:
        """Whether the scale is dynamic.

        Example:
            >>> import ampkit.paddle as amp
            >>> amp.GradScaler(use_dynamic_loss_scaling=False).is_use_dynamic_loss_scaling()
            False
        """
        return self._scaler.schedule.dynamic

    def get_init_loss_scaling(self) -> float:
        """The initial scale (as constructed or last set).

        Example:
            >>> import ampkit.paddle as amp
            >>> amp.GradScaler().get_init_loss_scaling()
            65536.0
        """
        return self._init_loss_scaling

    def set_init_loss_scaling(self, new_init_loss_scaling: float) -> None:
        """Set the initial scale; the current scale becomes it too (as in Paddle).

        Example:
            >>> import ampkit.paddle as amp
            >>> scaler = amp.GradScaler()
            >>> scaler.set_init_loss_scaling(128)
            >>> scaler.get_init_loss_scaling(), scaler.state_dict()["scale"]
            (128.0, 128.0)
        """
        value = check_scale_value(_as_float(new_init_loss_scaling, "new_init_loss_scaling"),
                                  "new_init_loss_scaling")
        self._replace(scale=value)
        self._init_loss_scaling = value

    def get_incr_ratio(self) -> float:
        """The growth factor.

        Example:
            >>> import ampkit.paddle as amp
            >>> amp.GradScaler().get_incr_ratio()
            2.0
        """
        return self._scaler.get_growth_factor()

    def set_incr_ratio(self, new_incr_ratio: float) -> None:
        """Set the growth factor (> 1).

        Example:
            >>> import ampkit.paddle as amp
            >>> scaler = amp.GradScaler()
            >>> scaler.set_incr_ratio(3.0)
            >>> scaler.get_incr_ratio()
            3.0
        """
        self._replace(growth_factor=new_incr_ratio)

    def get_decr_ratio(self) -> float:
        """The backoff factor.

        Example:
            >>> import ampkit.paddle as amp
            >>> amp.GradScaler().get_decr_ratio()
            0.5
        """
        return self._scaler.get_backoff_factor()

    def set_decr_ratio(self, new_decr_ratio: float) -> None:
        """Set the backoff factor (in (0, 1)).

        Example:
            >>> import ampkit.paddle as amp
            >>> scaler = amp.GradScaler()
            >>> scaler.set_decr_ratio(0.25)
            >>> scaler.get_decr_ratio()
            0.25
        """
        self._replace(backoff_factor=new_decr_ratio)

    def get_incr_every_n_steps(self) -> int:
        """Clean steps in a row before the scale grows.

        Example:
            >>> import ampkit.paddle as amp
            >>> amp.GradScaler().get_incr_every_n_steps()
            2000
        """
        return self._scaler.get_growth_interval()

    def set_incr_every_n_steps(self, new_incr_every_n_steps: int) -> None:
        """Set the clean steps in a row before the scale grows.

        Example:
            >>> import ampkit.paddle as amp
            >>> scaler = amp.GradScaler()
            >>> scaler.set_incr_every_n_steps(100)
            >>> scaler.get_incr_every_n_steps()
            100
        """
        self._replace(growth_interval=new_incr_every_n_steps)

    def get_decr_every_n_nan_or_inf(self) -> int:
        """Overflows in a row before the scale shrinks.

        Example:
            >>> import ampkit.paddle as amp
            >>> amp.GradScaler(decr_every_n_nan_or_inf=2).get_decr_every_n_nan_or_inf()
            2
        """
        return self._scaler.schedule.hysteresis

    def set_decr_every_n_nan_or_inf(self, new_decr_every_n_nan_or_inf: int) -> None:
        """Set the overflows in a row before the scale shrinks.

        Example:
            >>> import ampkit.paddle as amp
            >>> scaler = amp.GradScaler()
            >>> scaler.set_decr_every_n_nan_or_inf(3)
            >>> scaler.get_decr_every_n_nan_or_inf()
            3
        """
        self._replace(hysteresis=new_decr_every_n_nan_or_inf)

    def _replace(self, **changes: Any) -> None:
        if not self._scaler.is_enabled():
            return  # a disabled scaler has no state to change, as in Paddle
        state = {**self._scaler.state_dict(), **changes}
        with framework_errors(names=_RENAMES):
            self._scaler.load_state_dict(state)

    # -- checkpoints -----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Paddle's keys: ``scale``, ``incr_ratio``, ``decr_ratio``,
        ``incr_every_n_steps``, ``decr_every_n_nan_or_inf``, ``incr_count``,
        ``decr_count``, ``use_dynamic_loss_scaling``; empty when disabled.

        Example:
            >>> import ampkit.paddle as amp
            >>> sorted(amp.GradScaler().state_dict())[:3]
            ['decr_count', 'decr_every_n_nan_or_inf', 'decr_ratio']
        """
        core = self._scaler.state_dict()
        if not core:
            return {}
        return {paddle: core[name] for paddle, name in _STATE.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (a no-op when disabled).

        Raises:
            RuntimeError: the dict is empty (saved from a disabled scaler).
            ValueError: keys missing or unknown (named), or a bad value.

        Example:
            >>> import ampkit.paddle as amp
            >>> scaler = amp.GradScaler()
            >>> scaler.load_state_dict({**scaler.state_dict(), "scale": 512.0})
            >>> scaler.state_dict()["scale"]
            512.0
        """
        if not self._scaler.is_enabled():
            return
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
        if not state_dict:
            raise RuntimeError("the input state dict is empty, probably saved from a "
                               "disabled GradScaler; there is no scale to restore")
        missing = [k for k in _STATE if k not in state_dict]
        unknown = sorted(str(k) for k in state_dict if k not in _STATE)
        if missing or unknown:
            raise ValueError(f"GradScaler.load_state_dict: missing keys {missing}, unknown "
                             f"keys {unknown}; expected {list(_STATE)}")
        scale = check_scale_value(_as_float(state_dict["scale"], "state_dict['scale']"),
                                  "state_dict['scale']")
        self._init_loss_scaling = scale  # Paddle: the loaded scale is the initial one
        loaded = {name: state_dict[paddle] for paddle, name in _STATE.items()}
        self._replace(**{**loaded, "scale": scale})

    def __repr__(self) -> str:
        return f"ampkit.paddle.{self._scaler!r}"
