"""What ``ampkit.compare`` costs on a deep model: the tensors it holds while it runs stay
within a bound relative to the model's activations (the float32 run keeps one copy of
each distinct tensor, the low-precision run keeps only numbers), and it reports its
progress as it goes (the command line draws it on stderr)."""

from __future__ import annotations

import gc

import torch
import torch.nn as nn

import ampkit

_LAYERS, _WIDTH, _BATCH = 12, 64, 256
_READINGS: list[int] = []


def _live_tensor_bytes() -> int:
    """Bytes of the distinct storages of every tensor Python holds now."""
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor):  # type(): proxies warn on isinstance
            if obj.device.type != "cpu":
                continue  # (meta or fake tensors an earlier test of this process left)
            try:
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            except RuntimeError:
                continue  # (a fake tensor or a freed storage: holds no memory here)
    return sum(storages.values())


class _Probe(nn.Module):
    """The model's last module: reads what is held at the end of each forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _READINGS.append(_live_tensor_bytes())
        return x


def _deep_model() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(_LAYERS):
        layers += [nn.Linear(_WIDTH, _WIDTH), nn.GELU(), nn.LayerNorm(_WIDTH)]
    return nn.Sequential(*layers, _Probe())


def test_compare_holds_about_one_float32_forward_of_activations_not_every_tensor_twice(
) -> None:
    model = _deep_model()
    x = torch.randn(_BATCH, _WIDTH, generator=torch.Generator().manual_seed(1))
    # one float32 output per op call (Linear, GELU, LayerNorm in each layer)
    activations = 3 * _LAYERS * _BATCH * _WIDTH * 4
    _READINGS.clear()
    model(x)  # the plain forward: the model and what autograd holds
    plain = _READINGS[-1]
    _READINGS.clear()
    result = ampkit.compare(model, x, precision="torch", dtype=torch.bfloat16)
    assert len(_READINGS) == 2  # the end of the float32 and of the bfloat16 forward
    assert len(result.ops) == 3 * _LAYERS
    held = max(_READINGS) - plain
    # Before: each run kept a clone of every watched op's inputs and outputs and of every
    # module's (about 7x the activations at the end of the second run). Now: the float32
    # run's copies (each distinct tensor once), the low-precision copy of the model and
    # its forward's own tensors.
    assert held <= 2.5 * activations, held / activations


def test_compare_reports_its_progress_run_by_run_op_call_by_op_call() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    seen: list[tuple[str, int, int | None]] = []
    result = ampkit.compare(model, torch.ones(4, 8), precision="O1", dtype=torch.bfloat16,
                            progress=lambda run, done, total: seen.append((run, done, total)))
    calls = len(result.ops)
    assert calls == 3
    assert seen == [("float32", 1, None), ("float32", 2, None), ("float32", 3, None),
                    ("bfloat16", 1, 3), ("bfloat16", 2, 3), ("bfloat16", 3, 3)]
