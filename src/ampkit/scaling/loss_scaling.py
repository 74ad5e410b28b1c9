"""Several losses and optimizers: apex-style ``scale_loss`` with one scaler per loss id.

:func:`configure_loss_scaling` sets up one :class:`~ampkit.scaling.grad_scaler.GradScaler`
per loss id (``ampkit.initialize`` calls it with the level's settings); :func:`scale_loss`
is the context manager around each backward pass::

    configure_loss_scaling("dynamic", num_losses=2)
    with scale_loss(loss_a, optimizer, loss_id=0) as scaled:
        scaled.backward()
    with scale_loss(loss_b, optimizer, loss_id=1) as scaled:
        scaled.backward()
    optimizer.step()          # a no-op if either loss overflowed

What happens to each optimizer given:

* on entry, gradients already there (unscaled, from an earlier loss) are put aside, so
  the backward pass leaves only this loss's scaled gradients;
* on exit they are unscaled with this loss's scale (overflow agreed across ranks)
  and the loss's scale is updated; the gradients put aside are added back, after a
  check of their own (an inf among them, say left over from a skipped iteration that
  was never zeroed, skips the step too, without lowering this loss's scale); on
  overflow the optimizer's next ``step()`` returns ``None``
  without doing anything (parameters and optimizer state untouched);
* ``delay_unscale=True`` (gradient accumulation over micro-batches) leaves the scaled
  gradients in place for the next ``scale_loss`` with the same ``loss_id``; until an
  undelayed one unscales them, ``optimizer.step()`` raises instead of applying scaled
  gradients;
* an exception inside the block restores the gradients as they were on entry.

Deciding the skip reads ``found_inf`` on exit: host syncs on each undelayed
``scale_loss`` exit, as in apex. Static scaling (``loss_scale=128.0``) skips overflowing
steps too and never moves the scale; ``loss_scale=None`` turns scaling off (the loss is
yielded as is, nothing is unscaled or skipped).

Example:
    >>> import torch
    >>> from ampkit.scaling.loss_scaling import configure_loss_scaling, scale_loss
    >>> w = torch.nn.Parameter(torch.ones(2))
    >>> opt = torch.optim.SGD([w], lr=0.5)
    >>> _ = configure_loss_scaling("dynamic", num_losses=2, init_scale=1024.0)
    >>> with scale_loss((2 * w).sum(), opt, loss_id=0) as scaled:
    ...     scaled.backward()
    >>> with scale_loss((w * float("inf")).sum(), opt, loss_id=1) as scaled:
    ...     scaled.backward()                       # loss 1 overflows
    >>> opt.step()                                  # skipped
    >>> w.tolist(), loss_scaler(0).get_scale(), loss_scaler(1).get_scale()
    ([1.0, 1.0], 1024.0, 512.0)
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import gc
import numbers
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ampkit.common.arguments import canonical_names, parse_loss_scale, positive_int
from ampkit.scaling.distributed import agree_on_overflow_
from ampkit.scaling.grad_scaler import GradScaler
from ampkit.scaling.overflow import unscale_grads_

__all__ = [
    "build_loss_scaler",
    "configure_loss_scaling",
    "latest_loss_scaler",
    "load_loss_scaling_state_dict",
    "loss_scaler",
    "loss_scaling_state_dict",
    "release_optimizers",
    "scale_loss",
]


@dataclasses.dataclass(frozen=True)
class LossScalingConfig:
    """The settings :func:`configure_loss_scaling` was given (immutable)."""

    loss_scale: str | float | None = "dynamic"
    num_losses: int = 1
    init_scale: float = 2.0 ** 16
    min_scale: float | None = None
    max_scale: float | None = 2.0 ** 24
    growth_interval: int = 2000
    hysteresis: int = 1


def _build_scaler(config: LossScalingConfig) -> GradScaler:
    if config.loss_scale is None:
        return GradScaler(enabled=False)
    if isinstance(config.loss_scale, str):  # "dynamic", the only string it takes
        return GradScaler(init_scale=config.init_scale,
                          growth_interval=config.growth_interval,
                          hysteresis=config.hysteresis, min_scale=config.min_scale,
                          max_scale=config.max_scale)
    # Static: bounds and growth are meaningless, the scale is the number given.
    return GradScaler(init_scale=config.loss_scale, hysteresis=config.hysteresis,
                      dynamic=False)


def build_loss_scaler(loss_scale: str | float | None = "dynamic", *,
                      init_scale: float = 2.0 ** 16, min_scale: float | None = None,
                      max_scale: float | None = 2.0 ** 24, growth_interval: int = 2000,
                      hysteresis: int = 1) -> GradScaler:
    """One scaler as :func:`configure_loss_scaling` builds it for each loss id, for a
    caller that keeps its own (apex's legacy optimizer wrapper has one per loss); pass
    it to :func:`scale_loss` as ``scaler``.

    Example:
        >>> from ampkit.scaling.loss_scaling import build_loss_scaler
        >>> scaler = build_loss_scaler("dynamic")
        >>> scaler.get_scale(), scaler.schedule.max_scale
        (65536.0, 16777216.0)
    """
    return _build_scaler(LossScalingConfig(
        loss_scale=parse_loss_scale(loss_scale), init_scale=init_scale,
        min_scale=min_scale, max_scale=max_scale,
        growth_interval=growth_interval, hysteresis=hysteresis))


class _StepGuard(enum.Enum):
    """What an optimizer's next ``step()`` does while scale_loss holds it (no entry:
    a normal step)."""

    SKIP_ONCE = "skip"  # an overflow: the next step() is a no-op
    REFUSE = "refuse"  # gradients still scaled (delay_unscale): step() raises
    REFUSE_THEN_SKIP = "refuse, then skip"  # both: an earlier loss overflowed
    # A fused optimizer with state: step() runs with ``found_inf`` and the optimizer
    # skips on the device itself, so nothing is read back to the host.
    ON_DEVICE = "skip on the device"


@dataclasses.dataclass
class _PendingGrads:
    """An optimizer between a delayed scale_loss and the one that unscales."""

    loss_id: int
    # gradients put aside on entry (already unscaled), added back when unscaling
    stash: list[tuple[torch.Tensor, torch.Tensor]]


class _State:
    def __init__(self, config: LossScalingConfig) -> None:
        self.config = config
        self.scalers = tuple(_build_scaler(config) for _ in range(config.num_losses))


_lock = threading.Lock()
_state: _State | None = None
# Optimizer -> the set-up made for it (``configure_loss_scaling(optimizers=...)``, which
# ``ampkit.initialize`` passes its optimizers to): a later set-up for other optimizers
# leaves it alone, so each run keeps its own scales.
_bound: weakref.WeakKeyDictionary[Any, _State] = weakref.WeakKeyDictionary()
_pending: weakref.WeakKeyDictionary[torch.optim.Optimizer, _PendingGrads] = (
    weakref.WeakKeyDictionary())
# Optimizer -> (guard, the instance's own ``step`` attribute before guarding, if any,
# the found_inf tensor of an ON_DEVICE guard).
_guards: weakref.WeakKeyDictionary[torch.optim.Optimizer,
                                   tuple[_StepGuard, Any, torch.Tensor | None]] = (
    weakref.WeakKeyDictionary())
_NO_ATTRIBUTE = object()


def configure_loss_scaling(loss_scale: str | float | None = "dynamic", *,
                           num_losses: int = 1, init_scale: float = 2.0 ** 16,
                           min_scale: float | None = None,
                           max_scale: float | None = 2.0 ** 24,
                           growth_interval: int = 2000,
                           hysteresis: int = 1,
                           optimizers: Sequence[torch.optim.Optimizer] | None = None,
                           **deprecated: Any) -> tuple[GradScaler, ...]:
    """Set up one scaler per loss id for :func:`scale_loss`. Returns the scalers,
    indexed by loss id.

    The new set-up becomes the current one (what :func:`loss_scaler` and
    :func:`scale_loss` with other optimizers use), replacing the current one. Given
    ``optimizers`` (as ``ampkit.initialize`` gives its own), it also belongs to them:
    :func:`scale_loss` with those optimizers uses it, whatever is set up later for
    other optimizers, so a second run leaves the first one's scales alone.

    Args:
        loss_scale: ``"dynamic"``, a positive number (static scaling), or ``None`` (no
            scaling).
        num_losses: how many loss ids (``0 .. num_losses - 1``); int >= 1.
        init_scale: the dynamic scalers' starting scale.
        min_scale: floor of the dynamic scale (apex's ``min_loss_scale``), or ``None``.
        max_scale: ceiling of the dynamic scale (apex's ``max_loss_scale``, default
            2**24), or ``None``.
        growth_interval: clean steps before the dynamic scale doubles.
        hysteresis: overflows in a row before the scale halves (every overflow skips).
        optimizers: the optimizers this set-up belongs to, or ``None``.
        **deprecated: ``min_loss_scale``/``max_loss_scale``, the old names of
            ``min_scale``/``max_scale``, with a ``FutureWarning``.

    Raises:
        ValueError: a bad value, naming the argument.
        TypeError: ``optimizers`` holds something that is not an optimizer.

    Example:
        >>> from ampkit.scaling.loss_scaling import configure_loss_scaling
        >>> [s.get_scale() for s in configure_loss_scaling(128.0, num_losses=2)]
        [128.0, 128.0]
    """
    if deprecated:
        named = canonical_names(deprecated, "configure_loss_scaling", stacklevel=2)
        unknown = sorted(set(named) - {"min_scale", "max_scale"})
        if unknown:
            raise TypeError(f"configure_loss_scaling() got unexpected keyword arguments "
                            f"{unknown}")
        min_scale = named.get("min_scale", min_scale)
        max_scale = named.get("max_scale", max_scale)
    opts = [] if optimizers is None else _as_optimizers(optimizers)
    num_losses = positive_int(num_losses, "num_losses")
    config = LossScalingConfig(
        loss_scale=parse_loss_scale(loss_scale), num_losses=int(num_losses),
        init_scale=init_scale, min_scale=min_scale,
        max_scale=max_scale, growth_interval=growth_interval,
        hysteresis=hysteresis)
    state = _State(config)  # validates every value before anything is replaced
    global _state
    with _lock:
        _state = state
        for opt in opts:
            _bound[opt] = state
    return state.scalers


def release_optimizers(optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Forget the set-up these optimizers belonged to (a run without loss scaling now
    owns them): :func:`scale_loss` with them uses the current set-up again.

    Example:
        >>> import torch
        >>> from ampkit.scaling.loss_scaling import (configure_loss_scaling, loss_scaler,
        ...                                        release_optimizers)
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
        >>> _ = configure_loss_scaling(128.0, optimizers=[opt])
        >>> loss_scaler(0, optimizer=opt).get_scale()
        128.0
        >>> release_optimizers([opt])
    """
    with _lock:
        for opt in optimizers:
            _bound.pop(opt, None)


def _current_state() -> _State:
    global _state
    with _lock:
        if _state is None:
            _state = _State(LossScalingConfig())
        return _state


def _state_for(optimizers: Sequence[torch.optim.Optimizer]) -> _State:
    """The set-up the optimizers belong to, else the current one."""
    with _lock:
        states = {id(s): s for s in (_bound.get(o) for o in optimizers) if s is not None}
    if len(states) > 1:
        raise ValueError("optimizers: they belong to loss scaling set up by different "
                         "ampkit.initialize() (or configure_loss_scaling(optimizers=...)) "
                         "calls, each with its own scales; scale each run's loss with "
                         "that run's optimizers only")
    return next(iter(states.values())) if states else _current_state()


def loss_scaler(loss_id: int = 0, *, optimizer: torch.optim.Optimizer | None = None
                ) -> GradScaler:
    """The scaler behind ``loss_id`` (set up with the defaults if nothing was
    configured): of the set-up ``optimizer`` belongs to (see
    :func:`configure_loss_scaling`), else of the current one.

    Without ``optimizer`` the answer must be the scaler training uses: while another
    set-up made for live optimizers (an earlier ``ampkit.initialize``) is still in use
    beside the current one, which one is meant cannot be told, and it raises.

    Raises:
        ValueError: a bad ``loss_id``; or no ``optimizer`` while several set-ups are
            live (name the optimizer whose scale you mean).

    Example:
        >>> import torch
        >>> from ampkit.scaling.loss_scaling import configure_loss_scaling, loss_scaler
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
        >>> _ = configure_loss_scaling("dynamic", init_scale=256.0, optimizers=[opt])
        >>> loss_scaler(0).get_scale()
        256.0
        >>> other = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
        >>> _ = configure_loss_scaling("dynamic", init_scale=8.0, optimizers=[other])
        >>> loss_scaler(0, optimizer=opt).get_scale(), loss_scaler(0, optimizer=other).get_scale()
        (256.0, 8.0)
        >>> loss_scaler(0)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: loss_scaler(0): 2 loss-scaling set-ups are live ...
    """
    if optimizer is not None:
        return _scaler_of(_state_for(_as_optimizers(optimizer)), loss_id)
    state = _current_state()
    live = _live_setups(state)
    if len(live) > 1:
        # An optimizer the program dropped can linger in a reference cycle until the
        # collector runs; its set-up is not live, so collect once before refusing.
        gc.collect()
        live = _live_setups(state)
    if len(live) > 1:
        raise ValueError(
            f"loss_scaler({loss_id!r}): {len(live)} loss-scaling set-ups are live (each "
            f"ampkit.initialize() keeps its own scales for its optimizers), and the latest "
            f"need not be the one training uses; name the optimizer whose scale you mean: "
            f"loss_scaler({loss_id!r}, optimizer=opt)")
    return _scaler_of(state, loss_id)


def _live_setups(state: _State) -> set[int]:
    with _lock:
        return {id(s) for s in _bound.values()} | {id(state)}


def latest_loss_scaler(loss_id: int = 0) -> GradScaler:
    """The scaler behind ``loss_id`` of the latest set-up, whatever optimizers the
    others belong to: apex's process-wide loss scalers, which each ``amp.initialize``
    replaces (``ampkit.apex``). Elsewhere, :func:`loss_scaler`.

    Example:
        >>> from ampkit.scaling.loss_scaling import configure_loss_scaling, latest_loss_scaler
        >>> _ = configure_loss_scaling(64.0)
        >>> latest_loss_scaler(0).get_scale()
        64.0
    """
    return _scaler_of(_current_state(), loss_id)


def _scaler_of(state: _State, loss_id: int) -> GradScaler:
    if (isinstance(loss_id, bool) or not isinstance(loss_id, numbers.Integral)
            or not 0 <= loss_id < len(state.scalers)):
        raise ValueError(f"loss_id must be an int in [0, {len(state.scalers)}) (num_losses="
                         f"{len(state.scalers)}), got {loss_id!r}; pass num_losses to "
                         f"configure_loss_scaling (or ampkit.initialize) for more losses")
    return state.scalers[int(loss_id)]


def loss_scaling_state_dict() -> dict[str, Any]:
    """Every loss scaler's state, as ``{"loss_scaler0": {...}, ...}`` (each one a
    ``GradScaler.state_dict()``).

    Example:
        >>> from ampkit.scaling.loss_scaling import configure_loss_scaling
        >>> from ampkit.scaling.loss_scaling import loss_scaling_state_dict
        >>> _ = configure_loss_scaling("dynamic", num_losses=2, init_scale=8.0)
        >>> {k: v["scale"] for k, v in loss_scaling_state_dict().items()}
        {'loss_scaler0': 8.0, 'loss_scaler1': 8.0}
    """
    return {f"loss_scaler{i}": s.state_dict()
            for i, s in enumerate(_current_state().scalers)}


def load_loss_scaling_state_dict(state_dict: dict[str, Any]) -> None:
    """Restore :func:`loss_scaling_state_dict`'s output into the configured scalers.

    Raises:
        ValueError: keys missing or unknown for the configured ``num_losses`` (named).

    Example:
        >>> from ampkit.scaling.loss_scaling import configure_loss_scaling, loss_scaler
        >>> from ampkit.scaling.loss_scaling import load_loss_scaling_state_dict
        >>> _ = configure_loss_scaling("dynamic")
        >>> saved = {"loss_scaler0": {**loss_scaler(0).state_dict(), "scale": 4.0}}
        >>> load_loss_scaling_state_dict(saved)
        >>> loss_scaler(0).get_scale()
        4.0
    """
    scalers = _current_state().scalers
    expected = [f"loss_scaler{i}" for i in range(len(scalers))]
    missing = [k for k in expected if k not in state_dict]
    unknown = sorted(str(k) for k in state_dict if k not in expected)
    if missing or unknown:
        raise ValueError(f"load_loss_scaling_state_dict: missing keys {missing}, unknown "
                         f"keys {unknown}; expected {expected}")
    for key, scaler in zip(expected, scalers):
        if scaler.is_enabled():
            scaler.load_state_dict(state_dict[key])


# -- guarding optimizer.step() ---------------------------------------------------------

def _guard(optimizer: torch.optim.Optimizer, guard: _StepGuard,
           found_inf: torch.Tensor | None = None) -> None:
    if optimizer in _guards:
        original = _guards[optimizer][1]
    else:
        original = optimizer.__dict__.get("step", _NO_ATTRIBUTE)
    _guards[optimizer] = (guard, original, found_inf)

    def guarded_step(*args: Any, **kwargs: Any) -> Any:
        current = _guards.get(optimizer)
        if current is not None and current[0] in (_StepGuard.REFUSE,
                                                  _StepGuard.REFUSE_THEN_SKIP):
            raise RuntimeError("optimizer.step() was called while the gradients are still "
                               "scaled (scale_loss(..., delay_unscale=True)); finish with "
                               "a scale_loss(...) for the same loss_id without "
                               "delay_unscale before stepping")
        _unguard(optimizer)
        if current is not None and current[0] is _StepGuard.ON_DEVICE:
            # torch's fused optimizers read found_inf (and grad_scale, none here: the
            # gradients are unscaled) from these attributes, as torch's GradScaler sets.
            optimizer.found_inf = current[2]  # type: ignore[attr-defined]
            try:
                return optimizer.step(*args, **kwargs)
            finally:
                del optimizer.found_inf  # type: ignore[attr-defined]
        return None  # the skipped step: nothing in the optimizer changes

    optimizer.step = guarded_step  # type: ignore[method-assign]


def _unguard(optimizer: torch.optim.Optimizer) -> None:
    entry = _guards.pop(optimizer, None)
    if entry is None:
        return
    original = entry[1]
    if original is _NO_ATTRIBUTE:
        optimizer.__dict__.pop("step", None)
    else:
        optimizer.step = original  # type: ignore[method-assign]


def _skip_armed(optimizer: torch.optim.Optimizer) -> bool:
    entry = _guards.get(optimizer)
    return entry is not None and entry[0] in (_StepGuard.SKIP_ONCE,
                                              _StepGuard.REFUSE_THEN_SKIP)


def _as_optimizers(optimizers: Any) -> list[torch.optim.Optimizer]:
    items = list(optimizers) if isinstance(optimizers, list | tuple) else [optimizers]
    if not items or not all(isinstance(o, torch.optim.Optimizer) for o in items):
        raise TypeError(f"optimizers must be a torch.optim.Optimizer or a non-empty list or "
                        f"tuple of them, got {optimizers!r}")
    return items


@contextlib.contextmanager
def scale_loss(loss: torch.Tensor, optimizers: torch.optim.Optimizer
               | Sequence[torch.optim.Optimizer], loss_id: int = 0, *,
               delay_unscale: bool = False,
               scaler: GradScaler | None = None) -> Iterator[torch.Tensor]:
    """Yield ``loss`` (as float32) times the scale of ``loss_id``; on exit unscale the
    optimizers' new gradients, and on overflow make each optimizer's next ``step()`` a
    no-op and lower that loss's scale.

    The scaler is ``loss_id``'s of the set-up the optimizers belong to (each
    ``ampkit.initialize`` call with optimizers makes one), else of the current one: a
    dynamic scaler with the defaults when :func:`configure_loss_scaling` was never
    called. ``scaler`` (from :func:`build_loss_scaler`) replaces ``loss_id``'s
    configured one; ``loss_id`` then only tells apart the scaled gradients of
    ``delay_unscale``. See the module docstring for gradients accumulated across losses
    and for ``delay_unscale``.

    Raises:
        TypeError: ``optimizers`` is not an optimizer or a list/tuple of them.
        ValueError: ``loss_id`` out of range for ``num_losses``, or optimizers of two
            set-ups (two ``initialize`` runs) in one call.
        RuntimeError: an optimizer holds gradients scaled for another ``loss_id``.

    Example:
        >>> import torch
        >>> from ampkit.scaling.loss_scaling import configure_loss_scaling, scale_loss
        >>> _ = configure_loss_scaling("dynamic", init_scale=64.0)
        >>> w = torch.nn.Parameter(torch.ones(1))
        >>> opt = torch.optim.SGD([w], lr=0.1)
        >>> with scale_loss(3 * w.sum(), opt) as scaled:
        ...     scaled.backward()
        ...     print(scaled.item(), w.grad.item())
        192.0 192.0
        >>> w.grad.item()
        3.0
    """
    if not isinstance(delay_unscale, bool):
        raise TypeError(f"delay_unscale must be a bool, got {type(delay_unscale).__name__}")
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"loss must be a tensor, got {type(loss).__name__}")
    opts = list({id(o): o for o in _as_optimizers(optimizers)}.values())
    if scaler is None:
        scaler = _scaler_of(_state_for(opts), loss_id)
    elif not isinstance(scaler, GradScaler):
        raise TypeError(f"scaler must be None or an ampkit GradScaler (see "
                        f"build_loss_scaler), got {type(scaler).__name__}")
    if not scaler.is_enabled():
        yield loss
        return
    for opt in opts:
        pending = _pending.get(opt)
        if pending is not None and pending.loss_id != loss_id:
            raise RuntimeError(f"this optimizer holds gradients scaled for loss_id="
                               f"{pending.loss_id} (delay_unscale=True); finish them with "
                               f"scale_loss(..., loss_id={pending.loss_id}) before using "
                               f"loss_id={loss_id}")
    stashed_here: list[torch.optim.Optimizer] = []
    for opt in opts:
        if opt not in _pending:  # put unscaled gradients aside; keep still-scaled ones
            _pending[opt] = _PendingGrads(int(loss_id), _set_grads_aside(opt))
            stashed_here.append(opt)
    try:
        yield scaler.scale(loss.float())
    except BaseException:
        for opt in stashed_here:  # the gradients as they were on entry
            _put_grads_back(opt, _pending.pop(opt).stash, add=False)
        raise
    if delay_unscale:
        for opt in opts:
            _guard(opt, _StepGuard.REFUSE_THEN_SKIP if _skip_armed(opt)
                   else _StepGuard.REFUSE)
        return
    for opt in opts:
        scaler.unscale_(opt)
    found_inf = scaler.found_inf()  # this loss's overflow, still on the device
    assert found_inf is not None
    # Gradients put aside were checked when their own loss unscaled them, unless they
    # came from elsewhere (a backward outside scale_loss, a skipped iteration never
    # zeroed). Checking them again keeps an inf among them from reaching the weights;
    # it arms the skip of the optimizer that holds them, and of no other (apex skips
    # only the optimizer whose gradients overflowed), and it is not this loss's
    # overflow, so the loss's scale is left alone.
    skips = _per_optimizer_skips(opts, found_inf, scaler.process_group)
    for opt in opts:
        _put_grads_back(opt, _pending.pop(opt).stash, add=True)
    scaler.update()
    on_device = {id(opt) for opt in opts if GradScaler.skips_on_device(opt)}
    # apex's semantics: after scale_loss, a plain optimizer.step() must already know
    # whether to skip. Fused optimizers with state are told on the device; the others
    # need this one host sync (for all of them at once).
    on_host = [i for i, opt in enumerate(opts) if id(opt) not in on_device]
    overflows = (torch.stack([skips[i] for i in on_host]).tolist() if on_host else [])
    overflow = dict(zip(on_host, overflows))
    for i, opt in enumerate(opts):
        if _skip_armed(opt) or overflow.get(i, 0.0):
            _guard(opt, _StepGuard.SKIP_ONCE)
        elif id(opt) in on_device:
            earlier = _guards.get(opt)  # an earlier iteration's, never stepped: keep it
            _guard(opt, _StepGuard.ON_DEVICE, skips[i] if earlier is None
                   or earlier[2] is None else skips[i] + earlier[2])
        else:
            _unguard(opt)


def _per_optimizer_skips(opts: list[torch.optim.Optimizer], found_inf: torch.Tensor,
                         process_group: Any) -> list[torch.Tensor]:
    """Per optimizer (in ``opts``' order), nonzero when its step must be skipped: this
    loss overflowed (every optimizer named in the block), or the gradients it put aside
    on entry hold an inf/NaN (that optimizer only). One all-reduce for all of them."""
    stashes = [[grad for _, grad in _pending[opt].stash] for opt in opts]
    holding = [i for i, stash in enumerate(stashes) if stash]
    if not holding:
        return [found_inf] * len(opts)
    earlier = torch.zeros(len(holding), dtype=torch.float32, device=found_inf.device)
    for row, i in enumerate(holding):
        unscale_grads_(stashes[i], None, earlier[row])
    agree_on_overflow_(earlier, process_group, [g for i in holding for g in stashes[i]])
    skips = [found_inf] * len(opts)
    for row, i in enumerate(holding):
        skips[i] = found_inf + earlier[row]
    return skips


def _set_grads_aside(optimizer: torch.optim.Optimizer
                     ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Take the gradients out of ``optimizer``'s parameters, so that the next backward
    pass starts from none; returns ``(parameter, gradient)`` for :func:`_put_grads_back`.
    Keeps gradients already unscaled apart from a new loss's scaled ones."""
    aside = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                aside.append((p, p.grad))
                p.grad = None
    return aside


def _put_grads_back(optimizer: torch.optim.Optimizer,
                    aside: list[tuple[torch.Tensor, torch.Tensor]], *, add: bool) -> None:
    """Undo :func:`_set_grads_aside`: add the gradients set aside to those there now
    (``add=True``), or put them back in place of those (``add=False``)."""
    returned = {id(p) for p, _ in aside}
    with torch.no_grad():
        if not add:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if id(p) not in returned:
                        p.grad = None
        for p, grad in aside:
            if add and p.grad is not None:
                p.grad.add_(grad)
            else:
                p.grad = grad
