"""One route from settings to a converted model: every surface merges its
settings with ampkit.config.merged_config, ampkit.compare prepares its low-precision
copy with the function initialize prepares models with (fp8 included), and one
initialize builds the level's conversion once."""

from __future__ import annotations

import ast
import copy
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import ampkit
import ampkit.conversion.levels
import ampkit.front_door
from ampkit.config import AmpConfig
from ampkit.conversion import get_conversion
from ampkit.tools.accuracy.tune import TuneWarning

SRC = Path(__file__).resolve().parents[2] / "src" / "ampkit"


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 32), nn.GELU(),
                         nn.Linear(32, 32), nn.Linear(32, 8))


def _shape(model: nn.Module) -> list[tuple]:
    # what conversion decides, module by module: its class, its parameters' and
    # buffers' dtypes, and the conversion it carries
    return [(name, type(m).__qualname__,
             [(n, p.dtype) for n, p in m.named_parameters(recurse=False)],
             [(n, b.dtype) for n, b in m.named_buffers(recurse=False)],
             get_conversion(m))
            for name, m in model.named_modules()]


def _spy_on_prepare_models(monkeypatch) -> list[nn.Module]:
    """The models every later call of prepare_models converts, in order."""
    seen: list[nn.Module] = []
    prepare = ampkit.front_door.prepare_models

    def spy(models, *args, **kwargs):
        done = prepare(models, *args, **kwargs)
        seen.extend(models)
        return done

    monkeypatch.setattr(ampkit.front_door, "prepare_models", spy)
    return seen


def _compared_copy(monkeypatch, model: nn.Module, **compare_kwargs) -> nn.Module:
    """The low-precision copy ampkit.compare ran, as prepare_models left it."""
    seen = _spy_on_prepare_models(monkeypatch)
    ampkit.compare(model, torch.randn(4, 16), **compare_kwargs)
    assert len(seen) == 1
    return seen[0]


@pytest.mark.parametrize("config", [
    AmpConfig("O2", "bfloat16", custom_black_list=["gelu"], keep_fp32_modules=["2"]),
    AmpConfig("O3", "bfloat16"),
    AmpConfig("O1", "bfloat16", policy="conservative"),
    AmpConfig("O2", "bfloat16", master_weights="kahan", rounding_seed=0),
])
def test_compare_converts_a_config_as_initialize_does(monkeypatch, config) -> None:
    model = _mlp()
    trained = ampkit.initialize(copy.deepcopy(model), config=config)
    compared = _compared_copy(monkeypatch, model, precision=config)
    assert _shape(compared) == _shape(trained)
    assert all(p.dtype is torch.float32 for p in model.parameters())  # left as it was


def test_compare_converts_a_level_as_initialize_does(monkeypatch) -> None:
    model = _mlp()
    trained = ampkit.initialize(copy.deepcopy(model), level="O2", dtype=torch.bfloat16,
                                custom_white_list=["add"])
    compared = _compared_copy(monkeypatch, model, precision="O2", dtype=torch.bfloat16,
                              custom_white_list=["add"])
    assert _shape(compared) == _shape(trained)


def test_compare_converts_a_configs_fp8_layers_as_initialize_does(monkeypatch) -> None:
    pytest.importorskip("torchao.float8")
    config = AmpConfig("O2", "bfloat16", fp8="tensorwise")  # tensorwise: CPU's _scaled_mm
    model = _mlp()
    with pytest.warns(ampkit.fp8.Fp8SkipWarning):
        trained = ampkit.initialize(copy.deepcopy(model), config=config)
    compared = _compared_copy(monkeypatch, model, precision=config)
    kinds = {type(m).__qualname__ for m in compared.modules()}
    assert "Float8Linear" in kinds  # the middle Linears train in fp8, as in training
    assert _shape(compared) == _shape(trained)


def test_compare_refuses_what_contradicts_its_config_in_initializes_words() -> None:
    config = AmpConfig("O2", "bfloat16")
    with pytest.raises(ValueError, match=r"^dtype=float16 contradicts the config's "
                                         r"dtype=bfloat16; give it once$"):
        ampkit.compare(_mlp(), torch.randn(2, 16), precision=config, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"^dtype='float16' contradicts the config's "
                                         r"dtype=bfloat16; give it once$"):
        ampkit.initialize(_mlp(), config=config, dtype="float16")


def test_one_initialize_builds_the_levels_conversion_once(monkeypatch) -> None:
    calls = []
    build = ampkit.conversion.levels.build_level

    def counted(*args, **kwargs):
        calls.append(args)
        return build(*args, **kwargs)

    monkeypatch.setattr(ampkit.conversion.levels, "build_level", counted)
    monkeypatch.setattr(ampkit.front_door, "build_level", counted)
    ampkit.initialize(_mlp(), level="O2", dtype=torch.bfloat16)
    assert len(calls) == 1
    calls.clear()
    config = AmpConfig("O2", "bfloat16")  # made once: its conversion with it
    assert len(calls) == 1
    ampkit.initialize(_mlp(), config=config)
    assert len(calls) == 1


def test_the_config_kept_conversion_is_left_out_of_pickles() -> None:
    import pickle

    config = AmpConfig("O2", "float16", keep_fp32_modules=["head"])
    state = config.__getstate__()
    assert set(state) == {f.name for f in ampkit.config.config_fields()}
    again = pickle.loads(pickle.dumps(config))
    assert again == config and copy.deepcopy(config) == config
    assert again.level_conversion()[1] == config.level_conversion()[1]


def _contradiction_checks(tree: ast.AST) -> int:
    # `x.replace(**{name: value}) != x`: a hand-written merge of a keyword into a config
    count = 0
    for node in ast.walk(tree):
        if (isinstance(node, ast.Compare) and isinstance(node.ops[0], ast.NotEq)
                and isinstance(node.left, ast.Call)
                and isinstance(node.left.func, ast.Attribute)
                and node.left.func.attr == "replace"):
            count += 1
    return count


def test_grep_finds_one_settings_merge() -> None:
    found = {str(path.relative_to(SRC)): _contradiction_checks(ast.parse(path.read_text()))
             for path in SRC.rglob("*.py")}
    assert {path: n for path, n in found.items() if n} == {"config.py": 1}
    text = "def f(cfg, name, value):\n    return cfg.replace(**{name: value}) != cfg\n"
    assert _contradiction_checks(ast.parse(text)) == 1


def test_tune_prepares_each_trial_as_initialize_does(monkeypatch) -> None:
    # Each trial's copy is converted by the function initialize converts models with,
    # at level O1 with the trial's policy, and measures what that model computes.
    seen = _spy_on_prepare_models(monkeypatch)
    model = _mlp()
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(x)

    def metric(m: nn.Module) -> float:
        with torch.no_grad():
            return float((m(x).float() - ref).pow(2).mean())

    with pytest.warns(TuneWarning):  # no tolerance: one op moves per trial
        result = ampkit.tune(model, metric, torch.bfloat16, tolerance=0.0, budget=3)
    assert len(result.trials) == 3 and len(result.trials[-1].fp32_ops) == 2
    assert len(seen) == len(result.trials)
    for trial, tuned in zip(result.trials, seen):
        trained = ampkit.initialize(copy.deepcopy(model), level="O1", dtype=torch.bfloat16,
                                    policy=trial.policy)
        assert _shape(tuned) == _shape(trained)
        assert metric(trained) == trial.metric  # what training runs, bit for bit
    assert all(p.dtype is torch.float32 for p in model.parameters())  # left as it was
