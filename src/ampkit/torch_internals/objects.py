"""Private state of torch objects and torch's private ops: a module's parameter, buffer
and hook tables, a tensor's version counter, an op object's schema, the optimizer flags
LR schedulers and loss scalers share, dynamo's disable flags, and the amp, multi-tensor,
fp8 and convolution ops torch exposes under private names (see
:mod:`ampkit.torch_internals`).

Plain attribute reads are one-line Python functions, not ``operator.attrgetter``
objects: a converted module's forward reads them inside ``torch.compile``'s traces, and
dynamo traces a Python function but not an ``attrgetter`` call.

Example:
    >>> import torch
    >>> from ampkit.torch_internals.objects import module_parameters, tensor_version
    >>> lin = torch.nn.Linear(2, 2)
    >>> module_parameters(lin)["weight"] is lin.weight
    True
    >>> t = torch.zeros(1)
    >>> before = tensor_version(t)
    >>> _ = t.add_(1)
    >>> tensor_version(t) - before
    1
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from ampkit.torch_internals.entries import fail, register_entry, resolve

__all__ = ["STEP_SUPPORTS_AMP_SCALING", "amp_foreach_non_finite_check_and_unscale_",
           "amp_update_scale_", "backward_hooks", "backward_pre_hooks", "compiled_call_impl",
           "convolution", "destroy_library", "foreach_add_", "foreach_copy_", "foreach_max",
           "forward_hooks", "forward_pre_hooks", "fsdp_managed", "init_flat_weights", "is_view",
           "mark_dynamo_disabled", "mark_optimizer_called", "mark_wrapped_by_lr_scheduler",
           "module_buffers", "module_parameters", "nn_builtins", "set_state_parameters",
           "state_parameters", "op_builtin", "op_schema",
           "register_state_dict_hook", "scaled_mm", "set_step_supports_amp_scaling",
           "sparse_values", "step_supports_amp_scaling", "tensor_version", "view_base",
           "wrapped_by_lr_scheduler"]

# -- a module's tables ---------------------------------------------------------------------

_Table = dict[str, torch.Tensor | None]

def module_parameters(module: nn.Module) -> _Table:
    """``module._parameters``: the module's own parameters by name (the live dict torch
    reads; ampkit puts low-precision tensors there for a forward)."""
    table: Any = module._parameters
    return table  # type: ignore[no-any-return]


def state_parameters(state: dict[str, Any]) -> _Table | None:
    """The ``_parameters`` table in ``state``, a module's ``__getstate__`` (what
    ``copy.deepcopy`` and pickling copy), or ``None`` where it has none."""
    table = state.get("_parameters")
    return table if isinstance(table, dict) else None


def set_state_parameters(state: dict[str, Any], table: _Table) -> None:
    """Make ``table`` the ``_parameters`` of the module that ``state`` rebuilds."""
    state["_parameters"] = table


def module_buffers(module: nn.Module) -> _Table:
    """``module._buffers``: the module's own buffers by name (the live dict)."""
    return module._buffers


def forward_pre_hooks(module: nn.Module) -> dict[int, Any]:
    """``module._forward_pre_hooks``: the module's forward pre-hooks by handle id."""
    return module._forward_pre_hooks


def forward_hooks(module: nn.Module) -> dict[int, Any]:
    """``module._forward_hooks``: the module's forward hooks by handle id."""
    return module._forward_hooks


def backward_hooks(module: nn.Module) -> dict[int, Any]:
    """``module._backward_hooks``: the module's full backward hooks."""
    return module._backward_hooks


def backward_pre_hooks(module: nn.Module) -> dict[int, Any]:
    """``module._backward_pre_hooks``: the module's full backward pre-hooks."""
    return module._backward_pre_hooks


def compiled_call_impl(module: nn.Module) -> Any:
    """``module._compiled_call_impl``: set by ``module.compile()``, else ``None``."""
    return module._compiled_call_impl




def register_state_dict_hook(module: nn.Module, hook: Callable[..., Any]) -> Any:
    """``module._register_state_dict_hook(hook)``: a hook that may return the state dict
    (the public ``register_state_dict_post_hook`` must not replace it); the handle.

    Example:
        >>> import torch
        >>> from ampkit.torch_internals import objects
        >>> handle = objects.register_state_dict_hook(torch.nn.Linear(1, 1), lambda *a: None)
        >>> handle.remove()
    """
    return module._register_state_dict_hook(hook)


def init_flat_weights(module: nn.Module) -> None:
    """``rnn._init_flat_weights()``: an RNN re-reads its flat weight list from its
    parameters (after they were replaced).

    Example:
        >>> import torch
        >>> from ampkit.torch_internals import objects
        >>> objects.init_flat_weights(torch.nn.LSTM(2, 2))
    """
    module._init_flat_weights()  # type: ignore[operator]


def fsdp_managed(module: nn.Module) -> bool:
    """Whether FSDP (the first, wrapper API) manages ``module``: the flag its
    ``_is_fsdp_managed_module`` attribute sets; False where it is not there.

    Example:
        >>> import torch
        >>> from ampkit.torch_internals import objects
        >>> objects.fsdp_managed(torch.nn.Linear(1, 1))
        False
    """
    return bool(getattr(module, "_is_fsdp_managed_module", False))


@register_entry("module_state", ("torch.nn.Module._parameters", "torch.nn.Module._buffers",
                                 "torch.nn.Module._forward_pre_hooks",
                                 "torch.nn.Module._forward_hooks",
                                 "torch.nn.Module._backward_hooks",
                                 "torch.nn.Module._backward_pre_hooks",
                                 "torch.nn.Module._compiled_call_impl",
                                 "torch.nn.Module._register_state_dict_hook",
                                 "torch.nn.RNNBase._init_flat_weights",
                                 "torch.nn.Module._is_fsdp_managed_module"),
                "the levels swap a module's parameters for their low-precision copies in "
                "the dict torch reads (no copy kept behind torch's back), register buffers "
                "in place, order their hooks before the user's, take nn.Module's ordinary "
                "call where any hook or compile() needs it, and re-read an RNN's flat "
                "weights after a swap",
                "named_parameters()/named_buffers()/register_*_hook read or add, but do "
                "not replace an entry in place or put a hook first; "
                "register_state_dict_post_hook must not return a new state dict",
                provides=("module_parameters", "state_parameters",
                          "set_state_parameters", "module_buffers", "forward_pre_hooks",
                          "forward_hooks", "backward_hooks", "backward_pre_hooks",
                          "compiled_call_impl", "register_state_dict_hook",
                          "init_flat_weights", "fsdp_managed"))
def _check_module_state() -> None:
    lin, norm, rnn = nn.Linear(1, 1), nn.BatchNorm1d(1), nn.LSTM(1, 1)
    if module_parameters(lin).get("weight") is not lin.weight or \
            module_buffers(norm).get("running_mean") is not norm.running_mean:
        raise fail("module_state", "no longer holds a module's parameters/buffers by name")
    tables = ((lin.register_forward_pre_hook, forward_pre_hooks),
              (lin.register_forward_hook, forward_hooks),
              (lin.register_full_backward_hook, backward_hooks),
              (lin.register_full_backward_pre_hook, backward_pre_hooks))
    for register, table in tables:
        handle = register(lambda *a: None)
        try:
            if handle.id not in table(lin):
                raise fail("module_state", f"keeps no {register.__name__} hooks where "
                           f"ampkit reads them")
        finally:
            handle.remove()
    if compiled_call_impl(lin) is not None:
        raise fail("module_state", "reports a compiled call for a plain module")
    seen: list[bool] = []
    handle = register_state_dict_hook(lin, lambda *a: seen.append(True))
    lin.state_dict()
    handle.remove()
    if seen != [True]:
        raise fail("module_state", "does not call a state-dict hook from state_dict()")
    init_flat_weights(rnn)


# -- a tensor's state ----------------------------------------------------------------------

def tensor_version(tensor: torch.Tensor) -> int:
    """``tensor._version``: bumped by every in-place change."""
    return tensor._version


def is_view(tensor: torch.Tensor) -> bool:
    """``tensor._is_view()``: whether the tensor is a view of another."""
    return tensor._is_view()


def view_base(tensor: torch.Tensor) -> torch.Tensor | None:
    """``tensor._base``: the tensor a view was made from (``None`` for one that is not a
    view)."""
    return tensor._base


def sparse_values(tensor: torch.Tensor) -> torch.Tensor:
    """``sparse._values()``: a sparse COO tensor's values, coalesced or not."""
    return tensor._values()




@register_entry("tensor_state", ("torch.Tensor._version", "torch.Tensor._is_view",
                                 "torch.Tensor._base", "torch.Tensor._values"),
                "tell whether a cast copy is still current (a parameter changed in place "
                "since) without comparing data; leave views alone; find the input a "
                "returned view was taken from; check a sparse gradient's values for "
                "overflow",
                "none for the version counter (torch.autograd's saved-tensor check uses "
                "it); tensor._base is not None for a view (also private); "
                "tensor.values() for a coalesced sparse tensor only",
                provides=("tensor_version", "is_view", "view_base", "sparse_values"))
def _check_tensor_state() -> None:
    t = torch.zeros(2)
    before = tensor_version(t)
    t.add_(1)
    if tensor_version(t) != before + 1:
        raise fail("tensor_state", "does not count an in-place change")
    if not is_view(t[:1]) or is_view(t):
        raise fail("tensor_state", "tells views otherwise")
    if view_base(t[:1][0:]) is not t or view_base(t) is not None:
        raise fail("tensor_state", "gives a view's base otherwise")
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 0]]), torch.tensor([1.0, 2.0]), (2,),
                                     check_invariants=True)
    if sparse_values(sparse).tolist() != [1.0, 2.0]:
        raise fail("tensor_state", "gives an uncoalesced sparse tensor's values otherwise")


# -- op objects ----------------------------------------------------------------------------

def op_schema(op: Any) -> Any:
    """``op._schema``: an ``OpOverload``'s schema."""
    return op._schema


def op_builtin(op: Any) -> Callable[..., Any]:
    """``op._op``: the bound builtin an ``OpOverload`` calls, without its Python frame."""
    call: Callable[..., Any] = op._op
    return call




def destroy_library(library: Any) -> None:
    """``library._destroy()``: remove every kernel a ``torch.library.Library`` registered
    (torch does it when the library is collected; ampkit's kernels are replaced at once).

    Example:
        >>> from ampkit.torch_internals import objects
        >>> callable(objects.destroy_library)
        True
    """
    library._destroy()


@register_entry("op_details", ("torch._ops.OpOverload._schema", "torch._ops.OpOverload._op",
                               "torch.library.Library._destroy"),
                "read an op's arguments (the tools' per-op counts, the policy's view "
                "check); call an op without OpOverload.__call__'s frame in ampkit's "
                "kernels; unregister ampkit's kernels when a policy is replaced",
                "none: OpOverload has no public schema or call without a frame; a "
                "Library is unregistered only when collected",
                provides=("op_schema", "op_builtin", "destroy_library"))
def _check_op_details() -> None:
    mm = torch.ops.aten.mm.default
    if str(op_schema(mm).name) != "aten::mm":
        raise fail("op_details", "has no schema named aten::mm on aten.mm.default")
    one = torch.ones(1, 1)
    if not torch.equal(op_builtin(mm)(one, one), one):
        raise fail("op_details", "calls aten.mm's builtin otherwise")
    if not callable(getattr(torch.library.Library, "_destroy", None)):
        raise fail("op_details", "has no Library._destroy")


# -- private ops ---------------------------------------------------------------------------

_ops: Any = torch  # the private ops are not all in torch's stubs
#: ``torch._amp_update_scale_``: the loss scale's growth/backoff in one kernel
amp_update_scale_: Callable[..., Any] = resolve("private_ops", "amp_update_scale_",
                                                lambda: _ops._amp_update_scale_)
#: ``torch._amp_foreach_non_finite_check_and_unscale_``: unscale gradients, flag inf/nan
amp_foreach_non_finite_check_and_unscale_: Callable[..., Any] = resolve(
    "private_ops", "amp_foreach_non_finite_check_and_unscale_",
    lambda: _ops._amp_foreach_non_finite_check_and_unscale_)
#: ``torch._foreach_copy_``: copy lists of tensors in one multi-tensor call
foreach_copy_: Callable[..., Any] = resolve("private_ops", "foreach_copy_",
                                            lambda: _ops._foreach_copy_)
#: ``torch._foreach_add_``: add in place over lists of tensors
foreach_add_: Callable[..., Any] = resolve("private_ops", "foreach_add_",
                                           lambda: _ops._foreach_add_)
#: ``torch._foreach_max``: each tensor's maximum
foreach_max: Callable[..., Any] = resolve("private_ops", "foreach_max",
                                          lambda: _ops._foreach_max)
#: ``torch._scaled_mm``: the fp8 matrix product with scales
scaled_mm: Callable[..., Any] = resolve("private_ops", "scaled_mm", lambda: _ops._scaled_mm)
#: ``torch._convolution``: the convolution op every conv module reaches
convolution: Callable[..., Any] = resolve("private_ops", "convolution",
                                          lambda: _ops._convolution)
#: ``torch._C._nn``: the builtins behind ``torch.nn.functional``
nn_builtins: Any = resolve("private_ops", "nn_builtins", lambda: _ops._C._nn)


@register_entry("private_ops", ("torch._amp_update_scale_",
                                "torch._amp_foreach_non_finite_check_and_unscale_",
                                "torch._foreach_copy_", "torch._foreach_add_",
                                "torch._foreach_max", "torch._scaled_mm",
                                "torch._convolution", "torch._C._nn"),
                "the loss scaler updates its scale and unscales gradients with the kernels "
                "torch's GradScaler uses; the pure step copies and rounds with multi-tensor "
                "ops; fp8 Linears multiply with scales; the op registry names the ops "
                "behind torch.nn.functional and convolutions",
                "none: torch.amp.GradScaler and torch.optim use these ops themselves and "
                "publish no other entry point (fp8: torchao's float8 calls _scaled_mm too)",
                provides=("amp_update_scale_", "amp_foreach_non_finite_check_and_unscale_",
                          "foreach_copy_", "foreach_add_", "foreach_max", "scaled_mm",
                          "convolution", "nn_builtins"))
def _check_private_ops() -> None:
    scale, tracker = torch.full((1,), 4.0), torch.zeros(1, dtype=torch.int32)
    amp_update_scale_(scale, tracker, torch.ones(1), 2.0, 0.5, 2)
    if scale.item() != 2.0 or tracker.item() != 0:
        raise fail("private_ops", "backs the scale off otherwise after an overflow")
    grads, found = [torch.tensor([2.0]), torch.tensor([float("inf")])], torch.zeros(1)
    amp_foreach_non_finite_check_and_unscale_(grads, found, torch.full((1,), 0.5))
    if found.item() != 1.0 or grads[0].item() != 1.0:
        raise fail("private_ops", "unscales or flags non-finite gradients otherwise")
    a, b = [torch.zeros(2)], [torch.ones(2)]
    foreach_copy_(a, b)
    foreach_add_(a, b)
    if a[0].tolist() != [2.0, 2.0] or foreach_max(a)[0].item() != 2.0:
        raise fail("private_ops", "computes the multi-tensor ops otherwise")
    if not (callable(scaled_mm) and callable(convolution)
            and callable(getattr(nn_builtins, "linear", None))):
        raise fail("private_ops", "lacks _scaled_mm, _convolution or _C._nn.linear")


# -- flags torch's optimizers, LR schedulers and loss scalers share ----------------------

#: the flag's attribute name, for an optimizer's pickled state (``__getstate__``)
STEP_SUPPORTS_AMP_SCALING = "_step_supports_amp_scaling"


def step_supports_amp_scaling(optimizer: Any) -> bool:
    """Whether ``optimizer`` (or its class) says its ``step`` takes a loss scaler's
    ``grad_scale``/``found_inf`` itself (torch's ``_step_supports_amp_scaling``).

    Example:
        >>> import torch
        >>> from ampkit.torch_internals import objects
        >>> objects.step_supports_amp_scaling(torch.optim.SGD([torch.zeros(1)]))
        False
    """
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def set_step_supports_amp_scaling(target: Any, value: bool) -> None:
    """Set ``_step_supports_amp_scaling`` on an optimizer or optimizer class ``target``
    (loss scalers, torch's included, read it).

    Example:
        >>> import torch
        >>> from ampkit.torch_internals import objects
        >>> opt = torch.optim.SGD([torch.zeros(1)])
        >>> objects.set_step_supports_amp_scaling(opt, True)
        >>> objects.step_supports_amp_scaling(opt)
        True
    """
    target._step_supports_amp_scaling = value


def mark_optimizer_called(optimizer: Any) -> None:
    """Set the flag an LR scheduler's wrapped ``step`` sets (``_opt_called``), so the
    scheduler does not warn that ``scheduler.step()`` came first.

    Example:
        >>> import torch
        >>> from ampkit.torch_internals import objects
        >>> objects.mark_optimizer_called(torch.optim.SGD([torch.zeros(1)]))
    """
    optimizer._opt_called = True


def wrapped_by_lr_scheduler(step: Any) -> bool:
    """Whether ``step`` is an LR scheduler's wrapper of an optimizer's step.

    Example:
        >>> import torch
        >>> from ampkit.torch_internals import objects
        >>> objects.wrapped_by_lr_scheduler(torch.optim.SGD([torch.zeros(1)]).step)
        False
    """
    return bool(getattr(step, "_wrapped_by_lr_sched", False))


def mark_wrapped_by_lr_scheduler(step: Any) -> None:
    """Mark ``step`` as an LR scheduler's wrapper (schedulers then do not wrap it again).

    Example:
        >>> from ampkit.torch_internals import objects
        >>> def step() -> None: ...
        >>> objects.mark_wrapped_by_lr_scheduler(step)
        >>> objects.wrapped_by_lr_scheduler(step)
        True
    """
    step._wrapped_by_lr_sched = True


@register_entry("optimizer_flags", ("torch.optim.Optimizer._step_supports_amp_scaling",
                                    "torch.optim.Optimizer._opt_called",
                                    "torch.optim.lr_scheduler._wrapped_by_lr_sched"),
                "ampkit's and torch's loss scalers agree on which optimizers unscale in "
                "their own step; a step ampkit replaces keeps LR schedulers' order check",
                "none: the flags are the protocol torch's GradScaler and LRScheduler read",
                lazy=True,  # building an optimizer imports torch._dynamo (over a second)
                provides=("step_supports_amp_scaling", "set_step_supports_amp_scaling",
                          "STEP_SUPPORTS_AMP_SCALING",
                          "mark_optimizer_called", "wrapped_by_lr_scheduler",
                          "mark_wrapped_by_lr_scheduler"))
def _check_optimizer_flags() -> None:
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    if not wrapped_by_lr_scheduler(opt.step):
        raise fail("optimizer_flags", "no longer marks a scheduler's wrapped step")
    opt.step()
    if getattr(opt, "_opt_called", None) is not True:
        raise fail("optimizer_flags", "no longer flags an optimizer step a scheduler saw")
    reads = torch.amp.GradScaler.step.__code__.co_consts
    if "_step_supports_amp_scaling" not in reads:
        raise fail("optimizer_flags", "GradScaler.step no longer reads "
                   "_step_supports_amp_scaling")


# -- dynamo's disable flags --------------------------------------------------------------

def mark_dynamo_disabled(fn: Any, message: str | None = None) -> None:
    """Mark ``fn`` as dynamo marks what ``torch.compiler.disable`` returns
    (``_torchdynamo_disable``), or only give the reason a graph break there names
    (``_torchdynamo_disable_msg``), without importing torch._dynamo.

    Example:
        >>> from ampkit.torch_internals import objects
        >>> def f() -> None: ...
        >>> objects.mark_dynamo_disabled(f)
    """
    if message is None:
        fn._torchdynamo_disable = True
    else:
        fn._torchdynamo_disable_msg = message


@register_entry("dynamo_flags", ("torch._dynamo.eval_frame._torchdynamo_disable",
                                 "torch._dynamo.eval_frame._torchdynamo_disable_msg"),
                "code kept out of traces says so as torch.compiler.disable's does, and a "
                "graph break at a converted module's region names its reason",
                "torch.compiler.disable(fn, reason=...), which imports torch._dynamo "
                "(over a second) at import ampkit", lazy=True,
                provides=("mark_dynamo_disabled",))
def _check_dynamo_flags() -> None:
    disabled = torch.compiler.disable(lambda: None, reason="why")
    if getattr(disabled, "_torchdynamo_disable", None) is not True or \
            getattr(disabled, "_torchdynamo_disable_msg", None) != "why":
        raise fail("dynamo_flags", "are not what torch.compiler.disable sets")
