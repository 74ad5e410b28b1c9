"""The boundary with torch's internals (``ampkit.torch_internals``): every entry listed
with its check, each check run on the torch at hand, and the behaviours the checks
exist for (a checkpoint internal renamed behind a surviving shim, a compile flag whose
meaning widened between releases)."""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint as cp

from ampkit import torch_internals as ti


@pytest.mark.parametrize("name", sorted(ti.ENTRIES))
def test_each_entry_says_what_it_is_for_and_its_check_passes(name: str) -> None:
    entry = ti.ENTRIES[name]
    assert entry.name == name and entry.names and entry.need and entry.public
    assert all(n.startswith("torch.") for n in entry.names)
    ti.check(name)  # raises TorchInternalsError naming the torch version where it fails


def test_an_unknown_entry_is_named_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"name: unknown torch internal 'nope'.*compile"):
        ti.check("nope")


def test_a_failed_check_names_the_torch_version_and_the_entry() -> None:
    error = ti.fail("checkpoint_recompute", "is gone")
    assert isinstance(error, RuntimeError)
    assert f"torch {torch.__version__}" in str(error) and "checkpoint_recompute" in str(error)


# -- compile_session ------------------------------------------------------------------------

def test_a_backend_runs_inside_the_compile_session() -> None:
    # torch 2.11/2.12: torch.compiler.is_compiling() is False here (fails before there:
    # a region's graph node run by AOTAutograd's trace was taken for a compiled run)
    ti.check_compile_session_in_a_backend()
    assert not ti.compiling()


# -- checkpoint_recompute ---------------------------------------------------------------------

def test_the_carry_is_undone_and_named_where_checkpoint_calls_other_internals(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A torch whose checkpoint() reaches none of the wrapped names (as 2.14's, which calls
    # a new internal behind a surviving shim, did for the old wrapper): simulated by a
    # checkpoint that runs the function itself.
    before = {n: getattr(cp, n, None) for n in (*ti._GENERATORS, "CheckpointFunction")}
    monkeypatch.setattr(cp, "checkpoint", lambda fn, *args, **kwargs: fn(*args))
    with pytest.warns(RuntimeWarning, match=r"torch .*checkpoint_recompute.*is not what "
                      r"checkpoint\(\) calls.*recomputes without the ampkit policy"):
        assert ti.install_checkpoint_carry(lambda fn: fn) is False
    assert {n: getattr(cp, n, None) for n in before} == before  # nothing left wrapped
    with pytest.raises(ti.TorchInternalsError, match="checkpoint_recompute"):
        ti.check("checkpoint_recompute")
