"""Named policies: ``"torch"`` (the default) and curated alternatives.

* ``"torch"``: exactly native ``torch.autocast`` for the running device and torch
  version; nothing is intercepted, so it costs nothing extra.
* ``"conservative"``: only matrix products and convolutions run in low precision;
  numerically sensitive ops are pinned to float32; ops taking several tensors promote
  to the widest; every other op runs in its inputs' dtype. Its lists are written out in
  ``docs/policies.md``.

Dialects add their frameworks' presets here (a preset is data, not behaviour).

Example:
    >>> from ampkit.presets import get_policy, available_policies
    >>> "torch" in available_policies() and get_policy("torch").is_native
    True
    >>> get_policy("conservative").rule_for("softmax")
    'fp32'
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from types import MappingProxyType

from ampkit.policy import Policy

__all__ = ["CONSERVATIVE", "TORCH", "available_policies", "get_policy", "register_policy"]

TORCH = Policy(
    name="torch",
    description="Native torch.autocast for the running device and torch version.",
)

CONSERVATIVE = Policy(
    name="conservative",
    lower_precision_ops=frozenset({
        "linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "addbmm", "einsum",
        "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
        "conv_transpose3d", "scaled_dot_product_attention",
    }),
    fp32_ops=frozenset({
        # exponentials, logs and powers overflow or lose range in 16 bits
        "exp", "expm1", "log", "log1p", "log2", "log10", "pow", "rsqrt", "reciprocal",
        "sinh", "cosh", "tan", "erfinv",
        # normalisations, softmax and reductions accumulate over many values
        "softmax", "log_softmax", "softmin", "logsumexp", "layer_norm", "group_norm",
        "batch_norm", "instance_norm", "rms_norm", "normalize", "sum", "mean", "prod",
        "std", "var", "norm", "cumsum", "cumprod", "dist", "cdist",
        # losses
        "cross_entropy", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
        "binary_cross_entropy", "binary_cross_entropy_with_logits", "kl_div",
        "poisson_nll_loss", "cosine_embedding_loss", "margin_ranking_loss",
        "soft_margin_loss", "multilabel_soft_margin_loss",
    }),
    promote_ops=frozenset({
        "add", "sub", "mul", "div", "cat", "stack", "where", "addcmul", "addcdiv",
        "maximum", "minimum", "atan2", "lerp", "index_copy", "dot", "vdot",
    }),
    unlisted="keep",
    description="Matmuls and convolutions in low precision, sensitive ops in float32, "
                "multi-input ops promoted, all else in the inputs' dtype.",
)

_PRESETS: dict[str, Policy] = {p.name: p for p in (TORCH, CONSERVATIVE)}


def register_policy(policy: Policy, *, overwrite: bool = False) -> Policy:
    """Make ``policy`` available by its name to :func:`get_policy` and ``autocast``.

    Example:
        >>> from ampkit.policy import Policy
        >>> from ampkit.presets import register_policy, get_policy
        >>> _ = register_policy(Policy("doc-example", fp32_ops={"exp"}), overwrite=True)
        >>> get_policy("doc-example").fp32_ops
        frozenset({'exp'})
    """
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be an ampkit Policy, got {type(policy).__name__}")
    if policy.name in _PRESETS and not overwrite and _PRESETS[policy.name] != policy:
        raise ValueError(f"a different policy named {policy.name!r} is already registered; "
                         f"pass overwrite=True to replace it")
    _PRESETS[policy.name] = policy
    return policy


def available_policies() -> Mapping[str, Policy]:
    """All named policies, read-only.

    Example:
        >>> from ampkit.presets import available_policies
        >>> {"conservative", "torch"} <= set(available_policies())
        True
    """
    return MappingProxyType(_PRESETS)


def get_policy(policy: str | Policy) -> Policy:
    """A policy by name (or the policy itself); unknown names list the known ones.

    Example:
        >>> from ampkit.presets import get_policy
        >>> get_policy("torch").name
        'torch'
    """
    if isinstance(policy, Policy):
        return policy
    if not isinstance(policy, str):
        raise TypeError(f"policy must be a preset name or a Policy, got {type(policy).__name__}")
    if policy not in _PRESETS:
        close = difflib.get_close_matches(policy, list(_PRESETS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"policy: unknown preset {policy!r}{hint}; accepted values: "
                         f"{sorted(_PRESETS)}")
    return _PRESETS[policy]
