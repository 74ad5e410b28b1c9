"""The op-level autocast engine: ``ampkit.autocast``.

How it works: every region enters native ``torch.autocast``, which keeps doing what it
already does, at native speed. Only the ops whose rule under the region's
:class:`~ampkit.policies.policy.Policy` differs from native autocast are intercepted; an
intercepted op has its inputs cast by the policy's rule and runs with autocast off for
that one call. A policy equal to native autocast (the default, ``"torch"``) intercepts
nothing and registers nothing.

Where: an op with a dispatcher op of its own (aten ops, custom ops from
``torch.library``) by a kernel on the device's Autocast dispatch key
(:mod:`ampkit.engine.kernels`), so unlisted ops never leave C++, eager or compiled; a
Python-level composite with no dispatcher op (``F.interpolate``,
``F.multi_head_attention_forward``) by one ``TorchFunctionMode`` per thread, pushed
only while such an entry is listed. A listed dispatcher op therefore applies wherever
it runs, inside composites too (as native autocast's lists do); a listed composite is
one op: its rule applies to its inputs and the ops inside run with autocast off.

The kernels read the calling thread's innermost region, so two threads can run
different policies, an inner region (including ``enabled=False``) overrides the outer
one until it exits, and code outside any region computes as under native autocast.
Casts run above autograd, so each parameter's gradient comes back in that parameter's
own dtype. Compiled frames guard on the thread's active policy: a graph is reused under
an equal policy, never under another.

What the engine knows about an op it reads from the op's schema, not from name lists:
which ops return a view of their input (an unlisted rule never casts those, so a view
stays a view), where an explicit ``dtype`` argument sits (given by keyword or by
position, it wins), and which ops native autocast covers on the device (the
dispatcher's Autocast registrations). Custom ops (``torch.library``) are listed like any
other op.

Example:
    >>> import torch
    >>> import ampkit
    >>> a, b = torch.rand(2, 3), torch.rand(2, 3)
    >>> with ampkit.autocast("cpu", torch.float16, custom_white_list={"add"}):
    ...     (a + b).dtype
    torch.float16
    >>> conv = torch.nn.Conv2d(3, 2, 3, bias=False)
    >>> x = torch.rand(1, 3, 8, 8)
    >>> with ampkit.autocast("cpu", torch.float16, custom_black_list={"conv2d"}):
    ...     conv(x).dtype
    torch.float32
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
from torch.amp.autocast_mode import autocast as _native_autocast

from ampkit import torch_internals
from ampkit.common.arguments import default_device_type
from ampkit.common.compile_frames import not_traced
from ampkit.engine import kernels
from ampkit.engine.casting import WeightCastCache
from ampkit.engine.rules import NO_RULES, PolicyMode, Rules, compile_rules, region_policy
from ampkit.policies.policy import Policy, as_dtype
from ampkit.policies.presets import add_in_use_check, get_policy
from ampkit.policies.registry import AUTOCAST_KEYS as _AUTOCAST_KEYS
from ampkit.policies.registry import (
    OpEntry,
    native_op_names,
)

__all__ = ["UnsupportedDeviceError", "autocast", "current_policy", "innermost_policy",
           "native_op_names", "observe_regions", "release_kernels"]

F = TypeVar("F", bound=Callable[..., Any])


# -- thread state: one frame per entered region ---------------------------------------------

@dataclasses.dataclass
class _Frame:
    owner: object  # the region (or carried state) that entered it
    device_type: str
    policy: Policy | None  # None: autocast off in this region
    rules: Rules
    cache_enabled: bool
    native: Any = None  # the entered native torch.autocast, if this frame entered one
    pushed: bool = False  # this frame pushed the thread's mode
    saved: tuple[Any, ...] | None = None  # the mode's state before this frame
    dsaved: tuple[Any, ...] | None = None  # the Autocast kernels' state before it
    base: Policy | None = None  # the policy the region was given, before its lists
    thread: int = 0  # the ident of the thread that entered it
    held: bool = False  # this frame holds the Autocast kernels (kernels.hold)


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.mode: PolicyMode | None = None
        self.frames: list[_Frame] = []
        self.cache = WeightCastCache()
        # Called with each entered region's policy (``None``: disabled); the tools'
        # list-usage report registers here. Empty, it costs one check per region entry.
        self.observers: list[Callable[[Policy | None], None]] = []


_state = _ThreadState()
# Every entered frame of every thread, for the checks that must see other threads'
# regions (unregister_policy). id(frame) -> frame; one dict store per region entry.
_live: dict[int, _Frame] = {}


def _regions_using(policy: Policy) -> str | None:
    """The live regions (any thread) that were given ``policy``, described; ``None``
    if none. Frames of threads that ended inside a region are dropped."""
    names = {t.ident: t.name for t in threading.enumerate()}
    users = []
    for key, frame in list(_live.items()):
        if frame.thread not in names:
            _live.pop(key, None)
        elif frame.base is policy or frame.base == policy:
            users.append(f"on {frame.device_type} in thread {names[frame.thread]!r}")
    return f"{len(users)} live ampkit region(s) ({'; '.join(users)})" if users else None


add_in_use_check(_regions_using)


def observe_regions(observer: Callable[[Policy | None], None], *, stop: bool = False) -> None:
    """Call ``observer`` with each region's policy (``None``: autocast off) as it is
    entered in this thread; ``stop=True`` removes it again (no error if absent). For
    tools that report on regions (:mod:`ampkit.tools.ops.list_usage`).

    Example:
        >>> import torch
        >>> from ampkit.engine.regions import autocast, observe_regions
        >>> seen = []
        >>> observe_regions(seen.append)
        >>> with autocast("cpu", torch.bfloat16):
        ...     pass
        >>> observe_regions(seen.append, stop=True)
        >>> [p.name for p in seen]
        ['torch']
    """
    if not stop:
        _state.observers.append(observer)
    elif observer in _state.observers:
        _state.observers.remove(observer)


def innermost_policy() -> Policy | None:
    """The policy of the innermost region entered in this thread, on any device
    (``None``: none entered, or autocast off there).

    Example:
        >>> import torch
        >>> from ampkit.engine.regions import autocast, innermost_policy
        >>> with autocast("cpu", torch.bfloat16, policy="torch"):
        ...     innermost_policy().name
        'torch'
        >>> innermost_policy() is None
        True
    """
    frames = _state.frames
    return frames[-1].policy if frames else None


def innermost_region_dtype() -> torch.dtype | None:
    """The low-precision dtype of the innermost region entered in this thread, on any
    device, when that region is enabled; ``None`` outside every region or inside a
    disabled one. (Frameworks with one autocast state for all devices, Paddle's
    ``get_autocast_dtype``, ask this.)

    Example:
        >>> import torch
        >>> from ampkit.engine.regions import autocast, innermost_region_dtype
        >>> with autocast("cpu", torch.float16):
        ...     innermost_region_dtype()
        torch.float16
        >>> with autocast("cpu", torch.float16), autocast("cpu", enabled=False):
        ...     innermost_region_dtype() is None
        True
    """
    frames = _state.frames
    if not frames or frames[-1].policy is None:
        return None
    # The region entered native autocast with its dtype (a checkpoint's recompute
    # restores it), so torch's state holds the dtype of the innermost one.
    return torch.get_autocast_dtype(frames[-1].device_type)


def _push(frame: _Frame) -> None:
    """Enter ``frame``'s rules (its native autocast is already entered), all or nothing:
    an interrupt (Ctrl-C) half-way leaves the thread as it found it."""
    st = _state
    mode = st.mode
    try:
        frame.thread = threading.get_ident()
        _live[id(frame)] = frame
        rules = frame.rules
        if rules.ops:
            # Held before the generation is read: a release() in another thread from
            # here on refuses, one before it made the generation new (we register).
            name = frame.policy.name if frame.policy is not None else None
            kernels.hold(frame, f"policy {name!r} on {frame.device_type}")
            frame.held = True
        if rules.ops and rules.registered != kernels.generation():
            # First entry of this policy (or the first since kernels.release()).
            kernels.register(frame.device_type, rules.ops)
            rules.registered = kernels.generation()
        cache = st.cache if frame.cache_enabled else None
        frame.dsaved = kernels.activate(rules.ops or None, frame.device_type, rules.token,
                                          cache)
        if rules.entry and mode is None:
            mode = PolicyMode()
            mode.__enter__()  # type: ignore[no-untyped-call]  # torch's, unannotated
            st.mode, frame.pushed = mode, True
        if mode is not None:
            frame.saved = (mode.rules, mode.device_type, mode.cache)
            mode.rules, mode.device_type = rules.entry, frame.device_type
            mode.cache = cache
        st.frames.append(frame)
    except BaseException:
        _undo(frame)
        raise
    for observe in st.observers:
        observe(frame.policy)


def _undo(frame: _Frame) -> None:
    """Restore what ``frame`` changed: the mode's state, the mode itself, native autocast.
    Each step runs even when an earlier one raised."""
    st = _state
    try:
        mode = st.mode
        if mode is not None and frame.saved is not None:
            mode.rules, mode.device_type, mode.cache = frame.saved
            frame.saved = None
        if frame.dsaved is not None:
            kernels.restore(frame.dsaved)
            frame.dsaved = None
    finally:
        try:
            if frame.pushed:
                frame.pushed = False
                mode, st.mode = st.mode, None
                if mode is not None:
                    mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]
        finally:
            try:
                native, frame.native = frame.native, None
                if native is not None:
                    native.__exit__(None, None, None)
            finally:
                if frame.held:
                    frame.held = False
                    kernels.let_go(frame)
                _live.pop(id(frame), None)


def _pop(owner: object) -> None:
    """Leave ``owner``'s innermost frame, first closing any frame entered inside it and
    left open (a region whose exit never ran: an interrupted forward hook)."""
    st = _state
    for index in range(len(st.frames) - 1, -1, -1):
        if st.frames[index].owner is owner:
            break
    else:
        raise RuntimeError("ampkit.autocast: __exit__ of a region that is not entered in "
                           "this thread")
    try:
        while len(st.frames) > index:
            _undo(st.frames.pop())
    finally:
        if not st.frames:
            st.cache.clear()


# -- activation checkpointing: carry the policy into the recomputation -----------------------

class _Carried:
    """Re-enters a region's rules (not its native autocast: torch.utils.checkpoint
    restores that itself) around a checkpointed function's recomputation."""

    __slots__ = ("frame",)

    def __init__(self, frame: _Frame) -> None:
        self.frame = frame

    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            frames = _state.frames
            if frames and frames[-1].rules is self.frame.rules and (
                    frames[-1].device_type == self.frame.device_type):
                return fn(*args, **kwargs)  # the forward itself: already in effect
            _push(dataclasses.replace(self.frame, owner=self, native=None, pushed=False,
                                      saved=None, dsaved=None, held=False))
            try:
                return fn(*args, **kwargs)
            finally:
                _pop(self)

        return run


def _carry(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, bound to the policy in effect now (when it intercepts anything)."""
    frames = _state.frames
    if not frames or not frames[-1].rules or torch_internals.compiling():
        return fn  # torch carries native autocast state itself; compiled code bakes it in
    return _Carried(frames[-1])(fn)


_carry_installed = False


def _install_checkpoint_carry() -> None:
    """Make ``torch.utils.checkpoint`` carry the active policy into its recomputation,
    the way it carries native autocast state (which it captures in the forward and
    re-enters around the recomputation): the function it recomputes is bound to the
    policy in effect at the checkpoint call (:func:`_carry`; outside policy regions it
    is passed through unchanged). torch offers no hook for other state, so this goes
    through :func:`ampkit.torch_internals.install_checkpoint_carry`, which checks by
    behaviour that the internals it wraps are the ones checkpoint calls, and warns
    where they are not. Installed on first entry of a region that intercepts anything."""
    global _carry_installed
    if _carry_installed:
        return
    _carry_installed = True
    torch_internals.install_checkpoint_carry(_carry)


# -- a region entered inside compiled code ----------------------------------------------------

class _GraphRegion:
    """The owner of the frames :func:`enter_in_graph` pushes for one (device, policy):
    itself where a graph runs as Python, ``traced`` while a graph is being traced."""

    __slots__ = ("device_type", "policy", "traced")

    def __init__(self, device_type: str, policy: Policy) -> None:
        self.device_type, self.policy = device_type, policy
        self.traced = _TracedOwner()


class _TracedOwner:
    """Owns the frames a region's graph node pushes while dynamo or AOTAutograd traces."""

    __slots__ = ()


_graph_regions: list[_GraphRegion] = []
_graph_keys: dict[tuple[str, Policy], int] = {}
_graph_lock = threading.Lock()


def in_graph_key(device_type: str, policy: Policy) -> int | None:
    """A key for :func:`enter_in_graph` (an int: what a graph node carries), or ``None``
    where the policy intercepts a composite through the Python mode, which a graph
    cannot enter. Call it outside compiled code (a converted module's boundary does,
    when it is installed).

    Example:
        >>> from ampkit.engine.regions import in_graph_key
        >>> from ampkit.policies.policy import Policy
        >>> isinstance(in_graph_key("cpu", Policy(fp32_ops={"softmax"})), int)
        True
    """
    if compile_rules(policy, device_type).entry:
        return None
    with _graph_lock:
        key = _graph_keys.get((device_type, policy))
        if key is None:
            key = _graph_keys[device_type, policy] = len(_graph_regions)
            _graph_regions.append(_GraphRegion(device_type, policy))
    return key


def enter_in_graph(key: int) -> None:
    """Enter the rules of :func:`in_graph_key`'s policy (not its native autocast: the
    caller traces a ``torch.autocast`` block around it); :func:`exit_in_graph` leaves.

    Called in compiled code, it is a node of the graph (dynamo neither traces nor
    drops it): it runs where the graph is traced, so dynamo and AOTAutograd trace the
    ops after it through the policy's kernels and the casts are baked in, and where a
    backend runs the graph as Python. A trace that stops half-way (a graph break in the
    region: dynamo then runs the region's call eagerly) leaves nothing entered: what a
    trace entered is left at the end of the compilation."""
    region = _graph_regions[key]
    owner = region.traced if torch_internals.compiling() else region
    _push(_Frame(owner, region.device_type, region.policy,
                 compile_rules(region.policy, region.device_type), False))


def exit_in_graph(key: int) -> None:
    """Leave the region :func:`enter_in_graph` entered."""
    region = _graph_regions[key]
    _pop(region.traced if torch_internals.compiling() else region)


def _leave_traced_regions() -> None:
    """End of a compilation: leave what an interrupted trace entered."""
    frames = _state.frames
    traced = next((f.owner for f in frames if isinstance(f.owner, _TracedOwner)), None)
    if traced is not None:
        _pop(traced)  # and every frame entered inside it
        _leave_traced_regions()


torch_internals.in_graph(enter_in_graph)
torch_internals.in_graph(exit_in_graph)
torch_internals.after_compile(_leave_traced_regions)


# -- the region -------------------------------------------------------------------------------

class UnsupportedDeviceError(RuntimeError, ValueError):
    """A ``device_type`` that ``torch.autocast`` does not support. A ``RuntimeError``, as
    torch raises, and a ``ValueError`` (a bad argument value).

    Example:
        >>> import ampkit
        >>> try:
        ...     ampkit.autocast("gpu")
        ... except RuntimeError as error:
        ...     print(type(error).__name__)
        UnsupportedDeviceError
    """


def _autocast_available(device_type: str) -> bool:
    try:
        return torch.amp.is_autocast_available(device_type)
    except RuntimeError:  # not a device type torch knows at all
        return False


def _check_device(device_type: Any) -> str:
    if not isinstance(device_type, str):
        # torch's own wording (its tests match it), then ours.
        raise ValueError(f"Expected `device_type` of type `str`, got: `{type(device_type)}`; "
                         f"device_type must be a device type string such as 'cpu' or 'cuda'")
    try:
        available = torch.amp.is_autocast_available(device_type)
        reason = f"unsupported autocast device_type {device_type!r}"
    except RuntimeError as error:  # "Invalid device string: '...'"
        available, reason = False, str(error)
    if not available:
        accepted = [d for d in _AUTOCAST_KEYS if _autocast_available(d)]
        raise UnsupportedDeviceError(f"device_type: {reason}; device_type must be a device "
                                     f"type that torch.autocast supports, one of {accepted}")
    return device_type


def release_kernels() -> None:
    """Take ampkit's kernels off the dispatcher's Autocast keys.

    A policy's first region registers a kernel for each op it decides differently from
    native autocast. They stay registered: outside any ampkit region (or in another
    thread) they compute what native autocast computes, but each such op call under
    autocast pays one Python call to get there (on a 2-core CPU VM, 1.12x a
    dispatch-bound native step with ten ops' kernels registered). Call this once the
    custom-list regions are done, outside any region; a later region that needs the
    kernels registers them again.

    Raises:
        RuntimeError: a live region (in any thread) uses the kernels: it is named, and
            nothing is released (the region's lists would silently stop applying).

    Example:
        >>> import torch
        >>> import ampkit
        >>> from ampkit.engine.regions import release_kernels
        >>> with ampkit.autocast("cpu", torch.bfloat16, custom_black_list={"bmm"}):
        ...     pass
        >>> release_kernels()
        >>> with torch.autocast("cpu", torch.bfloat16):  # native autocast, no Python call
        ...     torch.bmm(torch.rand(1, 2, 2), torch.rand(1, 2, 2)).dtype
        torch.bfloat16
    """
    kernels.release()


def current_policy(device_type: str = "cpu") -> Policy | None:
    """The policy of the innermost enabled ampkit region for ``device_type`` in this
    thread, or ``None`` outside any (or inside an ``enabled=False`` one).

    Example:
        >>> import ampkit
        >>> from ampkit.engine.regions import current_policy
        >>> with ampkit.autocast("cpu", policy="conservative"):
        ...     current_policy("cpu").name
        'conservative'
        >>> current_policy("cpu") is None
        True
    """
    for frame in reversed(_state.frames):
        if frame.device_type == device_type:
            return frame.policy
    return None


class autocast:
    """Run ops in mixed precision by a policy: native ``torch.autocast`` plus custom
    lists. A context manager and a decorator.

    The positional signature is ``torch.autocast``'s, ``(device_type, dtype=None,
    enabled=True, cache_enabled=None)``; the policy arguments are keyword-only.

    Args:
        device_type: ``"cpu"``, ``"cuda"`` or any device ``torch.autocast`` supports;
            ``None`` picks ``"cuda"`` when available, else ``"cpu"``. Another string is
            an :class:`UnsupportedDeviceError` (a ``RuntimeError``, as in torch).
        dtype: ``torch.float16`` or ``torch.bfloat16`` (or their names); ``None`` takes
            the policy's dtype, else the device's autocast default. With
            ``enabled=False`` any ``torch.dtype`` is accepted (it is not used), as torch
            accepts it.
        enabled: ``False`` turns autocast off inside the region (overriding outer ones).
        cache_enabled: keep low-precision casts of weights for the outermost region;
            ``None`` follows ``torch.is_autocast_cache_enabled()``.
        policy: a preset name (``"torch"``, ``"conservative"``, ...) or a
            :class:`~ampkit.policies.policy.Policy`.
        custom_white_list: ops to run in ``dtype`` (names, callables, module classes,
            custom ops as ``"ns::name"`` or their ``torch.library`` objects).
        custom_black_list: ops to run in float32 (the same kinds of entries).

    Example:
        >>> import torch
        >>> import ampkit
        >>> lin = torch.nn.Linear(4, 4)
        >>> @ampkit.autocast("cpu", torch.bfloat16, custom_black_list=[torch.nn.Linear])
        ... def forward(x):
        ...     return lin(x)
        >>> forward(torch.rand(2, 4)).dtype
        torch.float32
        >>> with ampkit.autocast("cpu", torch.float32, False):  # torch's positional form
        ...     (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
        torch.float32
    """

    # Inside compiled code a region's entry and exit are graph breaks, and the ops in
    # between are traced with the region active. A region around the compiled call
    # costs no graph break at all.
    @not_traced
    def __init__(self, device_type: str | None = None, dtype: torch.dtype | str | None = None,
                 enabled: bool = True, cache_enabled: bool | None = None, *,
                 policy: str | Policy = "torch",
                 custom_white_list: Iterable[OpEntry] | None = None,
                 custom_black_list: Iterable[OpEntry] | None = None) -> None:
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
        if cache_enabled is None:
            cache_enabled = torch.is_autocast_cache_enabled()
        if not isinstance(cache_enabled, bool):
            raise TypeError(f"cache_enabled must be a bool or None, "
                            f"got {type(cache_enabled).__name__}")
        self.device_type = _check_device(default_device_type() if device_type is None
                                         else device_type)
        base = get_policy(policy)
        self._base = base  # what unregister_policy checks live regions against
        if not enabled and isinstance(dtype, torch.dtype):
            chosen: torch.dtype | None = dtype  # unused in a disabled region; as torch
        else:
            chosen = as_dtype(dtype)
        self.policy: Policy = region_policy(base, custom_white_list, custom_black_list)
        self.dtype: torch.dtype = (chosen or self.policy.dtype
                                   or torch.get_autocast_dtype(self.device_type))
        self.enabled = enabled
        self.cache_enabled = cache_enabled
        self._rules = compile_rules(self.policy, self.device_type) if enabled else NO_RULES

    @not_traced
    def __enter__(self) -> autocast:
        cache = self.cache_enabled
        if cache and torch.is_autocast_enabled(self.device_type) and (
                torch.get_autocast_dtype(self.device_type) != self.dtype):
            # Native autocast keys its weight cache by tensor only, so an inner region
            # with another dtype would get the outer dtype's casts (a dtype-mismatch
            # error in torch.autocast). Not caching in that inner region avoids it.
            cache = False
        if self._rules:
            _install_checkpoint_carry()
        native = _native_autocast(self.device_type, self.dtype, enabled=self.enabled,
                                  cache_enabled=cache)
        frame = _Frame(self, self.device_type, self.policy if self.enabled else None,
                       self._rules, self.cache_enabled,
                       base=self._base if self.enabled else None)
        native.__enter__()
        frame.native = native  # from here on _undo exits it
        _push(frame)
        return self

    @not_traced
    def __exit__(self, *exc: Any) -> None:
        _pop(self)

    def __call__(self, fn: F) -> F:
        if not callable(fn):
            raise TypeError(f"autocast()(func) requires a callable, but got "
                            f"{type(fn).__name__}")

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self:
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    def __repr__(self) -> str:
        return (f"ampkit.autocast(device_type={self.device_type!r}, dtype={self.dtype}, "
                f"enabled={self.enabled}, policy={self.policy.name!r})")
