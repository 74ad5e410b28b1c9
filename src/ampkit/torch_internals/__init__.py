"""ampkit's boundary with torch's internals: every private torch name ampkit uses and
every torch class it patches, each as an entry of :data:`ENTRIES`.

Each entry says what ampkit needs it for and the public API that replaces it where one
exists, and has a check that it is there *and behaves as ampkit expects*: what broke
between torch releases so far was behaviour (a flag whose meaning widened, an internal
renamed behind a surviving shim), never a missing name. The cheap checks run at
``import ampkit``; those that would import ``torch._dynamo`` (over a second) or compile
are ``lazy``: the test suite runs them, and the checkpoint carry proves its own at its
first installation. A failed check raises :class:`TorchInternalsError`, naming the torch
version and the entry. ``tests/project/test_torch_internals.py`` runs every check, so a new torch
release says in one place what moved.

Example:
    >>> from ampkit import torch_internals
    >>> "compile_session" in torch_internals.ENTRIES
    True
    >>> torch_internals.compiling()
    False
"""

from ampkit.torch_internals.autograd import at_backward_end, graph_task_id
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
from ampkit.torch_internals.entries import ENTRIES, Entry, TorchInternalsError, check, fail
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
from ampkit.torch_internals.tracing import (
    check_compile_session_in_a_backend,
    compiling,
    install_checkpoint_carry,
)

__all__ = ["BatchNormBase", "ENTRIES", "Entry", "InstanceNormBase", "NormBase", "OpOverload",
           "OpOverloadPacket", "TorchDispatchMode", "TorchInternalsError", "after_compile",
           "at_backward_end", "graph_task_id",
           "check", "check_compile_session_in_a_backend", "compiling", "current_autograd_node",
           "disable_current_modes", "disabled_torch_function_impl", "dynamo_loaded", "fail",
           "global_backward_hooks", "global_backward_pre_hooks", "global_forward_hooks",
           "global_forward_pre_hooks", "has_kernel", "in_graph", "install_checkpoint_carry",
           "install_compile_hooks", "lazy_check_dispatch_mode", "local_shape_and_offset",
           "make_wrapper_subclass", "native_kernel", "op_object_qualname", "redispatch_keysets",
           "registrations", "saved_tensors_hooks_free", "schema_exists", "schemas_of", "skip_code",
           "tree_leaves", "tree_map"]

# The cheap checks, now: a torch whose internals moved says so at import, naming itself
# and the entry. The rest (they import torch._dynamo or compile) at first use and in
# tests/project/test_torch_internals.py.
# (ExcludeKeys and DisableTorchFunction, torch's C classes, are attributes of this
# package but not in __all__: the reference documents torch's objects as torch's.)
for _entry in ENTRIES.values():
    if not _entry.lazy:
        _entry.check()
del _entry
