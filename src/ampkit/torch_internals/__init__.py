"""ampkit's boundary with torch's internals: every private torch name ampkit uses and
every torch class it patches, each as an entry of :data:`ENTRIES`.

Each entry says what ampkit needs it for and the public API that replaces it where one
exists, and has a check that it is there *and behaves as ampkit expects*: what broke
between torch releases so far was behaviour (a flag whose meaning widened, an internal
renamed behind a surviving shim), never a missing name. The cheap checks run at
``import ampkit``; those that would import ``torch._dynamo`` (over a second) or compile
are ``lazy``: the test suite runs them, and the checkpoint carry proves its own at its
first installation. ``tests/project/test_torch_internals.py`` runs every check, so a new
torch release says in one place what moved.

An entry this torch lacks, or whose import-time check fails, does not stop
``import ampkit``: the entry is disabled (one RuntimeWarning names it), its accessors
become :class:`Unavailable` stand-ins or public fallbacks, and the feature that needs it
raises :class:`TorchInternalsError` when used, naming torch's version, the entry and the
public alternative. Everything else (autocast without custom lists, GradScaler, the
dialects' regions) keeps working. :func:`unavailable` lists what was disabled.

Example:
    >>> from ampkit import torch_internals
    >>> "compile_session" in torch_internals.ENTRIES
    True
    >>> torch_internals.compiling()
    False
"""

import sys

from ampkit.torch_internals.autograd import (
    at_backward_end,
    graph_task_id,
    replace_clip_grads_with_norm,
)
from ampkit.torch_internals.dispatch import (
    DisableTorchFunction as DisableTorchFunction,
)
from ampkit.torch_internals.dispatch import (
    ExcludeKeys as ExcludeKeys,
)
from ampkit.torch_internals.dispatch import (
    OpOverload,
    OpOverloadPacket,
    TorchDispatchMode,
    current_autograd_node,
    disable_current_modes,
    disabled_torch_function_impl,
    has_kernel,
    lazy_check_dispatch_mode,
    local_shape_and_offset,
    native_kernel,
    op_object_qualname,
    redispatch_keysets,
    registrations,
    saved_tensors_hooks_free,
    schema_exists,
    schemas_of,
    tree_leaves,
    tree_map,
)
from ampkit.torch_internals.dynamo import (
    after_compile,
    dynamo_loaded,
    in_graph,
    install_compile_hooks,
    skip_code,
)
from ampkit.torch_internals.entries import (
    ENTRIES,
    Entry,
    TorchInternalsError,
    Unavailable,
    available,
    check,
    disable_broken,
    fail,
    unavailable,
)
from ampkit.torch_internals.modules import (
    BatchNormBase,
    InstanceNormBase,
    NormBase,
    global_backward_hooks,
    global_backward_pre_hooks,
    global_forward_hooks,
    global_forward_pre_hooks,
    make_wrapper_subclass,
)
from ampkit.torch_internals.objects import (
    STEP_SUPPORTS_AMP_SCALING,
    amp_foreach_non_finite_check_and_unscale_,
    amp_update_scale_,
    backward_hooks,
    backward_pre_hooks,
    compiled_call_impl,
    convolution,
    destroy_library,
    foreach_add_,
    foreach_copy_,
    foreach_max,
    forward_hooks,
    forward_pre_hooks,
    fsdp_managed,
    init_flat_weights,
    is_view,
    mark_dynamo_disabled,
    mark_optimizer_called,
    mark_wrapped_by_lr_scheduler,
    module_buffers,
    module_parameters,
    nn_builtins,
    op_builtin,
    op_schema,
    register_state_dict_hook,
    scaled_mm,
    set_state_parameters,
    set_step_supports_amp_scaling,
    sparse_values,
    state_parameters,
    step_supports_amp_scaling,
    tensor_version,
    view_base,
    wrapped_by_lr_scheduler,
)
from ampkit.torch_internals.simulation import fake_tensor_mode, is_fake
from ampkit.torch_internals.tracing import (
    check_compile_session_in_a_backend,
    compiling,
    compiling_here,
    install_checkpoint_carry,
)

__all__ = ["BatchNormBase", "ENTRIES", "Entry", "InstanceNormBase", "NormBase", "OpOverload",
           "OpOverloadPacket", "STEP_SUPPORTS_AMP_SCALING", "TorchDispatchMode",
           "TorchInternalsError", "Unavailable", "after_compile",
           "amp_foreach_non_finite_check_and_unscale_", "amp_update_scale_", "at_backward_end",
           "available", "backward_hooks", "backward_pre_hooks", "check",
           "check_compile_session_in_a_backend", "compiled_call_impl", "compiling",
           "compiling_here",
           "convolution",
           "current_autograd_node", "destroy_library", "disable_current_modes",
           "disabled_torch_function_impl", "dynamo_loaded", "fail", "fake_tensor_mode",
           "foreach_add_", "foreach_copy_", "foreach_max", "forward_hooks", "forward_pre_hooks",
           "fsdp_managed", "global_backward_hooks", "global_backward_pre_hooks",
           "global_forward_hooks", "global_forward_pre_hooks", "graph_task_id", "has_kernel",
           "in_graph", "init_flat_weights", "install_checkpoint_carry", "install_compile_hooks",
           "is_fake", "is_view", "lazy_check_dispatch_mode", "local_shape_and_offset",
           "make_wrapper_subclass", "mark_dynamo_disabled", "mark_optimizer_called",
           "mark_wrapped_by_lr_scheduler", "module_buffers", "module_parameters", "native_kernel",
           "nn_builtins", "op_builtin", "op_object_qualname", "op_schema", "redispatch_keysets",
           "register_state_dict_hook", "registrations", "replace_clip_grads_with_norm",
           "saved_tensors_hooks_free", "scaled_mm",
           "schema_exists", "schemas_of", "set_state_parameters",
           "set_step_supports_amp_scaling", "skip_code", "sparse_values", "state_parameters",
           "step_supports_amp_scaling", "tensor_version", "tree_leaves",
           "tree_map", "unavailable", "view_base", "wrapped_by_lr_scheduler"]

# The cheap checks, now: an entry a torch lacks or that behaves otherwise is disabled
# (a RuntimeWarning names it), so a moved internal costs the feature that needs it, not
# ``import ampkit``. The rest (they import torch._dynamo or compile) at first use and in
# tests/project/test_torch_internals.py.
# (ExcludeKeys and DisableTorchFunction, torch's C classes, are attributes of this
# package but not in __all__: the reference documents torch's objects as torch's.)
disable_broken(sys.modules[__name__])
