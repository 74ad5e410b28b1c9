"""The pure low-precision optimizer: :class:`PureLowPrecisionOptimizer` makes a torch
optimizer step bf16 parameters through fp32 working copies, chunk by chunk, and round
the results back (:mod:`ampkit.pure.rounding`); its ``state_dict``, pickling and
checks. How a step works, what it costs and how checkpoints behave: :mod:`ampkit.pure`.

Example:
    >>> import torch
    >>> from ampkit.pure import PURE_ROUNDINGS, PureLowPrecisionOptimizer
    >>> w = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    >>> opt = PureLowPrecisionOptimizer(torch.optim.AdamW([w]), "kahan")
    >>> type(opt).__name__, isinstance(opt, torch.optim.AdamW), PURE_ROUNDINGS[:2]
    ('PureLowPrecisionAdamW', True, ('stochastic', 'kahan'))
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable
from typing import Any, cast

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ampkit import torch_internals
from ampkit.conversion.levels import Rounding
from ampkit.conversion.parameter_owners import MADE_FROM
from ampkit.conversion.parameter_owners import optimizer_class_name as class_name_made_from
from ampkit.pure.fused import lanes, left_to_torch, stepping_fused, takes_fused
from ampkit.pure.rounding import local_tensor
from ampkit.pure.step import COMP as _COMP
from ampkit.pure.step import OWN_STATE as _OWN_STATE
from ampkit.pure.step import (
    RoundBatch,
    Slice,
    Workspace,
    chunks,
    slice_size,
    slice_stand_in,
    slices,
    stand_ins,
)
from ampkit.pure.step import stored_low as _stored_low

__all__ = ["PURE_ROUNDINGS", "PureLowPrecisionOptimizer", "PureState", "check_pure_optimizer",
           "check_rounding", "check_seed", "needs_closure", "optimizer_class_name",
           "pure_rounding",
           "rebuild_pure", "rounding_keys"]

#: The roundings :class:`PureLowPrecisionOptimizer` accepts, by value: the pure modes'
#: roundings (:attr:`ampkit.conversion.levels.MasterWeights.rounding`) and
#: ``"nearest"``, the stalling baseline.
PURE_ROUNDINGS: tuple[str, ...] = tuple(r.value for r in Rounding)

_SEED = "rounding_seed"  # a hyper-parameter of every parameter group
_SD_KEY = "ampkit_pure_low_precision"  # the optimizer state_dict entry of this mode


def check_rounding(rounding: Any) -> Rounding:
    """The :class:`~ampkit.conversion.levels.Rounding` a public entry of
    :mod:`ampkit.pure` was given as text: the one parse of it there.

    Raises:
        ValueError: not one of :data:`PURE_ROUNDINGS`.

    Example:
        >>> from ampkit.pure.optimizer import check_rounding
        >>> check_rounding("nearest")
        <Rounding.NEAREST: 'nearest'>
    """
    return Rounding.parse(rounding)


def _rounding(rounding: Rounding | str) -> Rounding:
    # a member was checked where it was made (initialize passes its mode's rounding):
    # only text is parsed, once per public entry
    return rounding if isinstance(rounding, Rounding) else check_rounding(rounding)


def _check_no_float16(params: Any) -> None:
    for p in params:
        if isinstance(p, torch.Tensor) and p.dtype is torch.float16:
            raise ValueError("pure low-precision training takes bfloat16 "
                             "parameters; float16 has too little range for "
                             "optimizer state and updates: use fp32 parameters "
                             "(master_weights=True) for float16")


def needs_closure(optimizer: Any) -> bool:
    """Whether the optimizer's step requires a closure (LBFGS): such a step evaluates
    the closure again at weights it tries (a pure optimizer answers for the class it
    was made from).

    Example:
        >>> import torch
        >>> from ampkit.pure.optimizer import needs_closure
        >>> w = torch.nn.Parameter(torch.ones(1))
        >>> needs_closure(torch.optim.LBFGS([w])), needs_closure(torch.optim.SGD([w]))
        (True, False)
    """
    try:
        closure = inspect.signature(_inner_step(type(optimizer))).parameters.get("closure")
    except (TypeError, ValueError):  # no signature to read: assume the common case
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


def _inner_step(cls: type) -> Callable[..., Any]:
    """The step of the optimizer class a pure class was made from (or ``cls``'s own),
    without torch's wrapper that runs the step hooks: the pure step runs them once
    around all chunks, with every parameter group whole, instead of once per chunk."""
    base = cls.__bases__[1] if issubclass(cls, PureLowPrecisionOptimizer) else cls
    step: Callable[..., Any] = cast("type[torch.optim.Optimizer]", base).step
    wrapped: Callable[..., Any] | None = getattr(step, "__wrapped__", None)
    if getattr(step, "hooked", False) and wrapped is not None:
        return wrapped
    return step


def check_seed(seed: Any, name: str) -> None:
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise TypeError(f"{name} must be an int or None, got {seed!r}")


def check_pure_optimizer(optimizer: Any, rounding: Rounding | str = Rounding.STOCHASTIC, *,
                         seed: Any = None, seed_name: str = "seed") -> None:
    """Raise the error :class:`PureLowPrecisionOptimizer` would raise for these
    arguments, without changing anything (``ampkit.initialize`` checks every optimizer
    before converting the models; ``seed_name`` is the argument's name there).

    Raises:
        TypeError: ``optimizer`` is not an optimizer; ``seed`` not an int.
        ValueError: an unknown ``rounding``, a float16 parameter, or an optimizer
            already pure with another rounding.

    Example:
        >>> import torch
        >>> from ampkit.pure import check_pure_optimizer
        >>> w = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
        >>> check_pure_optimizer(torch.optim.SGD([w], lr=0.1), "kahan")  # fine: None
        >>> check_pure_optimizer(torch.optim.SGD([w], lr=0.1), "kahan", seed=0.5)
        Traceback (most recent call last):
        ...
        TypeError: seed must be an int or None, got 0.5
    """
    _check_pure_optimizer(optimizer, _rounding(rounding), seed, seed_name)


def _check_pure_optimizer(optimizer: Any, rounding: Rounding, seed: Any,
                          seed_name: str) -> None:
    # check_pure_optimizer with the rounding's name already checked
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    check_seed(seed, seed_name)
    existing = pure_rounding(optimizer)
    if existing is not None:
        if existing is not rounding:
            raise ValueError(f"this optimizer already trains in pure low precision with "
                             f"rounding={existing.value!r}, not {rounding.value!r}")
        return
    for group in optimizer.param_groups:
        _check_no_float16(group["params"])


class PureState:
    """What a pure optimizer keeps besides torch's own ``param_groups`` and ``state``:
    its rounding, chunk budget and whether its step is compiled (pickled with it), and,
    with Kahan, each parameter's :func:`~ampkit.pure.step.fingerprint` as the last step
    left it (not pickled: a copy's parameters are new tensors, and a compensation
    without a record is taken as it is), and the step's scratch
    (:class:`~ampkit.pure.step.Workspace`, not pickled)."""

    __slots__ = ("chunk_bytes", "compile_step", "rounding", "versions", "workspace")

    def __init__(self, rounding: Rounding, chunk_bytes: int | None,
                 compile_step: bool = False) -> None:
        self.rounding = rounding
        self.chunk_bytes = chunk_bytes
        self.compile_step = compile_step  # steps through ampkit.pure.compiled_step
        self.versions: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.workspace = Workspace(shared=True)

    def __getstate__(self) -> dict[str, Any]:
        # the rounding by its value: pickles made before and after the member load
        return {"rounding": self.rounding.value, "chunk_bytes": self.chunk_bytes,
                "compile_step": self.compile_step}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(Rounding.parse(state["rounding"]),  # type: ignore[misc]
                      state["chunk_bytes"], state.get("compile_step", False))


def _as_saved(value: Any, device: torch.device) -> Any:
    """A checkpoint's state entry as it was saved (tensors copied onto ``device``, in
    their saved dtype; also inside lists), where torch would cast it to the parameter's
    dtype."""
    if isinstance(value, torch.Tensor):
        return value.to(device=device, copy=True)
    if isinstance(value, list | tuple):
        return type(value)(_as_saved(v, device) for v in value)
    return value


@functools.cache
def _pure_class(base: type) -> type:
    """``base`` with :class:`PureLowPrecisionOptimizer`'s methods in front
    (``PureLowPrecisionAdamW``, ...), one per optimizer class. Pickle and
    ``copy.deepcopy`` rebuild it from ``base`` (see ``__reduce_ex__``)."""
    return type(f"PureLowPrecision{base.__name__}", (PureLowPrecisionOptimizer, base),
                {"__module__": PureLowPrecisionOptimizer.__module__, MADE_FROM: base})


def rebuild_pure(base: type) -> Any:
    """An empty pure ``base`` optimizer; copy/pickle then calls ``__setstate__``."""
    return object.__new__(_pure_class(base))


class PureLowPrecisionOptimizer:
    """Make a torch optimizer train bf16 parameters with bf16 state, in place.

    ``PureLowPrecisionOptimizer(opt, rounding, seed=...)`` returns ``opt`` itself, now
    also an instance of this class. Its class becomes a subclass of both, so
    ``isinstance(opt, torch.optim.AdamW)`` holds. LR schedulers (made before or after),
    ``state_dict`` and every other reference to ``opt`` keep working, and ``opt`` pickles
    by naming its original class. ``param_groups`` keep the model's bf16 parameters, and
    ``state`` stays keyed by them, stored in bf16. See the docstring of :mod:`ampkit.pure` for how a
    step rounds. An ``Adam``/``AdamW`` group on the CPU that leaves ``foreach`` and
    ``fused`` to torch is stepped with torch's fused kernel (see :mod:`ampkit.pure`).
    Tested with AdamW (for-loop, foreach, fused), SGD with momentum, NAdam,
    ASGD and LBFGS. Any ``torch.optim`` optimizer whose state is per-parameter tensors
    works the same way.

    Args:
        optimizer: a ``torch.optim.Optimizer`` over bf16 (and possibly fp32)
            parameters.
        rounding: a :class:`~ampkit.conversion.levels.Rounding` (a pure
            ``MasterWeights`` member's :attr:`~ampkit.conversion.levels.MasterWeights.rounding`
            is what ``initialize`` passes) or its value, ``"stochastic"``, ``"kahan"``
            or ``"nearest"`` (:data:`PURE_ROUNDINGS`).
        seed: the stochastic rounding's seed, stored as the hyper-parameter
            ``"rounding_seed"`` of every parameter group (and of groups added later).
            ``None`` means 0. It is never drawn from torch's RNG: replicas must agree.
        chunk_bytes: the most fp32 working memory one chunk of a step may take.
            ``None``: a sixteenth of what the whole optimizer would take (about one
            byte per parameter on top of the 6-8 held). A parameter larger than the
            budget is a chunk of its own (its working copies take 16 bytes per
            element), or, with an element-wise torch optimizer, is stepped in slices
            of the budget's size (at least 262,144 elements).
        compile_step: run each bf16 parameter's update (upcast, the optimizer's own
            update math from its torch functional form, rounding back) as
            code compiled by ``torch.compile``, with the random bits stated in
            :mod:`ampkit.pure.compiled_step`; only with ``"stochastic"`` or
            ``"kahan"``. Optimizers it cannot take step eagerly, said once.

    ``add_param_group`` refuses float16 parameters too.

    Raises:
        TypeError: ``optimizer`` is not an optimizer, ``seed`` or ``chunk_bytes``
            not an int, or ``compile_step`` not a bool.
        ValueError: an unknown ``rounding`` (the accepted ones are listed), a float16
            parameter, or an optimizer already made pure with another rounding.
        RuntimeError: ``optimizer.step`` was replaced on the instance by something
            other than an LR scheduler.

    Example:
        >>> import torch
        >>> from ampkit.pure import PureLowPrecisionOptimizer
        >>> model = torch.nn.Linear(4, 2).to(torch.bfloat16)
        >>> opt = PureLowPrecisionOptimizer(torch.optim.AdamW(model.parameters()), "kahan",
        ...                                 seed=0)
        >>> model(torch.ones(1, 4, dtype=torch.bfloat16)).sum().backward()
        >>> opt.step()
        >>> sorted(opt.state[model.weight]), opt.state[model.weight]["exp_avg"].dtype
        (['exp_avg', 'exp_avg_sq', 'kahan_compensation', 'rounding_step', 'step'], \
torch.bfloat16)
    """

    _ampkit_pure: PureState

    def __new__(cls, optimizer: torch.optim.Optimizer,
                rounding: Rounding | str = Rounding.STOCHASTIC, *,
                seed: int | None = None, chunk_bytes: int | None = None,
                compile_step: bool = False) -> Any:
        rounding = _rounding(rounding)
        _check_pure_optimizer(optimizer, rounding, seed, "seed")
        from ampkit.pure.compiled_step import check_compile_step

        check_compile_step(compile_step, rounding, optimizer)
        if chunk_bytes is not None and (not isinstance(chunk_bytes, int)
                                        or isinstance(chunk_bytes, bool) or chunk_bytes <= 0):
            raise TypeError(f"chunk_bytes must be a positive int or None, got "
                            f"{chunk_bytes!r}")
        if pure_rounding(optimizer) is not None:  # already pure, with this rounding
            return optimizer
        patched = optimizer.__dict__.get("step")
        if patched is not None and not torch_internals.wrapped_by_lr_scheduler(patched):
            raise RuntimeError("optimizer.step was replaced on this optimizer instance; "
                               "make the optimizer pure before patching its step")
        seed = 0 if seed is None else seed
        object.__setattr__(optimizer, "_ampkit_pure", PureState(rounding, chunk_bytes,
                                                                compile_step))
        # Loss scalers hand fused optimizers found_inf and let them skip on the device;
        # here the rounding would still run. Make scalers unscale, check and skip the
        # call instead, so a skipped step changes nothing at all.
        torch_internals.set_step_supports_amp_scaling(optimizer, False)
        optimizer.defaults[_SEED] = seed  # what add_param_group fills in
        for group in optimizer.param_groups:
            group[_SEED] = seed
        with torch.no_grad():  # state made before: store it in bf16 from now on
            for p, state in optimizer.state.items():
                if p.dtype is torch.bfloat16:
                    for k, v in state.items():
                        if _stored_low(k, v, p) and v.dtype is torch.float32:
                            state[k] = v.to(torch.bfloat16)
        optimizer.__class__ = _pure_class(type(optimizer))  # type: ignore[arg-type]
        if patched is not None:  # an LR scheduler's wrapper bound to the old class
            ref = weakref.ref(optimizer)

            def step(*args: Any, **kwargs: Any) -> Any:
                opt = ref()
                assert opt is not None
                torch_internals.mark_optimizer_called(opt)  # the scheduler's flag
                return type(opt).step(opt, *args, **kwargs)

            torch_internals.mark_wrapped_by_lr_scheduler(step)
            optimizer.step = step  # type: ignore[method-assign]
        return optimizer

    def __init__(self, optimizer: torch.optim.Optimizer,
                 rounding: Rounding | str = Rounding.STOCHASTIC, *,
                 seed: int | None = None, chunk_bytes: int | None = None,
                 compile_step: bool = False) -> None:
        # Everything happened in __new__, which returns the optimizer itself.
        pass

    # -- parameter groups and copies ---------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's ``add_param_group``, refusing float16 parameters; the group's
        ``rounding_seed`` defaults to the optimizer's.

        Example:
            >>> import torch
            >>> from ampkit.pure import PureLowPrecisionOptimizer
            >>> w = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
            >>> opt = PureLowPrecisionOptimizer(torch.optim.SGD([w], lr=0.1), "kahan",
            ...                                 seed=5)
            >>> opt.add_param_group({"params": [torch.nn.Parameter(
            ...     torch.ones(2, dtype=torch.bfloat16))], "lr": 0.01})
            >>> [g["rounding_seed"] for g in opt.param_groups]
            [5, 5]
        """
        if isinstance(param_group, dict):
            params = param_group.get("params")
            if params is not None and not isinstance(params, torch.Tensor | set):
                params = list(params)  # a generator is read once: hand torch the list
                param_group = {**param_group, "params": params}
            _check_no_float16([params] if isinstance(params, torch.Tensor)
                              else params or [])
            check_seed(param_group.get(_SEED), _SEED)
        super().add_param_group(param_group)  # type: ignore[misc]

    def __reduce_ex__(self, protocol: Any) -> Any:
        # copy.deepcopy and pickle: rebuild through the optimizer's own class (the pure
        # subclass is made at run time, so pickle cannot look it up by name).
        base = type(self).__bases__[1]
        return rebuild_pure, (base,), self.__getstate__()

    def __getstate__(self) -> dict[str, Any]:
        # torch's optimizer pickles only defaults, state and param_groups (the seed is
        # in the last two, the counts in state); a copy must also round the same way.
        # (the torch optimizer class is this class's second base only at run time)
        state: dict[str, Any] = super().__getstate__()  # type: ignore[misc]
        state["_ampkit_pure"] = self._ampkit_pure
        state[torch_internals.STEP_SUPPORTS_AMP_SCALING] = False
        return state

    # -- one step ---------------------------------------------------------------------

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """Run the optimizer's own step on fp32 working parameters, chunk by chunk, and
        round the results back into the bf16 parameters and state (see the module
        docstring).

        ``kwargs`` go to the optimizer's own step. ``found_inf`` != 0 (from a loss
        scaler) skips the step and changes nothing. A closure is called once, before
        the update, unless the optimizer's step requires one (LBFGS), which then
        evaluates it at the weights it tries.

        Example:
            >>> import torch
            >>> from ampkit.pure import PureLowPrecisionOptimizer
            >>> w = torch.nn.Parameter(torch.ones(1, dtype=torch.bfloat16))
            >>> opt = PureLowPrecisionOptimizer(torch.optim.SGD([w], lr=1e-3), "kahan")
            >>> for _ in range(3):
            ...     w.grad = torch.ones_like(w)
            ...     opt.step()
            >>> comp = opt.state[w]["kahan_compensation"]
            >>> w.item(), round(w.item() + comp.item(), 4)  # weight + what it lost: 0.997
            (0.99609375, 0.997)
        """
        inner = _inner_step(type(self))
        loss = None
        if closure is not None and not needs_closure(self):
            with torch.enable_grad():
                loss = closure()
            closure = None
        found_inf = kwargs.get("found_inf", getattr(self, "found_inf", None))
        if isinstance(found_inf, torch.Tensor) and bool(found_inf.item() != 0):
            return loss  # an overflow: nothing may change
        groups = self.param_groups  # type: ignore[attr-defined]
        # The lists themselves are refilled in place: optimizers may hold them (LBFGS).
        lists = [g["params"] for g in groups]
        saved = [list(ps) for ps in lists]
        # each parameter's (index in the optimizer, its group's seed): the hash's key.
        # A step inside backward (ampkit.step_in_backward) narrows the groups to one
        # parameter and hands the whole optimizer's indices here.
        where = self.__dict__.get("_ampkit_indices") or rounding_keys(self)  # type: ignore[arg-type]
        pure = self._ampkit_pure
        if pure.compile_step:  # (an optimizer that keeps a closure has no compiled step)
            from ampkit.pure.compiled_step import compiled_step

            if compiled_step(self, inner, where, kwargs):  # else: eager, said once
                return loss
        budget = pure.chunk_bytes
        if budget is None:
            budget = sum(16 * p.numel() for ps in saved for p in ps) // 16
        try:
            if closure is not None:  # LBFGS: one pass over everything, closure re-run
                return self._step_all(inner, closure, lists, saved, where, kwargs)
            size = slice_size(budget)
            for i, group in enumerate(groups):
                active = [p for p in saved[i] if p.grad is not None]
                if left_to_torch(self, group):  # torch's fused kernel for bf16 on the CPU
                    runs = [([p for p in active if takes_fused(p)], lanes()),
                            ([p for p in active if not takes_fused(p)], None)]
                else:
                    runs = [(active, None)]
                for ps, pad in runs:
                    with stepping_fused(group, pad is not None):
                        self._step_group(i, ps, inner, lists, where, size, budget, pad,
                                         kwargs)
        finally:
            for ps, original in zip(lists, saved):
                ps[:] = original
        return loss

    def _step_group(self, i: int, active: list[torch.Tensor], inner: Callable[..., Any],
                    lists: list[list[Any]], where: dict[int, tuple[int, int]], size: int,
                    budget: int, pad: int | None, kwargs: dict[str, Any]) -> None:
        """Step ``active``, parameters of group ``i`` with gradients, through their
        working copies (zero-padded to a multiple of ``pad`` elements when given): large
        ones a slice at a time, the others in chunks of ``budget`` bytes."""
        parts = {id(p): slices(self, p, size) for p in active}
        with self._ampkit_pure.workspace.borrowed() as workspace:
            self._step_parts(i, active, parts, inner, lists, where, budget, pad, kwargs,
                             workspace)

    def _step_parts(self, i: int, active: list[torch.Tensor],
                    parts: dict[int, list[Slice] | None], inner: Callable[..., Any],
                    lists: list[list[Any]], where: dict[int, tuple[int, int]], budget: int,
                    pad: int | None, kwargs: dict[str, Any], workspace: Workspace) -> None:
        for p in active:  # large parameters of element-wise optimizers
            index, seed = where[id(p)]
            for part in parts[id(p)] or ():
                w = slice_stand_in(self, p, part, workspace, pad)
                try:
                    for j, ps in enumerate(lists):
                        ps[:] = [w] if j == i else []
                    inner(self, **kwargs)
                    batch = RoundBatch(self, workspace)
                    with torch.no_grad():
                        batch.add(p, w, seed, index, part=part)
                        batch.run()
                finally:
                    self.state.pop(w, None)  # type: ignore[attr-defined]
        for chunk in chunks([p for p in active if parts[id(p)] is None], budget, pad):
            pairs = stand_ins(self, chunk, pad)
            try:
                working = [w for _, w in pairs]
                for j, ps in enumerate(lists):
                    ps[:] = working if j == i else []
                inner(self, **kwargs)
                self._round_all(pairs, where, workspace)
            finally:
                self._discard(pairs)

    def _round_all(self, pairs: list[tuple[torch.Tensor, Any]],
                   where: dict[int, tuple[int, int]], workspace: Workspace) -> None:
        batch = RoundBatch(self, workspace)
        with torch.no_grad():
            for p, w in pairs:
                if w is not p:
                    index, seed = where[id(p)]
                    batch.add(p, w, seed, index)
            batch.run()

    def _discard(self, pairs: list[tuple[torch.Tensor, Any]]) -> None:
        for p, w in pairs:
            if w is not p:
                self.state.pop(w, None)  # type: ignore[attr-defined]

    def _step_all(self, inner: Callable[..., Any], closure: Callable[[], Any],
                  lists: list[list[Any]], saved: list[list[Any]],
                  where: dict[int, tuple[int, int]], kwargs: dict[str, Any]) -> Any:
        """A step that evaluates ``closure`` at weights it tries (LBFGS): every
        parameter at once. Before each evaluation the working weights are rounded to
        nearest into the model's parameters, and the groups hold the model's parameters
        while the closure runs (its ``zero_grad`` must clear their gradients); after it
        the model's gradients are handed to the working parameters."""
        pairs = stand_ins(self, [p for ps in saved for p in ps])
        low = [(p, w) for p, w in pairs if w is not p]
        working = iter(w for _, w in pairs)
        standing = [[next(working) for _ in original] for original in saved]

        def swap(to: list[list[Any]]) -> None:
            for ps, new in zip(lists, to):
                ps[:] = new

        def evaluate() -> Any:
            with torch.no_grad():
                for p, w in low:
                    local_tensor(p.detach()).copy_(local_tensor(w.detach()))
            swap(saved)  # the closure's zero_grad() must reach the model's gradients
            try:
                loss = closure()
            finally:
                swap(standing)
            with torch.no_grad():
                for p, w in low:
                    w.grad = None if p.grad is None else p.grad.to(torch.float32,
                                                                   copy=True)
            return loss

        try:
            swap(standing)
            loss = inner(self, evaluate, **kwargs)
            with self._ampkit_pure.workspace.borrowed() as workspace:
                self._round_all(pairs, where, workspace)
        finally:
            self._discard(pairs)
        return loss

    def kept_scratch(self) -> list[torch.Tensor]:
        """The tensors this optimizer keeps between steps besides torch's ``state``:
        its step's scratch (the fp32 working copies of one slice and the stochastic
        rounding's noise buffers, per device), reused by the next step rather than
        allocated again. What they hold means nothing; count them where memory is
        counted. Neither pickled nor copied, nor in ``state_dict``.

        Example:
            >>> import torch
            >>> from ampkit.pure import PureLowPrecisionOptimizer
            >>> w = torch.nn.Parameter(torch.ones(300_000, dtype=torch.bfloat16))
            >>> opt = PureLowPrecisionOptimizer(torch.optim.SGD([w], lr=1e-3), "stochastic")
            >>> opt.kept_scratch()
            []
            >>> w.grad = torch.ones_like(w)
            >>> opt.step()
            >>> sum(t.nbytes for t in opt.kept_scratch()) > 0
            True
        """
        return list(self._ampkit_pure.workspace.buffers.values())

    # -- checkpoints ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """torch's ``state_dict`` (with each parameter's ``rounding_step`` and, with
        Kahan, ``kahan_compensation``; each group's ``rounding_seed``) plus this mode's
        rounding, which ``load_state_dict`` checks.

        Example:
            >>> import torch
            >>> from ampkit.pure import PureLowPrecisionOptimizer
            >>> w = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
            >>> opt = PureLowPrecisionOptimizer(torch.optim.SGD([w], lr=0.1), seed=7)
            >>> sd = opt.state_dict()
            >>> sd["param_groups"][0]["rounding_seed"], sd["ampkit_pure_low_precision"]
            (7, {'rounding': 'stochastic'})
        """
        # (the torch optimizer class is this class's second base only at run time)
        out: dict[str, Any] = super().state_dict()  # type: ignore[misc]
        out[_SD_KEY] = {"rounding": self._ampkit_pure.rounding.value}  # text: a checkpoint
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load torch's ``state_dict``, keeping scalar state in fp32 and taking the
        groups' ``rounding_seed`` from it, so a resumed run continues bit for bit. A
        Kahan compensation is kept only by a Kahan optimizer, from a checkpoint that is
        not marked as another rounding's (Distributed Checkpoint drops the mark).

        Raises:
            ValueError: the checkpoint was saved with another rounding.

        Example:
            >>> import torch
            >>> from ampkit.pure import PureLowPrecisionOptimizer
            >>> w = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
            >>> opt = PureLowPrecisionOptimizer(torch.optim.SGD([w], lr=0.1), seed=7)
            >>> sd = opt.state_dict()
            >>> other = PureLowPrecisionOptimizer(torch.optim.SGD([w], lr=0.1), seed=1)
            >>> other.load_state_dict(sd); other.param_groups[0]["rounding_seed"]
            7
        """
        state_dict = dict(state_dict)
        extra = state_dict.pop(_SD_KEY, None)
        pure = self._ampkit_pure
        saved_rounding = None if extra is None else extra.get("rounding")
        if saved_rounding is not None and saved_rounding != pure.rounding.value:
            raise ValueError(f"the checkpoint was saved with rounding="
                             f"{saved_rounding!r}; this optimizer uses "
                             f"rounding={pure.rounding.value!r}")
        if pure.rounding is not Rounding.KAHAN and any(
                isinstance(s, dict) and _COMP in s
                for s in state_dict.get("state", {}).values()):
            # Without Kahan a compensation would never be updated nor used: drop it.
            state_dict["state"] = {k: {n: v for n, v in s.items() if n != _COMP}
                                   for k, s in state_dict["state"].items()}
        super().load_state_dict(state_dict)  # type: ignore[misc]
        pure.versions = WeakIdKeyDictionary()  # the loaded compensations count as saved
        seed = self.defaults.get(_SEED, 0)  # type: ignore[attr-defined]
        for group in self.param_groups:  # type: ignore[attr-defined]
            group.setdefault(_SEED, seed)  # a checkpoint of a plain optimizer has none
        # torch casts every floating state entry to the parameter's dtype; here only
        # per-element state is bf16 (see _stored_low): take the rest from the
        # checkpoint again, as saved (copied: never the checkpoint's own tensors).
        saved = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]  # type: ignore[attr-defined]
        for key, p in zip(saved, params):
            if p.dtype is not torch.bfloat16 or p not in self.state:  # type: ignore[attr-defined]
                continue
            for k, v in state_dict["state"].get(key, {}).items():
                if k not in ("step", *_OWN_STATE) and not _stored_low(k, v, p):
                    self.state[p][k] = _as_saved(v, p.device)  # type: ignore[attr-defined]


# The step hooks (and the profiler's record) run once around the whole pure step, as
# torch's wrapper runs them around any optimizer's step; marked hooked so that
# Optimizer.__setstate__ (copy.deepcopy, unpickling) does not wrap it again.
PureLowPrecisionOptimizer.step = torch.optim.Optimizer.profile_hook_step(  # type: ignore[method-assign]
    PureLowPrecisionOptimizer.step)
PureLowPrecisionOptimizer.step.hooked = True  # type: ignore[attr-defined]
torch_internals.set_step_supports_amp_scaling(PureLowPrecisionOptimizer, False)


def rounding_keys(optimizer: torch.optim.Optimizer) -> dict[int, tuple[int, int]]:
    """Each parameter's ``(index in the optimizer, its group's rounding seed)`` by
    ``id``: what its stochastic rounding's bits are drawn from, with the step count.

    Example:
        >>> import torch
        >>> from ampkit.pure.optimizer import rounding_keys
        >>> w, b = torch.ones(2), torch.ones(1)
        >>> opt = torch.optim.SGD([{"params": [w]}, {"params": [b], "rounding_seed": 3}])
        >>> sorted(rounding_keys(opt).values())
        [(0, 0), (1, 3)]
    """
    default = optimizer.defaults.get(_SEED, 0)
    return {id(p): (i, seed) for i, (p, seed) in enumerate(
        (p, g.get(_SEED, default)) for g in optimizer.param_groups for p in g["params"])}


def pure_rounding(optimizer: torch.optim.Optimizer) -> Rounding | None:
    """The rounding ``optimizer`` applies updates with, or ``None`` when it is not a
    :class:`PureLowPrecisionOptimizer`.

    Example:
        >>> import torch
        >>> from ampkit.pure import PureLowPrecisionOptimizer, pure_rounding
        >>> w = torch.nn.Parameter(torch.ones(1, dtype=torch.bfloat16))
        >>> opt = torch.optim.SGD([w], lr=0.1)
        >>> pure_rounding(opt), pure_rounding(PureLowPrecisionOptimizer(opt, "kahan"))
        (None, <Rounding.KAHAN: 'kahan'>)
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    pure = optimizer.__dict__.get("_ampkit_pure")
    return None if pure is None else pure.rounding



def optimizer_class_name(optimizer: torch.optim.Optimizer) -> str:
    """The name of the torch optimizer class ``optimizer`` was built as (a pure one's
    ``PureLowPrecisionAdamW`` is ``"AdamW"``), for messages that show its constructor.

    Example:
        >>> import torch
        >>> from ampkit.pure import PureLowPrecisionOptimizer, optimizer_class_name
        >>> w = torch.nn.Parameter(torch.ones(1, dtype=torch.bfloat16))
        >>> optimizer_class_name(PureLowPrecisionOptimizer(torch.optim.AdamW([w])))
        'AdamW'
    """
    return class_name_made_from(optimizer)  # the pure class records what it was made from

