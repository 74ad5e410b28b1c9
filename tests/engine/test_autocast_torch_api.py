"""ampkit.autocast takes torch.autocast's own signature and answers bad input as
torch does; a region restores all state on any exception, KeyboardInterrupt included.

The behaviours PyTorch's test/test_autocast.py checks and ampkit failed are here too, in
our words (docs/migration.md has the run's counts).
"""

from __future__ import annotations

import inspect
import sys
import warnings

import pytest
import torch
import torch.nn as nn

import ampkit
import ampkit.torch as amp
from ampkit.engine import kernels, regions, rules
from ampkit.engine.regions import UnsupportedDeviceError

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
LISTS = {"custom_white_list": ["add"], "custom_black_list": ["mm"]}


def _clean() -> bool:
    """Nothing of any region is left on this thread."""
    return (not torch.is_autocast_enabled("cpu") and ampkit.current_policy("cpu") is None
            and torch._C._len_torch_function_stack() == 0
            and not regions._state.frames
            and kernels._active.table is None and kernels._active.token is None)


# -- torch's signature -------------------------------------------------------------------------

def test_positional_signature_is_torchs() -> None:
    params = list(inspect.signature(ampkit.autocast.__init__).parameters.values())[1:]
    assert [p.name for p in params[:4]] == ["device_type", "dtype", "enabled", "cache_enabled"]
    assert all(p.kind is p.POSITIONAL_OR_KEYWORD for p in params[:4])
    assert params[3].default is None
    assert all(p.kind is p.KEYWORD_ONLY for p in params[4:])
    a = torch.ones(2, 2)
    with ampkit.autocast("cpu", BF16, False):
        assert (a @ a).dtype == F32
    with ampkit.autocast("cpu", BF16, True, False, **LISTS) as region:
        assert region.cache_enabled is False and (a @ a).dtype == BF16
        assert (a + a).dtype == BF16


def test_cache_enabled_none_follows_torch() -> None:
    assert ampkit.autocast("cpu").cache_enabled is torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        assert ampkit.autocast("cpu").cache_enabled is False
    finally:
        torch.set_autocast_cache_enabled(True)


@pytest.mark.parametrize("make", [ampkit.autocast, amp.autocast], ids=["core", "dialect"])
def test_disabled_region_accepts_any_torch_dtype_silently(make: type) -> None:
    a = torch.ones(2, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch accepts this without a word
        with make("cpu", F32, enabled=False):
            assert (a @ a).dtype == F32 and not torch.is_autocast_enabled("cpu")
        with make("cpu", torch.float64, False):
            assert (a @ a).dtype == F32


def test_enabled_region_still_rejects_an_unsupported_dtype() -> None:
    with pytest.raises(ValueError, match=r"dtype must be torch\.float16 or torch\.bfloat16"):
        ampkit.autocast("cpu", F32)
    with pytest.warns(UserWarning, match="disabling autocast"), amp.autocast("cpu", F32):
        assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("make", [ampkit.autocast, amp.autocast], ids=["core", "dialect"])
@pytest.mark.parametrize("device", ["not a real device", "gpu", "cuda:0x"])
def test_unknown_device_is_a_runtime_error(make: type, device: str) -> None:
    with pytest.raises(RuntimeError, match="device_type") as info:
        make(device)
    assert isinstance(info.value, UnsupportedDeviceError)
    assert isinstance(info.value, ValueError)  # also a bad argument value
    assert "'cpu'" in str(info.value)  # lists what is accepted


def test_non_string_device_is_a_value_error_that_asks_for_a_string() -> None:
    with pytest.raises(ValueError, match=r"`device_type` of type `str`"):
        ampkit.autocast(torch.device("cpu"))  # type: ignore[arg-type]


def test_decorating_a_non_callable_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="requires a callable"):
        ampkit.autocast("cpu")(torch.ones(2))  # type: ignore[arg-type]


def test_dialect_cpu_autocast_warns_as_torch_deprecates_it() -> None:
    deprecated = r"torch.cpu.amp.autocast\(args...\)` is deprecated"
    with pytest.warns(FutureWarning, match=deprecated), amp.cpu_autocast():
        assert torch.is_autocast_enabled("cpu")


def test_regions_work_with_torch_autocast_rebound_to_ampkit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A drop-in swap (``torch.autocast = ampkit.torch.autocast``) must not make ampkit's
    own regions enter themselves instead of native autocast."""
    monkeypatch.setattr(torch, "autocast", amp.autocast)
    monkeypatch.setattr(torch.amp, "autocast", amp.autocast)
    a = torch.ones(2, 2)
    with torch.autocast("cpu", BF16, policy="torch-cpu-legacy"):
        assert (a @ a).dtype == F32 and torch.mm(a, a).dtype == BF16
    with ampkit.autocast("cpu", BF16, **LISTS):
        assert (a + a).dtype == BF16 and torch.mm(a, a).dtype == F32
    assert _clean()


# -- all state restored, whatever the exception -------------------------------------------------

@pytest.mark.parametrize("error", [KeyboardInterrupt, SystemExit, ValueError])
def test_region_restores_everything_on_any_exception(error: type[BaseException]) -> None:
    inner = ampkit.autocast("cpu", F16, custom_black_list=["add"])
    with pytest.raises(error), ampkit.autocast("cpu", BF16, **LISTS), inner:
        raise error()
    assert _clean()

    @ampkit.autocast("cpu", BF16, **LISTS)
    def step() -> None:
        raise error()

    with pytest.raises(error):
        step()
    assert _clean()


def test_interrupt_while_entering_leaves_nothing_behind(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(self: object) -> None:
        raise KeyboardInterrupt

    # Ctrl-C lands after native autocast was entered and the Autocast kernels' rules
    # were activated, while the mode (for a Python composite on the list) is pushed.
    monkeypatch.setattr(rules.PolicyMode, "__enter__", interrupted)
    with pytest.raises(KeyboardInterrupt), ampkit.autocast(
            "cpu", BF16, custom_white_list=["add", "interpolate"], custom_black_list=["mm"]):
        pass
    assert _clean()


def test_interrupt_while_activating_kernel_rules_leaves_nothing_behind(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(kernels, "activate", interrupted)
    with pytest.raises(KeyboardInterrupt), ampkit.autocast("cpu", BF16, **LISTS):
        pass
    assert _clean()


def test_exiting_a_region_closes_regions_left_open_inside_it() -> None:
    """A region entered in a forward pre-hook and left by an interrupt (its exit never
    ran) must not outlive the region around it."""
    outer = ampkit.autocast("cpu", BF16, **LISTS)
    inner = ampkit.autocast("cpu", F16, custom_black_list=["add"])
    outer.__enter__()
    inner.__enter__()
    outer.__exit__(None, None, None)  # inner.__exit__ never called
    assert _clean()
    with pytest.raises(RuntimeError, match="not entered"):
        inner.__exit__(None, None, None)
    assert _clean()


def test_interrupt_in_a_forward_under_a_region_leaves_plain_code_in_fp32() -> None:
    class Interrupting(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise KeyboardInterrupt

    model = nn.Sequential(nn.Linear(4, 4), Interrupting())
    with pytest.raises(KeyboardInterrupt), ampkit.autocast("cpu", BF16, **LISTS):
        model(torch.rand(2, 4))
    a = torch.rand(3, 3)
    assert (a @ a).dtype == F32 and _clean()


# -- import cost -------------------------------------------------------------------------------

def test_import_ampkit_does_not_load_torch_dynamo() -> None:
    import subprocess

    code = ("import sys, torch, ampkit, ampkit.torch, ampkit.paddle, ampkit.mxnet\n"
            "with ampkit.autocast('cpu', custom_white_list=['add']):\n"
            "    torch.ones(1) + 1\n"
            "print(sorted(m for m in ('torch._dynamo', 'sympy', 'onnx') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
