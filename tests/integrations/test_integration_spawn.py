"""The integrations under spawn launchers: ``AmpkitPrecision`` and ``AmpkitAccelerator``
pickle and unpickle to equal settings, a Lightning ``ddp_spawn`` fit runs on 2 CPU
processes, and an ``accelerate launch`` run on 2 CPU processes trains with a pickled
accelerator.

The launches run in a process of their own (the scripts in ``launch_scripts/``) with a
wall-clock bound stretched by the machine's load, as the distributed harness does, and
killed with everything they started if it passes.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")
pytest.importorskip("accelerate")

from accelerate.utils import AutocastKwargs, GradScalerKwargs  # noqa: E402

import ampkit  # noqa: E402
from ampkit import AmpConfig  # noqa: E402
from ampkit.integrations.accelerate import AmpkitAccelerator  # noqa: E402
from ampkit.integrations.lightning import AmpkitPrecision  # noqa: E402
from tests.distributed_harness import load_factor  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

SCRIPTS = Path(__file__).parent / "launch_scripts"
ROOT = Path(__file__).parents[2]


def _round_trip(obj):
    return pickle.loads(pickle.dumps(obj))


@pytest.mark.parametrize("make", [
    lambda: AmpkitPrecision("O2", torch.float16, custom_black_list={"softmax"},
                            hysteresis=2, step_scheduler_on_skip=True),
    lambda: AmpkitPrecision(config=AmpConfig("O1", "bfloat16", policy="torch")),
    lambda: AmpkitPrecision("O2", torch.bfloat16, cast_model_type=torch.bfloat16),
], ids=["fp16-options", "config", "apex-override"])
def test_precision_plugin_pickles_to_equal_settings(make) -> None:
    plugin = make()
    copy = _round_trip(plugin)
    assert copy.config == plugin.config
    assert copy._settings == plugin._settings
    assert copy.step_scheduler_on_skip == plugin.step_scheduler_on_skip
    assert repr(copy) == repr(plugin) and copy.precision == plugin.precision


def test_precision_plugin_pickles_after_converting_with_its_scaler_state() -> None:
    plugin = AmpkitPrecision("O2", torch.float16, init_scale=8.0)
    plugin.convert_module(torch.nn.Linear(2, 2))
    copy = _round_trip(plugin)
    assert copy.state_dict() == plugin.state_dict()
    assert copy.device == "cpu"


@pytest.fixture
def fresh_gradient_state():
    """accelerate's ``GradientState`` is one state shared by every accelerator of the
    process; a loop an earlier test left mid-epoch leaves a weak reference to its
    dataloader in it, which no accelerator (accelerate's own included) then pickles."""
    from accelerate.state import GradientState

    GradientState._reset_state()
    yield
    GradientState._reset_state()


@pytest.mark.usefixtures("fresh_gradient_state")
def test_accelerator_pickles_to_equal_settings() -> None:
    accelerator = AmpkitAccelerator(
        level="O2", dtype="float16", cpu=True, custom_black_list={"softmax"},
        cast_model_type=torch.float16,
        kwargs_handlers=[GradScalerKwargs(init_scale=1024.0), AutocastKwargs(cache_enabled=False)])
    copy = _round_trip(accelerator)
    assert copy._ampkit == accelerator._ampkit
    assert copy.ampkit_config == accelerator.ampkit_config
    assert copy.scaler.get_scale() == 1024.0
    assert copy._ampkit_cache_enabled is False
    assert copy.mixed_precision == "fp16" and repr(copy) == repr(accelerator)


@pytest.mark.usefixtures("fresh_gradient_state")
def test_accelerator_mid_epoch_pickles_exactly_as_accelerates_own() -> None:
    from accelerate import Accelerator

    results = []
    for make in (lambda: Accelerator(cpu=True),
                 lambda: AmpkitAccelerator(level="O1", dtype="bfloat16", cpu=True)):
        accelerator = make()
        loader = accelerator.prepare(torch.utils.data.DataLoader(list(range(8)), batch_size=2))
        for _ in loader:
            break  # the loop left mid-epoch: its dataloader stays in the shared state
        with pytest.raises(TypeError) as caught:
            pickle.dumps(accelerator)
        results.append(str(caught.value))
        del loader
    assert results[0] == results[1] == "cannot pickle 'weakref.ReferenceType' object"


def test_precision_plugin_device_is_the_autocast_device_type() -> None:
    # Lightning's MixedPrecision.device: the device type its autocast regions run on
    plugin = AmpkitPrecision("O1", torch.bfloat16)
    assert plugin.device == ("cuda" if torch.cuda.is_available() else "cpu")
    trainer = pl.Trainer(accelerator="cpu", devices=1, plugins=[plugin], max_steps=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    from lightning.pytorch.demos.boring_classes import BoringModel

    trainer.fit(BoringModel())
    assert trainer.precision_plugin.device == "cpu"


def _run_bounded(cmd: list[str], budget: float, env: dict[str, str]) -> str:
    """Run ``cmd`` in a session of its own; kill the whole session past the budget
    (seconds of an unloaded machine, stretched by the load)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, cwd=ROOT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=budget * load_factor())
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{cmd[-2]} ran past its budget:\n{out[-4000:]}")
    assert proc.returncode == 0, out[-4000:]
    return out


def _env() -> dict[str, str]:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    # the ampkit this test imported, in the launched processes too
    source = Path(ampkit.__file__).parents[1]
    env["PYTHONPATH"] = os.pathsep.join([str(source), str(ROOT),
                                         env.get("PYTHONPATH", "")])
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.distributed
def test_lightning_ddp_spawn_fits_on_two_cpu_processes(tmp_path) -> None:
    # mirrors Lightning's models/test_amp.py::test_amp_cpus[ddp_spawn-bf16-mixed]
    # (2 epochs of 2 batches, fit only); the steps assert the region is on and the
    # output bfloat16 in each rank, so a fit that finished checked them
    out = tmp_path / "result.json"
    _run_bounded([sys.executable, str(SCRIPTS / "lightning_ddp_spawn.py"), str(out)],
                 budget=120.0, env=_env())
    result = json.loads(out.read_text())
    assert result["finished"]
    assert result["changed"] and result["finite"]
    assert result["plugin"] == ("AmpkitPrecision(level='O1', dtype=torch.bfloat16, "
                                "custom_black_list=('softmax',), "
                                "cast_model_outputs=torch.bfloat16)")


@pytest.mark.distributed
def test_accelerate_launch_trains_with_a_pickled_accelerator(tmp_path) -> None:
    out = tmp_path / "rank"
    accelerate = Path(sys.executable).parent / "accelerate"
    cmd = [str(accelerate), "launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_ip", "127.0.0.1", "--main_process_port", str(_free_port()),
           str(SCRIPTS / "accelerate_pickled.py"), str(out)]
    _run_bounded(cmd, budget=120.0, env={**_env(), "ACCELERATE_USE_CPU": "true"})
    ranks = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in (0, 1)]
    for result in ranks:
        assert result["same_settings"]
        assert result["distributed_type"] == "MULTI_CPU" and result["num_processes"] == 2
        # DistributedDataParallelKwargs reached DDP (as accelerate's test_kwargs_handlers
        # main() checks)
        assert result["bucket_cap_mb"] == 15 and result["find_unused_parameters"] is True
        # GradScalerKwargs(init_scale=1024, growth_factor=4, growth_interval=1): the
        # scale grows 4x after each finite step, as torch.amp.GradScaler's does
        assert result["scales"] == [4096.0, 16384.0, 65536.0]
    assert ranks[0]["weight"] == ranks[1]["weight"]  # DDP kept the replicas equal
