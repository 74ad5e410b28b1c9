"""Swapping the selected Linears for torchao's ``Float8Linear``, inside ``initialize``.

How fp8 composes with the level: the parameters stay the truth in fp32, as at O2. A
``Float8Linear`` takes the module's own fp32 ``nn.Parameter`` objects (the optimizer
keeps stepping the same tensors, ``state_dict`` keys do not change) and casts them to
fp8 itself, with a scale computed from the fp32 values, once per use. So O2's cast on
use (:mod:`ampkit.conversion.parameter_casts`) is skipped for these modules: a bf16 copy in
between would round every weight twice (fp32 -> bf16 -> fp8) and cost a copy for
nothing. Everything else follows the level: the activations a Float8Linear receives at
O2 are bf16, its outputs come back in bf16, and norms, attention and the rest of the
model run as the level's policy says.

The decision (:func:`~ampkit.fp8.select_fp8_layers`) is stored on the model;
:func:`fp8_layers` returns it, and ``ampkit.tools.fp8_report`` prints it.

Example:
    >>> import torch
    >>> import ampkit
    >>> from ampkit.fp8 import fp8_layers
    >>> net = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(3)])
    >>> net = ampkit.initialize(net, level="O2", dtype=torch.bfloat16, fp8="tensorwise")
    >>> [(x.name, x.fp8) for x in fp8_layers(net)]
    [('0', False), ('1', True), ('2', False)]
    >>> type(net[1]).__name__, net[1].weight.dtype
    ('Float8Linear', torch.float32)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn as nn

from ampkit.conversion import OWN_PARAMETER_CASTS, ConversionConfig, get_conversion
from ampkit.fp8.conv1d import is_hf_conv1d, to_float8_conv1d
from ampkit.fp8.linear import to_ampkit_float8_linear
from ampkit.fp8.recipe import check_fp8_device, float8_linear_config, parse_fp8, recipe_name
from ampkit.fp8.selection import (
    FP8_DIM_MULTIPLE,
    Fp8Layer,
    check_first_last,
    is_float8,
    select_fp8_layers,
)

__all__ = ["FP8_OPTIONS", "Fp8Plan", "Fp8SkipWarning", "apply_fp8", "check_fp8_converts",
           "check_fp8_level", "check_fp8_options", "fp8_layers", "fp8_skip_message",
           "get_fp8_plan", "prepare_fp8"]

#: The ``initialize`` keywords that choose fp8: ``fp8`` (the recipe),
#: ``fp8_exclude_modules`` (selectors kept out of fp8), ``fp8_first_last`` (convert the
#: first and last Linear too).
FP8_OPTIONS: tuple[str, ...] = ("fp8", "fp8_exclude_modules", "fp8_first_last")

_PLAN = "_ampkit_fp8_plan"


@dataclasses.dataclass(frozen=True)
class Fp8Plan:
    """What fp8 does to one model: the recipe and the decision for every Linear.

    Example:
        >>> from ampkit.fp8 import Fp8Plan
        >>> Fp8Plan("rowwise", ()).converted
        ()
    """

    recipe: Any
    layers: tuple[Fp8Layer, ...]
    settings: tuple[Any, ...] = ()

    @property
    def recipe_name(self) -> str:
        """``"tensorwise"``, ``"rowwise"``, ``"rowwise_with_gw_hp"`` or ``"custom"``.

        Example:
            >>> from ampkit.fp8 import Fp8Plan
            >>> Fp8Plan("rowwise", ()).recipe_name
            'rowwise'
        """
        return recipe_name(self.recipe)

    @property
    def converted(self) -> tuple[str, ...]:
        """The qualified names of the layers that run in fp8.

        Example:
            >>> from ampkit.fp8 import Fp8Layer, Fp8Plan
            >>> Fp8Plan("rowwise", (Fp8Layer("a", 16, 16, True, "fp8"),)).converted
            ('a',)
        """
        return tuple(layer.name for layer in self.layers if layer.fp8)

    def table(self) -> str:
        """The decision as a plain-text table (``ampkit.tools.fp8_report``'s text):
        every linear layer, its type, its shape (in x out), whether it runs in fp8 and
        why not.

        Example:
            >>> from ampkit.fp8 import Fp8Layer, Fp8Plan
            >>> print(Fp8Plan("rowwise", (Fp8Layer("a", 16, 16, True, "fp8"),)).table())
            fp8 (rowwise): 1 of 1 linear layers
            layer  type    shape    fp8  why not
            a      Linear  16 x 16  yes
        """
        from ampkit.common.text import text_table

        rows = [(x.name, x.kind, f"{x.in_features} x {x.out_features}",
                 "yes" if x.fp8 else "no", "" if x.fp8 else x.reason) for x in self.layers]
        head = (f"fp8 ({self.recipe_name}): {len(self.converted)} of {len(self.layers)} "
                f"linear layers")
        table = text_table(("layer", "type", "shape", "fp8", "why not"), rows,
                           align="lllll")
        return head + "\n" + "\n".join(line.rstrip() for line in table.splitlines())

    def skipped_summary(self) -> str:
        """How many linear layers stay out of fp8, by cause, in a few words (empty
        when none does).

        Example:
            >>> from ampkit.fp8 import Fp8Layer, Fp8Plan
            >>> plan = Fp8Plan("tensorwise", (
            ...     Fp8Layer("a", 16, 8, False, "out_features=8 is not a multiple of 16"),
            ...     Fp8Layer("b", 16, 16, True, "fp8"),
            ...     Fp8Layer("c", 16, 16, False, "last linear layer of the model (...)")))
            >>> print(plan.skipped_summary())
            1 with a dimension not a multiple of 16, 1 as the model's first or last layer
        """
        counts: dict[str, int] = {}
        for layer in self.layers:
            if not layer.fp8:
                cause = _cause(layer.reason)
                counts[cause] = counts.get(cause, 0) + 1
        return ", ".join(f"{n} {cause}" for cause, n in counts.items())


class Fp8SkipWarning(UserWarning):
    """``initialize(fp8=...)`` left some linear layers out of fp8 (it says how many and
    why; ``ampkit.tools.fp8_report(model)`` lists them). Filter it with ``warnings``
    once you have read the report.

    Example:
        >>> from ampkit.fp8 import Fp8SkipWarning
        >>> issubclass(Fp8SkipWarning, UserWarning)
        True
    """


_CAUSES = (("first linear layer", "as the model's first or last layer"),
           ("last linear layer", "as the model's first or last layer"),
           ("kept in fp32", "kept in fp32"),
           ("excluded", "excluded by fp8_exclude_modules"),
           ("not a multiple", f"with a dimension not a multiple of {FP8_DIM_MULTIPLE}"),
           ("subclass", "of a subclass of nn.Linear or Conv1D"),
           ("the model itself", "the model itself"))


def _cause(reason: str) -> str:
    return next((cause for key, cause in _CAUSES if key in reason), reason)


def _model_label(name: str) -> str:
    return "" if name == "model" else f"{name}: "


def check_fp8_converts(plans: Sequence[tuple[str, Fp8Plan]]) -> None:
    """Refuse an fp8 request that would convert no layer at all: ``plans`` holds each
    model's name (``"model"``, ``"models[1]"``) and plan, and when none of them runs a
    layer in fp8 the ``ValueError`` says why, with each model's fp8 table.

    Raises:
        ValueError: no layer of any model would run in fp8.

    Example:
        >>> import torch
        >>> from ampkit.conversion.levels import conversion_for_level
        >>> from ampkit.fp8 import check_fp8_converts, prepare_fp8
        >>> net = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
        >>> plan = prepare_fp8(net, conversion_for_level("O2"), fp8="tensorwise")
        >>> check_fp8_converts([("model", plan)])
        Traceback (most recent call last):
        ...
        ValueError: fp8='tensorwise' would convert no layer (2 as the model's first or ...
    """
    if not plans or any(plan.converted for _, plan in plans):
        return
    recipe = plans[0][1].recipe_name
    found = sum(len(plan.layers) for _, plan in plans)
    if not found:
        why = ("the model has no nn.Linear or transformers Conv1D layer, the layers fp8 "
               "trains")
    else:
        why = "; ".join(f"{_model_label(name)}{plan.skipped_summary()}"
                        for name, plan in plans)
    tables = "\n".join(f"{_model_label(name)}{plan.table()}" for name, plan in plans)
    raise ValueError(
        f"fp8={recipe!r} would convert no layer ({why}), so the run would train exactly "
        f"as without fp8. fp8 takes exact nn.Linear and transformers Conv1D layers whose "
        f"in and out features are multiples of {FP8_DIM_MULTIPLE}; fp8_first_last=True "
        f"converts the first and last one, and fp8_exclude_modules / keep_fp32_modules "
        f"choose the rest. Or leave fp8 off (fp8=None). The decision "
        f"(ampkit.tools.fp8_report):\n{tables}")


def fp8_skip_message(plans: Sequence[tuple[str, Fp8Plan]]) -> str | None:
    """What ``initialize`` warns (:class:`Fp8SkipWarning`) when it leaves linear layers
    out of fp8: how many of how many, and why, per model; ``None`` when every layer
    converts.

    Example:
        >>> from ampkit.fp8 import Fp8Layer, Fp8Plan, fp8_skip_message
        >>> plan = Fp8Plan("tensorwise", (
        ...     Fp8Layer("a", 16, 16, True, "fp8"),
        ...     Fp8Layer("b", 16, 16, False, "excluded (fp8_exclude_modules)")))
        >>> print(fp8_skip_message([("model", plan)]))  # doctest: +NORMALIZE_WHITESPACE
        ampkit.initialize: fp8 ('tensorwise') converts 1 of 2 linear layers; 1 stays out
        (1 excluded by fp8_exclude_modules). ampkit.tools.fp8_report(model) lists each
        layer and why.
    """
    parts = []
    for name, plan in plans:
        skipped = len(plan.layers) - len(plan.converted)
        if skipped:
            parts.append(f"{_model_label(name)}converts {len(plan.converted)} of "
                         f"{len(plan.layers)} linear layers; {skipped} "
                         f"{'stays' if skipped == 1 else 'stay'} out "
                         f"({plan.skipped_summary()})")
    if not parts:
        return None
    return (f"ampkit.initialize: fp8 ({plans[0][1].recipe_name!r}) {'; '.join(parts)}. "
            f"ampkit.tools.fp8_report(model) lists each layer and why.")


def _settings(fp8: Any, exclude: Any, first_last: bool) -> tuple[Any, ...]:
    # What a second initialize call is compared against (instances by identity).
    items = () if exclude is None else (
        (exclude,) if isinstance(exclude, str | type | nn.Module) else tuple(exclude))
    return (fp8 if isinstance(fp8, str) else id(fp8),
            tuple(id(x) if isinstance(x, nn.Module) else x for x in items), first_last)


def check_fp8_level(fp8: Any, config: ConversionConfig) -> Any:
    """``fp8`` checked (:func:`~ampkit.fp8.recipe.parse_fp8`) and refused at a level that
    stores parameters in low precision; no torchao needed. Returns the canonical value.

    Example:
        >>> from ampkit.conversion.levels import conversion_for_level
        >>> from ampkit.fp8.convert import check_fp8_level
        >>> check_fp8_level("RowWise", conversion_for_level("O2"))
        'rowwise'
        >>> check_fp8_level("rowwise", conversion_for_level("O3"))
        Traceback (most recent call last):
        ...
        ValueError: fp8 trains Linears from their fp32 parameters (torchao casts them ...
    """
    fp8 = parse_fp8(fp8)
    if fp8 is not None and config.casts_parameters:
        raise ValueError(f"fp8 trains Linears from their fp32 parameters (torchao casts "
                         f"them to fp8 itself), but this level stores parameters in "
                         f"{config.param_dtype}; use level O0, O1 or O2 (parameters stay fp32)")
    return fp8


def check_fp8_options(fp8: Any, fp8_exclude_modules: Any = None,
                      fp8_first_last: Any = False) -> Any:
    """``fp8`` checked (:func:`~ampkit.fp8.recipe.parse_fp8`) with the options that
    choose its layers, before any model is seen: they mean nothing without a recipe,
    and ``fp8_first_last`` is a bool. Returns the canonical recipe.

    Example:
        >>> from ampkit.fp8.convert import check_fp8_options
        >>> check_fp8_options("TensorWise", ["head"], True)
        'tensorwise'
        >>> check_fp8_options(None, fp8_first_last=True)
        Traceback (most recent call last):
        ...
        ValueError: fp8_first_last chooses which Linears train in fp8, but fp8 is None; ...
    """
    fp8 = parse_fp8(fp8)
    if fp8 is None:
        extra = [n for n, v in (("fp8_exclude_modules", fp8_exclude_modules),
                                ("fp8_first_last", fp8_first_last)) if v]
        if extra:
            raise ValueError(f"{extra[0]} chooses which Linears train in fp8, but fp8 is "
                             f"None; pass fp8= one of the recipes too")
    check_first_last(fp8_first_last)
    return fp8


def prepare_fp8(model: nn.Module, config: ConversionConfig, *, fp8: Any = None,
                fp8_exclude_modules: Iterable[Any] | Any = None,
                fp8_first_last: bool = False) -> Fp8Plan | None:
    """Check the fp8 options against ``model`` and the level's ``config`` and decide
    which layers convert, changing nothing; ``None`` when there is nothing to do (no
    fp8, or the model already carries this very plan).

    Raises:
        ImportError: torchao is missing (names the extra ``ampkit[fp8]``).
        ValueError: an unknown recipe, a level that stores parameters in low precision,
            fp8 options without ``fp8``, or a selector not in the model.
        RuntimeError: the model was converted before with other fp8 settings.

    Example:
        >>> import torch
        >>> from ampkit.conversion.levels import conversion_for_level
        >>> from ampkit.fp8 import prepare_fp8
        >>> net = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(3)])
        >>> plan = prepare_fp8(net, conversion_for_level("O2"), fp8="tensorwise")
        >>> plan.converted, type(net[1]).__name__  # nothing changed yet
        (('1',), 'Linear')
    """
    fp8 = check_fp8_options(fp8, fp8_exclude_modules, fp8_first_last)
    if fp8 is None:
        if getattr(model, _PLAN, None) is not None:
            raise RuntimeError("this model was converted with fp8 before; initialize it "
                               "again with the same fp8 settings, or start from a fresh "
                               "fp32 model")
        return None
    check_fp8_level(fp8, config)
    float8_linear_config(fp8)  # torchao missing: an ImportError naming the extra
    settings = _settings(fp8, fp8_exclude_modules, fp8_first_last)
    earlier = getattr(model, _PLAN, None)
    if earlier is not None:
        if earlier.settings == settings:
            return None
        raise RuntimeError("this model was converted with other fp8 settings; converting "
                           "again would swap its layers twice. Start from a fresh fp32 "
                           "model")
    if get_conversion(model) is not None:
        raise RuntimeError("this model was converted without fp8 before; start from a "
                           "fresh fp32 model to train it in fp8")
    layers = select_fp8_layers(model, keep_fp32_modules=config.keep_fp32_modules,
                               exclude=fp8_exclude_modules, first_last=fp8_first_last)
    # last: the caller's argument errors come first, whatever the machine
    check_fp8_device(fp8, next((p.device.type for p in model.parameters()), None))
    return Fp8Plan(fp8, layers, settings)


def apply_fp8(model: nn.Module, plan: Fp8Plan,
              optimizers: Sequence[torch.optim.Optimizer] = ()) -> None:
    """Swap the planned layers for ``Float8Linear`` (torchao's
    ``convert_to_float8_training``, then ampkit's subclass of it, which also evaluates
    under ``torch.inference_mode()``: :mod:`ampkit.fp8.linear`) and their Conv1Ds for
    ``Float8Conv1D`` (:mod:`ampkit.fp8.conv1d`, in place), mark them so O2 does not
    cast their parameters on use, and store the plan on the model. A parameter that
    torchao replaces (its FSDP2 float8 all-gather wraps weights in a new tensor
    subclass) is replaced in ``optimizers`` too, state included.

    Example:
        >>> import torch
        >>> from ampkit.conversion.levels import conversion_for_level
        >>> from ampkit.fp8 import apply_fp8, prepare_fp8
        >>> net = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(3)])
        >>> apply_fp8(net, prepare_fp8(net, conversion_for_level("O2"),
        ...                            fp8="tensorwise", fp8_first_last=True))
        >>> [type(m).__name__ for m in net]
        ['Float8Linear', 'Float8Linear', 'Float8Linear']
    """
    from torchao.float8 import convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    chosen = set(plan.converted)
    already = {name for name, m in model.named_modules() if name in chosen and is_float8(m)}
    config = float8_linear_config(plan.recipe)
    before = {name: (m.weight, m.bias) for name, m in model.named_modules()
              if name in chosen}
    # torchao swaps the Linears for new Float8Linear modules (run even with none
    # chosen: it also readies inductor for float8); a Conv1D changes class in place.
    convert_to_float8_training(model, config=config,
                               module_filter_fn=lambda m, fqn: fqn in chosen
                               and not is_float8(m))
    for name, module in model.named_modules():
        if name in chosen and not is_float8(module) and is_hf_conv1d(module):
            to_float8_conv1d(module, config)
        elif name in chosen and name not in already and type(module) is Float8Linear:
            # torchao's class, with a forward that also runs under inference_mode
            to_ampkit_float8_linear(module)
    replaced: dict[int, torch.Tensor] = {}
    for name, module in model.named_modules():
        if is_float8(module):
            object.__setattr__(module, OWN_PARAMETER_CASTS, True)
        if name in before:
            for old, new in zip(before[name], (module.weight, module.bias)):
                if old is not None and new is not old:
                    replaced[id(old)] = new
    if replaced:
        _replace_in_optimizers(optimizers, replaced)
    object.__setattr__(model, _PLAN, plan)


def _replace_in_optimizers(optimizers: Sequence[torch.optim.Optimizer],
                           replaced: dict[int, torch.Tensor]) -> None:
    for opt in optimizers:
        for group in opt.param_groups:
            for i, p in enumerate(group["params"]):
                new = replaced.get(id(p))
                if new is not None:
                    group["params"][i] = new
                    if p in opt.state:
                        opt.state[new] = opt.state.pop(p)


def get_fp8_plan(model: nn.Module) -> Fp8Plan | None:
    """The :class:`Fp8Plan` ``initialize`` applied to ``model``, or ``None``.

    Example:
        >>> import torch
        >>> from ampkit.fp8 import get_fp8_plan
        >>> get_fp8_plan(torch.nn.Linear(2, 2)) is None
        True
    """
    plan = getattr(model, _PLAN, None)
    return plan if isinstance(plan, Fp8Plan) else None


def fp8_layers(model: nn.Module) -> tuple[Fp8Layer, ...]:
    """The fp8 decision ``initialize`` made for every Linear of ``model`` (empty when
    it was not initialized with ``fp8=``).

    Example:
        >>> import torch
        >>> from ampkit.fp8 import fp8_layers
        >>> fp8_layers(torch.nn.Linear(2, 2))
        ()
    """
    plan = get_fp8_plan(model)
    return () if plan is None else plan.layers
