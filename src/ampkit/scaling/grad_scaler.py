"""``GradScaler``: torch's gradient scaler, drop-in, and the extras the other seeds have.

The constructor, methods and ``state_dict`` are those of ``torch.amp.GradScaler``; with
default settings the scale trajectory and the skipped steps are torch's, bit for bit,
for the same gradients. Beyond torch:

* ``hysteresis``: back off only after N overflows in a row (Paddle's
  ``decr_every_n_nan_or_inf``); every overflow still skips its step;
* ``min_scale`` / ``max_scale``: floor and ceiling (apex ``min_loss_scale`` /
  ``max_loss_scale``, MXNet's 2**24 cap, MindSpore's floor of 1);
* ``dynamic=False``: static loss scaling; overflows still skip the step (ampkit never
  writes inf/NaN into weights), the scale stays put;
* float16 *and* bfloat16 gradients are unscaled (torch refuses float16 gradients in
  ``unscale_``, and bfloat16 on builds whose kernel lacks it,
  https://github.com/pytorch/pytorch/issues/127176);
* distributed agreement: an overflow skips the step on every rank that shares the
  parameters (FSDP2's shards: one all-reduce of ``found_inf`` over their mesh; DDP's
  replicas agree through their reduced gradients; a model on one rank waits for no
  one), see :mod:`ampkit.scaling.distributed`;
* reporting: ``get_scale()``, ``skipped_steps``, ``last_step_skipped``,
  ``last_overflow_step``, ``metrics()`` (for training logs, no host sync) and an
  opt-in line per skipped step (``log_skipped_steps=True``, like DeepSpeed's OVERFLOW
  line).

Skipping. A skipped step never calls ``optimizer.step()``, so parameters and
optimizer state (moments, ``state["step"]``) stay exactly as they were.
Optimizers that declare ``_step_supports_amp_scaling`` (torch's ``fused=True`` Adam,
AdamW, SGD, Adagrad from torch 2.13 on, and your own) get torch's contract: each step
they run finds the attributes ``grad_scale`` (the gradients are still scaled) and
``found_inf`` set, and they unscale and skip on the device themselves; that path reads
nothing back to the host once the optimizer has state (its first steps, until one
succeeds, are decided on the host, so that a skipped first step creates no state:
neither zero moments nor fused SGD's uninitialised momentum buffers). An optimizer
whose ``step`` takes a ``grad_scaler`` keyword is passed the scaler instead, with
torch's ``FutureWarning``, and does everything itself. Every other optimizer costs one
host sync per ``step()`` (reading ``found_inf``), as in torch.

LR schedulers are stepped by you. To leave a scheduler untouched on a skipped step
(and so never see torch's "lr_scheduler.step() before optimizer.step()" warning, which
a skipped first step raises)::

    scaler.step(optimizer)
    scaler.update()
    scaler.step_scheduler(scheduler)   # not on a skipped step; one host sync

(torch's own pattern, stepping the scheduler every iteration, is also fine: it shifts
the schedule by the few skipped steps.)

Example:
    >>> import torch
    >>> from ampkit.scaling.grad_scaler import GradScaler
    >>> model = torch.nn.Linear(2, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> scaler = GradScaler("cpu", init_scale=2.0 ** 4, hysteresis=2, min_scale=1.0)
    >>> scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    >>> scaler.step(opt)
    >>> scaler.update()
    >>> scaler.get_scale(), scaler.skipped_steps, scaler.last_step_skipped
    (16.0, 0, False)
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import warnings
from collections.abc import Iterable, Iterator
from typing import Any, overload

import torch

from ampkit import torch_internals
from ampkit.common.arguments import parse_device_type
from ampkit.common.containers import map_leaves
from ampkit.scaling.distributed import agree_on_overflow_, check_process_group
from ampkit.scaling.overflow import unscale_grads_
from ampkit.scaling.scaler_state import OptimizerRecord, OptState, ScalerState
from ampkit.scaling.schedule import ScaleSchedule, check_scale_value, update_scale_

__all__ = ["GradScaler", "OptState", "scheduler_warning_suppressed"]


_log = logging.getLogger("ampkit.scaling")


def _takes_grad_scaler(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` declares a ``grad_scaler`` parameter."""
    try:
        return "grad_scaler" in inspect.signature(optimizer.step).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False


@contextlib.contextmanager
def scheduler_warning_suppressed() -> Iterator[None]:
    """Silence torch's "lr_scheduler.step() before optimizer.step()" warning: on a step
    the scaler skipped, the optimizer did not step on purpose, and the warning would
    blame the user's code. Integrations that step schedulers for the user wrap it too.

    Example:
        >>> import torch, warnings
        >>> from ampkit.scaling.grad_scaler import scheduler_warning_suppressed
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0)
        >>> sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
        >>> with warnings.catch_warnings(record=True) as seen:
        ...     warnings.simplefilter("always")
        ...     with scheduler_warning_suppressed():
        ...         sched.step()
        >>> seen
        []
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler")
        yield


class GradScaler(ScalerState):
    """Scales the loss, unscales and checks gradients, skips steps that overflowed and
    adjusts the scale: ``torch.amp.GradScaler``'s contract, plus hysteresis, bounds, a
    static mode, bfloat16/float16/float32 gradients and distributed agreement.

    Use it exactly like torch's::

        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)        # optional: to clip or inspect gradients
        scaler.step(optimizer)            # skipped if any gradient is inf/NaN
        scaler.update()                   # once per iteration, after all step() calls

    Args:
        device: device type of the scale's home (``"cuda"``, ``"cpu"``, ...). ``None``
            (the default, unlike torch's ``"cuda"``) means ``"cuda"`` when available,
            else ``"cpu"``. ``"cuda"`` without CUDA warns and disables the scaler, as
            torch does. The scale tensor itself is created on the first scaled output's
            device.
        init_scale: starting scale; finite and > 0 (and within the bounds).
        growth_factor: multiplier after ``growth_interval`` clean steps; > 1.
        backoff_factor: multiplier on overflow; in (0, 1).
        growth_interval: clean steps in a row before growing; int >= 1.
        enabled: ``False`` makes every method a no-op and ``step`` a plain
            ``optimizer.step()``.
        hysteresis: overflows in a row before backing off; int >= 1 (1: torch).
        min_scale: floor when backing off, or ``None`` (torch: none).
        max_scale: ceiling when growing, or ``None`` (torch: none; apex: 2**24).
        dynamic: ``False`` for a static scale (``init_scale`` forever); overflowing
            steps are still skipped.
        process_group: group whose ranks must agree on overflows (one all-reduce
            per check); ``None``: the ranks that share the parameters, as their
            gradients show (the mesh of sharded ``DTensor`` gradients; none for plain
            ones), see :mod:`ampkit.scaling.distributed`.
        scale_bfloat16: scale the loss of a bfloat16 run too, as torch does. By
            default a scaler whose first ``scale()`` sees a bfloat16 run (a bfloat16
            loss, or a call inside a bfloat16 autocast region) warns and keeps a static
            scale of 1.0: bfloat16 has float32's range, so scaling by 65536 buys
            nothing; steps with inf/NaN gradients are still skipped.
        log_skipped_steps: log one line per skipped step (logger ``ampkit.scaling``,
            level WARNING: step index, scale before and after, skipped so far), like
            DeepSpeed's OVERFLOW line; costs one host sync per ``update()``.

    Raises:
        ValueError: a bad value, naming the argument (see
            :class:`~ampkit.scaling.schedule.ScaleSchedule`).

    Example:
        >>> import torch
        >>> from ampkit.scaling.grad_scaler import GradScaler
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> opt = torch.optim.SGD([w], lr=1.0)
        >>> scaler = GradScaler("cpu", init_scale=8.0)
        >>> scaler.scale((w * float("inf")).sum()).backward()  # an overflow
        >>> scaler.step(opt)                                    # skipped
        >>> scaler.update()
        >>> w.tolist(), scaler.get_scale(), scaler.skipped_steps
        ([1.0, 1.0], 4.0, 1)
    """

    def __init__(self, device: str | torch.device | None = None,
                 init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000,
                 enabled: bool = True, *, hysteresis: int = 1,
                 min_scale: float | None = None, max_scale: float | None = None,
                 dynamic: bool = True, process_group: Any = None,
                 log_skipped_steps: bool = False, scale_bfloat16: bool = False) -> None:
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
        self._device = parse_device_type(device)
        self._schedule = ScaleSchedule(
            growth_factor=growth_factor, backoff_factor=backoff_factor,
            growth_interval=growth_interval, hysteresis=hysteresis, min_scale=min_scale,
            max_scale=max_scale, dynamic=dynamic)
        self._init_scale = self._schedule.check_init_scale(init_scale)
        self._enabled = enabled
        if enabled and self._device == "cuda" and not torch.cuda.is_available():
            warnings.warn("GradScaler is enabled for device 'cuda', but CUDA is not "
                          "available; disabling it. Pass device='cpu' (or None) to scale "
                          "on CPU.", stacklevel=2)
            self._enabled = False
        self._process_group = check_process_group(process_group)
        if not isinstance(log_skipped_steps, bool):
            raise TypeError(f"log_skipped_steps must be a bool, got {log_skipped_steps!r}")
        #: print one line (logger ``ampkit.scaling``, level WARNING) per skipped step
        self.log_skipped_steps = log_skipped_steps
        if not isinstance(scale_bfloat16, bool):
            raise TypeError(f"scale_bfloat16 must be a bool, got {scale_bfloat16!r}")
        self._scale_bfloat16 = scale_bfloat16
        # iterations ended by update(): a host int, so counting costs no sync
        self._steps = 0
        # Counters as plain ints until the scale tensor exists (lazily, on the loss's device).
        self._init_growth_tracker = 0
        self._init_overflow_tracker = 0
        self._init_skipped = 0
        self._init_last_overflow = -1  # -1: none yet
        self._scale: torch.Tensor | None = None
        self._growth_tracker: torch.Tensor | None = None
        self._overflow_tracker: torch.Tensor | None = None
        self._skipped: torch.Tensor | None = None  # iterations that overflowed, int64
        self._last_overflow: torch.Tensor | None = None  # its step index, int64 (-1: none)
        self._last_found_inf: torch.Tensor | None = None  # the last updated iteration's
        self._records: dict[int, OptimizerRecord] = {}

    # -- torch's API -----------------------------------------------------------------

    @overload
    def scale(self, outputs: torch.Tensor) -> torch.Tensor: ...

    @overload
    def scale(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]: ...

    @overload
    def scale(self, outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]: ...

    @overload
    def scale(self, outputs: Iterable[torch.Tensor]) -> Iterable[torch.Tensor]: ...

    def scale(self, outputs: torch.Tensor | Iterable[torch.Tensor]
              ) -> torch.Tensor | Iterable[torch.Tensor]:
        """Multiply a tensor (or nested lists/tuples/iterables of tensors) by the scale.

        Returns ``outputs`` unchanged when the scaler is disabled. The product keeps the
        output's dtype, as torch's does.

        Example:
            >>> import torch
            >>> from ampkit.scaling.grad_scaler import GradScaler
            >>> GradScaler("cpu", init_scale=4.0).scale([torch.ones(1), torch.ones(2)])
            [tensor([4.]), tensor([4., 4.])]
        """
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            if self._scale is None:
                self._bfloat16_run(outputs)
                self._lazy_init(outputs.device)
            assert self._scale is not None
            return outputs * self._scale.to(outputs.device, non_blocking=True)

        copies: dict[torch.device, torch.Tensor] = {}

        def apply(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                if self._scale is None:
                    self._lazy_init(value.device)
                assert self._scale is not None
                if value.device not in copies:
                    copies[value.device] = self._scale.to(value.device, non_blocking=True)
                return value * copies[value.device]
            if isinstance(value, Iterable) and not isinstance(value, str | bytes):
                # torch's contract: any other iterable is scaled lazily.
                return map(lambda v: map_leaves(v, apply), value)
            raise ValueError(f"outputs must be a Tensor or an iterable of Tensors, found "
                             f"{type(value).__name__}")

        return map_leaves(outputs, apply)

    def _bfloat16_run(self, loss: torch.Tensor) -> None:
        """On the first ``scale()``: in a bfloat16 run (and unless ``scale_bfloat16``),
        keep the scale at 1.0, with a warning, and still skip overflowing steps."""
        if self._scale_bfloat16:
            return
        device = loss.device.type
        in_bf16_region = (torch.is_autocast_enabled(device)
                          and torch.get_autocast_dtype(device) is torch.bfloat16)
        if loss.dtype is not torch.bfloat16 and not in_bf16_region:
            return
        warnings.warn("GradScaler: this is a bfloat16 run (the loss is bfloat16 or is "
                      "scaled inside a bfloat16 autocast region); bfloat16 has float32's "
                      "range, so scaling the loss would buy nothing. The scale stays 1.0 "
                      "(static) and steps with inf/NaN gradients are still skipped; pass "
                      "enabled=False to drop the checks too, or scale_bfloat16=True to "
                      "scale anyway (torch.amp.GradScaler's behaviour).", stacklevel=3)
        self._init_scale = 1.0
        self._schedule = dataclasses.replace(self._schedule, dynamic=False)

    def _params_of(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        for p in params:
            grad = p.grad
            if grad is not None and grad.is_sparse and grad.dtype is torch.float16:
                p.grad = grad.coalesce()  # duplicates may overflow only once summed
        return params

    def _check_grads(self, optimizer: torch.optim.Optimizer, *, unscale: bool
                     ) -> torch.Tensor:
        """found_inf for the optimizer's gradients (agreed across ranks), unscaling them
        on the way when ``unscale``."""
        scale = self._require_scale("unscale_" if unscale else "step")
        # The reciprocal in float64, rounded to float32: torch's, so unscaled values match.
        inv_scale = scale.double().reciprocal().float() if unscale else None
        found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)
        grads = [p.grad for p in self._params_of(optimizer)]
        unscale_grads_(grads, inv_scale, found_inf)
        return agree_on_overflow_(found_inf, self._process_group, grads)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale, in place, and check them for
        inf/NaN (on every rank). Optional: ``step`` does it when you have not.

        Call it at most once per optimizer per iteration, after all backward passes,
        e.g. to clip unscaled gradients. It reads nothing back to the host.

        Raises:
            RuntimeError: if called twice for this optimizer before ``update()``, or
                after ``step()``.

        Example:
            >>> import torch
            >>> from ampkit.scaling.grad_scaler import GradScaler
            >>> w = torch.nn.Parameter(torch.ones(1))
            >>> opt = torch.optim.SGD([w], lr=0.1)
            >>> scaler = GradScaler("cpu", init_scale=1024.0)
            >>> scaler.scale(3 * w.sum()).backward()
            >>> w.grad.item()
            3072.0
            >>> scaler.unscale_(opt)
            >>> w.grad.item()
            3.0
        """
        if not self._enabled:
            return
        record = self._record(optimizer)
        if record.stage is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer in "
                               "this iteration; call scaler.step(optimizer) and then "
                               "scaler.update() before unscaling again")
        if record.stage is OptState.STEPPED:
            raise RuntimeError("unscale_() was called after step() for this optimizer; "
                               "call scaler.update() to end the iteration first")
        record.found_inf = self._check_grads(optimizer, unscale=True)
        record.stage = OptState.UNSCALED

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless ``unscale_`` already did) and run ``optimizer.step(*args,
        **kwargs)`` unless a gradient is inf/NaN on any rank; returns its result (or
        ``None`` when skipped).

        Optimizers with ``_step_supports_amp_scaling`` (``fused=True`` Adam, AdamW, SGD;
        Adagrad from torch 2.13; your own) find ``grad_scale``/``found_inf`` set and skip
        on the device: no host sync once they have state. One whose ``step`` takes
        ``grad_scaler`` is passed the scaler (with a ``FutureWarning``, as in torch).
        Others cost one host sync.

        Raises:
            RuntimeError: if called twice for this optimizer before ``update()``, or with
                a ``closure``.

        Example:
            >>> import torch
            >>> from ampkit.scaling.grad_scaler import GradScaler
            >>> w = torch.nn.Parameter(torch.ones(1))
            >>> opt = torch.optim.SGD([w], lr=0.5)
            >>> scaler = GradScaler("cpu")
            >>> scaler.scale(w.sum()).backward()
            >>> scaler.step(opt)
            >>> w.item()
            0.5
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("GradScaler.step() does not take a closure: compute the "
                               "loss, call scaler.scale(loss).backward(), then "
                               "scaler.step(optimizer)")
        record = self._record(optimizer)
        if record.stage is OptState.STEPPED:
            raise RuntimeError("step() has already been called for this optimizer in this "
                               "iteration; call scaler.update() before stepping again")
        self._require_scale("step")
        if torch_internals.step_supports_amp_scaling(optimizer):
            if _takes_grad_scaler(optimizer):
                # torch's older contract: the optimizer gets the scaler itself and does
                # the unscaling and the overflow check on its own.
                warnings.warn("GradScaler passes itself as grad_scaler= to an optimizer "
                              "whose step() takes it, as torch's GradScaler does; torch "
                              "is phasing this out in favour of the grad_scale and "
                              "found_inf attributes", FutureWarning, stacklevel=2)
                step: Any = optimizer.step  # this optimizer's step takes grad_scaler=
                result = step(*args, grad_scaler=self, **kwargs)
                record.stage = OptState.STEPPED
                return result
            still_scaled = record.stage is OptState.READY
            if still_scaled:
                record.found_inf = self._check_grads(optimizer, unscale=False)
            assert record.found_inf is not None
            # First steps, until the optimizer has state: decided on the host, so a
            # skipped one creates none (zero moments, fused SGD's uninitialised momentum
            # buffers). A step that runs gets grad_scale and found_inf, the first too.
            if not self._has_state(optimizer) and record.found_inf.item():
                record.stage = OptState.STEPPED
                return None
            return self._step_on_device(optimizer, record, args, kwargs,
                                        still_scaled=still_scaled)
        if record.stage is OptState.READY:
            self.unscale_(optimizer)
        assert record.found_inf is not None
        result = None
        if not record.found_inf.item():  # the one host sync of this path
            result = optimizer.step(*args, **kwargs)
        record.stage = OptState.STEPPED
        return result

    @staticmethod
    def _has_state(optimizer: torch.optim.Optimizer) -> bool:
        """Whether every parameter with a gradient already has optimizer state.

        A fused optimizer creates its state (zero moments) even for a step it then
        skips on the device; until the state exists, steps go the host-decided way so a
        skipped first step leaves the optimizer exactly as it was.
        """
        state = optimizer.state
        return all(p in state for group in optimizer.param_groups for p in group["params"]
                   if p.grad is not None)

    @staticmethod
    def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
        """Whether :meth:`step` decides a skip of ``optimizer`` on the device, with no
        host sync: an optimizer that takes ``grad_scale``/``found_inf`` (torch's fused
        Adam, AdamW, SGD, and Adagrad from torch 2.13) once it has state (a first
        step would create its zero moments even when skipped, so it is decided on the
        host).

        Example:
            >>> import torch
            >>> from ampkit.scaling.grad_scaler import GradScaler
            >>> w = torch.nn.Parameter(torch.ones(1))
            >>> GradScaler.skips_on_device(torch.optim.SGD([w], lr=0.1))
            False
        """
        return (torch_internals.step_supports_amp_scaling(optimizer)
                and GradScaler._has_state(optimizer))

    def _step_on_device(self, optimizer: torch.optim.Optimizer, record: OptimizerRecord,
                        args: tuple[Any, ...], kwargs: dict[str, Any], *,
                        still_scaled: bool) -> Any:
        """The optimizer unscales (``grad_scale``) and skips (``found_inf``) itself;
        ``record.found_inf`` is already set."""
        scale = self._require_scale("step")
        grad_scale: torch.Tensor | None
        if still_scaled:
            # The optimizer divides by grad_scale (times any grad_scale of the user's own).
            grad_scale = scale * getattr(optimizer, "grad_scale", 1)
        else:  # unscale_() already divided; pass only the user's own grad_scale, if any
            grad_scale = getattr(optimizer, "grad_scale", None)
        assert record.found_inf is not None
        optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
        optimizer.found_inf = record.found_inf  # type: ignore[attr-defined]
        try:
            result = optimizer.step(*args, **kwargs)
        finally:
            del optimizer.grad_scale  # type: ignore[attr-defined]
            del optimizer.found_inf  # type: ignore[attr-defined]
        record.stage = OptState.STEPPED
        return result

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """End the iteration: back off if any optimizer overflowed, grow after
        ``growth_interval`` clean iterations (within the bounds; never in static mode).

        ``new_scale`` sets the scale instead (a positive finite float, or a one-element
        float32 tensor on the scaler's device type); the bounds do not apply to it.
        Reads nothing back to the host, except a ``new_scale`` tensor's value, which is
        checked as a number is.

        Raises:
            RuntimeError: if no optimizer was stepped or unscaled in this iteration.
            ValueError: ``new_scale`` is not finite and > 0 (nothing is changed).

        Example:
            >>> import torch
            >>> from ampkit.scaling.grad_scaler import GradScaler
            >>> scaler = GradScaler("cpu", init_scale=4.0)
            >>> _ = scaler.scale(torch.ones(1))
            >>> scaler.update(new_scale=2.0)
            >>> scaler.get_scale()
            2.0
        """
        if not self._enabled:
            return
        scale = self._require_scale("update")
        assert self._growth_tracker is not None and self._overflow_tracker is not None
        assert self._skipped is not None
        found_inf = self.found_inf()
        before = scale.item() if self.log_skipped_steps and found_inf is not None else None
        if new_scale is not None:
            if isinstance(new_scale, torch.Tensor):
                if (new_scale.numel() != 1 or new_scale.requires_grad
                        or new_scale.device.type != scale.device.type):
                    raise ValueError(f"new_scale must be a float or a one-element tensor "
                                     f"on device type {scale.device.type!r} that does not "
                                     f"require grad, got {new_scale!r}")
                # Checked as a number is (one host sync, on a call that sets the
                # scale by hand): a NaN or negative scale would poison every step.
                check_scale_value(float(new_scale.detach().reshape(()).item()),
                                  "new_scale")
                scale.copy_(new_scale.reshape(()))
            else:
                scale.fill_(check_scale_value(new_scale, "new_scale"))
        else:
            if found_inf is None:
                raise RuntimeError("update() found no gradient check in this iteration; "
                                   "call scaler.step(optimizer) (or scaler.unscale_"
                                   "(optimizer)) for each optimizer before update()")
            update_scale_(scale, self._growth_tracker, self._overflow_tracker, found_inf,
                          self._schedule)
        if found_inf is not None:
            overflowed = found_inf != 0
            self._skipped += overflowed.to(torch.int64)
            assert self._last_overflow is not None
            self._last_overflow.copy_(torch.where(
                overflowed, torch.full_like(self._last_overflow, self._steps),
                self._last_overflow))
            self._last_found_inf = found_inf
            if before is not None and overflowed.item():
                _log.warning("ampkit: OVERFLOW at step %d, optimizer step skipped; loss "
                             "scale %g -> %g (%d steps skipped so far)", self._steps,
                             before, scale.item(), int(self._skipped.item()))
        self._steps += 1
        self._records = {}

    def step_scheduler(self, scheduler: Any, *args: Any, on_skip: bool = False,
                       **kwargs: Any) -> bool:
        """Step an LR scheduler after this iteration's optimizer steps, unless they were
        skipped for an overflow (``on_skip=True`` steps it anyway, without torch's
        "lr_scheduler.step() before optimizer.step()" warning, which a skipped step
        would otherwise raise). Returns whether it stepped. One host sync.

        Example:
            >>> import torch, warnings
            >>> from ampkit.scaling.grad_scaler import GradScaler
            >>> w = torch.nn.Parameter(torch.ones(1))
            >>> opt = torch.optim.SGD([w], lr=1.0)
            >>> sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            >>> scaler = GradScaler("cpu")
            >>> scaler.scale((w * float("inf")).sum()).backward()
            >>> scaler.step(opt); scaler.update()
            >>> with warnings.catch_warnings():
            ...     warnings.simplefilter("error")
            ...     scaler.step_scheduler(sched), sched.get_last_lr()
            (False, [1.0])
        """
        if self.last_step_skipped and not on_skip:
            return False
        with scheduler_warning_suppressed():
            scheduler.step(*args, **kwargs)
        return True

    def __repr__(self) -> str:
        rule = self._schedule
        extras = "".join(f", {name}={getattr(rule, name)!r}"
                         for name in ("hysteresis", "min_scale", "max_scale", "dynamic")
                         if getattr(rule, name) != getattr(ScaleSchedule, name))
        return (f"GradScaler(device={self._device!r}, scale={self.get_scale()!r}, "
                f"growth_factor={rule.growth_factor!r}, backoff_factor="
                f"{rule.backoff_factor!r}, growth_interval={rule.growth_interval!r}, "
                f"enabled={self._enabled!r}{extras})")
