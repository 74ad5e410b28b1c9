"""Loading pickles that name a module path ampkit no longer has.

A pickle names each class and function it holds by module path. Modules of ampkit that
moved (``ampkit.master_weights_pure`` became ``ampkit.pure``; the core's flat files
became the ``common``, ``policies``, ``engine`` and ``conversion`` packages; the tools
went into rooms by concept) left no module behind at the old path, so ``pickle.load``
of an older pickle raises ``ModuleNotFoundError``. This module is the one place that
reads such pickles: its :class:`Unpickler` looks each old path up in
:data:`MOVED_MODULES` and loads the object from its home today. It is itself a pickle
module, so ``torch.load`` can use it: ``torch.load(f, pickle_module=unpickling,
weights_only=False)`` (an older pickle holds ampkit's classes, which ``weights_only``
refuses anyway).

Example:
    >>> import io, pickle
    >>> from ampkit.common import unpickling
    >>> from ampkit.policies.policy import Policy
    >>> old = pickle.dumps(Policy, protocol=2).replace(b"ampkit.policies.policy",
    ...                                                b"ampkit.policy")
    >>> unpickling.loads(old) is Policy
    True
    >>> unpickling.load(io.BytesIO(old)) is Policy
    True
"""

from __future__ import annotations

import io
import pickle
from typing import IO, Any

__all__ = ["MOVED_MODULES", "MOVED_NAMES", "Unpickler", "load", "loads"]

#: Every ampkit module path that existed in a release or on ``main`` and is gone, with
#: the module that holds its names today (the CHANGELOG's "Removed" lists them too).
MOVED_MODULES: dict[str, str] = {
    # the core's flat files, by layer
    "ampkit.arguments": "ampkit.common.arguments",
    "ampkit.containers": "ampkit.common.containers",
    "ampkit.module_selection": "ampkit.common.module_selection",
    "ampkit.device_support": "ampkit.common.device_support",
    "ampkit.compile_frames": "ampkit.common.compile_frames",
    "ampkit.step_hooks": "ampkit.common.step_hooks",
    "ampkit._text": "ampkit.common.text",
    "ampkit._lazy": "ampkit.common.lazy",
    "ampkit.registry": "ampkit.policies.registry",
    "ampkit.op_aliases": "ampkit.policies.op_names",
    "ampkit.policy": "ampkit.policies.policy",
    "ampkit.presets": "ampkit.policies.presets",
    "ampkit.autocast_mode": "ampkit.engine.regions",
    "ampkit.autocast_rules": "ampkit.engine.rules",
    "ampkit.autocast_kernels": "ampkit.engine.kernels",
    "ampkit.casting": "ampkit.engine.casting",
    "ampkit.function_patching": "ampkit.engine.function_patching",
    "ampkit.levels": "ampkit.conversion.levels",
    "ampkit.parameter_casts": "ampkit.conversion.parameter_casts",
    "ampkit.parameter_truth": "ampkit.conversion.parameter_truth",
    # renamed modules
    "ampkit.master_weights_pure": "ampkit.pure",
    "ampkit.scaling.multi_loss": "ampkit.scaling.loss_scaling",
    # the tools' flat files, now in rooms by concept
    "ampkit.tools._text": "ampkit.common.text",
    "ampkit.tools._tracing": "ampkit.tools.ops.tracing",
    "ampkit.tools.cast_traffic": "ampkit.tools.ops.cast_traffic",
    "ampkit.tools.list_usage": "ampkit.tools.ops.list_usage",
    "ampkit.tools.numerics_checker": "ampkit.tools.ops.numerics_checker",
    "ampkit.tools.op_stats": "ampkit.tools.ops.op_stats",
    "ampkit.tools.fp8_casts": "ampkit.tools.ops.fp8_casts",
    "ampkit.tools.fp8.casts": "ampkit.tools.ops.fp8_casts",
    "ampkit.tools.compare": "ampkit.tools.accuracy.compare",
    "ampkit.tools.compare_report": "ampkit.tools.accuracy.compare_report",
    "ampkit.tools.comparison": "ampkit.tools.accuracy.comparison",
    "ampkit.tools.tune": "ampkit.tools.accuracy.tune",
    "ampkit.tools.fp8_errors": "ampkit.tools.accuracy.fp8_errors",
    "ampkit.tools.fp8.errors": "ampkit.tools.accuracy.fp8_errors",
    "ampkit.tools.fp8_decisions": "ampkit.tools.fp8.decisions",
    "ampkit.tools.fp8_tune": "ampkit.tools.fp8.tune",
    "ampkit.tools.digits": "ampkit.tools.demo.digits",
    "ampkit.tools.pure_curves": "ampkit.tools.demo.pure_curves",
    "ampkit.tools.report": "ampkit.tools.demo.report",
    "ampkit.tools.plotting": "ampkit.tools.pages.plotting",
    "ampkit.tools.cli_args": "ampkit.tools.cli.args",
    "ampkit.tools.cli_compare": "ampkit.tools.cli.compare",
    "ampkit.tools.cli_target": "ampkit.tools.cli.target",
    "ampkit.tools.cli_tune": "ampkit.tools.cli.tune",
}

#: Names a pickle may hold that were renamed with their module: (old module, old name)
#: to (module, name). Pure optimizers pickled under ``ampkit.master_weights_pure`` name
#: its private rebuild function and state class.
MOVED_NAMES: dict[tuple[str, str], tuple[str, str]] = {
    ("ampkit.master_weights_pure", "_rebuild_pure"): ("ampkit.pure", "rebuild_pure"),
    ("ampkit.master_weights_pure", "_Pure"): ("ampkit.pure", "PureState"),
}


class Unpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that loads what an older pickle names at an old module path
    from its module today (:data:`MOVED_MODULES`, :data:`MOVED_NAMES`); every other
    name loads as ``pickle`` loads it.

    Example:
        >>> import io, pickle
        >>> from ampkit.common.unpickling import Unpickler
        >>> Unpickler(io.BytesIO(pickle.dumps([1, 2]))).load()
        [1, 2]
    """

    def find_class(self, module: str, name: str) -> Any:
        renamed = MOVED_NAMES.get((module, name))
        if renamed is not None:
            module, name = renamed
        else:
            module = MOVED_MODULES.get(module, module)
        return super().find_class(module, name)


def load(file: IO[bytes], **kwargs: Any) -> Any:
    """``pickle.load`` through :class:`Unpickler` (keywords as ``pickle.load``'s).

    Example:
        >>> import io, pickle
        >>> from ampkit.common.unpickling import load
        >>> load(io.BytesIO(pickle.dumps({"a": 1})))
        {'a': 1}
    """
    return Unpickler(file, **kwargs).load()


def loads(data: bytes, **kwargs: Any) -> Any:
    """``pickle.loads`` through :class:`Unpickler` (keywords as ``pickle.loads``').

    Example:
        >>> import pickle
        >>> from ampkit.common.unpickling import loads
        >>> loads(pickle.dumps((1, "x")))
        (1, 'x')
    """
    return load(io.BytesIO(data), **kwargs)
