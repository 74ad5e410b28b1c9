"""Differential tests: ampkit.autocast against native torch.autocast, op by op.

The op lists and sample arguments are torch's own (``autocast_test_lists.py``, shipped
in the wheel). Native autocast is the oracle: same output dtype, bit-for-bit values.

Two ampkit configurations are checked:
* the default policy, which must *be* native autocast;
* a "mirror" policy that re-lists every native op in ampkit's own lists, so the ops
  go through ampkit's interception and casting code instead of native's. It must still
  agree bit for bit, which proves the casting machinery, not just the pass-through.
"""

from __future__ import annotations

import collections.abc
from typing import Any

import pytest
import torch

# Importing torch's own autocast test lists needs `expecttest` (in the "test" extra).
from torch.testing._internal.autocast_test_lists import AutocastCPUTestLists

import ampkit
from ampkit.policies.policy import Policy
from ampkit.policies.registry import all_op_names

AMP_DTYPES = [torch.bfloat16, torch.float16]
LISTS = AutocastCPUTestLists(torch.device("cpu"))


def _to_amp(value: Any, amp_dtype: torch.dtype) -> Any:
    """The lists hold bf16 inputs; fp16 runs get the same values in fp16."""
    if isinstance(value, torch.Tensor):
        return value.to(amp_dtype) if value.dtype is torch.bfloat16 else value
    if isinstance(value, tuple | list):
        return type(value)(_to_amp(v, amp_dtype) for v in value)
    return value


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)))
    if isinstance(a, collections.abc.Iterable) and not isinstance(a, str):
        return all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _cases() -> list[Any]:
    cases = []
    for list_name in ("torch_16", "torch_fp32", "nn_16", "nn_fp32"):
        for entry in getattr(LISTS, list_name):
            op, args = entry[0], entry[1]
            kwargs = entry[2] if len(entry) > 2 else {}
            cases.append(pytest.param(list_name, op, args, kwargs, id=f"{list_name}-{op}"))
    for entry in LISTS.torch_need_autocast_promote:
        cases.append(pytest.param("torch_need_autocast_promote", entry[0], entry[1], {},
                                  id=f"promote-{entry[0]}"))
    for list_name in ("torch_expect_builtin_promote", "methods_expect_builtin_promote"):
        for entry in getattr(LISTS, list_name):
            cases.append(pytest.param(list_name, entry[0], entry[1], {},
                                      id=f"{list_name}-{entry[0]}"))
    return cases


def _variants(list_name: str, op: str) -> list[tuple[str, Any]]:
    """Every Python entry point of the op that the list implies: torch.X and Tensor.X,
    torch._C._nn.X for the nn lists, Tensor dunders for the methods list."""
    if list_name.startswith("nn_"):
        return [("torch._C._nn", getattr(torch._C._nn, op))]
    if list_name.startswith("methods"):
        return [("Tensor", lambda *a, **k: getattr(a[0], op)(*a[1:], **k))]
    found = []
    if hasattr(torch, op):
        found.append(("torch", getattr(torch, op)))
    if hasattr(torch.Tensor, op):
        found.append(("Tensor", lambda *a, **k: getattr(a[0], op)(*a[1:], **k)))
    return found


# A policy that lists again, in ampkit's own lists, every op that native autocast casts,
# so that ampkit (not native) performs the casts for them.
def _mirror_policy() -> Policy:
    known = all_op_names()

    def names(*list_names: str) -> set[str]:
        return {e[0] for ln in list_names for e in getattr(LISTS, ln) if e[0] in known}

    return Policy(
        name="mirror",
        lower_precision_ops=names("torch_16", "nn_16"),
        fp32_ops=names("torch_fp32", "nn_fp32"),
        promote_ops=names("torch_need_autocast_promote"),
    )


MIRROR = _mirror_policy()


@pytest.fixture(autouse=True)
def _mirror_takes_kernels(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The mirror policy re-lists native's own rules, which take no kernel (native's
    computes them). Here they take ampkit's kernels all the same, so that
    ampkit's casts are what is compared with native's, op by op."""
    from ampkit.engine import kernels
    from ampkit.engine.regions import release_kernels
    from ampkit.engine.rules import compile_rules

    monkeypatch.setattr(kernels, "skip_native_equal", False)
    compile_rules.cache_clear()
    yield
    compile_rules.cache_clear()
    release_kernels()


@pytest.mark.parametrize("amp_dtype", AMP_DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize(("list_name", "op", "args", "kwargs"), _cases())
@pytest.mark.parametrize("policy", ["torch", MIRROR], ids=["default", "mirror"])
def test_matches_native_autocast(policy: Any, list_name: str, op: str, args: Any,
                                 kwargs: Any, amp_dtype: torch.dtype) -> None:
    args = _to_amp(args, amp_dtype)
    variants = _variants(list_name, op)
    assert variants, f"{op}: no entry point found"
    for where, fn in variants:
        with torch.autocast("cpu", amp_dtype):
            expected = fn(*args, **kwargs)
        with ampkit.autocast("cpu", amp_dtype, policy=policy):
            got = fn(*args, **kwargs)
        assert _same(expected, got), f"{where}.{op} under {amp_dtype}: ampkit differs from native"


def test_mirror_policy_really_intercepts() -> None:
    """Guard for the test above: the mirror policy must route ops through ampkit."""
    assert not MIRROR.is_native
    assert {"mm", "conv2d", "linear", "mse_loss", "cat"} <= (
        MIRROR.lower_precision_ops | MIRROR.fp32_ops | MIRROR.promote_ops)
    calls = []
    from ampkit.engine import kernels

    # The Autocast kernels own mm and cat under this policy; cat's promote rule asks
    # promote_dtype for its target: spy on that.
    promote = kernels.promote_dtype

    def promote_spy(*args: Any) -> Any:
        calls.append("promote")
        return promote(*args)

    kernels.promote_dtype = promote_spy
    try:
        with ampkit.autocast("cpu", torch.bfloat16, policy=MIRROR):
            table = dict(kernels._active.table or {})
            torch.mm(torch.rand(2, 2), torch.rand(2, 2))
            torch.cat([torch.rand(2), torch.rand(2).bfloat16()])
    finally:
        kernels.promote_dtype = promote
    assert (table["mm"], table["cat"]) == ("lower", "promote")
    registered = kernels.registered()
    assert {("AutocastCPU", "aten::mm"), ("AutocastCPU", "aten::cat")} <= registered
    assert calls == ["promote"]
