"""Taking away what a live region uses is an error in the thread that tries, and changes
nothing: ``release_kernels()`` while a region's kernels apply (they used to be dropped
silently, and the region computed as native autocast), ``unregister_policy`` of a policy
a live region was given."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import ampkit
from ampkit.engine.kernels import registered
from ampkit.engine.regions import release_kernels
from ampkit.policies.policy import Policy

BF16, F32 = torch.bfloat16, torch.float32


def _in_thread(fn: Callable[[], Any]) -> BaseException | None:
    """Run ``fn`` in another thread; what it raised (``None``: nothing)."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as error:
            raised.append(error)

    thread = threading.Thread(target=run, name="other-thread")
    thread.start()
    thread.join(timeout=30)
    return raised[0] if raised else None


def test_release_kernels_inside_a_region_is_refused_and_changes_nothing() -> None:
    a, w = torch.rand(2, 3), torch.rand(3, 3)
    with ampkit.autocast("cpu", BF16, custom_black_list={"linear", "mm"}):
        before = registered()
        with pytest.raises(RuntimeError, match=r"release_kernels\(\): 1 live ampkit region"
                                               r".*policy 'torch\+custom' on cpu in thread "
                                               r"'MainThread'.*after those regions exit"):
            release_kernels()
        assert registered() == before
        assert F.linear(a, w).dtype == F32  # the region's list still applies
    release_kernels()  # outside: fine
    assert registered() == frozenset()


def test_release_kernels_from_another_thread_is_refused_there() -> None:
    a, w = torch.rand(2, 3), torch.rand(3, 3)
    with ampkit.autocast("cpu", BF16, custom_black_list={"linear"}):
        error = _in_thread(release_kernels)
        assert isinstance(error, RuntimeError) and "thread 'MainThread'" in str(error)
        assert F.linear(a, w).dtype == F32
    assert _in_thread(release_kernels) is None  # the region is gone: allowed


def test_a_nested_region_keeps_the_outer_ones_kernels_held() -> None:
    a, w = torch.rand(2, 3), torch.rand(3, 3)
    with ampkit.autocast("cpu", BF16, custom_black_list={"linear"}):
        with ampkit.autocast("cpu", BF16, custom_white_list={"add"}):
            pass
        with pytest.raises(RuntimeError, match="1 live ampkit region"):
            release_kernels()
        assert F.linear(a, w).dtype == F32


@pytest.fixture
def mine() -> Any:
    policy = ampkit.register_policy(Policy("in-use-mine", fp32_ops={"linear"}))
    yield policy
    if "in-use-mine" in ampkit.available_policies():
        ampkit.unregister_policy("in-use-mine")


@pytest.mark.parametrize("given", ["name", "object"])
def test_unregister_policy_a_live_region_uses_is_refused(mine: Policy, given: str) -> None:
    a, w = torch.rand(2, 3), torch.rand(3, 3)
    with ampkit.autocast("cpu", BF16, policy="in-use-mine" if given == "name" else mine,
                         custom_white_list={"add"}):  # lists on top: still its policy
        with pytest.raises(RuntimeError, match=r"unregister_policy\('in-use-mine'\): the "
                                               r"policy is in use by 1 live ampkit region"
                                               r".*exit those regions first"):
            ampkit.unregister_policy("in-use-mine")
        assert ampkit.available_policies()["in-use-mine"] is mine
        assert F.linear(a, w).dtype == F32
        error = _in_thread(lambda: ampkit.unregister_policy("in-use-mine"))
        assert isinstance(error, RuntimeError) and "'MainThread'" in str(error)
    ampkit.unregister_policy("in-use-mine")  # no region left: allowed
    assert "in-use-mine" not in ampkit.available_policies()
