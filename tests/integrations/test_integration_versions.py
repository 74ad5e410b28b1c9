"""An integration refuses, at import, a framework release that lacks a non-public method
it overrides, naming the release it was tested with (the extras allow releases up to the
next major one, so such a release can be installed)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ampkit.integrations._versions import TESTED


@pytest.mark.parametrize(("integration", "owner", "hook"), [
    ("lightning", "lightning.pytorch.plugins.precision:Precision", "_after_closure"),
    ("transformers", "transformers:Trainer", "_save"),
])
def test_a_release_without_the_hook_is_refused_naming_the_tested_one(
        integration: str, owner: str, hook: str) -> None:
    pytest.importorskip(integration)
    module, cls = owner.split(":")
    code = (f"import {module} as m\n"
            f"delattr(m.{cls}, {hook!r})\n"
            f"import ampkit.integrations.{integration}\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: ")
    assert f"{cls}.{hook}" in last and f"{integration}=={TESTED[integration]}" in last


def test_the_tested_releases_import() -> None:
    for integration in TESTED:
        pytest.importorskip(integration)
    import ampkit.integrations.accelerate
    import ampkit.integrations.lightning
    import ampkit.integrations.transformers  # noqa: F401
