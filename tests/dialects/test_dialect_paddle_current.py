"""ampkit.paddle against Paddle 3's newer AMP API: the autocast state functions, the
GradScaler that also takes torch's spellings, and device questions answered from the
machine."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import ampkit.paddle as amp
from ampkit.common.device_support import device_supports_dtype
from ampkit.dialects.paddle import region as paddle_region


@pytest.fixture(autouse=True)
def _fresh_global_amp_dtype(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # Paddle's global AMP dtype (the last auto_cast's), which GradScaler.scale reads,
    # as a fresh process has it.
    monkeypatch.setattr(paddle_region, "_amp_dtype", "float16")
    yield

# -- autocast state ----------------------------------------------------------------------

STATE_READERS = (amp.get_autocast_dtype, amp.get_autocast_cpu_dtype,
                 lambda: amp.get_autocast_gpu_dtype())


def _dtypes() -> set[str]:
    return {read() for read in STATE_READERS}


def test_outside_a_region_the_state_is_off_and_float16() -> None:
    assert amp.is_autocast_enabled() is False
    assert _dtypes() == {"float16"}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_region_reports_its_dtype_and_restores_the_default(dtype: str) -> None:
    with amp.auto_cast(dtype=dtype):
        assert amp.is_autocast_enabled() is True
        assert _dtypes() == {dtype}
        # One state for every device, as in Paddle: the argument changes nothing.
        assert {amp.get_autocast_dtype(d) for d in (None, "cpu", "gpu", "gpu:0")} == {dtype}
        assert all(amp.is_autocast_enabled(d) for d in (None, "cpu", "gpu:1", "xpu"))
    assert amp.is_autocast_enabled() is False
    assert _dtypes() == {"float16"}


def test_nested_regions_report_the_innermost() -> None:
    with amp.auto_cast(dtype="bfloat16"):
        with amp.auto_cast(dtype="float16"):
            assert amp.get_autocast_dtype() == "float16"
        assert amp.get_autocast_dtype() == "bfloat16"
        with amp.auto_cast(enable=False):
            assert amp.is_autocast_enabled() is False
            assert amp.get_autocast_dtype() == "float16"
        with amp.auto_cast(level="O0"):
            assert amp.is_autocast_enabled() is False
        assert amp.is_autocast_enabled() is True


def test_the_state_follows_what_ops_actually_do() -> None:
    a = torch.rand(3, 3)
    with amp.auto_cast(dtype="bfloat16"):
        assert str((a @ a).dtype) == f"torch.{amp.get_autocast_dtype()}"


@pytest.mark.parametrize("bad", ["tpu", "gpu:x", 3, ("cpu",)])
def test_a_device_type_that_names_no_device_is_a_value_error(bad: object) -> None:
    for read in (amp.get_autocast_dtype, amp.is_autocast_enabled, amp.get_autocast_cpu_dtype):
        with pytest.raises(ValueError, match="device must be None or one of"):
            read(bad)  # type: ignore[arg-type]


# -- device questions ----------------------------------------------------------------------

def _cuda_capability_at_least(major: int, minor: int) -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability(0) >= (major, minor)


def test_gpu_support_is_asked_of_the_machine() -> None:
    # The build knows CUDA autocast whether or not a GPU is present; the answer may not
    # follow it.
    assert amp.is_float16_supported("gpu") == _cuda_capability_at_least(5, 3)
    assert amp.is_bfloat16_supported("gpu") == _cuda_capability_at_least(8, 0)
    assert amp.is_float16_supported("gpu:0") == amp.is_float16_supported("cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_without_cuda_no_gpu_dtype_is_supported() -> None:
    assert torch.amp.is_autocast_available("cuda")  # what the old answer read
    assert amp.is_float16_supported("gpu") is False
    assert amp.is_bfloat16_supported("gpu") is False


def test_a_gpu_index_that_is_not_present_is_not_supported() -> None:
    assert amp.is_float16_supported(f"gpu:{torch.cuda.device_count()}") is False


def test_the_cpu_and_the_default_device() -> None:
    assert amp.is_float16_supported("cpu") and amp.is_bfloat16_supported("cpu")
    default = torch.get_default_device().type
    assert amp.is_float16_supported() == device_supports_dtype(default, torch.float16)


@pytest.mark.parametrize("bad", ["xxx", "npu", "gpu:", "gpu:a", 111, 1.5, ["gpu"]])
def test_an_unknown_device_is_a_value_error_as_in_paddle(bad: object) -> None:
    for ask in (amp.is_float16_supported, amp.is_bfloat16_supported):
        with pytest.raises(ValueError, match=r"'cpu', 'gpu', 'gpu:x', 'xpu', 'xpu:x'"):
            ask(bad)  # type: ignore[arg-type]


def test_core_device_support_refuses_other_device_types() -> None:
    with pytest.raises(ValueError, match=r"device must be one of \['cpu', 'cuda', 'xpu'\]"):
        device_supports_dtype("meta", torch.float16)
    with pytest.raises(ValueError, match=r"device must be one of"):
        device_supports_dtype("not a device", torch.float16)
    with pytest.raises(TypeError, match="device must be a device name"):
        device_supports_dtype(0, torch.float16)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dtype must be"):
        device_supports_dtype("cpu", torch.float32)


# -- GradScaler: torch's spellings -----------------------------------------------------------

def _settings(scaler: amp.GradScaler) -> tuple[object, ...]:
    return (scaler.is_enable(), scaler.get_init_loss_scaling(), scaler.get_incr_ratio(),
            scaler.get_decr_ratio(), scaler.get_incr_every_n_steps(),
            scaler.get_decr_every_n_nan_or_inf(), scaler.is_use_dynamic_loss_scaling())


PADDLE_DEFAULTS = (True, 65536.0, 2.0, 0.5, 2000, 1, True)


@pytest.mark.parametrize(("args", "kwargs", "expected"), [
    ((), {}, PADDLE_DEFAULTS),
    ((), {"enabled": True, "init_scale": 512.0, "growth_factor": 4.0, "backoff_factor": 0.125,
          "growth_interval": 10}, (True, 512.0, 4.0, 0.125, 10, 1, True)),
    ((True, 256.0, 3.0, 0.25, 50, 3, False), {}, (True, 256.0, 3.0, 0.25, 50, 3, False)),
    ((True, 256.0), {"growth_factor": 8.0}, (True, 256.0, 8.0, 0.5, 2000, 1, True)),
    ((128.0, 3.0, 0.25, 40, True), {}, (True, 128.0, 3.0, 0.25, 40, 1, True)),
    ((64.0,), {}, (True, 64.0, 2.0, 0.5, 2000, 1, True)),
    (("cuda", 32.0, 3.0, 0.25, 20, True), {}, (True, 32.0, 3.0, 0.25, 20, 1, True)),
    (("cuda",), {}, PADDLE_DEFAULTS),
    (("cuda", 16.0), {}, (True, 16.0, 2.0, 0.5, 2000, 1, True)),
    (("cpu",), {"init_scale": 8.0, "enabled": True}, (True, 8.0, 2.0, 0.5, 2000, 1, True)),
    ((), {"device": "cuda", "init_scale": 4.0, "decr_every_n_nan_or_inf": 2,
          "use_dynamic_loss_scaling": False}, (True, 4.0, 2.0, 0.5, 2000, 2, False)),
    ((), {"init_loss_scaling": 1024.0, "init_scale": 1024.0}, (True, 1024.0, 2.0, 0.5, 2000, 1,
                                                               True)),
])
def test_paddle_and_torch_spellings_give_the_same_scaler(
        args: tuple[object, ...], kwargs: dict[str, object], expected: tuple[object, ...]) -> None:
    assert _settings(amp.GradScaler(*args, **kwargs)) == expected


@pytest.mark.parametrize("kwargs", [
    {"enable": True, "enabled": False}, {"init_loss_scaling": 1.0, "init_scale": 2.0},
    {"incr_ratio": 2.0, "growth_factor": 3.0}, {"decr_ratio": 0.5, "backoff_factor": 0.25},
    {"incr_every_n_steps": 10, "growth_interval": 20},
])
def test_a_paddle_and_a_torch_name_that_disagree_are_a_value_error(
        kwargs: dict[str, object]) -> None:
    paddle_name, torch_name = kwargs
    with pytest.raises(ValueError, match=f"{paddle_name}=.* and {torch_name}=.*same setting"):
        amp.GradScaler(**kwargs)


def test_torch_positional_disabled_scaler_is_paddles_disabled_scaler() -> None:
    for scaler in (amp.GradScaler(1024.0, 2.0, 0.5, 2000, False),
                   amp.GradScaler(1024.0, enabled=False), amp.GradScaler(enabled=False)):
        assert scaler.is_enabled() is False
        assert scaler.get_init_loss_scaling() == 1.0
        assert scaler.get_scale() == 0.0


def test_constructor_argument_errors() -> None:
    with pytest.raises(TypeError, match="multiple values for argument 'init_scale'"):
        amp.GradScaler(64.0, init_scale=32.0)
    with pytest.raises(TypeError, match="multiple values for argument 'enable'"):
        amp.GradScaler(True, enable=False)
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['growth'\]"):
        amp.GradScaler(growth=2.0)
    with pytest.raises(TypeError, match="at most 5 positional arguments"):
        amp.GradScaler(1.0, 2.0, 0.5, 10, True, 3)
    with pytest.raises(TypeError, match="enable must be a bool"):
        amp.GradScaler(enabled=1)
    with pytest.raises(ValueError, match="incr_ratio must be"):
        amp.GradScaler(growth_factor=0.5)  # the core's check, in Paddle's name


def test_torch_named_getters_and_setters_are_paddles_settings() -> None:
    scaler = amp.GradScaler(init_scale=2048.0, growth_factor=3.0, backoff_factor=0.25,
                            growth_interval=500)
    assert scaler.is_enabled() is True
    assert scaler.get_scale() == 2048.0
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor(),
            scaler.get_growth_interval()) == (3.0, 0.25, 500)
    scaler.set_growth_factor(5.0)
    scaler.set_backoff_factor(0.1)
    scaler.set_growth_interval(100)
    assert (scaler.get_incr_ratio(), scaler.get_decr_ratio(),
            scaler.get_incr_every_n_steps()) == (5.0, 0.1, 100)
    assert scaler.state_dict()["incr_ratio"] == 5.0


def test_get_scale_follows_the_dynamic_scale() -> None:
    w = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler = amp.GradScaler(init_scale=8.0)
    scaler.scale(w.sum() * float("inf")).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 4.0
    assert w.item() == 1.0


def test_a_torch_spelled_scaler_trains_like_torchs() -> None:
    torch.manual_seed(0)
    ref_model = torch.nn.Linear(4, 1)
    model = torch.nn.Linear(4, 1)
    model.load_state_dict(ref_model.state_dict())
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_scaler = torch.amp.GradScaler("cpu", 1024.0, 2.0, 0.5, 1)
    scaler = amp.GradScaler("cpu", 1024.0, 2.0, 0.5, 1)
    for _ in range(3):
        x = torch.rand(8, 4)
        for m, o, s in ((ref_model, ref_opt, ref_scaler), (model, opt, scaler)):
            o.zero_grad()
            s.scale(m(x).pow(2).mean()).backward()
            s.step(o)
            s.update()
    assert torch.equal(model.weight, ref_model.weight)
    assert scaler.get_scale() == ref_scaler.get_scale() == 8192.0
