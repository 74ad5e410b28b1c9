"""A converted module's boundary: casts on the way in, a region around its forward
(the conversion's policy, all-low-precision for a white-listed module, autocast off for
a kept-fp32 one), casts on the way out. The :class:`Boundary` is entered eagerly as one
``try``/``finally`` (:meth:`Boundary.enter`, :meth:`Boundary.leave`) and traced inside
compiled code (:meth:`Boundary.call_traced`), where a policy with lists enters its
region through a graph key made when the boundary is installed.

Example:
    >>> import torch
    >>> from ampkit.conversion.boundary import Region, compute_device_type
    >>> compute_device_type(torch.nn.Linear(2, 2), ()), Region.FP32.value
    ('cpu', 'fp32')
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
import threading
import types
from typing import Any

import torch
import torch.nn as nn

from ampkit import torch_internals
from ampkit.common.arguments import LOW_PRECISION
from ampkit.common.compile_frames import not_traced, skip_frame_only, skip_recursively
from ampkit.common.containers import iter_tensors
from ampkit.conversion.classes import give_boundary, original_class
from ampkit.conversion.config import record_of
from ampkit.conversion.norms import (
    LOW_INPUT_LAYER_NORM,
    SaveLowCopies,
    low_contiguous,
    saved_tensor_hooks_free,
    takes_low_input,
)
from ampkit.conversion.parameter_casts import (
    called_on_its_own,
    casting_on_use,
    end_forward_pass,
    new_forward_pass,
    restore_to,
    swap_depth,
)
from ampkit.engine.casting import cast_tree, map_floating
from ampkit.engine.regions import autocast, enter_in_graph, exit_in_graph, in_graph_key
from ampkit.policies.policy import Policy

__all__ = ["ALL_LOW_PRECISION", "Boundary", "Region", "compute_device_type",
           "install_boundary", "region_autocast", "upcast_inside"]

_LOW = LOW_PRECISION


#: The policy of a white-listed module's region: every op on floating inputs runs in
#: the low-precision dtype (its fp32 parameters are cast on use, once per region).
ALL_LOW_PRECISION = Policy(
    name="all-low-precision", unlisted="lower",
    description="Every compute op runs in the low-precision dtype (module white lists).")


class Region(enum.Enum):
    """What a boundary module's forward runs inside."""

    UNCHANGED = "unchanged"
    POLICY = "policy"  # ampkit.autocast with the conversion's policy (O1, O2)
    LOW = "low"  # ampkit.autocast running every op in low precision (white list)
    FP32 = "fp32"  # autocast off: a kept-fp32 module


@functools.lru_cache(maxsize=64)
def region_autocast(device_type: str, dtype: torch.dtype | None,
                     policy: Policy | None) -> autocast:
    """One reusable region per (device, dtype, policy): ampkit.autocast keeps its state
    on a thread-local stack, so one object can be entered by nested and other threads."""
    if policy is None:
        return autocast(device_type, enabled=False)
    return autocast(device_type, dtype, policy=policy)


class _OnItsOwnCalls(threading.local):
    def __init__(self) -> None:
        self.modules: list[nn.Module] = []


_on_its_own = _OnItsOwnCalls()


class _OnItsOwn:
    """While entered: ``module``, an O2 kept module, runs called on its own with fp32
    inputs, so its output cast (a forward hook, which sees the inputs only after the
    boundary cast them) leaves the fp32 output as it is."""

    __slots__ = ("module",)

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __enter__(self) -> None:
        _on_its_own.modules.append(self.module)

    def __exit__(self, *exc: object) -> None:
        _on_its_own.modules.pop()


def compute_device_type(module: nn.Module, args: Any) -> str:
    """The device a module computes on: its first parameter's (or buffer's), else its
    first tensor input's."""
    # The module's own tensors first: cheap, and almost always there (norms, the root's
    # first layer is usually reached after one or two children).
    for store in (torch_internals.module_parameters(module),
                  torch_internals.module_buffers(module)):
        for tensor in store.values():
            if tensor is not None:
                return tensor.device.type
    for tensor in module.parameters():
        return tensor.device.type
    for tensor in iter_tensors(args):
        return tensor.device.type
    return "cpu"


def _check_gathered_fp32(module: nn.Module) -> None:
    """A kept-fp32 module in an FSDP2 group: its parameters, as FSDP gathered them for
    this forward, must be fp32, or the group's ``MixedPrecisionPolicy`` rounds what the
    level keeps in fp32."""
    low = next(((n, p.dtype) for n, p in torch_internals.module_parameters(module).items()
                if p is not None and p.is_floating_point() and p.dtype is not torch.float32),
               None)
    if low is None:
        return
    record = record_of(module)
    name = "?" if record is None else record.name
    level = ""
    if record is not None and record.config.param_compute_dtype is not None:
        level = " at O2"
    raise RuntimeError(
        f"ampkit keeps module {name!r} ({original_class(type(module)).__name__}) in "
        f"float32{level}, but FSDP2 gathered its parameter {low[0]!r} as {low[1]}: it is "
        f"in a fully_shard group whose MixedPrecisionPolicy has param_dtype={low[1]}. "
        f"Shard the model with ampkit.fsdp.fully_shard(model, blocks=...), which gives "
        f"kept modules fp32 groups of their own, or call fully_shard on this module "
        f"first with mp_policy=ampkit.fsdp.mixed_precision_policy(model, kept=True)")


class _Given(threading.local):
    """This thread's root boundaries that cast their inputs, innermost last: for each,
    ``id(cast input) -> (cast input, the caller's tensor, the cast's version)``."""

    def __init__(self) -> None:
        self.stack: list[dict[int, tuple[torch.Tensor, torch.Tensor, int]]] = []


_given = _Given()


class _PopGiven:
    """In a boundary's entered contexts: leaving it drops its inputs' record."""

    def __exit__(self, *exc: object) -> None:
        if _given.stack:
            _given.stack.pop()


_GIVEN = _PopGiven()


def _has_backward_hooks(module: nn.Module) -> bool:
    """Whether torch wraps ``module``'s inputs for backward hooks when it is called."""
    return bool(torch_internals.backward_hooks(module)
                or torch_internals.backward_pre_hooks(module)
                or torch_internals.global_backward_hooks
                or torch_internals.global_backward_pre_hooks)


_NO_FORWARD = object()


class _Deferred(threading.local):
    """This thread's model calls whose input cast is made in the forward, innermost
    last."""

    def __init__(self) -> None:
        self.stack: list[_CastInForward] = []


_deferred = _Deferred()


class _CastInForward:
    """While entered: the module's ``forward`` (its instance attribute, for this call)
    is :func:`_cast_then_forward`, which casts the inputs it is given, then runs the
    module's own forward. The model's input cast, made there instead of before
    ``nn.Module.__call__``, comes after torch has wrapped the caller's tensors for the
    module's full backward hooks."""

    __slots__ = ("boundary", "entered", "forward", "module", "saved")

    def __init__(self, boundary: Boundary, module: nn.Module, entered: list[Any]) -> None:
        self.boundary, self.module, self.entered = boundary, module, entered
        self.saved: Any = _NO_FORWARD
        self.forward: Any = None

    def __enter__(self) -> None:
        module = self.module
        self.saved = module.__dict__.get("forward", _NO_FORWARD)
        self.forward = module.forward
        _deferred.stack.append(self)
        # (a bound method of one function: torch.compile of the model guards on that
        # function, so a later call reuses its graph)
        module.__dict__["forward"] = types.MethodType(_cast_then_forward, module)

    def __exit__(self, *exc: object) -> None:
        if self.saved is _NO_FORWARD:
            self.module.__dict__.pop("forward", None)
        else:
            self.module.__dict__["forward"] = self.saved
        _deferred.stack.remove(self)


def _cast_then_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The forward of a model whose input cast waits for it (:class:`_CastInForward`)."""
    deferred = next(d for d in reversed(_deferred.stack) if d.module is module)
    device_type = compute_device_type(module, (args, kwargs))
    args, kwargs = deferred.boundary._cast_inputs(module, device_type, args, kwargs,
                                                  deferred.entered)
    return deferred.forward(*args, **kwargs)


def _own_forward(module: nn.Module) -> Any:
    """``module.forward`` as its class (or the user) defined it."""
    forward = module.forward
    if getattr(forward, "__func__", None) is _cast_then_forward:
        return next(d.forward for d in reversed(_deferred.stack) if d.module is module)
    return forward


def _not_double(t: torch.Tensor) -> bool:
    return t.dtype is not torch.float64


def _same_view(view: torch.Tensor, cast: torch.Tensor, given: torch.Tensor) -> torch.Tensor:
    """``view``, a view of ``cast`` (the boundary's copy of the caller's ``given``), taken
    of ``given`` instead: the caller's exact values, as a view of the caller's tensor,
    as native autocast hands it back (the cast copy has ``given``'s shape, and its
    strides where ``given`` is dense)."""
    offset = view.storage_offset() - cast.storage_offset()
    if cast.stride() == given.stride():
        return given.as_strided(view.size(), view.stride(), given.storage_offset() + offset)
    # A gapped or broadcast input, whose copy is contiguous: the same elements, picked
    # by their place in the copy (exact values, but not a view of the caller's tensor)
    places = torch.arange(cast.numel(), device=cast.device).view(cast.shape)
    return given.reshape(-1)[places.as_strided(view.size(), view.stride(), offset)]


def _input_path(obj: Any, targets: tuple[torch.Tensor, ...], path: str) -> str | None:
    """Where one of ``targets`` sits inside ``obj`` (``path`` names ``obj``), or ``None``."""
    if any(obj is target for target in targets):
        return path
    items: Any = ()
    if isinstance(obj, list | tuple):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(obj))
    elif isinstance(obj, dict):
        items = ((f"{path}[{k!r}]", v) for k, v in obj.items())
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        items = ((f"{path}.{f.name}", getattr(obj, f.name)) for f in dataclasses.fields(obj))
    for name, value in items:
        found = _input_path(value, targets, name)
        if found is not None:
            return found
    return None


def _refuse_edited_input(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                         cast: torch.Tensor, given: torch.Tensor) -> None:
    """The model's forward edited in place the copy its boundary made of a caller's
    input: native autocast's forward edits the caller's own tensor, and copying the
    edit back would round every element of it, so the call is refused."""
    try:
        names = [p.name for p in inspect.signature(_own_forward(module)).parameters.values()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        names = []
    # (the forward hook's arguments: the cast copies, or the caller's tensors as torch
    # wrapped them for backward hooks where the cast is made in the forward)
    wrapped = (cast, given)
    where = None
    for i, value in enumerate(args):
        where = _input_path(value, wrapped, names[i] if i < len(names) else f"args[{i}]")
        if where is not None:
            break
    for key, value in kwargs.items():
        where = where or _input_path(value, wrapped, key)
    raise RuntimeError(
        f"the forward of the converted model {original_class(type(module)).__name__!r} "
        f"edited {'one of its inputs' if where is None else f'its input {where!r}'} in "
        f"place: the model's boundary hands "
        f"the forward a {cast.dtype} copy of your {given.dtype} tensor, so the edit "
        f"reached the copy, not your tensor (native torch.autocast edits yours, and "
        f"copying the edit back would round all of it to {cast.dtype}). Make the edit "
        f"out of place in the forward (x = x + 1, not x.add_(1)), make it before calling "
        f"the model, or convert at O1, which hands the forward your own tensors")


# Autograd nodes of ops that hand their input on in its own dtype, reshaped, sliced or
# copied (``logits[..., :-1, :].contiguous()``): between a model's output and the
# upcast of it that its own loss makes (names without their numeric suffix).
_SAME_DTYPE_NODES = frozenset({
    "ViewBackward", "UnsafeViewBackward", "ReshapeAliasBackward", "SliceBackward",
    "SelectBackward", "NarrowBackward", "TBackward", "TransposeBackward",
    "PermuteBackward", "SqueezeBackward", "UnsqueezeBackward", "ExpandBackward",
    "AsStridedBackward", "CloneBackward", "AliasBackward"})


def _node_kind(node: Any) -> str:
    return str(node.name()).rstrip("0123456789")


def _is_loss(kind: str) -> bool:
    # torch's loss kernels: NllLoss, MseLoss, BinaryCrossEntropyWithLogits, HuberLoss, ...
    return "Loss" in kind or "CrossEntropy" in kind


def upcast_inside(output: Any) -> set[tuple[Any, int]]:
    """The low-precision floating tensors of ``output`` that the model itself upcast
    for a loss it also returns (a Hugging Face model given labels: ``logits.float()``,
    then cross entropy), as autograd identities ``(grad_fn, output_nr)``.

    Read from the autograd graph the forward recorded: from each returned tensor of a
    wider floating dtype down through a loss kernel (``nll_loss``, ``mse_loss``,
    ``binary_cross_entropy_with_logits``, ...) to a ``_to_copy`` of such an output, or
    of a view or same-dtype copy of it. Empty where autograd recorded nothing
    (``no_grad``, inference mode) and inside compiled code.

    Example:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> from ampkit.conversion.boundary import upcast_inside
        >>> w = torch.ones(2, 3, requires_grad=True)
        >>> logits = w.bfloat16() * 2
        >>> loss = F.cross_entropy(logits.float(), torch.tensor([0, 2]))
        >>> (logits.grad_fn, logits.output_nr) in upcast_inside((loss, logits))
        True
        >>> norm = logits.float().norm()  # no loss: a loss outside still needs fp32
        >>> upcast_inside((norm, logits))
        set()
    """
    if torch.compiler.is_compiling():
        return set()
    low: set[tuple[Any, int]] = set()
    wide: list[Any] = []
    for t in iter_tensors(output):
        if t.grad_fn is None or not t.is_floating_point():
            continue
        if t.dtype in _LOW:
            low.add((t.grad_fn, t.output_nr))
        else:
            wide.append(t.grad_fn)
    found: set[tuple[Any, int]] = set()
    if not low or not wide:
        return found
    # (node, below a loss kernel): a node is walked at most once in each state. The
    # nodes seen are kept alive for the walk: some torch releases (2.11) make a fresh
    # Python object for a node on each access and free it after, so an id would be
    # reused by another node, which the walk would then take as seen.
    todo = [(node, False) for node in wide]
    seen = {(id(node), False): node for node in wide}
    while todo and len(found) < len(low):
        node, below = todo.pop()
        kind = _node_kind(node)
        if below and kind == "ToCopyBackward":
            # the cast's input, followed back through reshapes, slices and copies
            chain = [edge for edge in node.next_functions if edge[0] is not None]
            while chain:
                edge = chain.pop()
                if edge in low:
                    found.add(edge)
                elif _node_kind(edge[0]) in _SAME_DTYPE_NODES:
                    chain.extend(e for e in edge[0].next_functions if e[0] is not None)
        below = below or _is_loss(kind)
        for nxt, _ in node.next_functions:
            if nxt is not None and (id(nxt), below) not in seen:
                seen[id(nxt), below] = nxt
                todo.append((nxt, below))
    return found


@dataclasses.dataclass(slots=True, eq=False)
class Boundary:
    """One module's boundary: casts on the way in, a region around the forward, casts
    on the way out, as one ``try``/``finally`` around the module's call
    (:func:`converted_call`, the ``__call__`` of the module's converted class). Holds
    no reference to the module, so ``copy.deepcopy`` of a converted model gets working
    boundaries of its own.

    A ``with`` around the call, not a pre-hook and a post-hook: torch runs
    ``always_call`` post-hooks for ``Exception`` only, so after a ``KeyboardInterrupt``
    a hook pair would leave its region entered and parameters swapped; and a region
    entered in one hook and left in another cannot be traced by ``torch.compile``.

    A kept-fp32 norm in :data:`MIXED_INPUT_NORMS` gets its low-precision input as it is
    (its kernel computes in fp32 inside from fp32 parameters and statistics, and
    returns the input's dtype): no activation-sized cast on the way in, none on the way
    out, none in the backward pass."""

    region: Region
    input_dtype: torch.dtype | None
    output_dtype: torch.dtype | None
    compute_dtype: torch.dtype | None = None
    policy: Policy | None = None
    _: dataclasses.KW_ONLY
    root: bool = False  # the converted model's own boundary: a forward pass starts
    # The module's class when it was converted: the conversion's own class swap and
    # FSDP2's later replace it with subclasses.
    module_type: type | None = None
    # The output is a parameter's value (a parametrization's result): cast only while
    # a converted model's forward or a module cast on use runs, its use; read from
    # outside (``model[0].weight``, ``remove_parametrizations``) it stays fp32.
    on_use: bool = False
    # O2's kept module: called on its own with no low-precision input
    # (parameter_casts.called_on_its_own), its output stays fp32, as every module
    # around it then computes in fp32.
    bare_fp32: bool = False
    # The root's output cast skips a low-precision output the model's own loss read in
    # fp32 (ConversionConfig.outputs_read_by_loss_as_computed).
    loss_read_as_computed: bool = False
    # Device type -> key of the region's policy for regions.enter_in_graph (made
    # when the boundary is installed, for the module's device: compiled code enters
    # the region through it); a missing or None key: entered as an ampkit.autocast.
    graph_keys: dict[str, int | None] = dataclasses.field(default_factory=dict)

    def _listed_policy(self) -> Policy | None:
        """The region's policy where it has lists (an ampkit region, not torch.autocast)."""
        if self.region is Region.POLICY:
            policy = self.policy
        elif self.region is Region.LOW:
            policy = ALL_LOW_PRECISION
        else:
            return None
        return None if policy is None or policy.is_native else policy

    def prepare_graph_region(self, device_type: str) -> None:
        """Make the key compiled code enters this region's policy with on ``device_type``."""
        policy = self._listed_policy()
        if policy is not None and device_type not in self.graph_keys:
            self.graph_keys[device_type] = in_graph_key(device_type, policy)

    # The keys index this process's table of regions: a pickled (or copied) boundary
    # carries the device types and makes its keys again where it is loaded.
    def __getstate__(self) -> dict[str, Any]:
        state = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        state["graph_keys"] = list(self.graph_keys)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        devices = state.pop("graph_keys", [])
        for name, value in state.items():
            object.__setattr__(self, name, value)
        self.graph_keys = {}
        for device_type in devices:
            self.prepare_graph_region(device_type)

    def _contexts(self, device_type: str) -> list[Any]:
        if self.region is Region.UNCHANGED:
            return []
        if self.region is Region.FP32:
            # Nothing to switch off when no autocast is on (O3, outside regions).
            if torch.is_autocast_enabled(device_type):
                return [region_autocast(device_type, None, None)]
            return []
        policy = self.policy if self.region is Region.POLICY else ALL_LOW_PRECISION
        return [region_autocast(device_type, self.compute_dtype, policy)]

    def _low_input(self, module: nn.Module, device_type: str, args: Any) -> bool:
        """A kept norm that takes its low-precision input as it is."""
        return (self.region is Region.FP32 and self.output_dtype in _LOW
                and takes_low_input(module, device_type, self.module_type)
                and low_contiguous(args, self.output_dtype))

    def enter(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
              cast_inputs: bool = True
              ) -> tuple[list[Any], int, tuple[Any, ...], dict[str, Any]]:
        """Eager: enter the boundary (all or nothing); ``(entered contexts, swap depth,
        args, kwargs)`` for :meth:`leave` and the call. ``cast_inputs=False``: the
        region (and, for the root, the forward pass) only, for a method of the model
        other than its call (:data:`ampkit.conversion.classes.ENTRY_METHODS`), whose
        calls of the model cast their own inputs."""
        if not self.root and self.region is Region.FP32 and torch_internals.fsdp_managed(module):
            _check_gathered_fp32(module)
        swaps = swap_depth()
        device_type = compute_device_type(module, (args, kwargs))
        entered: list[Any] = []
        if self.root:
            # A forward of the model begins: the copies of its parameters live until
            # the outermost one ends (leave, which the except below reaches too).
            new_forward_pass()
        elif self.bare_fp32 and called_on_its_own(device_type, (args, kwargs)):
            marker = _OnItsOwn(module)
            marker.__enter__()
            entered.append(marker)
        try:
            for context in self._contexts(device_type):
                context.__enter__()
                entered.append(context)
            if self.input_dtype is not None and cast_inputs:
                if self.root and _has_backward_hooks(module):
                    # torch wraps a module's inputs for its full backward hooks after
                    # the pre-hooks, just before the forward: cast there, so that the
                    # hooks' grad_input are the gradients of the caller's tensors (as
                    # under native autocast, which casts inside the ops).
                    deferred = _CastInForward(self, module, entered)
                    deferred.__enter__()
                    entered.append(deferred)
                else:
                    args, kwargs = self._cast_inputs(module, device_type, args, kwargs,
                                                     entered)
        except BaseException:
            self.leave(entered, swaps)
            raise
        return entered, swaps, args, kwargs

    def _cast_inputs(self, module: nn.Module, device_type: str, args: tuple[Any, ...],
                     kwargs: dict[str, Any], entered: list[Any]
                     ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The input cast (and what it needs entered, appended to ``entered``)."""
        if self.input_dtype is None:
            return args, kwargs
        if self._low_input(module, device_type, (args, kwargs)):
            if issubclass(self.module_type or type(module), nn.LayerNorm):
                LOW_INPUT_LAYER_NORM.__enter__()  # type: ignore[no-untyped-call]
                entered.append(LOW_INPUT_LAYER_NORM)
        else:
            cast = cast_tree((args, kwargs), self.input_dtype)
            if (self.region is Region.FP32 and torch.is_grad_enabled()
                    and saved_tensor_hooks_free()):
                upcasts = {id(new): (new, old, torch_internals.tensor_version(new))
                           for old, new in zip(
                    iter_tensors((args, kwargs)), iter_tensors(cast))
                    if new is not old and old.dtype in _LOW}
                if upcasts:
                    hooks = SaveLowCopies(upcasts)
                    hooks.__enter__()
                    entered.append(hooks)
            if self.root and self.output_dtype is not None:
                # (for the output cast: an input handed back untouched is the
                # caller's tensor again)
                # (an inference tensor has no version counter: -1)
                _given.stack.append({id(new): (new, old, -1 if new.is_inference()
                                               else torch_internals.tensor_version(new))
                                     for old, new in zip(
                                         iter_tensors((args, kwargs)),
                                         iter_tensors(cast)) if new is not old})
                entered.append(_GIVEN)
            args, kwargs = cast
        return args, kwargs

    def leave(self, entered: list[Any], swaps: int) -> None:
        """Eager: put swapped parameters back and close the contexts, in that order,
        each step even when an earlier one raised."""
        try:
            restore_to(swaps)
        finally:
            if self.root:
                end_forward_pass()
            while entered:
                entered.pop().__exit__(None, None, None)

    def cast_output(self, module: nn.Module, args: Any, kwargs: dict[str, Any],
                    output: Any) -> Any:
        """A forward hook, the first of the module's: the output cast. A hook, so that
        forward hooks the user registered on the module see what it hands back.

        Only the floating tensors the level made in another precision are cast: a
        float64 output stays float64, as native autocast leaves it (it never computes
        in float64 with lower precision). The containers come back as the model built
        them (:mod:`ampkit.common.containers`: same types, no user code run again, an
        untouched one the same object). At the model's own boundary, an input the
        forward hands back, or a view of one, is the caller's tensor (a view of it), and
        an input the forward edited in place is refused (:func:`_refuse_edited_input`)."""
        if self.output_dtype is None or output is None or (
                self.on_use and not torch_internals.compiling_here() and not casting_on_use()):
            return None
        if self.bare_fp32 and _on_its_own.modules and _on_its_own.modules[-1] is module:
            return None
        given = _given.stack[-1] if self.root and _given.stack else None
        # The model's own loss already read these in fp32: handed back as computed, as
        # native does, rather than held a second time in fp32 through the backward.
        consumed = (upcast_inside(output) if self.loss_read_as_computed
                    and self.output_dtype is torch.float32 else set())

        def keep(t: torch.Tensor) -> bool:
            return bool(consumed) and (t.grad_fn, t.output_nr) in consumed

        if not given:
            return cast_tree(output, self.output_dtype,
                             lambda t: _not_double(t) and not keep(t))
        for new, old, version in given.values():
            # (an inference tensor has no version counter: its edits cannot be seen)
            if version >= 0 and torch_internals.tensor_version(new) != version:
                _refuse_edited_input(module, args, kwargs, new, old)
        dtype = self.output_dtype

        def cast(t: torch.Tensor) -> torch.Tensor:
            found = given.get(id(t))
            if found is not None and found[0] is t and found[2] >= 0:
                return found[1]  # the caller's own input, handed back untouched
            base = torch_internals.view_base(t)
            if base is not None:
                found = given.get(id(base))
                if found is not None and found[0] is base and found[2] >= 0:
                    return _same_view(t, base, found[1])
            if t.dtype is dtype or t.dtype is torch.float64 or keep(t):
                return t
            return t.to(dtype)

        return map_floating(output, cast)

    def call_traced(self, module: nn.Module, call: Any, args: tuple[Any, ...],
                     kwargs: dict[str, Any], cast_inputs: bool = True) -> Any:
        # Traced by dynamo (the module is called inside compiled code): only what it
        # traces, regions as ``with torch.autocast`` blocks. torch.compile of the model
        # itself runs the model's own call outside the graph (see converted_call), so
        # its region, whatever the policy, is in effect while the forward is traced.
        # A policy with lists enters its rules as two nodes of the graph around a
        # traced torch.autocast block (regions.enter_in_graph); one that
        # intercepts a composite through the Python mode cannot be entered by a graph:
        # an ampkit region, a graph break at its entry and exit.
        device_type = compute_device_type(module, (args, kwargs))
        if self.input_dtype is not None and cast_inputs and not (
                self._low_input(module, device_type, (args, kwargs))
                and not issubclass(self.module_type or type(module), nn.LayerNorm)):
            # (LayerNorm's low-input kernel is entered through a function mode, which
            # is not traced here: its input is cast, the forward is the same.)
            args, kwargs = cast_tree((args, kwargs), self.input_dtype)
        if self.region is Region.UNCHANGED:
            return call(*args, **kwargs)
        if self.region is Region.FP32:
            if not torch.is_autocast_enabled(device_type):
                return call(*args, **kwargs)
            with torch.autocast(device_type, enabled=False):
                return call(*args, **kwargs)
        policy = self.policy if self.region is Region.POLICY else ALL_LOW_PRECISION
        if policy is None or policy.is_native:
            with torch.autocast(device_type, self.compute_dtype):
                return call(*args, **kwargs)
        key = self.graph_keys.get(device_type)
        if key is not None:
            # The policy's lists as two nodes of the graph around the call, inside the
            # traced native region: no graph break (see regions.enter_in_graph).
            with torch.autocast(device_type, self.compute_dtype):
                enter_in_graph(key)
                try:
                    return call(*args, **kwargs)
                finally:
                    exit_in_graph(key)
        _region_outside_the_graph()  # a graph break, named (fullgraph=True: the error)
        with region_autocast(device_type, self.compute_dtype, policy):
            return call(*args, **kwargs)


@not_traced
def _region_outside_the_graph() -> None:
    """Where compiled code meets a converted module's region that a graph cannot enter:
    the graph breaks here, and ``fullgraph=True`` fails with the reason below."""


torch_internals.mark_dynamo_disabled(
    _region_outside_the_graph,
    "ampkit: a converted module's region, called inside compiled code, has a policy "
    "that intercepts a Python-level composite (an op with no dispatcher op, such as "
    "F.interpolate, on its lists, or an unlisted rule other than 'native', such as "
    "MindSpore O1's white-listed modules); compiled code cannot enter it, so the "
    "region runs outside the graph. Compile the model itself (torch.compile(model)) "
    "or leave that op off the lists to get one graph")


# The deferred input cast as Python, the forward it calls compiled (as converted_call).
skip_frame_only(_cast_then_forward.__code__)

for _eager in (Boundary.enter, Boundary.leave, Boundary.cast_output, Boundary._cast_inputs):
    # The boundary's eager bookkeeping and everything it calls: plain Python when
    # dynamo meets it as a frame of its own (the model's hooks, which torch.compile of
    # the model runs outside the graph); traced where compiled code calls it.
    skip_recursively(_eager.__code__)


def install_boundary(module: nn.Module, boundary: Boundary) -> None:
    """Give ``module`` its boundary: its converted class, the key its region is entered
    with in compiled code, and the output cast (the first of its forward hooks)."""
    give_boundary(module, boundary)
    boundary.prepare_graph_region(compute_device_type(module, ()))
    if boundary.output_dtype is not None:
        module.register_forward_hook(boundary.cast_output, prepend=True, with_kwargs=True)
