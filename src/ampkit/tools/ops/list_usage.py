"""List usage: which entries of a policy's lists matched an op call, and which never did.

A list entry that never matches changes nothing and says nothing. GPT-2's attention
runs ``scaled_dot_product_attention``, which does its softmax inside one kernel, so
``custom_black_list={"softmax"}`` on it is a no-op; a custom op listed under a name its
model never calls is another. :func:`list_usage` watches the ``ampkit.autocast``
regions entered inside it and counts, for every op on their policies' lists, the op
calls that matched it; :meth:`ListUsage.unmatched` and :meth:`ListUsage.report` then
name the entries that matched nothing.

An op call counts for the innermost region around it (an ``enabled=False`` region
counts for none). Calls are seen at the level the engine works at: the Python entry
points of each op (``torch.X``, ``F.X``, ``Tensor.X``, custom ops), so an op that a
composite function runs inside its own kernel is not a match. Watching adds a
``TorchFunctionMode`` while the report is open: run one eager step under it, not the
whole training.

Example:
    >>> import torch
    >>> import ampkit
    >>> from ampkit.tools.ops.list_usage import list_usage
    >>> q = k = v = torch.rand(1, 2, 4, 8)
    >>> with list_usage() as usage, ampkit.autocast(
    ...         "cpu", torch.bfloat16, custom_black_list={"softmax"},
    ...         custom_white_list={"scaled_dot_product_attention"}):
    ...     out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    >>> [(e.list, e.op) for e in usage.unmatched()]
    [('fp32_ops', 'softmax')]
    >>> print(usage.report())
    policy 'torch+custom': 1 of 2 listed ops matched no op call
      fp32_ops: softmax
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

from ampkit.engine.regions import innermost_policy, observe_regions
from ampkit.policies.policy import Policy
from ampkit.tools.ops.tracing import OpWatch

__all__ = ["EntryUsage", "ListUsage", "list_usage"]

_LISTS = ("lower_precision_ops", "fp32_ops", "promote_ops")


@dataclasses.dataclass(frozen=True)
class EntryUsage:
    """One listed op of one policy, and how many op calls matched it.

    Example:
        >>> from ampkit.tools.ops.list_usage import EntryUsage
        >>> EntryUsage("torch+custom", "fp32_ops", "softmax", 0).matched
        False
    """

    policy: str
    list: str  # "lower_precision_ops", "fp32_ops" or "promote_ops"
    op: str  # canonical op name (custom ops: "ns::name")
    calls: int

    @property
    def matched(self) -> bool:
        """Whether any op call matched the entry."""
        return self.calls > 0


class ListUsage:
    """The list usage of the regions entered while it is open; made by
    :func:`list_usage`. Readable during and after the ``with`` block.

    Example:
        >>> import torch
        >>> import ampkit
        >>> from ampkit.tools.ops.list_usage import list_usage
        >>> with list_usage() as usage:
        ...     with ampkit.autocast("cpu", custom_white_list={"add", "exp"}):
        ...         _ = torch.ones(2) + 1
        >>> [(e.op, e.calls) for e in usage.entries()]
        [('add', 1), ('exp', 0)]
    """

    def __init__(self) -> None:
        self._policies: dict[Policy, Counter[str]] = {}
        self._watch: OpWatch | None = None
        self._entered = False

    def __enter__(self) -> ListUsage:
        if self._entered:
            raise RuntimeError("a ListUsage report can be opened only once; call "
                               "list_usage() again for a new one")
        self._entered = True
        observe_regions(self._region_entered)
        self._watch = OpWatch(self._op_called)
        try:
            self._watch.__enter__()  # type: ignore[no-untyped-call]  # torch's base, unannotated
        except BaseException:
            observe_regions(self._region_entered, stop=True)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            if self._watch is not None:
                self._watch.__exit__(*exc)  # type: ignore[no-untyped-call]  # torch's base, unannotated
                self._watch = None
        finally:
            observe_regions(self._region_entered, stop=True)

    def _region_entered(self, policy: Policy | None) -> None:
        if policy is not None:
            self._policies.setdefault(policy, Counter())

    def _op_called(self, name: str, *_: Any) -> None:
        policy = innermost_policy()
        if policy is not None:
            self._policies.setdefault(policy, Counter())[name] += 1

    def entries(self) -> tuple[EntryUsage, ...]:
        """Every listed op of every policy entered, with its matching calls; by policy
        (in the order first entered), list, then op name."""
        out = []
        for policy, calls in self._policies.items():
            for field in _LISTS:
                for op in sorted(getattr(policy, field)):
                    out.append(EntryUsage(policy.name, field, op, calls[op]))
        return tuple(out)

    def unmatched(self) -> tuple[EntryUsage, ...]:
        """The entries no op call matched (see :meth:`entries`)."""
        return tuple(e for e in self.entries() if not e.matched)

    def report(self) -> str:
        """Per policy: how many listed ops matched nothing, and which, by list.

        Example:
            >>> import torch
            >>> import ampkit
            >>> from ampkit.tools.ops.list_usage import list_usage
            >>> with list_usage() as usage, ampkit.autocast("cpu", custom_white_list={"add"}):
            ...     _ = torch.ones(1) + 1
            >>> usage.report()
            "policy 'torch+custom': every listed op matched an op call"
        """
        if not self._policies:
            return "no ampkit.autocast region with a policy was entered"
        lines = []
        entries = self.entries()
        for policy in self._policies:
            mine = [e for e in entries if e.policy == policy.name]
            missed = [e for e in mine if not e.matched]
            if not missed:
                lines.append(f"policy {policy.name!r}: every listed op matched an op call")
                continue
            lines.append(f"policy {policy.name!r}: {len(missed)} of {len(mine)} listed ops "
                         f"matched no op call")
            for field in _LISTS:
                ops = [e.op for e in missed if e.list == field]
                if ops:
                    lines.append(f"  {field}: {', '.join(ops)}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"ListUsage(policies={[p.name for p in self._policies]}, "
                f"unmatched={len(self.unmatched())})")


def list_usage() -> ListUsage:
    """Report which list entries of the ``ampkit.autocast`` regions entered inside it
    matched an op call; use the result as a context manager (see the module docstring).

    Example:
        >>> import torch
        >>> import ampkit
        >>> from ampkit.tools.ops.list_usage import list_usage
        >>> with list_usage() as usage, ampkit.autocast("cpu", custom_black_list={"exp"}):
        ...     _ = torch.ones(2).sum()
        >>> [e.op for e in usage.unmatched()]
        ['exp']
    """
    return ListUsage()
