"""Pure low-precision master weights: bf16 parameters and optimizer state, no fp32 copies.

Beside fp32 masters (:mod:`ampkit.master_weights`), this is the master-weights layer's
second mode: the bf16 parameters *are* the masters. Dropping the fp32 copies saves
memory (AdamW: 6 bytes per parameter between steps instead of 14 at O2), but
round-to-nearest updates stall: ``w + lr * update`` rounds back to ``w`` whenever the
update is below half a bf16 ulp (bf16 keeps 8 significant bits, so about 0.4% of
``|w|``). :class:`PureLowPrecisionOptimizer` applies each update with one of:

* ``"stochastic"``: stochastic rounding (Zamirai et al., "Revisiting BFloat16
  Training", 2020): the fp32 result rounds up with probability equal to its distance
  from the bf16 value below, so the rounding is unbiased and small updates survive on
  average. The random bits come from a seeded ``torch.Generator`` (one per device), so
  runs are reproducible; its state is part of the optimizer's ``state_dict``.
* ``"kahan"``: Kahan-compensated summation: a bf16 compensation buffer per parameter
  (the optimizer state ``"kahan_compensation"``) keeps what rounding the weight to
  nearest lost (truncated to bf16, so weight + compensation always rounds back to the
  weight), and adds it back before the next update. 2 more bytes per parameter.
* ``"nearest"``: round to nearest, the baseline that stalls (for comparisons only).

How one step works: for each chunk of parameters (at most ``chunk_bytes`` of fp32
working memory at a time), each bf16 parameter's ``.data`` is swapped for an fp32
working copy (``param`` + compensation), its gradient and its optimizer state
(moments, momentum) for fp32 copies, and the optimizer's *own* step runs on them
(any ``torch.optim`` optimizer; foreach and fused variants included, since they see
ordinary fp32 tensors). The results are then rounded back into bf16: the weight by
the chosen rounding, the optimizer state stochastically (``"stochastic"`` and
``"kahan"``) or to nearest (``"nearest"``). The state is rounded stochastically even
with Kahan because round-to-nearest stalls moments too: AdamW's
``v = 0.999 v + 0.001 g**2`` rounds back to ``v`` unless ``g**2`` differs from ``v`` by
about twice ``v``. Parameters that are not bf16 (norms kept in fp32 at O2) are
stepped as they are. Scalar state (the step count, NAdam's ``mu_product``, ASGD's
``eta``/``mu``: functions of the step count and hyper-parameters) stays fp32 and
exact. Step hooks (``register_step_pre_hook``/``post_hook``) run once per step, seeing
whole parameter groups, as with any torch optimizer; the chunks are invisible to them.

A step that is not taken (a loss scaler skipped it, or ``found_inf`` != 0 was handed
to the step) leaves the parameters, the state and the generators exactly as they were.
A pure optimizer tells loss scalers that it does not take ``grad_scale``/``found_inf``,
even when the inner optimizer is fused: the scaler then unscales the gradients itself
and skips the call on an overflow (one host sync per step).

Checkpoints: ``model.state_dict()`` reports fp32 values that load into an fp32 model;
with Kahan each value is the weight plus its compensation, so nothing the
compensation kept is lost. Resuming from the model's and the optimizer's
``state_dict`` (compensation and generator states included) continues bit for bit.
Loading a model ``state_dict`` sets each existing Kahan buffer to what rounding the
loaded value to bf16 loses, so the model then reports the loaded value (ampkit's
conversion guard has already made a failed load change nothing and refused
``assign=True``). ``copy.deepcopy((model, optimizer))`` and pickling both keep the
rounding, the buffers and the generator states: the copy trains bit for bit like the
original. ``copy.deepcopy(model)`` alone does not copy the Kahan buffers (optimizer
state): the copy's ``state_dict`` reports its bf16 weights.

Closures: a closure handed to ``step`` is called once, before the update, at the
current weights (as ``torch.optim.SGD``/``AdamW`` do). Optimizers whose step *requires*
a closure, ``torch.optim.LBFGS``, evaluate it again at weights they try, which the
chunked fp32 step cannot show the model: they are refused with a ``TypeError`` (use
``master_weights=True``).

Memory (AdamW): 6 bytes per parameter between steps with ``"stochastic"`` (bf16
weight and two bf16 moments), 8 with ``"kahan"``, against 12 for fp32 and 14 for O2
(gradients: 2 bytes during a step, 4 in fp32). During the step, one chunk at a time
holds fp32 working copies (about 24 bytes per element of the chunk with AdamW's
temporaries); a chunk is at least one whole parameter, so the largest parameter sets
the floor. The inner optimizer's variant (for-loop, foreach, fused) makes no
difference to correctness; foreach/fused only pay off within a chunk.

float16 is refused: pure fp16 would need loss scaling on every update and has
little range; use fp32 masters (``master_weights=True``) for fp16.

Example:
    >>> import torch
    >>> from ampkit.master_weights_pure import PureLowPrecisionOptimizer
    >>> w = torch.nn.Parameter(torch.ones(1000, dtype=torch.bfloat16))
    >>> opt = PureLowPrecisionOptimizer(torch.optim.SGD([w], lr=1e-4), "stochastic",
    ...                                 seed=0)
    >>> for _ in range(10):
    ...     w.grad = torch.ones_like(w)
    ...     opt.step()
    >>> w.dtype, round(w.float().mean().item(), 3)  # round-to-nearest would stay at 1.0
    (torch.bfloat16, 0.999)
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

__all__ = [
    "PURE_ROUNDINGS",
    "PureLowPrecisionOptimizer",
    "check_pure_optimizer",
    "pure_low_precision",
    "pure_rounding",
    "register_pure_state_dict_hook",
    "stochastic_round",
]

#: The rounding modes :class:`PureLowPrecisionOptimizer` accepts; ``initialize``'s
#: ``master_weights`` takes the first two (``"nearest"`` is the stalling baseline).
PURE_ROUNDINGS: tuple[str, ...] = ("stochastic", "kahan", "nearest")

_COMP = "kahan_compensation"  # the optimizer-state key of the Kahan buffer
_SD_KEY = "ampkit_pure_low_precision"  # the optimizer state_dict entry of this mode
_LOW_MANTISSA = 1 << 16  # the fp32 bits below bf16's mantissa
_HIGH_MASK = -_LOW_MANTISSA  # 0xFFFF0000 as an int32
# parameter -> weakref of the pure optimizer that steps it (weakly keyed by identity), so
# the model's state_dict and load hooks find the Kahan buffer without holding the
# optimizer, and a deep copy of (model, optimizer) finds the copy's own buffers.
_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def stochastic_round(value: torch.Tensor, generator: torch.Generator | None = None
                     ) -> torch.Tensor:
    """``value`` (fp32) rounded to bfloat16 stochastically: up with probability equal to
    its distance from the bf16 number below (in units of the gap), so the expected
    result is ``value`` itself.

    Adds 16 uniformly random bits to the fp32 bit pattern and truncates the low 16 bits
    (sign-magnitude, so negative values round symmetrically). Values that bf16 holds
    exactly, infinities and NaNs come back unchanged.

    Raises:
        TypeError: ``value`` is not float32.

    Example:
        >>> import torch
        >>> from ampkit.master_weights_pure import stochastic_round
        >>> g = torch.Generator().manual_seed(0)
        >>> x = torch.full((10000,), 1.0 + 2 ** -10)  # a quarter of the way to 1 + 2**-7
        >>> r = stochastic_round(x, g)
        >>> r.dtype, sorted(r.unique().tolist()), round(r.float().mean().item(), 3)
        (torch.bfloat16, [1.0, 1.0078125], 1.001)
    """
    if value.dtype is not torch.float32:
        raise TypeError(f"stochastic_round takes a float32 tensor, got {value.dtype}")
    bits = value.view(torch.int32)
    noise = torch.randint(0, _LOW_MANTISSA, value.shape, dtype=torch.int32,
                          device=value.device, generator=generator)
    noise.add_(bits).bitwise_and_(_HIGH_MASK)
    rounded = noise.view(torch.float32)
    # NaN payloads in the low bits would truncate to inf; keep NaNs NaN.
    rounded = torch.where(value.isnan(), value, rounded)
    return rounded.to(torch.bfloat16)  # exact: the low 16 bits are zero


def _check_rounding(rounding: Any) -> str:
    if not isinstance(rounding, str) or rounding not in PURE_ROUNDINGS:
        raise ValueError(f"rounding must be one of {list(PURE_ROUNDINGS)}, got {rounding!r}")
    return rounding


def _check_no_float16(params: Any) -> None:
    for p in params:
        if isinstance(p, torch.Tensor) and p.dtype is torch.float16:
            raise ValueError("pure low-precision training takes bfloat16 "
                             "parameters; float16 has too little range for "
                             "optimizer state and updates: use fp32 master "
                             "weights (master_weights=True) for float16")


def _needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer's step requires a closure (LBFGS): such a step evaluates
    the closure again at weights it tries, which the chunked fp32 step cannot show the
    model."""
    try:
        closure = inspect.signature(type(optimizer).step).parameters.get("closure")
    except (TypeError, ValueError):  # no signature to read: assume the common case
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


def check_pure_optimizer(optimizer: Any, rounding: str = "stochastic", *,
                         seed: Any = None, seed_name: str = "seed") -> None:
    """Raise the error :class:`PureLowPrecisionOptimizer` would raise for these
    arguments, without changing anything (``ampkit.initialize`` checks every optimizer
    before converting the models; ``seed_name`` is the argument's name there).

    Raises:
        TypeError: ``optimizer`` is not an optimizer, keeps fp32 master weights, or its
            step requires a closure (``torch.optim.LBFGS``); ``seed`` not an int.
        ValueError: an unknown ``rounding``, a float16 parameter, or an optimizer
            already pure with another rounding.

    Example:
        >>> import torch
        >>> from ampkit.master_weights_pure import check_pure_optimizer
        >>> w = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
        >>> check_pure_optimizer(torch.optim.SGD([w], lr=0.1), "kahan")  # fine: None
        >>> check_pure_optimizer(torch.optim.SGD([w], lr=0.1), "kahan", seed=0.5)
        Traceback (most recent call last):
        ...
        TypeError: seed must be an int or None, got 0.5
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    rounding = _check_rounding(rounding)
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise TypeError(f"{seed_name} must be an int or None, got {seed!r}")
    existing = pure_rounding(optimizer)
    if existing is not None:
        if existing != rounding:
            raise ValueError(f"this optimizer already trains in pure low precision with "
                             f"rounding={existing!r}, not {rounding!r}")
        return
    if optimizer.__dict__.get("_ampkit_masters") is not None:
        raise TypeError("this optimizer keeps fp32 master weights "
                        "(MasterWeightOptimizer); pure low precision has none: make "
                        "it pure instead of, not on top of, fp32 masters")
    if _needs_closure(optimizer):
        raise TypeError(f"{type(optimizer).__name__}.step requires a closure, which it "
                        f"evaluates again at the weights it tries; pure low-precision "
                        f"training steps in fp32 working copies chunk by chunk and "
                        f"cannot show the model those weights, so such optimizers are not "
                        f"supported: use fp32 master weights (master_weights=True) for "
                        f"{type(optimizer).__name__}")
    for group in optimizer.param_groups:
        _check_no_float16(group["params"])


class _Generators:
    """One seeded generator per device, made on first use from ``seed`` and the device
    (so a CPU run and a CUDA run each reproduce themselves)."""

    __slots__ = ("by_device", "seed")

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.by_device: dict[str, torch.Generator] = {}

    def get(self, device: torch.device) -> torch.Generator:
        key = str(device)
        gen = self.by_device.get(key)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seed)
            self.by_device[key] = gen
        return gen

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed,
                "generators": {k: g.get_state() for k, g in self.by_device.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seed = int(state["seed"])
        self.by_device = {}
        for key, gen_state in state["generators"].items():
            self.get(torch.device(key)).set_state(gen_state.cpu())


class _Pure:
    """What a pure low-precision optimizer keeps besides torch's own state."""

    __slots__ = ("chunk_bytes", "generators", "rounding")

    def __init__(self, rounding: str, seed: int, chunk_bytes: int | None) -> None:
        self.rounding = rounding
        self.generators = _Generators(seed)
        self.chunk_bytes = chunk_bytes


def _pure_class(cls: type) -> type:
    return _wrapped_optimizer_class(cls)


@functools.cache
def _wrapped_optimizer_class(cls: type) -> type:
    """``cls`` with the pure optimizer's methods in front (``PureLowPrecisionAdamW``),
    made once per class so that every pure optimizer of a class shares one class."""
    return type(f"PureLowPrecision{cls.__name__}", (PureLowPrecisionOptimizer, cls),
                {"__module__": PureLowPrecisionOptimizer.__module__})


def _chunks(params: list[torch.Tensor], budget: int) -> Iterator[list[torch.Tensor]]:
    """Consecutive runs of ``params`` whose fp32 working copies (weight, gradient and
    up to two moments: 16 bytes per element) stay within ``budget`` bytes (a parameter
    larger than the budget is a chunk of its own)."""
    chunk: list[torch.Tensor] = []
    used = 0
    for p in params:
        size = 16 * p.numel()
        if chunk and used + size > budget:
            yield chunk
            chunk, used = [], 0
        chunk.append(p)
        used += size
    if chunk:
        yield chunk


class PureLowPrecisionOptimizer:
    """Make a torch optimizer train bf16 parameters with bf16 state, in place.

    ``PureLowPrecisionOptimizer(opt, rounding, seed=...)`` returns ``opt`` itself, now
    also an instance of this class (its class becomes a subclass of both, so
    ``isinstance(opt, torch.optim.AdamW)``, LR schedulers and ``state_dict`` keep
    working). ``param_groups`` keep the model's bf16 parameters; the optimizer state
    (moments, momentum) is stored in bf16; see the module docstring for how a step
    rounds. Tested with AdamW (for-loop, foreach, fused) and SGD with momentum; any
    ``torch.optim`` optimizer whose state is per-parameter tensors works the same way.

    Args:
        optimizer: a ``torch.optim.Optimizer`` over bf16 (and possibly fp32)
            parameters.
        rounding: ``"stochastic"``, ``"kahan"`` or ``"nearest"`` (see
            :data:`PURE_ROUNDINGS`).
        seed: seeds the stochastic-rounding generators; ``None`` draws one from
            torch's default generator (so ``torch.manual_seed`` makes runs
            reproducible).
        chunk_bytes: the most fp32 working memory one chunk of a step may take;
            ``None``: a sixteenth of what the whole optimizer would take (about one
            byte per parameter on top of the 6-8 held). A parameter larger than the
            budget is a chunk of its own: its working copies (16 bytes per element,
            plus 9 while rounding) are the floor of the step's extra memory.

    ``add_param_group`` refuses float16 parameters too. ``copy.deepcopy`` of the
    optimizer (with its model: ``copy.deepcopy((model, opt))``) copies the rounding
    generators, so the copy's next steps are bit for bit the original's. Optimizers
    whose step requires a closure (``torch.optim.LBFGS``: it evaluates the closure
    again at the weights it tries) are refused; a closure handed to any other
    optimizer's step is called once, before the update, at the current weights.

    Raises:
        TypeError: ``optimizer`` is not an optimizer, ``seed`` or ``chunk_bytes`` not
            an int, the optimizer already keeps fp32 master weights, or its step
            requires a closure (LBFGS).
        ValueError: an unknown ``rounding`` (the accepted ones are listed), a float16
            parameter, or an optimizer already made pure with another rounding.

    Example:
        >>> import torch
        >>> from ampkit.master_weights_pure import PureLowPrecisionOptimizer
        >>> model = torch.nn.Linear(4, 2).to(torch.bfloat16)
        >>> opt = PureLowPrecisionOptimizer(torch.optim.AdamW(model.parameters()), "kahan",
        ...                                 seed=0)
        >>> model(torch.ones(1, 4, dtype=torch.bfloat16)).sum().backward()
        >>> opt.step()
        >>> sorted(opt.state[model.weight]), opt.state[model.weight]["exp_avg"].dtype
        (['exp_avg', 'exp_avg_sq', 'kahan_compensation', 'step'], torch.bfloat16)
    """

    _ampkit_pure: _Pure

    def __new__(cls, optimizer: torch.optim.Optimizer, rounding: str = "stochastic", *,
                seed: int | None = None, chunk_bytes: int | None = None) -> Any:
        check_pure_optimizer(optimizer, rounding, seed=seed)
        if chunk_bytes is not None and (not isinstance(chunk_bytes, int)
                                        or isinstance(chunk_bytes, bool) or chunk_bytes <= 0):
            raise TypeError(f"chunk_bytes must be a positive int or None, got "
                            f"{chunk_bytes!r}")
        if pure_rounding(optimizer) is not None:  # already pure, with this rounding
            return optimizer
        patched = optimizer.__dict__.get("step")
        if patched is not None and not getattr(patched, "_wrapped_by_lr_sched", False):
            raise RuntimeError("optimizer.step was replaced on this optimizer instance; "
                               "make the optimizer pure before patching its step")
        if seed is None:
            seed = int(torch.randint(0, 2 ** 62, (), dtype=torch.int64).item())
        object.__setattr__(optimizer, "_ampkit_pure", _Pure(rounding, seed, chunk_bytes))
        # Loss scalers hand fused optimizers found_inf and let them skip on the device;
        # here the rounding would still draw random bits. Make scalers unscale, check
        # and skip the call instead, so a skipped step changes nothing at all.
        optimizer._step_supports_amp_scaling = False
        with torch.no_grad():  # state made before: store it in bf16 from now on
            for p, state in optimizer.state.items():
                if p.dtype is torch.bfloat16:
                    for k, v in state.items():
                        if _stored_low(k, v) and v.dtype is torch.float32:
                            state[k] = v.to(torch.bfloat16)
        optimizer.__class__ = _pure_class(type(optimizer))
        _own(optimizer)
        if patched is not None:  # an LR scheduler's wrapper bound to the old class
            ref = weakref.ref(optimizer)

            def step(*args: Any, **kwargs: Any) -> Any:
                opt = ref()
                assert opt is not None
                opt._opt_called = True  # what the scheduler's wrapper records
                return type(opt).step(opt, *args, **kwargs)

            step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
            optimizer.step = step  # type: ignore[method-assign]
        return optimizer

    def __init__(self, optimizer: torch.optim.Optimizer, rounding: str = "stochastic", *,
                 seed: int | None = None, chunk_bytes: int | None = None) -> None:
        # Everything happened in __new__, which returns the optimizer itself.
        pass

    # -- parameter groups and copies ---------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's ``add_param_group``, refusing float16 parameters (see the class).

        Example:
            >>> import torch
            >>> from ampkit.master_weights_pure import PureLowPrecisionOptimizer
            >>> w = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
            >>> opt = PureLowPrecisionOptimizer(torch.optim.SGD([w], lr=0.1), "kahan")
            >>> opt.add_param_group({"params": [torch.nn.Parameter(
            ...     torch.ones(2, dtype=torch.bfloat16))], "lr": 0.01})
            >>> len(opt.param_groups)
            2
        """
        if isinstance(param_group, dict):
            params = param_group.get("params")
            if params is not None and not isinstance(params, torch.Tensor | set):
                params = list(params)  # a generator is read once: hand torch the list
                param_group = {**param_group, "params": params}
            _check_no_float16([params] if isinstance(params, torch.Tensor)
                              else params or [])
        super().add_param_group(param_group)  # type: ignore[misc]
        _own(self)

    def __reduce_ex__(self, protocol: Any) -> Any:
        # copy.deepcopy and pickle: rebuild through the optimizer's own class (the pure
        # subclass is made at run time, so pickle cannot look it up by name).
        base = type(self).__bases__[1]
        return _rebuild_pure, (base,), self.__getstate__()

    def __getstate__(self) -> dict[str, Any]:
        # torch's optimizer pickles only defaults, state and param_groups; a copy must
        # also round like the original (same rounding, seed and generator states).
        state = super().__getstate__()  # type: ignore[misc]
        state["_ampkit_pure"] = self._ampkit_pure
        state["_step_supports_amp_scaling"] = False
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)  # type: ignore[misc]
        _own(self)

    # -- one step ---------------------------------------------------------------------

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """Run the optimizer's own step in fp32, chunk by chunk, and round the results
        back into bf16 (see the module docstring).

        ``kwargs`` go to the optimizer's own step (fused optimizers take
        ``grad_scale``/``found_inf`` from a loss scaler; ``found_inf`` != 0 skips the
        step and changes nothing). A closure is called once, before the update.

        Example:
            >>> import torch
            >>> from ampkit.master_weights_pure import PureLowPrecisionOptimizer
            >>> w = torch.nn.Parameter(torch.ones(1, dtype=torch.bfloat16))
            >>> opt = PureLowPrecisionOptimizer(torch.optim.SGD([w], lr=1e-3), "kahan")
            >>> for _ in range(3):
            ...     w.grad = torch.ones_like(w)
            ...     opt.step()
            >>> comp = opt.state[w]["kahan_compensation"]
            >>> w.item(), round(w.item() + comp.item(), 4)  # weight + what it lost: 0.997
            (0.99609375, 0.997)
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf = kwargs.get("found_inf", getattr(self, "found_inf", None))
        if isinstance(found_inf, torch.Tensor) and bool(found_inf.item() != 0):
            return loss  # an overflow: nothing may change, generators included
        groups = self.param_groups  # type: ignore[attr-defined]
        saved = [g["params"] for g in groups]
        inner = _inner_step(type(self))
        try:
            budget = self._ampkit_pure.chunk_bytes
            if budget is None:
                budget = sum(16 * p.numel() for ps in saved for p in ps) // 16
            for i in range(len(groups)):
                active = [p for p in saved[i] if p.grad is not None]
                for chunk in _chunks(active, budget):
                    for j, g in enumerate(groups):
                        g["params"] = chunk if j == i else []
                    with _working_copies(self, chunk):
                        inner(self, **kwargs)
        finally:
            for g, params in zip(groups, saved):
                g["params"] = params
        return loss

    # -- checkpoints ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """torch's ``state_dict`` plus this mode's rounding, seed and generator states
        (the Kahan buffers are already in each parameter's state).

        Example:
            >>> import torch
            >>> from ampkit.master_weights_pure import PureLowPrecisionOptimizer
            >>> w = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
            >>> opt = PureLowPrecisionOptimizer(torch.optim.SGD([w], lr=0.1), seed=7)
            >>> opt.state_dict()["ampkit_pure_low_precision"]["seed"]
            7
        """
        out = super().state_dict()  # type: ignore[misc]
        pure = self._ampkit_pure
        out[_SD_KEY] = {"rounding": pure.rounding, **pure.generators.state_dict()}
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load torch's ``state_dict`` (state stored in bf16) and, when present, this
        mode's generator states, so a resumed run continues bit for bit. Kahan buffers
        count only from a pure Kahan optimizer's own ``state_dict``; others are dropped.

        Raises:
            ValueError: the checkpoint was saved with another rounding.

        Example:
            >>> import torch
            >>> from ampkit.master_weights_pure import PureLowPrecisionOptimizer
            >>> w = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
            >>> opt = PureLowPrecisionOptimizer(torch.optim.SGD([w], lr=0.1), seed=7)
            >>> sd = opt.state_dict()
            >>> other = PureLowPrecisionOptimizer(torch.optim.SGD([w], lr=0.1), seed=1)
            >>> other.load_state_dict(sd); other.state_dict()[
            ...     "ampkit_pure_low_precision"]["seed"]
            7
        """
        state_dict = dict(state_dict)
        extra = state_dict.pop(_SD_KEY, None)
        pure = self._ampkit_pure
        if extra is not None and extra["rounding"] != pure.rounding:
            raise ValueError(f"the checkpoint was saved with rounding="
                             f"{extra['rounding']!r}; this optimizer uses "
                             f"rounding={pure.rounding!r}")
        if (pure.rounding != "kahan" or extra is None) and any(
                _COMP in s for s in state_dict.get("state", {}).values()):
            # A Kahan buffer carried over by another optimizer (a Kahan run resumed in
            # fp32, then here) belongs to weights that run has since moved, and without
            # Kahan it would never be updated: only a pure Kahan checkpoint's counts.
            state_dict["state"] = {k: {n: v for n, v in s.items() if n != _COMP}
                                   for k, s in state_dict["state"].items()}
        super().load_state_dict(state_dict)  # type: ignore[misc]
        # torch stores every floating state entry in the parameter's dtype; scalar
        # state stays fp32 here (see _stored_low): take it from the checkpoint again.
        saved = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]  # type: ignore[attr-defined]
        for index, p in zip(saved, params):
            for k, v in state_dict["state"].get(index, {}).items():
                if (k not in ("step", _COMP) and isinstance(v, torch.Tensor)
                        and v.is_floating_point() and v.dim() == 0
                        and p in self.state):  # type: ignore[attr-defined]
                    self.state[p][k] = v.to(device=p.device, dtype=torch.float32,  # type: ignore[attr-defined]
                                            copy=True)  # never the checkpoint's own
        if extra is not None:
            pure.generators.load_state_dict(extra)


def _stored_low(key: str, value: Any) -> bool:
    """Whether an optimizer state entry is stored in bf16: per-element state (moments,
    momentum). The step count and scalar state that follows from it and the
    hyper-parameters (NAdam's ``mu_product``, ASGD's ``eta``) stay fp32 and exact;
    the Kahan buffer is rounded its own way."""
    return (key not in ("step", _COMP) and isinstance(value, torch.Tensor)
            and value.is_floating_point() and value.dim() > 0)


def _rebuild_pure(base: type) -> Any:
    """An empty pure ``base`` optimizer; copy/pickle then calls ``__setstate__``."""
    return object.__new__(_pure_class(base))


@contextlib.contextmanager
def _working_copies(opt: Any, chunk: list[torch.Tensor]) -> Iterator[None]:
    """Swap ``chunk``'s bf16 parameters, gradients and state for fp32 working copies
    while the optimizer steps, then round everything back (also when the step raised:
    the bf16 values are then put back unchanged)."""
    pure: _Pure = opt._ampkit_pure
    state = opt.state
    swapped: list[tuple[nn.Parameter, torch.Tensor, torch.Tensor]] = []
    # the bf16 state tensors, refilled in place after the step (no allocator churn)
    originals: dict[tuple[int, str], torch.Tensor] = {}
    with torch.no_grad():
        for p in chunk:
            if p.dtype is not torch.bfloat16:
                continue
            low, grad = p.data, p.grad
            work = low.float()
            comp = state[p].get(_COMP) if p in state and pure.rounding == "kahan" else None
            if comp is not None:
                work.add_(comp)
            p.grad = None
            p.data = work
            p.grad = grad.float()
            for k, v in list(state[p].items()) if p in state else ():
                if k not in ("step", _COMP) and isinstance(v, torch.Tensor) \
                        and v.dtype is torch.bfloat16:
                    originals[id(p), k] = v
                    state[p][k] = v.float()
            swapped.append((p, low, grad))
    ok = False
    try:
        yield
        ok = True
    finally:
        with torch.no_grad():
            for p, low, grad in swapped:
                work = p.data
                p.grad = None
                if ok:
                    p.data = _round_weight(pure, state[p], work, low)
                else:
                    p.data = low
                p.grad = grad
                del work
                for k, v in list(state[p].items()):
                    if _stored_low(k, v) and v.dtype is torch.float32:
                        original = originals.get((id(p), k))
                        if not ok and original is not None:
                            state[p][k] = original  # the step failed: as it was
                            continue
                        rounded = _round_state(pure, v)
                        del v
                        if original is not None and original.shape == rounded.shape:
                            rounded = original.copy_(rounded)
                        state[p][k] = rounded


def _round_weight(pure: _Pure, state: dict[str, Any], work: torch.Tensor,
                  low: torch.Tensor) -> torch.Tensor:
    if pure.rounding == "stochastic":
        new = stochastic_round(work, pure.generators.get(work.device))
    else:
        new = work.to(torch.bfloat16)
        if pure.rounding == "kahan":
            # What rounding lost, truncated toward zero (not rounded) to bf16: it then
            # stays below half an ulp of the weight, so weight + compensation, saved in
            # fp32, rounds back to the very same weight on loading.
            lost = work.sub_(new).view(torch.int32).bitwise_and_(_HIGH_MASK)
            lost_bf16 = lost.view(torch.float32).to(torch.bfloat16)
            comp = state.get(_COMP)
            if comp is not None and comp.shape == lost_bf16.shape:
                comp.copy_(lost_bf16)  # in place: no allocator churn between steps
            else:
                state[_COMP] = lost_bf16
    low.copy_(new)  # into the parameter's own storage: views of it stay valid
    return low


def _round_state(pure: _Pure, value: torch.Tensor) -> torch.Tensor:
    if pure.rounding == "nearest":
        return value.to(torch.bfloat16)
    return stochastic_round(value, pure.generators.get(value.device))


def _inner_step(cls: type) -> Callable[..., Any]:
    """The step of the optimizer class a pure class was made from, without torch's
    wrapper that runs the step hooks: the pure step runs them once around all chunks,
    with every parameter group whole, instead of once per chunk."""
    step = cls.__bases__[1].step
    if getattr(step, "hooked", False) and hasattr(step, "__wrapped__"):
        step = step.__wrapped__
    return step


# The step hooks (and the profiler's record) run once around the whole pure step, as
# torch's wrapper runs them around any optimizer's step; marked hooked so that
# Optimizer.__setstate__ (copy.deepcopy, unpickling) does not wrap it again.
PureLowPrecisionOptimizer.step = torch.optim.Optimizer.profile_hook_step(  # type: ignore[method-assign]
    PureLowPrecisionOptimizer.step)
PureLowPrecisionOptimizer.step.hooked = True  # type: ignore[attr-defined]


def pure_rounding(optimizer: torch.optim.Optimizer) -> str | None:
    """The rounding ``optimizer`` applies updates with, or ``None`` when it is not a
    :class:`PureLowPrecisionOptimizer`.

    Example:
        >>> import torch
        >>> from ampkit.master_weights_pure import PureLowPrecisionOptimizer, pure_rounding
        >>> w = torch.nn.Parameter(torch.ones(1, dtype=torch.bfloat16))
        >>> opt = torch.optim.SGD([w], lr=0.1)
        >>> pure_rounding(opt), pure_rounding(PureLowPrecisionOptimizer(opt, "kahan"))
        (None, 'kahan')
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    pure = optimizer.__dict__.get("_ampkit_pure")
    return None if pure is None else pure.rounding


def _own(optimizer: Any) -> None:
    """Record ``optimizer`` as the one stepping each of its parameters (see _OWNERS)."""
    ref = weakref.ref(optimizer)
    for group in optimizer.param_groups:
        for p in group["params"]:
            _OWNERS[p] = ref


def _compensation(param: torch.Tensor) -> torch.Tensor | None:
    """The Kahan buffer of ``param`` in the pure optimizer that steps it, if any."""
    ref = _OWNERS.get(param)
    opt = None if ref is None else ref()
    if opt is None or param not in opt.state:
        return None
    return opt.state[param].get(_COMP)


class _ReportCompensated:
    """``state_dict`` post-hook: each parameter with a Kahan buffer is reported as the
    weight plus its compensation, in fp32 (what an fp32 model should load). Holds
    nothing: the buffer is found through the parameter, so the hook of a deep-copied
    model reports the copied optimizer's buffers. (No ``__slots__``: torch tags hooks
    with an attribute.)"""

    def __call__(self, module: nn.Module, state_dict: dict[str, Any], prefix: str,
                 local_metadata: Any) -> None:
        for name, param in module._parameters.items():
            key = prefix + name
            value = state_dict.get(key)
            if param is None or value is None or value is param:  # keep_vars=True
                continue
            comp = _compensation(param)
            if comp is not None:
                state_dict[key] = param.detach().float() + comp.float()


class _LoadCompensated:
    """``load_state_dict`` pre-hook: a parameter with a Kahan buffer gets the buffer of
    the value it loads (what rounding that value to nearest loses, truncated to bf16),
    so the model then holds and reports the loaded value, not the loaded value plus the
    compensation of the weight it replaced. Runs after ampkit's conversion guard, which
    has refused a load that would fail, so a failed load changes no buffer either."""

    def __call__(self, module: nn.Module, state_dict: dict[str, Any], prefix: str,
                 *unused: Any) -> None:
        with torch.no_grad():
            for name, param in module._parameters.items():
                value = state_dict.get(prefix + name)
                comp = None if param is None else _compensation(param)
                if (comp is None or not isinstance(value, torch.Tensor)
                        or value.shape != param.shape):
                    continue
                exact = value.detach().to(device=comp.device, dtype=torch.float32)
                lost = (exact - exact.to(torch.bfloat16).float()).view(torch.int32)
                comp.copy_(lost.bitwise_and_(_HIGH_MASK).view(torch.float32))


def register_pure_state_dict_hook(model: nn.Module, optimizer: torch.optim.Optimizer
                                  ) -> None:
    """Make ``model.state_dict()`` report each parameter that has a Kahan buffer in
    ``optimizer`` as the weight plus its compensation, in fp32 (so an fp32 model loads
    what the compensation kept), and ``model.load_state_dict`` set each such buffer to
    what rounding the loaded value loses (so the model then holds the loaded value, not
    it plus the replaced weight's compensation). :func:`pure_low_precision` calls it.

    Example:
        >>> import torch
        >>> from ampkit.master_weights_pure import (
        ...     PureLowPrecisionOptimizer, register_pure_state_dict_hook)
        >>> model = torch.nn.Linear(1, 1, bias=False).to(torch.bfloat16)
        >>> torch.nn.init.ones_(model.weight)
        Parameter containing:
        tensor([[1.]], dtype=torch.bfloat16, requires_grad=True)
        >>> opt = PureLowPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3),
        ...                                 "kahan")
        >>> register_pure_state_dict_hook(model, opt)
        >>> model.weight.grad = torch.ones_like(model.weight)
        >>> opt.step()
        >>> model.weight.item(), round(model.state_dict()["weight"].item(), 4)
        (1.0, 0.999)
    """
    if pure_rounding(optimizer) is None:
        raise TypeError("optimizer must be a PureLowPrecisionOptimizer")
    _own(optimizer)
    report, load = _ReportCompensated(), _LoadCompensated()
    params = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for module in model.modules():
        if any(p is not None and id(p) in params for p in module._parameters.values()):
            if hasattr(module, "register_state_dict_post_hook"):
                module.register_state_dict_post_hook(report)
                module.register_load_state_dict_pre_hook(load)
            else:  # torch < 2.5
                module._register_state_dict_hook(report)
                module._register_load_state_dict_pre_hook(load, with_module=True)


def pure_low_precision(models: nn.Module | list[nn.Module] | tuple[nn.Module, ...],
                       optimizer: torch.optim.Optimizer, rounding: str, *,
                       seed: int | None = None) -> Any:
    """Make ``optimizer`` pure (:class:`PureLowPrecisionOptimizer`) and hook each of
    ``models`` so its ``state_dict`` carries the Kahan compensation; what
    ``ampkit.initialize(..., master_weights="stochastic" | "kahan")`` does. Calling it
    again on the same optimizer changes nothing.

    Example:
        >>> import torch
        >>> import ampkit
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        >>> model, opt = ampkit.initialize(model, opt, level="O2", dtype=torch.bfloat16,
        ...                                master_weights="stochastic", rounding_seed=0)
        >>> model[0].weight.dtype, type(opt).__name__
        (torch.bfloat16, 'PureLowPrecisionAdamW')
        >>> model(torch.rand(2, 4)).sum().backward(); opt.step()
        >>> opt.state[model[0].weight]["exp_avg"].dtype, model.state_dict()["0.weight"].dtype
        (torch.bfloat16, torch.bfloat16)
    """
    rounding = _check_rounding(rounding)
    if pure_rounding(optimizer) == rounding:
        return optimizer
    optimizer = PureLowPrecisionOptimizer(optimizer, rounding, seed=seed)
    if rounding == "kahan":
        for model in [models] if isinstance(models, nn.Module) else models:
            register_pure_state_dict_hook(model, optimizer)
    return optimizer
