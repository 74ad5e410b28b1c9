"""fp8 training for linear layers (``nn.Linear``, transformers ``Conv1D``), through
torchao, as part of a precision level.

``ampkit.initialize(model, optimizer, level="O2", dtype=torch.bfloat16,
fp8="tensorwise")`` trains the eligible linear layers (``nn.Linear``, with torchao's
``Float8Linear``, and Hugging Face's ``Conv1D``, with :mod:`ampkit.fp8.conv1d`'s
``Float8Conv1D`` on the same torchao matmul; all three matmuls, forward and both
gradients, in ``torch._scaled_mm``), while everything else follows the level. It warns
(:class:`Fp8SkipWarning`) with the count when it leaves layers out, and a request that
would convert no layer is a ``ValueError`` with the table of why. One concept a
module:

* :mod:`ampkit.fp8.recipe`: the ``fp8=`` value (:func:`parse_fp8`, the recipe names,
  the torchao import and its ``ImportError`` naming ``ampkit[fp8]``);
* :mod:`ampkit.fp8.selection`: which layers go to fp8 and why the others do not;
* :mod:`ampkit.fp8.convert`: the swap, and how it composes with O2's parameters;
* :mod:`ampkit.fp8.conv1d`: Hugging Face's ``Conv1D`` in fp8, in its own layout;
* :mod:`ampkit.fp8.linear`: torchao's ``Float8Linear`` as ampkit converts it, which
  (as ``Float8Conv1D``) also evaluates under ``torch.inference_mode()``.

Importing this package does not import torchao.

Example:
    >>> import torch
    >>> import ampkit
    >>> net = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)])
    >>> opt = torch.optim.AdamW(net.parameters())
    >>> net, opt = ampkit.initialize(net, opt, level="O2", dtype=torch.bfloat16,
    ...                              fp8="tensorwise")
    >>> ampkit.fp8.get_fp8_plan(net).converted
    ('1', '2')
"""

from ampkit.fp8.convert import (
    FP8_OPTIONS,
    Fp8Plan,
    Fp8SkipWarning,
    apply_fp8,
    check_fp8_converts,
    check_fp8_level,
    check_fp8_options,
    fp8_layers,
    fp8_skip_message,
    get_fp8_plan,
    prepare_fp8,
)
from ampkit.fp8.recipe import (
    FP8_EXTRA,
    FP8_RECIPES,
    TORCHAO_TESTED,
    float8_linear_config,
    parse_fp8,
    recipe_name,
    require_torchao,
)
from ampkit.fp8.selection import FP8_DIM_MULTIPLE, Fp8Layer, select_fp8_layers

__all__ = [
    "FP8_DIM_MULTIPLE",
    "FP8_EXTRA",
    "FP8_OPTIONS",
    "FP8_RECIPES",
    "TORCHAO_TESTED",
    "Fp8Layer",
    "Fp8Plan",
    "Fp8SkipWarning",
    "apply_fp8",
    "check_fp8_converts",
    "check_fp8_level",
    "check_fp8_options",
    "float8_linear_config",
    "fp8_layers",
    "fp8_skip_message",
    "get_fp8_plan",
    "parse_fp8",
    "prepare_fp8",
    "recipe_name",
    "require_torchao",
    "select_fp8_layers",
]
