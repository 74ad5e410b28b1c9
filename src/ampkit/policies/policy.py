"""The policy: an immutable description of which op runs in which dtype.

A :class:`Policy` says plainly what the autocast engine does with every op call:

* ``dtype``: the low-precision compute dtype (``torch.float16`` or ``torch.bfloat16``;
  ``None`` means the device's autocast default: bfloat16 on CPU, float16 on CUDA);
* ``lower_precision_ops``: ops whose floating inputs are cast to ``dtype``;
* ``fp32_ops``: ops whose floating inputs are cast to ``torch.float32``;
* ``promote_ops``: ops whose floating inputs are cast to the widest floating dtype
  among them (float32 if any input is float32);
* ``unlisted``: what happens to every other op (see :data:`UNLISTED_RULES`).

The default policy, ``"torch"``, has empty lists and ``unlisted="native"``: it *is*
``torch.autocast``. Custom lists are deltas on top of a base policy, made with
:meth:`Policy.with_lists`, which follows Paddle's rule: an op put in the white list is
taken out of the black and promote lists, and the other way round.

Example:
    >>> import torch
    >>> from ampkit.policies.policy import Policy
    >>> p = Policy().with_lists(custom_white_list={"add"}, custom_black_list={"conv2d"})
    >>> p.rule_for("add"), p.rule_for("conv2d"), p.rule_for("relu")
    ('lower', 'fp32', 'native')
    >>> p.name
    'torch+custom'
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Mapping
from typing import Any, Literal, get_args

import torch

from ampkit.common.arguments import LOW_PRECISION, parse_dtype
from ampkit.policies.registry import OpEntry, resolve_ops

__all__ = ["LOW_PRECISION_DTYPES", "UNLISTED_RULES", "Policy", "Rule", "Unlisted", "as_dtype"]

#: What the engine does with an op.
Rule = Literal["lower", "fp32", "promote", "native", "keep"]

#: What the engine does with ops that are on none of the three lists:
#: ``"native"`` lets ``torch.autocast`` decide (its own lists for the device and torch
#: version); ``"keep"`` runs them in their inputs' dtype (no autocast at all);
#: ``"promote"`` casts mixed floating inputs to the widest (Paddle O1); ``"fp32"`` runs
#: them in float32 (Paddle OD); ``"lower"`` runs them in ``dtype`` (Paddle O2).
Unlisted = Literal["native", "keep", "promote", "fp32", "lower"]
UNLISTED_RULES: tuple[str, ...] = get_args(Unlisted)

#: The dtypes a policy may compute in.
LOW_PRECISION_DTYPES: Mapping[str, torch.dtype] = {
    "float16": torch.float16, "bfloat16": torch.bfloat16,
}


def as_dtype(value: Any, argument: str = "dtype", *, allow_none: bool = True) -> torch.dtype | None:
    """Check and normalise a low-precision dtype given as a torch dtype or a name
    (:func:`ampkit.common.arguments.parse_dtype` with float16 and bfloat16 accepted).

    Example:
        >>> import torch
        >>> from ampkit.policies.policy import as_dtype
        >>> as_dtype("bfloat16") is torch.bfloat16
        True
    """
    if value is None and allow_none:  # "the default": not a choice the error lists
        return None
    return parse_dtype(value, argument, accept=LOW_PRECISION)


@dataclasses.dataclass(frozen=True)
class Policy:
    """Which ops run in low precision, which in float32, which promote; immutable.

    Lists accept canonical names, op callables and ``nn.Module`` classes (see
    :func:`ampkit.policies.registry.resolve_op`) and are stored as frozensets of canonical
    names. An op may be on one list only.

    Example:
        >>> import torch
        >>> from ampkit.policies.policy import Policy
        >>> p = Policy("mine", torch.bfloat16, lower_precision_ops={"linear"},
        ...            fp32_ops={torch.softmax}, unlisted="keep")
        >>> sorted(p.fp32_ops), p.dtype
        (['softmax'], torch.bfloat16)
    """

    name: str = "torch"
    dtype: torch.dtype | None = None
    lower_precision_ops: frozenset[str] = frozenset()
    fp32_ops: frozenset[str] = frozenset()
    promote_ops: frozenset[str] = frozenset()
    unlisted: Unlisted = "native"
    description: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty string, got {self.name!r}")
        object.__setattr__(self, "dtype", as_dtype(self.dtype))
        if self.unlisted not in UNLISTED_RULES:
            raise ValueError(f"unlisted must be one of {list(UNLISTED_RULES)}, "
                             f"got {self.unlisted!r}")
        lists = {}
        for field in ("lower_precision_ops", "fp32_ops", "promote_ops"):
            lists[field] = resolve_ops(getattr(self, field), argument=field)
            object.__setattr__(self, field, lists[field])
        for a, b in (("lower_precision_ops", "fp32_ops"), ("lower_precision_ops", "promote_ops"),
                     ("fp32_ops", "promote_ops")):
            both = lists[a] & lists[b]
            if both:
                raise ValueError(f"ops {sorted(both)} are in both {a} and {b}; an op may be on "
                                 f"one list only")

    @property
    def is_native(self) -> bool:
        """True when this policy is exactly ``torch.autocast`` (nothing to intercept).

        Example:
            >>> from ampkit.policies.policy import Policy
            >>> Policy().is_native, Policy().with_lists(custom_white_list={"add"}).is_native
            (True, False)
        """
        return (self.unlisted == "native" and not self.lower_precision_ops
                and not self.fp32_ops and not self.promote_ops)

    def rule_for(self, op: str) -> Rule:
        """The rule for canonical op name ``op``.

        Example:
            >>> from ampkit.policies.policy import Policy
            >>> Policy(fp32_ops={"linear"}).rule_for("linear")
            'fp32'
        """
        if op in self.lower_precision_ops:
            return "lower"
        if op in self.fp32_ops:
            return "fp32"
        if op in self.promote_ops:
            return "promote"
        return self.unlisted

    def with_lists(self, custom_white_list: Iterable[OpEntry] | None = None,
                   custom_black_list: Iterable[OpEntry] | None = None, *,
                   framework: str | None = None, name: str | None = None) -> Policy:
        """A new policy with custom white (low precision) and black (float32) entries.

        An op in both custom lists is a ``ValueError``. A white entry is removed from
        the fp32 and promote lists, a black entry from the lower-precision and promote
        lists. ``framework`` (``"paddle"``, ``"mxnet"``, ``"mindspore"``) also accepts
        that framework's op names.

        Example:
            >>> from ampkit.policies.policy import Policy
            >>> Policy().with_lists(custom_white_list={"elementwise_add"},
            ...                     framework="paddle").lower_precision_ops
            frozenset({'add'})
        """
        white = resolve_ops(custom_white_list, framework=framework, argument="custom_white_list")
        black = resolve_ops(custom_black_list, framework=framework, argument="custom_black_list")
        both = white & black
        if both:
            raise ValueError(f"ops {sorted(both)} are in both custom_white_list and "
                             f"custom_black_list; put each op in one list")
        if not white and not black:
            return self if name is None else dataclasses.replace(self, name=name)
        return dataclasses.replace(
            self,
            name=name or (self.name if self.name.endswith("+custom") else f"{self.name}+custom"),
            lower_precision_ops=(self.lower_precision_ops - black) | white,
            fp32_ops=(self.fp32_ops - white) | black,
            promote_ops=self.promote_ops - white - black,
        )

    def with_dtype(self, dtype: torch.dtype | str | None) -> Policy:
        """The same policy computing in ``dtype``.

        Example:
            >>> import torch
            >>> from ampkit.policies.policy import Policy
            >>> Policy().with_dtype("float16").dtype
            torch.float16
        """
        return dataclasses.replace(self, dtype=as_dtype(dtype))

    # -- files ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; :meth:`from_dict` reads it back.

        Example:
            >>> from ampkit.policies.policy import Policy
            >>> p = Policy(fp32_ops={"softmax"})
            >>> Policy.from_dict(p.to_dict()) == p
            True
        """
        return {
            "name": self.name,
            "dtype": None if self.dtype is None else str(self.dtype).removeprefix("torch."),
            "lower_precision_ops": sorted(self.lower_precision_ops),
            "fp32_ops": sorted(self.fp32_ops),
            "promote_ops": sorted(self.promote_ops),
            "unlisted": self.unlisted,
            "description": self.description,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Policy:
        """Build a policy from :meth:`to_dict`'s output; unknown keys are an error.

        Example:
            >>> from ampkit.policies.policy import Policy
            >>> Policy.from_dict({"name": "x", "fp32_ops": ["exp"]}).fp32_ops
            frozenset({'exp'})
        """
        if not isinstance(data, Mapping):
            raise TypeError(f"data must be a mapping, got {type(data).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - fields
        if unknown:
            raise ValueError(f"unknown policy keys {sorted(unknown)}; accepted keys: "
                             f"{sorted(fields)}")
        return cls(**dict(data))

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the policy as JSON to ``path``.

        Example:
            >>> import tempfile, os
            >>> from ampkit.policies.policy import Policy
            >>> path = os.path.join(tempfile.mkdtemp(), "policy.json")
            >>> Policy(fp32_ops={"softmax"}).save(path)
            >>> Policy.load(path).fp32_ops
            frozenset({'softmax'})
        """
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Policy:
        """Read a policy written by :meth:`save`.

        Example:
            >>> from ampkit.policies.policy import Policy
            >>> callable(Policy.load)
            True
        """
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    def describe(self) -> str:
        """A short human-readable summary of the lists.

        Example:
            >>> from ampkit.policies.policy import Policy
            >>> print(Policy(fp32_ops={"softmax"}, name="p").describe().splitlines()[0])
            policy 'p': dtype=device default, unlisted ops: native
        """
        dtype = "device default" if self.dtype is None else str(self.dtype).removeprefix("torch.")
        lines = [f"policy {self.name!r}: dtype={dtype}, unlisted ops: {self.unlisted}"]
        for label, ops in (("lower precision", self.lower_precision_ops),
                           ("float32", self.fp32_ops), ("promote", self.promote_ops)):
            lines.append(f"  {label} ({len(ops)}): {', '.join(sorted(ops)) or '-'}")
        return "\n".join(lines)
