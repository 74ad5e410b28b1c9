"""The anchors' own mixed-precision tests, as behaviours of ampkit's integrations.

Each test checks what the named test of Lightning (``tests/tests_pytorch``, 2.6) or
accelerate (``tests``, 1.15) checks of its own mixed precision, with the same inputs and
the same assertions, run against ``AmpkitPrecision`` / ``AmpkitAccelerator`` on CPU. The
precision flag becomes the ampkit level that means the same (``"16-mixed"``/
``"bf16-mixed"``: ``AmpkitPrecision("O1", dtype)``, autocast around the steps), and
each further difference is said where it is made. The anchors' real files, run against
ampkit, and the tests of theirs that cannot pass are listed in docs/integrations.md.
"""

from __future__ import annotations

import pickle
from unittest import mock

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")
pytest.importorskip("accelerate")

from accelerate.utils import AutocastKwargs, GradScalerKwargs  # noqa: E402
from lightning.pytorch.demos.boring_classes import BoringModel  # noqa: E402
from lightning.pytorch.utilities import GradClipAlgorithmType  # noqa: E402

import ampkit  # noqa: E402
from ampkit.integrations.accelerate import AmpkitAccelerator  # noqa: E402
from ampkit.integrations.lightning import AmpkitPrecision  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

_DTYPES = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}


def _plugin(precision: str) -> AmpkitPrecision:
    # ampkit's O1 casts the model's outputs to fp32 (apex's rule); torch.autocast, which
    # the anchors' "*-mixed" flags use, leaves them low: ask for that
    dtype = _DTYPES[precision]
    return AmpkitPrecision("O1", dtype, cast_model_outputs=dtype)


def _trainer(**kwargs) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, **kwargs)


# -- Lightning: tests/tests_pytorch/plugins/precision/test_amp.py ---------------------

def test_clip_gradients_dispatches_by_algorithm() -> None:
    # mirrors plugins/precision/test_amp.py::test_clip_gradients
    optimizer = mock.Mock(spec=torch.optim.Optimizer)
    precision = _plugin("16-mixed")
    precision.clip_grad_by_value = mock.Mock()
    precision.clip_grad_by_norm = mock.Mock()
    precision.clip_gradients(optimizer)
    precision.clip_grad_by_value.assert_not_called()
    precision.clip_grad_by_norm.assert_not_called()
    precision.clip_gradients(optimizer, clip_val=1.0,
                             gradient_clip_algorithm=GradClipAlgorithmType.VALUE)
    precision.clip_grad_by_value.assert_called_once()
    precision.clip_grad_by_norm.assert_not_called()
    precision.clip_grad_by_value.reset_mock()
    precision.clip_gradients(optimizer, clip_val=1.0,
                             gradient_clip_algorithm=GradClipAlgorithmType.NORM)
    precision.clip_grad_by_value.assert_not_called()
    precision.clip_grad_by_norm.assert_called_once()


def test_no_grad_inside_the_region_keeps_gradient_tracking_after_it() -> None:
    # mirrors plugins/precision/test_amp.py::test_amp_with_no_grad
    layer = torch.nn.Linear(2, 1)
    x = torch.randn(1, 2)
    amp = _plugin("bf16-mixed")
    with amp.autocast_context_manager():
        with torch.no_grad():
            _ = layer(x)
        loss = layer(x).mean()
        loss.backward()
        assert loss.grad_fn is not None


# -- Lightning: tests/tests_pytorch/plugins/precision/test_amp_integration.py ---------

class _FusedOptimizerParityModel(BoringModel):
    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.fused = fused

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # the anchor checks for torch.amp.GradScaler; the plugin's is ampkit's
        assert isinstance(self.trainer.precision_plugin.scaler, ampkit.GradScaler)
        return torch.optim.Adam(self.parameters(), lr=1.0, fused=self.fused)


def test_fused_adam_trains_like_plain_adam() -> None:
    # mirrors plugins/precision/test_amp_integration.py::test_amp_fused_optimizer_parity
    # (cuda -> cpu)
    def run(fused: bool) -> list[torch.Tensor]:
        pl.seed_everything(1234)
        model = _FusedOptimizerParityModel(fused)
        _trainer(plugins=[_plugin("16-mixed")], max_steps=5).fit(model)
        return [p.detach().clone() for p in model.parameters()]

    for p, q in zip(run(False), run(True), strict=True):
        torch.testing.assert_close(p, q)


def test_a_skipped_training_step_skips_the_scaler_too() -> None:
    # mirrors plugins/precision/test_amp_integration.py::
    # test_skip_training_step_with_grad_scaler (cuda -> cpu)
    class Model(BoringModel):
        def training_step(self, batch, batch_idx):
            if batch_idx % 2:
                return None  # no backward: no unscale, step or update either
            return super().training_step(batch, batch_idx)

    trainer = pl.Trainer(accelerator="cpu", devices=1, plugins=[_plugin("16-mixed")],
                         barebones=True, max_steps=5, gradient_clip_val=0.5)
    assert isinstance(trainer.precision_plugin, AmpkitPrecision)
    model = Model()
    plugin = trainer.precision_plugin
    # the scaler exists once the Trainer converts the module: wrap it then
    original = plugin.convert_module

    def convert(module):
        out = original(module)
        plugin.scaler = mock.Mock(wraps=plugin.scaler)
        return out

    plugin.convert_module = convert
    trainer.fit(model)
    assert plugin.scaler.unscale_.call_count == 3
    assert plugin.scaler.step.call_count == 3
    assert plugin.scaler.update.call_count == 3


# -- Lightning: tests/tests_pytorch/models/test_amp.py ------------------------------

class _AMPTestModel(BoringModel):
    def step(self, batch):
        self._assert_autocast_enabled()
        output = self(batch)
        assert output.dtype == _DTYPES[self.trainer.precision_plugin.precision]
        return self.loss(output)

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        self._assert_autocast_enabled()
        output = self(batch)
        assert output.dtype == _DTYPES[self.trainer.precision_plugin.precision]
        return output

    def _assert_autocast_enabled(self):
        assert self.trainer.precision_plugin.device == "cpu"
        assert torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_amp_cpus_single_device(tmp_path, precision) -> None:
    # mirrors models/test_amp.py::test_amp_cpus[single_device-*] (the ddp_spawn cases:
    # test_integration_spawn.py); the anchor's dtype assertion, which binds as
    # ``(dtype == float16) if not bf16 else bfloat16``, is made for both dtypes here
    trainer = _trainer(default_root_dir=tmp_path, strategy="single_device",
                       plugins=[_plugin(precision)], max_epochs=1, limit_train_batches=1,
                       limit_val_batches=1, limit_test_batches=1, limit_predict_batches=1)
    model = _AMPTestModel()
    trainer.fit(model)
    trainer.test(model)
    trainer.predict(model)


@pytest.mark.parametrize("clip_val", [0, 10])
def test_gradients_are_clipped_only_with_a_positive_value(tmp_path, clip_val) -> None:
    # mirrors models/test_amp.py::test_precision_16_clip_gradients
    with mock.patch("torch.nn.utils.clip_grad_norm_") as clip:
        _trainer(default_root_dir=tmp_path, plugins=[_plugin("16-mixed")], max_epochs=1,
                 limit_train_batches=4, limit_val_batches=0,
                 gradient_clip_val=clip_val).fit(BoringModel())
    assert clip.called == (clip_val > 0)


# -- accelerate: tests/test_kwargs_handlers.py ---------------------------------------

def test_grad_scaler_kwargs_reach_the_scaler() -> None:
    # mirrors test_kwargs_handlers.py::KwargsHandlerTester::test_grad_scaler_kwargs
    # (non-CPU -> CPU; the scaler's public getters for torch's private attributes)
    handler = GradScalerKwargs(init_scale=1024, growth_factor=2)
    accelerator = AmpkitAccelerator(mixed_precision="fp16", cpu=True,
                                    kwargs_handlers=[handler])
    assert accelerator.mixed_precision == "fp16"
    scaler = accelerator.scaler
    assert scaler.get_scale() == 1024.0
    assert scaler.get_growth_factor() == 2.0
    assert scaler.get_backoff_factor() == 0.5
    assert scaler.get_growth_interval() == 2000
    assert scaler.is_enabled() is True


def test_autocast_kwargs_disable_a_nested_block() -> None:
    # mirrors test_kwargs_handlers.py::KwargsHandlerTester::test_autocast_kwargs
    # (non-CPU -> CPU; level O1: the level whose accelerator.autocast() region casts,
    # as accelerate's fp16 mode's does)
    kwargs = AutocastKwargs(enabled=False)
    accelerator = AmpkitAccelerator(level="O1", mixed_precision="fp16", cpu=True)
    a, b, c, d = (torch.rand((8, 8), device=accelerator.device) for _ in range(4))
    with accelerator.autocast():
        e_float16 = torch.mm(a, b)
        assert e_float16.dtype == torch.float16
        with accelerator.autocast(autocast_handler=kwargs):
            f_float32 = torch.mm(c, e_float16.float())
            assert f_float32.dtype == torch.float32
        g_float16 = torch.mm(d, f_float32)
        assert g_float16.dtype == torch.float16


# -- accelerate: tests/test_accelerator.py -------------------------------------------

@pytest.mark.parametrize("mixed_precision", ["no", "fp16"])
def test_unwrapped_model_runs_and_pickles(mixed_precision) -> None:
    # mirrors test_accelerator.py::AcceleratorTester::test_can_unwrap_model and
    # ::test_can_unwrap_model_fp16 (non-CPU -> CPU)
    model = torch.nn.Linear(2, 4)
    accelerator = AmpkitAccelerator(mixed_precision=mixed_precision, cpu=True)
    inputs = torch.randn(10, 2)
    model = accelerator.prepare(model)
    model(inputs)
    model = accelerator.unwrap_model(model, keep_fp32_wrapper=False)
    model(inputs)
    model_loaded = pickle.loads(pickle.dumps(model))
    model_loaded(inputs)
