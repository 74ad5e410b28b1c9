"""Where a pure mode's rounding is checked: once per ``initialize``, where the user's
``master_weights`` text becomes a :class:`~ampkit.conversion.levels.MasterWeights` member;
the pure package then takes that member's :class:`~ampkit.conversion.levels.Rounding` as
already checked, and carries the member only. Each public entry of :mod:`ampkit.pure`
still checks a rounding given to it as text."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch

import ampkit
import ampkit.conversion.levels
import ampkit.pure.optimizer
from ampkit.conversion.levels import MasterWeights, Rounding
from ampkit.pure import (
    PureLowPrecisionOptimizer,
    check_pure_optimizer,
    mark_pure_models,
    pure_low_precision,
    pure_rounding,
)


def _spy(monkeypatch: pytest.MonkeyPatch, module: Any, name: str,
         calls: list[tuple[str, Any]]) -> None:
    real = getattr(module, name)

    def spy(value: Any) -> Any:
        calls.append((name, value))
        return real(value)

    monkeypatch.setattr(module, name, spy)


@pytest.mark.parametrize("optimizers", [1, 2])
@pytest.mark.parametrize("mode", ["stochastic", "kahan"])
def test_a_pure_initialize_checks_its_rounding_once(monkeypatch, mode, optimizers):
    calls: list[tuple[str, Any]] = []
    # every binding of the two checks: the text parse and the pure package's own
    _spy(monkeypatch, ampkit.conversion.levels, "master_weights_value", calls)
    check = ampkit.pure.optimizer.check_rounding
    for module in [m for name, m in list(sys.modules.items()) if name.startswith("ampkit")]:
        if getattr(module, "check_rounding", None) is check:
            _spy(monkeypatch, module, "check_rounding", calls)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    opts = [torch.optim.SGD(model[i].parameters(), lr=0.1) for i in range(optimizers)]
    model, opts = ampkit.initialize(model, opts, level="O2", dtype="bfloat16",
                                    master_weights=mode)
    texts = [(name, value) for name, value in calls if isinstance(value, str)]
    assert texts == [("master_weights_value", mode)]
    assert [name for name, _ in calls if name == "check_rounding"] == []
    assert [pure_rounding(opt).value for opt in opts] == [mode] * optimizers


def _opt() -> torch.optim.Optimizer:
    w = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    return torch.optim.SGD([w], lr=0.1)


def test_each_public_entry_checks_a_rounding_given_as_text():
    message = r"rounding must be one of \['stochastic', 'kahan', 'nearest'\], got 'kahn'"
    with pytest.raises(ValueError, match=message):
        PureLowPrecisionOptimizer(_opt(), "kahn")
    with pytest.raises(ValueError, match=message):
        pure_low_precision(_opt(), "kahn")
    with pytest.raises(ValueError, match=message):
        check_pure_optimizer(_opt(), "kahn")
    with pytest.raises(ValueError, match=message):
        mark_pure_models([torch.nn.Linear(2, 2)], "kahn", None)


@pytest.mark.parametrize("member", list(MasterWeights))
def test_a_master_weights_member_is_no_rounding(member):
    # one vocabulary per argument: a pure mode's rounding is member.rounding
    opt = _opt()
    with pytest.raises(ValueError, match="rounding must be one of"):
        PureLowPrecisionOptimizer(opt, member)
    with pytest.raises(ValueError, match="rounding must be one of"):
        mark_pure_models([torch.nn.Linear(2, 2)], member, None)
    assert pure_rounding(opt) is None


def test_a_rounding_member_and_its_text_make_the_same_optimizer():
    by_member = PureLowPrecisionOptimizer(_opt(), MasterWeights.KAHAN.rounding, seed=3)
    by_text = PureLowPrecisionOptimizer(_opt(), "kahan", seed=3)
    assert pure_rounding(by_member) is pure_rounding(by_text) is Rounding.KAHAN
    assert type(by_member) is type(by_text)
    assert by_member.param_groups[0]["rounding_seed"] == 3
    # made pure again with the same mode, in either form: unchanged
    assert pure_low_precision(by_member, "kahan") is by_member
    assert pure_low_precision(by_text, Rounding.KAHAN) is by_text
    with pytest.raises(ValueError, match="already trains in pure low precision with "
                                         "rounding='kahan', not 'stochastic'"):
        pure_low_precision(by_member, Rounding.STOCHASTIC)


def test_the_rounding_is_a_property_of_the_master_weights_member():
    assert MasterWeights.STOCHASTIC.rounding is Rounding.STOCHASTIC
    assert MasterWeights.KAHAN.rounding is Rounding.KAHAN
    assert MasterWeights.FP32.rounding is None and MasterWeights.NONE.rounding is None
    assert [r.value for r in Rounding] == ["stochastic", "kahan", "nearest"]


@pytest.mark.parametrize("mode", ["stochastic", "KAHAN"])
def test_inside_a_pure_initialize_the_rounding_is_the_member_only(monkeypatch, mode):
    import ampkit.pure.models
    from ampkit.pure import pure_settings
    from ampkit.pure.optimizer import PureState

    given: list[Any] = []
    real_init = PureState.__init__

    def spy(self: PureState, rounding: Any, *args: Any, **kwargs: Any) -> None:
        given.append(rounding)
        real_init(self, rounding, *args, **kwargs)

    monkeypatch.setattr(PureState, "__init__", spy)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = ampkit.AmpConfig(level="O2", dtype="bfloat16", master_weights=mode)
    assert config.master_weights is MasterWeights(mode.lower())  # the enum, from the edge
    model, opt = ampkit.initialize(model, opt, config=config)
    expected = {"stochastic": Rounding.STOCHASTIC, "kahan": Rounding.KAHAN}[mode.lower()]
    assert given == [expected]
    settings = pure_settings(model)
    assert settings is not None and settings[0] is expected
    record = next(iter(ampkit.pure.models._PURE_PARAMS.values()))
    assert type(record.rounding) is Rounding


def test_pickles_and_checkpoints_keep_the_roundings_text():
    import pickle

    opt = PureLowPrecisionOptimizer(_opt(), "kahan", seed=2)
    state = opt._ampkit_pure.__getstate__()
    assert state["rounding"] == "kahan"  # text: pickles of either form load
    assert opt.state_dict()["ampkit_pure_low_precision"] == {"rounding": "kahan"}
    again = pickle.loads(pickle.dumps(opt))
    assert again._ampkit_pure.rounding is Rounding.KAHAN
    # a pickle of the state written when the rounding was held as text
    from ampkit.pure.optimizer import PureState

    old = PureState.__new__(PureState)
    old.__setstate__({"rounding": "stochastic", "chunk_bytes": None})
    assert old.rounding is Rounding.STOCHASTIC and old.compile_step is False
    other = PureLowPrecisionOptimizer(_opt(), "stochastic")
    with pytest.raises(ValueError, match="the checkpoint was saved with rounding='kahan'; "
                                         "this optimizer uses rounding='stochastic'"):
        other.load_state_dict(opt.state_dict())
