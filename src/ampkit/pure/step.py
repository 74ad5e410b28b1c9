"""One chunk of a pure step, with multi-tensor (``torch._foreach_*``) ops: the fp32
working parameters the inner optimizer steps, and the rounding of its results back into
the bf16 parameters and state (:mod:`ampkit.pure.rounding`). The wrapper that drives
the chunks is :mod:`ampkit.pure.optimizer`; how a step works: :mod:`ampkit.pure`.

Example:
    >>> import torch
    >>> from ampkit.pure import PureLowPrecisionOptimizer
    >>> from ampkit.pure.step import chunks
    >>> ws = [torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16)) for _ in range(3)]
    >>> [len(c) for c in chunks(ws, 16 * 16)]  # 16 bytes of fp32 copies per element
    [2, 1]
"""

from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

from ampkit import torch_internals
from ampkit.conversion.levels import Rounding
from ampkit.pure.fused import padded_length
from ampkit.pure.rounding import (
    BLOCK,
    Positions,
    StochasticJob,
    is_dtensor,
    local_tensor,
    round_kahan_foreach,
    round_stochastic,
)

__all__ = ["COMP", "COUNT", "ELEMENTWISE", "OWN_STATE", "RoundBatch", "Slice", "Workspace",
           "chunks", "fingerprint", "placed_like", "slice_stand_in", "slice_size", "slices",
           "stand_ins", "stored_low"]

COMP = "kahan_compensation"  # per-parameter optimizer state: the Kahan compensation
COUNT = "rounding_step"  # per-parameter optimizer state: rounded updates so far
OWN_STATE = (COMP, COUNT)  # state of this mode, which the inner optimizer never sees


#: torch optimizers whose update of an element depends on nothing but that element's
#: weight, gradient and state, the step count and the hyper-parameters: they may step a
#: large parameter a slice at a time, with the same result.
ELEMENTWISE: tuple[type, ...] = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW,
                                 torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adamax,
                                 torch.optim.Adagrad, torch.optim.RMSprop)
_MIN_SLICE = 4 * BLOCK  # the fewest elements of a slice (the stream's blocks stay whole)
# The most: the optimizer keeps one slice's copies between steps (Workspace), so they
# must not grow with the model. The benchmark's 10M-parameter model steps in slices of
# 589,824 elements, under it.
_MAX_SLICE = 16 * BLOCK


def slice_size(budget: int) -> int:
    """Elements per slice of a parameter for a chunk budget of ``budget`` bytes: the
    budget's worth of fp32 working copies (16 bytes per element), in whole blocks of the
    random stream, from ``_MIN_SLICE`` to ``_MAX_SLICE``."""
    return min(_MAX_SLICE, max(_MIN_SLICE, budget // 16 // BLOCK * BLOCK))


class Slice:
    """A run ``[start, stop)`` of a parameter's flat elements stepped on its own, with
    the parameter's rounding count and state as they were before its first slice."""

    __slots__ = ("count", "start", "state", "stop")

    def __init__(self, start: int, stop: int, count: int, state: dict[str, Any]) -> None:
        self.start, self.stop, self.count, self.state = start, stop, count, state


def slices(opt: Any, p: torch.Tensor, size: int) -> list[Slice] | None:
    """``p``'s slices of ``size`` elements when ``opt`` may step it a slice at a time
    (an optimizer of :data:`ELEMENTWISE`, itself not a subclass; a contiguous plain bf16
    parameter larger than ``size`` with a dense contiguous gradient and contiguous
    state), else ``None``. Checks Kahan's compensation once, for all of them."""
    base = type(opt).__bases__[1] if len(type(opt).__bases__) > 1 else type(opt)
    grad = p.grad
    if (base not in ELEMENTWISE or p.numel() <= size or p.dtype is not torch.bfloat16
            or is_dtensor(p) or not p.is_contiguous() or grad is None
            or grad.layout is not torch.strided or not grad.is_contiguous()):
        return None
    own = opt.state[p]
    if not all(v.is_contiguous() for k, v in own.items()
               if isinstance(v, torch.Tensor) and (k == COMP or stored_low(k, v, p))):
        return None
    _check_compensation(opt, p, own)
    snapshot = dict(own)
    count = own.get(COUNT, 0)
    return [Slice(a, min(a + size, p.numel()), count, snapshot)
            for a in range(0, p.numel(), size)]


def _check_compensation(opt: Any, p: torch.Tensor, own: dict[str, Any]) -> bool:
    """Drop ``p``'s Kahan compensation if the weight changed since the last step (a
    load, an edit: the compensation belonged to the weight that step left); whether
    one is kept."""
    pure = opt._ampkit_pure
    if own.get(COMP) is None:
        return False
    seen = pure.versions.get(p)
    if pure.rounding is not Rounding.KAHAN or (seen is not None and seen != fingerprint(p)):
        del own[COMP]
        return False
    return True


class Workspace:
    """The pure step's scratch, kept by its optimizer from one step to the next: the
    fp32 working copies of a parameter's slices (every slice has the same size, and a
    slice's results are rounded back before the next one is stepped, so one set of
    buffers serves them all) and the rounding's noise buffers. What they hold between
    uses means nothing; only their memory is kept, per device (and CUDA stream), at most
    the copies of one slice (:func:`slice_size`) and the noise of one group of
    positions.

    Why kept: a buffer the size of a slice is memory the allocator may hand back to
    the system when it is freed and fault in again when it is next allocated. Measured
    on the AVX2 CPU at 0.6M parameters, in a process holding other models: 900 to 1,400
    page faults per step; with the memory kept, the step fell from 24 to 13 ms.

    One step at a time uses it, with real tensors: :meth:`borrowed` gives scratch of
    its own to a step that finds it in use (a second thread stepping the same
    optimizer) or that ``torch.compile`` traces, so that no traced tensor is kept, and
    a step on fake tensors (the memory planner) a kept workspace of its own."""

    __slots__ = ("buffers", "fake", "lock")

    def __init__(self, shared: bool = False) -> None:
        self.fake: Workspace | None = None
        self.buffers: dict[tuple[Any, torch.device, int | None], torch.Tensor] = {}
        # only an optimizer's own workspace is shared between steps (a lock made inside
        # a step that torch.compile traces would break its graph)
        self.lock = threading.Lock() if shared else None

    @contextlib.contextmanager
    def borrowed(self) -> Iterator[Workspace]:
        """This workspace while no other step uses it, else a new one for this use. A
        step on fake tensors (the memory planner's) keeps its scratch in a workspace of
        its own beside this one, so that it counts what a real step keeps and no fake
        tensor meets a real one."""
        if self.lock is None or torch_internals.compiling():
            yield Workspace()
            return
        space = self
        if torch_internals.is_fake(torch.empty(0)):
            if self.fake is None:
                self.fake = Workspace(shared=True)
            space = self.fake
        assert space.lock is not None
        if not space.lock.acquire(blocking=False):
            yield Workspace()
            return
        try:
            yield space
        finally:
            space.lock.release()

    def scratch(self, name: Any, numel: int, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
        """The first ``numel`` elements of buffer ``name`` on ``device`` (grown when
        shorter, or made in ``dtype`` when it is of another): contents unspecified.
        The form of :data:`~ampkit.pure.rounding.Scratch`. A workspace for one use
        (not ``shared``) keeps nothing: a new tensor every time."""
        if self.lock is None:  # scratch for one use: nothing to share with a later one
            return torch.empty(numel, dtype=dtype, device=device)
        device = torch.device(device)
        # On CUDA, per stream too: a buffer the last step used on one stream may still be
        # in use there when a step on another stream (a hook in backward) would write it.
        stream = torch.cuda.current_stream(device).stream_id if device.type == "cuda" else None
        key = (name, device, stream)
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < numel or buf.dtype is not dtype:
            # kept: a buffer made in inference mode could not be written outside it
            with torch.inference_mode(False):
                buf = self.buffers[key] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel]

    def fp32_of(self, index: int, src: torch.Tensor, pad: int | None = None) -> torch.Tensor:
        """Buffer ``index``'s first ``src.numel()`` elements, filled with ``src`` (flat,
        on its device) in fp32; with ``pad``, followed by zeros up to a multiple of
        ``pad`` elements (see :mod:`ampkit.pure.fused`)."""
        n = src.numel()
        total = n if pad is None else padded_length(n, pad)
        buf = self.scratch(index, total, torch.float32, src.device)
        buf[:n].copy_(src)
        if total > n:  # a longer slice may have left its values there
            buf[n:].zero_()
        return buf


def slice_stand_in(opt: Any, p: torch.Tensor, part: Slice,
                   workspace: Workspace | None = None, pad: int | None = None
                   ) -> nn.Parameter:
    """The fp32 working parameter of one slice of ``p`` (see :func:`stand_ins`), from
    the state ``p`` had before its first slice; its copies in ``workspace``'s buffers
    when given (the previous slice's results must have been rounded back); with
    ``pad``, zero-padded to a multiple of ``pad`` elements."""
    a, b = part.start, part.stop
    space = Workspace() if workspace is None else workspace
    with torch.no_grad():
        w = nn.Parameter(space.fp32_of(0, p.detach().view(-1)[a:b], pad))
        comp = part.state.get(COMP)
        if comp is not None:
            w.detach()[:b - a].add_(comp.view(-1)[a:b])
        assert p.grad is not None
        w.grad = space.fp32_of(1, p.grad.view(-1)[a:b], pad)
        working: dict[str, Any] = {}
        for k, v in part.state.items():
            if k in OWN_STATE:
                continue
            if isinstance(v, torch.Tensor):
                v = (space.fp32_of(len(working) + 2, v.view(-1)[a:b], pad)
                     if stored_low(k, v, p) else v.clone())
            elif isinstance(v, list):
                v = list(v)
            working[k] = v
        opt.state[w] = working
    return w


def chunks(params: list[torch.Tensor], budget: int, pad: int | None = None
           ) -> Iterator[list[torch.Tensor]]:
    """Consecutive runs of ``params`` whose fp32 working copies (weight, gradient and
    up to two moments: 16 bytes per element, each copy padded to a multiple of ``pad``
    elements when given) stay within ``budget`` bytes (a parameter larger than the
    budget is a chunk of its own, unless :func:`slices` cuts it)."""
    chunk: list[torch.Tensor] = []
    used = 0
    for p in params:
        size = 16 * (p.numel() if pad is None else padded_length(p.numel(), pad))
        if chunk and used + size > budget:
            yield chunk
            chunk, used = [], 0
        chunk.append(p)
        used += size
    if chunk:
        yield chunk


def stored_low(key: str, value: Any, param: torch.Tensor) -> bool:
    """Whether an optimizer state entry of a bf16 parameter is stored in bf16:
    per-element state (moments, momentum: the parameter's shape). The step count and
    scalar state that follows from it and the hyper-parameters (NAdam's ``mu_product``,
    ASGD's ``eta``) stay fp32 and exact. State of other shapes (LBFGS's flat direction
    and gradient over all parameters) stays as the optimizer made it: LBFGS's curvature
    pairs are differences of such vectors, which bf16 would swamp. This mode's own
    entries are kept their own way."""
    return (key != "step" and key not in OWN_STATE and isinstance(value, torch.Tensor)
            and value.is_floating_point() and value.dim() > 0
            and value.shape == param.shape)


def fingerprint(p: torch.Tensor) -> tuple[int, int]:
    """What changes when ``p`` is changed by anything but the step: its version counter
    (bumped by in-place ops such as ``load_state_dict``'s ``copy_``) and its storage
    (``p.data = ...``). In-place edits through ``p.data`` change neither."""
    return torch_internals.tensor_version(p), local_tensor(p.detach()).data_ptr()


class _Copies:
    """Pending ``dst.copy_(src)`` of local tensors, run as one multi-tensor copy per
    device."""

    def __init__(self) -> None:
        self.by_device: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]] \
            = defaultdict(lambda: ([], []))

    def fp32_of(self, t: torch.Tensor, pad: int | None = None) -> torch.Tensor:
        """A new fp32 tensor like ``t`` (a DTensor stays one), filled when run; with
        ``pad``, a flat one of ``t``'s local elements followed by zeros up to a multiple
        of ``pad`` elements (see :mod:`ampkit.pure.fused`)."""
        src = local_tensor(t)
        if pad is None:
            out = torch.empty_like(t, dtype=torch.float32)
            dst = local_tensor(out)
        else:
            n = src.numel()
            out = torch.empty(padded_length(n, pad), dtype=torch.float32, device=src.device)
            out[n:].zero_()
            dst = out[:n].view(src.shape)
        pending = self.by_device[dst.device]
        pending[0].append(dst)
        pending[1].append(src)
        return out

    def run(self) -> None:
        for dsts, srcs in self.by_device.values():
            torch_internals.foreach_copy_(dsts, srcs)


def placed_like(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``t`` laid out as the DTensor ``p`` is: a DTensor gradient or state entry of
    another placement (a ``Partial`` gradient of a replicated norm weight under
    sequence parallelism, a ``Shard(1)`` gradient of a ``Shard(0)`` weight) is
    redistributed, as torch's own ops on DTensors would, so that each local element
    pairs with its weight's; anything else as it is."""
    if (is_dtensor(t) and is_dtensor(p)
            and (t.placements != p.placements or t.device_mesh != p.device_mesh)):
        return t.redistribute(p.device_mesh, p.placements)
    return t


def stand_ins(opt: Any, params: list[torch.Tensor], pad: int | None = None
              ) -> list[tuple[torch.Tensor, Any]]:
    """``(parameter, what the inner step sees)`` for one chunk: for each bf16 parameter
    an fp32 working ``nn.Parameter`` (its weight plus the Kahan compensation, an fp32
    copy of its gradient, fp32 copies of its state under the working parameter's key in
    ``opt.state``); any other parameter stands for itself. Every copy of the chunk runs
    as one multi-tensor copy per device. Other state tensors are cloned and lists copied,
    so a step that fails changes nothing. With ``pad``, the copies of a bf16 parameter
    are flat plain tensors of its local elements, zero-padded to a multiple of ``pad``
    elements (see :mod:`ampkit.pure.fused`)."""
    state = opt.state
    copies = _Copies()
    kahan: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]] = defaultdict(
        lambda: ([], []))
    pairs: list[tuple[torch.Tensor, Any]] = []
    with torch.no_grad():
        for p in params:
            if p.dtype is not torch.bfloat16:
                pairs.append((p, p))
                continue
            own = state.get(p, {})
            w = nn.Parameter(copies.fp32_of(p.detach(), pad))
            if _check_compensation(opt, p, own):
                comp = local_tensor(own[COMP])
                local = local_tensor(w.detach())
                if pad is not None:
                    local = local[:comp.numel()].view(comp.shape)
                kahan[local.device][0].append(local)
                kahan[local.device][1].append(comp)
            if p.grad is not None:
                w.grad = copies.fp32_of(p.grad if pad is None else placed_like(p.grad, p), pad)
            working: dict[str, Any] = {}
            for k, v in own.items():
                if k in OWN_STATE:
                    continue
                if isinstance(v, torch.Tensor):
                    v = (copies.fp32_of(v, None) if pad is None or not stored_low(k, v, p)
                         else copies.fp32_of(placed_like(v, p), pad)
                         ) if v.dtype is torch.bfloat16 else v.clone()
                elif isinstance(v, list):
                    v = list(v)
                working[k] = v
            state[w] = working
            pairs.append((p, w))
        copies.run()
        for works, comps in kahan.values():
            torch_internals.foreach_add_(works, comps)
    return pairs


_Lists = tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]


class RoundBatch:
    """The roundings of one chunk's results, collected per parameter
    (:meth:`add`) and run per device with multi-tensor ops (:meth:`run`), their
    scratch from ``workspace``."""

    def __init__(self, opt: Any, workspace: Workspace) -> None:
        self.opt = opt
        self.workspace = workspace
        self.rounding: Rounding = opt._ampkit_pure.rounding
        # per device: (bf16 outs, fp32 values, Kahan compensations or noises)
        self.kahan: dict[torch.device, _Lists] = defaultdict(lambda: ([], [], []))
        self.stochastic: dict[torch.device, list[StochasticJob]] = defaultdict(list)
        self.nearest = _Copies()
        self.kahan_params: list[torch.Tensor] = []

    def add(self, p: torch.Tensor, w: nn.Parameter, seed: int, index: int,
            part: Slice | None = None) -> None:
        """Take the working parameter ``w``'s weight and state as ``p``'s (or as its
        slice ``part``'s): the state entries move into ``p``'s (bf16 ones in place where
        they exist) and the roundings are queued."""
        state = self.opt.state
        results = state.pop(w, None)
        own = state[p]
        count = own.get(COUNT, 0) if part is None else part.count

        def region(t: torch.Tensor) -> torch.Tensor:  # the part of a p-shaped tensor
            t = local_tensor(t)
            return t if part is None else t.view(-1)[part.start:part.stop]

        target = region(p.detach())

        def values(t: torch.Tensor) -> torch.Tensor:  # a working copy's values as target
            t = local_tensor(t)
            if t.shape == target.shape:
                return t
            return t.view(-1)[:target.numel()].view(target.shape)  # padded: flat, longer

        work = values(w.detach())
        low: list[tuple[str, torch.Tensor, torch.Tensor]] = [("", target, work)]
        if results is not None:
            like = p.detach()
            for k, v in results.items():
                if stored_low(k, v, w) and v.dtype is torch.float32:
                    old = own.get(k)
                    if (not isinstance(old, torch.Tensor) or old.dtype is not torch.bfloat16
                            or old.shape != like.shape or type(old) is not type(like)):
                        old = torch.empty_like(like, dtype=torch.bfloat16)
                    low.append((k, region(old), values(v)))
                    own[k] = old
                else:
                    own[k] = v
            for k in [k for k in own if k not in results and k not in OWN_STATE]:
                del own[k]
        own[COUNT] = count + 1
        if self.rounding is Rounding.KAHAN:
            comp = own.get(COMP)
            if comp is None or comp.shape != p.shape or comp.dtype is not torch.bfloat16:
                comp = own[COMP] = torch.zeros_like(p.detach())
            lists = self.kahan[work.device]
            lists[0].append(target)
            lists[1].append(work)
            lists[2].append(region(comp))
            self.kahan_params.append(p)
            low = low[1:]  # the state is still rounded stochastically
        if self.rounding is Rounding.NEAREST:
            for _, out, value in low:
                pending = self.nearest.by_device[out.device]
                pending[0].append(out)
                pending[1].append(value)
            return
        if not low:
            return
        # One draw for the weight and its state; the order of the names fixes whose
        # bits are whose.
        low.sort(key=lambda job: job[0])
        positions = Positions(p)
        if part is not None:  # a run of the whole parameter's positions
            positions.local_shape, positions.block_start = (len(work),), part.start
        self.stochastic[work.device].append((positions, (seed, index, count),
                                             [out for _, out, _ in low],
                                             [value for _, _, value in low]))

    def run(self) -> None:
        self.nearest.run()
        for outs, values, comps in self.kahan.values():
            round_kahan_foreach(outs, values, comps)
        for jobs in self.stochastic.values():
            round_stochastic(jobs, self.workspace.scratch)
        versions = self.opt._ampkit_pure.versions
        for p in self.kahan_params:
            versions[p] = fingerprint(p)
