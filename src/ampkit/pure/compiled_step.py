"""The compiled pure step (``compile_step=True``): each bf16 parameter's update (upcast
of the weight, gradient and moments, the user's optimizer's own update math, rounding
back to bf16 of the weight and the moments) runs as one function compiled by
``torch.compile``.

The update math is torch's: the single-tensor update of the optimizer's class
(``torch.optim.adam``'s for AdamW and Adam, ``torch.optim.sgd``'s), written out op for
op, with the parameter group's hyper-parameters read at every step as 0-dim float64
tensors (data, not guards: an LR scheduler's or OneCycleLR's changes of ``lr``,
``betas`` or ``momentum`` compile no new graph). Each parameter is handed to the
compiled function as flat 1-D
tensors with dynamic shapes, so a model compiles a handful of graphs (one per
optimizer class, rounding and set of group options, plus torch's own specialisation of
one-element tensors), not one per parameter shape. The first step pays for the
compilation (seconds per graph on a CPU, once per process: inductor's on-disk cache
serves later processes).

Where the compiled step cannot take the optimizer (a class without a functional form
here, a subclass that may change the update, options such as ``differentiable=True``,
sparse or non-contiguous tensors), the optimizer takes the eager pure step instead and
one :class:`CompiledStepFallbackWarning` names the optimizer and the reason.

**Random bits.** The 16 bits that stochastic rounding adds below bf16's mantissa come
from a counter-based hash computed inside the compiled kernel, with no generator. For
the element at flat position ``i`` of the *whole* parameter (row-major; a DTensor
shard uses its elements' positions in the whole parameter) the hash is
``h = mix32(i XOR k)`` in 32-bit arithmetic, where ``mix32`` is Wellons' "lowbias32"
permutation (``x ^= x >> 16; x *= 0x7feb352d; x ^= x >> 15; x *= 0x846ca68b;
x ^= x >> 16``, logical shifts, products modulo 2**32) and ``k`` is the 32-bit key
read (little-endian) from the 4-byte BLAKE2b digest of the ``repr`` of
``("compiled pure step", seed, index, count, tag, pair)``: the group's
``rounding_seed``, the parameter's index in the optimizer, its ``rounding_step``
count, the shard tag of :class:`~ampkit.pure.rounding.Positions` (empty but for
``_StridedShard`` placements) and the pair number. The jobs are the weight (not with
Kahan) and then the per-element state entries in the order of their names; jobs
``2j`` and ``2j + 1`` share pair ``j``'s hash, the first taking its low 16 bits, the
second its high 16 bits. A parameter of 2**31 elements or more also hashes the high
part of each position (``mix32(low31(i) XOR k_j XOR mix32(high(i) XOR k_last))``).
So the bits are the same on every run, every replica, every chunking and every
sharding of the parameter; for a fixed key ``mix32`` permutes the positions, so each
16-bit field is uniform and the rounding unbiased. They are not the bits of the eager
step (which draws from the device's generator): a compiled and an eager run round
differently, each reproducibly. Kahan's rounding to nearest is done on the bit pattern
(:func:`ampkit.pure.rounding.nearest_bits`), which inductor cannot fuse away.

**Arithmetic.** The update is torch's single-tensor update written out, compiled:
inductor fuses its element-wise operations (multiply-adds among them), so a compiled
update may differ from torch's eager kernels in the last fp32 bit where terms cancel;
the step count enters in float64, as the eager step reads it. A group's
``foreach``/``fused`` choice picks among torch's implementations of the same update
and is not used here.

Example:
    >>> import torch
    >>> from ampkit.pure import PureLowPrecisionOptimizer
    >>> w = torch.nn.Parameter(torch.ones(1000, dtype=torch.bfloat16))
    >>> opt = PureLowPrecisionOptimizer(torch.optim.SGD([w], lr=1e-4), "stochastic",
    ...                                 compile_step=True)
    >>> for _ in range(10):
    ...     w.grad = torch.ones_like(w)
    ...     opt.step()
    >>> round(w.float().mean().item(), 3)  # round-to-nearest would stay at 1.0
    0.999
"""

from __future__ import annotations

import hashlib
import math
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

from ampkit.conversion.levels import Rounding
from ampkit.pure.rounding import Positions, local_tensor, nearest_bits
from ampkit.pure.step import COMP, COUNT, fingerprint

__all__ = ["COMPILED_OPTIMIZERS", "CompiledStepFallbackWarning", "check_compile_step",
           "compiled_step", "compiled_step_models", "mark_compiled_step_models"]


class CompiledStepFallbackWarning(UserWarning):
    """An optimizer asked for ``compile_step=True`` takes the eager pure step: said once
    per optimizer, naming it and why.

    Example:
        >>> from ampkit.pure.compiled_step import CompiledStepFallbackWarning
        >>> issubclass(CompiledStepFallbackWarning, UserWarning)
        True
    """


_HIGH_MASK = -(1 << 16)  # 0xFFFF0000 as an int32
_MIX_1 = 0x7FEB352D  # the multipliers of Wellons' "lowbias32" permutation
_MIX_2 = 0x846CA68B - (1 << 32)  # (as an int32: products wrap modulo 2**32)
_WIDE = 1 << 31  # parameters with this many elements hash the positions' high part


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A permutation of 32-bit integers (int32 tensors, wrapping arithmetic): xor-shifts
    (logical: the shifted bits are masked) and odd multipliers."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * _MIX_1
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * _MIX_2
    return x ^ ((x >> 16) & 0xFFFF)


def _hashes(n: int, offset: torch.Tensor, index: torch.Tensor | None, keys: torch.Tensor,
            count: int, wide: bool, device: torch.device) -> list[torch.Tensor]:
    """``count`` int32 hashes of the ``n`` local elements' positions (``offset`` + local
    flat index, or ``index`` when the positions are scattered), one per key."""
    if wide:
        pos = (torch.arange(n, dtype=torch.int64, device=device) + offset
               if index is None else index)
        low = (pos & 0x7FFFFFFF).to(torch.int32)
        high = _mix32((pos >> 31).to(torch.int32) ^ keys[count])
        return [_mix32(low ^ keys[j] ^ high) for j in range(count)]
    pos32 = (torch.arange(n, dtype=torch.int32, device=device) + offset
             if index is None else index.to(torch.int32))
    return [_mix32(pos32 ^ keys[j]) for j in range(count)]


def _round_stochastic(value: torch.Tensor, noise: torch.Tensor, out: torch.Tensor) -> None:
    # Add 16 random bits below bf16's mantissa, truncate; sign-magnitude, so symmetric.
    # NaNs stay NaN (a payload's carry could make them infinities).
    rounded = ((value.view(torch.int32) + noise) & _HIGH_MASK).view(torch.float32)
    out.copy_(torch.where(value != value, value, rounded))  # exact: low bits are zero


def _update(p: torch.Tensor, g: torch.Tensor, states: list[torch.Tensor],
            comp: torch.Tensor | None, step: torch.Tensor | None, offset: torch.Tensor,
            index: torch.Tensor | None, keys: torch.Tensor, hyper: dict[str, torch.Tensor],
            *, kind: str, first: bool, wide: bool, flags: tuple[bool, ...]) -> bool:
    """One parameter's pure update (flat 1-D local tensors, written in place): upcast,
    the update of torch's single-tensor functional form, rounding back. ``states`` are
    the bf16 per-element state entries in ``_STATE_NAMES[kind]`` order (present ones
    only); ``first``: SGD's momentum buffer does not exist yet (torch makes it from the
    gradient). ``hyper`` holds the float hyper-parameters as 0-dim float64 tensors (so
    that their values are data, not guards: a schedule never recompiles); ``flags`` the
    choices that change the code (see ``_hyper``). Returns whether it ran compiled
    (``False`` where torch.compile declined it and it ran as plain Python, as once
    dynamo's recompile limit for its code object is reached)."""
    w = p.float()
    if comp is not None:
        w = w + comp.float()
    grad = g.float()
    work = [s.float() for s in states]
    lr = hyper["lr"]
    if kind in ("adam", "adamw"):
        # torch.optim.adam._single_tensor_adam (not capturable, not differentiable),
        # op for op, with the hyper-parameters as tensors
        assert step is not None
        maximize, amsgrad, decoupled, decay = flags
        beta1, beta2 = hyper["beta1"], hyper["beta2"]
        if maximize:
            grad = -grad
        if decay:
            if decoupled:
                w.mul_(1 - lr * hyper["weight_decay"])
            else:
                grad = grad.add(w * hyper["weight_decay"])
        # the count in float64: torch's eager step reads it as a Python float
        count = step.to(torch.float64) + 1
        exp_avg, exp_avg_sq = work[0], work[1]
        exp_avg.lerp_(grad, (1 - beta1).to(torch.float32))
        exp_avg_sq.mul_(beta2.to(torch.float32)).add_(grad * grad * (1 - beta2))
        step_size = lr / (1 - beta1 ** count)
        correction2_sqrt = (1 - beta2 ** count).sqrt()
        if amsgrad:
            torch.maximum(work[2], exp_avg_sq, out=work[2])
            denom = (work[2].sqrt() / correction2_sqrt).add_(hyper["eps"])
        else:
            denom = (exp_avg_sq.sqrt() / correction2_sqrt).add_(hyper["eps"])
        w.add_(exp_avg / denom * -step_size)
        step.copy_(count)
    else:  # sgd: torch.optim.sgd._single_tensor_sgd, op for op
        maximize, decay, has_momentum, nesterov = flags
        if maximize:
            grad = -grad
        if decay:
            grad = grad.add(w * hyper["weight_decay"])
        if has_momentum:
            momentum = hyper["momentum"]
            if first:
                buf = grad.detach().clone()
                work = [buf]
            else:
                buf = work[0]
                buf.mul_(momentum.to(torch.float32)).add_(
                    grad * (1 - hyper["dampening"]))
            grad = grad.add(buf * momentum) if nesterov else buf
        w.add_(grad * -lr)
    jobs = ([] if comp is not None else [(w, p)]) + list(zip(work, states))
    hashes = _hashes(p.numel(), offset, index, keys, (len(jobs) + 1) // 2, wide, p.device)
    if comp is not None:  # Kahan: nearest on the bits, what it lost truncated
        new = nearest_bits(w)
        p.copy_(new)  # exact: the low 16 bits are zero
        comp.copy_(((w - new).view(torch.int32) & _HIGH_MASK).view(torch.float32))
    for j, (value, out) in enumerate(jobs):
        h = hashes[j // 2]
        noise = h & 0xFFFF if j % 2 == 0 else (h >> 16) & 0xFFFF
        _round_stochastic(value, noise, out)
    return torch.compiler.is_compiling()  # a constant of the compiled graph: True


_COMPILED: dict[tuple[str, Rounding], Callable[..., bool]] = {}  # (kind, rounding) -> wrapper


def _compiled(kind: str, rounding: Rounding) -> Callable[..., bool]:
    """The compiled update of one optimizer kind and rounding, made once per process.
    torch keeps compiled graphs per code object, up to a small number of them: a code
    object of its own per kind and rounding (the same code, renamed) keeps one kind's
    graphs from taking another's places."""
    fn = _COMPILED.get((kind, rounding))
    if fn is None:
        code = _update.__code__.replace(co_name=f"_update_{kind}_{rounding.value}")
        plain = types.FunctionType(code, _update.__globals__, code.co_name,
                                   _update.__defaults__)
        plain.__kwdefaults__ = _update.__kwdefaults__
        fn = _COMPILED[kind, rounding] = torch.compile(plain, dynamic=True)
    return fn


#: The optimizer classes the compiled step takes, with the functional form whose math
#: it runs (the class itself, not a subclass: a subclass may change the update).
COMPILED_OPTIMIZERS: dict[type, str] = {torch.optim.AdamW: "torch.optim.adamw.adamw",
                                        torch.optim.Adam: "torch.optim.adam.adam",
                                        torch.optim.SGD: "torch.optim.sgd.sgd"}
_KIND = {torch.optim.AdamW: "adamw", torch.optim.Adam: "adam", torch.optim.SGD: "sgd"}


def _hyper(kind: str, group: dict[str, Any], device: torch.device
           ) -> tuple[dict[str, torch.Tensor], tuple[bool, ...]]:
    """A group's float hyper-parameters as 0-dim float64 tensors (values the compiled
    code reads as data, as a Python float is read in float64: changing them never
    recompiles) and the flags that change the code (options, and which terms are zero,
    as torch's functional forms test them)."""
    if kind == "sgd":
        names: tuple[str, ...] = ("lr", "momentum", "dampening", "weight_decay")
        values = [float(group[k]) for k in names]
        flags: tuple[bool, ...] = (bool(group["maximize"]), group["weight_decay"] != 0,
                                   group["momentum"] != 0, bool(group["nesterov"]))
    else:
        names = ("lr", "beta1", "beta2", "eps", "weight_decay")
        values = [float(group["lr"]), float(group["betas"][0]), float(group["betas"][1]),
                  float(group["eps"]), float(group["weight_decay"])]
        flags = (bool(group["maximize"]), bool(group["amsgrad"]),
                 kind == "adamw" or bool(group.get("decoupled_weight_decay", False)),
                 group["weight_decay"] != 0)
    return ({n: torch.tensor(v, dtype=torch.float64, device=device)
             for n, v in zip(names, values)}, flags)


def _state_names(kind: str, group: dict[str, Any]) -> tuple[str, ...]:
    if kind == "sgd":
        return ("momentum_buffer",) if group["momentum"] != 0 else ()
    names = ("exp_avg", "exp_avg_sq")
    return (*names, "max_exp_avg_sq") if group["amsgrad"] else names


def check_compile_step(compile_step: Any, rounding: Rounding, optimizer: Any = None) -> None:
    """Refuse a ``compile_step`` that cannot be honoured: not a bool, asked with a
    rounding other than ``"stochastic"``/``"kahan"``, or differing from the one an
    already pure ``optimizer`` has.

    Raises:
        TypeError: not ``True``/``False``.
        ValueError: a rounding or an optimizer it cannot go with (named).

    Example:
        >>> from ampkit.conversion.levels import Rounding
        >>> from ampkit.pure.compiled_step import check_compile_step
        >>> check_compile_step(True, Rounding.KAHAN)
        >>> check_compile_step(True, Rounding.NEAREST)
        Traceback (most recent call last):
        ...
        ValueError: compile_step=True compiles the pure step of master_weights=...
    """
    if not isinstance(compile_step, bool):
        raise TypeError(f"compile_step must be True or False, got {compile_step!r}")
    if compile_step and rounding not in (Rounding.STOCHASTIC, Rounding.KAHAN):
        raise ValueError(f"compile_step=True compiles the pure step of master_weights="
                         f"'stochastic' or 'kahan'; rounding={rounding.value!r} has none: use "
                         f"rounding 'stochastic' or 'kahan', or compile_step=False")
    pure = None if optimizer is None else optimizer.__dict__.get("_ampkit_pure")
    if pure is not None and pure.compile_step != compile_step:
        raise ValueError(f"this optimizer is already pure with compile_step="
                         f"{pure.compile_step}, not {compile_step}")


class _Plan:
    """What the compiled step decided about one optimizer: ``None`` (compiled) or why it
    takes the eager step; kept on the optimizer (not pickled: decided again)."""

    __slots__ = ("reason", "warned")

    def __init__(self) -> None:
        self.reason: str | None = None
        self.warned = False


def _base(opt: Any) -> type:
    cls = type(opt)
    return cls.__bases__[1] if len(cls.__bases__) > 1 else cls


def _why_not(opt: Any, kwargs: dict[str, Any]) -> str | None:
    """Why ``opt`` cannot take the compiled step now (``None``: it can)."""
    base = _base(opt)
    if base not in _KIND:
        supported = ", ".join(f"torch.optim.{c.__name__}" for c in COMPILED_OPTIMIZERS)
        return (f"{base.__module__}.{base.__qualname__} has no functional form the "
                f"compiled step runs (it takes {supported})")
    if kwargs:
        return f"its step was given {sorted(kwargs)}"
    kind = _KIND[base]
    for i, group in enumerate(opt.param_groups):
        for flag in ("differentiable", "capturable"):
            if group.get(flag):
                return f"param_groups[{i}] has {flag}=True"
        if kind != "sgd" and isinstance(group["betas"][0], torch.Tensor):
            return f"param_groups[{i}] has tensor betas"
        for p in group["params"]:
            if p.grad is None or p.dtype is not torch.bfloat16:
                continue
            local, grad = local_tensor(p.detach()), local_tensor(p.grad)
            if grad.layout is not torch.strided or grad.is_sparse:
                return "a parameter has a sparse gradient"
            if not (local.is_contiguous() and grad.is_contiguous()):
                return f"a parameter of shape {tuple(p.shape)} is not contiguous"
            for k, v in opt.state.get(p, {}).items():
                if (isinstance(v, torch.Tensor) and v.dim() > 0
                        and not local_tensor(v).is_contiguous()):
                    return f"its state {k!r} of a parameter is not contiguous"
    return None


def _key(*parts: Any) -> int:
    """A 32-bit key (as a signed int32 value) from ``parts``, the same everywhere."""
    digest = hashlib.blake2b(repr(("compiled pure step", *parts)).encode(),
                             digest_size=4).digest()
    value = int.from_bytes(digest, "little")
    return value - (1 << 32) if value >= 1 << 31 else value


def _kahan_compensation(opt: Any, p: torch.Tensor, own: dict[str, Any]) -> torch.Tensor:
    """``p``'s compensation, new (zeros) where there was none or where the weight was
    changed by anything but the step since (a load, an edit: the old compensation
    belonged to the weight that step left)."""
    comp = own.get(COMP)
    seen = opt._ampkit_pure.versions.get(p)
    if (comp is None or comp.shape != p.shape or comp.dtype is not torch.bfloat16
            or (seen is not None and seen != fingerprint(p))):
        comp = own[COMP] = torch.zeros_like(p.detach())
    return comp


def _step_one(opt: Any, p: torch.Tensor, kind: str, group: dict[str, Any],
              index: int, seed: int) -> None:
    """Step the bf16 parameter ``p`` with the compiled update, making its state on its
    first step as the eager step would leave it (bf16 per-element entries, an fp32
    count)."""
    pure = opt._ampkit_pure
    own = opt.state[p]
    names = _state_names(kind, group)
    first = False
    with torch.no_grad():
        started = "step" in own
        for name in names:
            if not isinstance(own.get(name), torch.Tensor):
                if kind == "sgd":  # torch makes it from the gradient: written, not read
                    first = True
                    own[name] = torch.empty_like(p.detach())
                elif started:
                    # torch's Adam makes its moments on a parameter's first step only
                    # (amsgrad switched on later: it fails the same way)
                    raise KeyError(name)
                else:
                    own[name] = torch.zeros_like(p.detach())
        # entries of options switched off since (an SGD momentum buffer, an amsgrad
        # maximum) stay, as torch keeps them
        step = None
        if kind != "sgd":
            step = own.get("step")
            if not isinstance(step, torch.Tensor):
                step = own["step"] = torch.tensor(float(step or 0), dtype=torch.float32)
        comp = _kahan_compensation(opt, p, own) if pure.rounding is Rounding.KAHAN else None
        count = own.get(COUNT, 0)
        positions = Positions(p)
        total = math.prod(positions.global_shape) if not positions.tag else math.prod(
            positions.local_shape)
        local = local_tensor(p.detach())
        device = local.device
        where: torch.Tensor | None = None
        if positions.block_start is None:
            where = positions.index(0, local.numel(), device)
            start = 0
        else:
            start = positions.block_start
        jobs = len(names) + (0 if comp is not None else 1)
        keys = torch.tensor([_key(seed, index, count, positions.tag, j)
                             for j in range((jobs + 1) // 2 + 1)], dtype=torch.int32,
                            device=device)
        wide = total >= _WIDE
        offset = torch.tensor(start, dtype=torch.int64 if wide else torch.int32,
                              device=device)
        hyper, flags = _hyper(kind, group, device)
        flat = [local_tensor(own[name]).view(-1) for name in names]
        grad = p.grad
        assert grad is not None
        ran = _compiled(kind, pure.rounding)(
            local.view(-1), local_tensor(grad).view(-1), flat,
            None if comp is None else local_tensor(comp).view(-1), step, offset, where,
            keys, hyper, kind=kind, first=first, wide=wide, flags=flags)
        if not ran:
            _said_uncompiled(opt, kind, pure.rounding)
        own[COUNT] = count + 1
        if comp is not None:
            pure.versions[p] = fingerprint(p)


_PLANS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # optimizer -> its _Plan


def _said_uncompiled(opt: Any, kind: str, rounding: Rounding) -> None:
    """One :class:`CompiledStepFallbackWarning` per optimizer when its update ran as
    plain Python: torch.compile gave up on it (its recompile limit reached for that
    code object: too many variants of group options, shapes and state compiled in this
    process). The step stays right, only slower."""
    plan = _PLANS.get(opt)
    if plan is None or plan.warned:
        return
    plan.warned = True
    warnings.warn(f"compile_step=True: this {_base(opt).__name__}'s update "
                  f"(_update_{kind}_{rounding.value}) now runs uncompiled: torch.compile stopped "
                  f"compiling it, having reached its recompile limit (torch._dynamo.config."
                  f"recompile_limit) for that code in this process; the results are the "
                  f"same, only slower. Raise the limit, or use fewer distinct group options "
                  f"(momentum, weight_decay zero or not, nesterov, maximize, amsgrad)",
                  CompiledStepFallbackWarning, stacklevel=5)


def compiled_step(opt: Any, inner: Callable[..., Any], where: dict[int, tuple[int, int]],
                  kwargs: dict[str, Any]) -> bool:
    """Take ``opt``'s pure step with the compiled update; ``False`` (after one
    :class:`CompiledStepFallbackWarning` per optimizer) when it cannot, changing
    nothing, so that the eager step runs. Parameters that are not bf16 are stepped by
    the optimizer's own step, as the eager pure step does. ``where`` gives each
    parameter's ``(index, seed)``; ``inner`` is the optimizer class's own step.

    Example:
        >>> import torch
        >>> from ampkit.pure import PureLowPrecisionOptimizer
        >>> w = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
        >>> opt = PureLowPrecisionOptimizer(torch.optim.SGD([w], lr=0.5), "kahan",
        ...                                 compile_step=True)
        >>> w.grad = torch.ones_like(w)
        >>> opt.step(); w.tolist()
        [0.5, 0.5, 0.5, 0.5]
    """
    # Traced by an outer torch.compile (a whole training step compiled): the step runs
    # outside that trace (a graph break), as itself; traced, its flat views of the
    # parameters would reach the inner compiled update as graph inputs it cannot alias
    return _outside_traces(opt, inner, where, kwargs)


def _take_compiled_step(opt: Any, inner: Callable[..., Any],
                        where: dict[int, tuple[int, int]], kwargs: dict[str, Any]) -> bool:
    plan = _PLANS.get(opt)
    if plan is None:
        plan = _PLANS[opt] = _Plan()
    plan.reason = _why_not(opt, kwargs)
    if plan.reason is not None:
        if not plan.warned:
            plan.warned = True
            warnings.warn(f"compile_step=True: this {_base(opt).__name__} takes the eager "
                          f"pure step: {plan.reason}", CompiledStepFallbackWarning,
                          stacklevel=4)
        return False
    kind = _KIND[_base(opt)]
    groups = opt.param_groups
    lists = [g["params"] for g in groups]
    saved = [list(ps) for ps in lists]
    try:
        for i, group in enumerate(groups):
            other = []
            for p in saved[i]:
                if p.grad is None:
                    continue
                if p.dtype is not torch.bfloat16:
                    other.append(p)
                    continue
                index, seed = where[id(p)]
                _step_one(opt, p, kind, group, index, seed)
            if other:  # (fp32 norms) stepped as they are, by the optimizer's own step
                for j, ps in enumerate(lists):
                    ps[:] = other if j == i else []
                inner(opt)
    finally:
        for ps, original in zip(lists, saved):
            ps[:] = original
    return True


_outside_traces: Callable[..., bool] = torch.compiler.disable(_take_compiled_step)


_MODELS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # models initialize set to compile


def mark_compiled_step_models(models: list[nn.Module]) -> None:
    """Record that ``models`` were set up with ``compile_step=True``, so that an
    optimizer built for them later (``ampkit.fsdp.prepare_optimizer``) compiles its
    step too.

    Example:
        >>> import torch
        >>> from ampkit.pure.compiled_step import compiled_step_models, mark_compiled_step_models
        >>> net = torch.nn.Linear(2, 2)
        >>> mark_compiled_step_models([net]); compiled_step_models(net)
        True
    """
    for model in models:
        _MODELS[model] = True


def compiled_step_models(model: nn.Module) -> bool:
    """Whether ``ampkit.initialize`` set ``model`` up with ``compile_step=True``.

    Example:
        >>> import torch
        >>> from ampkit.pure.compiled_step import compiled_step_models
        >>> compiled_step_models(torch.nn.Linear(2, 2))
        False
    """
    return bool(_MODELS.get(model, False))
