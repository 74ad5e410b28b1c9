"""Where a pure mode's rounding is checked: once per ``initialize``, where the user's
``master_weights`` text becomes a :class:`~ampkit.conversion.levels.MasterWeights` member; the pure
package then takes that member as already checked. Each public entry of
:mod:`ampkit.pure` still checks a rounding given to it as text."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch

import ampkit
import ampkit.conversion.levels
import ampkit.pure.optimizer
from ampkit.conversion.levels import MasterWeights
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
    assert [pure_rounding(opt) for opt in opts] == [mode] * optimizers


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


@pytest.mark.parametrize("member", [MasterWeights.FP32, MasterWeights.NONE])
def test_a_member_that_is_not_a_pure_mode_is_refused(member):
    opt = _opt()
    with pytest.raises(ValueError, match="rounding must be one of"):
        PureLowPrecisionOptimizer(opt, member)
    with pytest.raises(ValueError, match="rounding must be one of"):
        mark_pure_models([torch.nn.Linear(2, 2)], member, None)
    assert pure_rounding(opt) is None


def test_a_pure_member_and_its_text_make_the_same_optimizer():
    by_member = PureLowPrecisionOptimizer(_opt(), MasterWeights.KAHAN, seed=3)
    by_text = PureLowPrecisionOptimizer(_opt(), "kahan", seed=3)
    assert pure_rounding(by_member) == pure_rounding(by_text) == "kahan"
    assert type(by_member) is type(by_text)
    assert by_member.param_groups[0]["rounding_seed"] == 3
    # made pure again with the same mode, in either form: unchanged
    assert pure_low_precision(by_member, "kahan") is by_member
    assert pure_low_precision(by_text, MasterWeights.KAHAN) is by_text
    with pytest.raises(ValueError, match="already trains in pure low precision with "
                                         "rounding='kahan', not 'stochastic'"):
        pure_low_precision(by_member, MasterWeights.STOCHASTIC)
