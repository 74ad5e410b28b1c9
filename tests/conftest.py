"""Shared test settings: small thread count, deterministic seeds, the devices present,
and the headless browser for the pages the tools write.

The folders follow the layers (DESIGN.md): ``engine/`` (registry, policy, casting, the
autocast engine), ``levels/`` (initialize, conversion, O0-O3, pure bf16, fp8, configs),
``scaling/`` (GradScaler, loss scaling), ``dialects/``, ``integrations/``, ``tools/``,
``distributed/`` (DDP, FSDP2, DCP over gloo) and ``project/`` (the README's examples,
the import graph, the benchmark scripts). Models shared by core tests live in
``helpers_models.py``, never in ``ampkit.tools``."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

#: Devices every device-parametrized test runs on: the CPU always, CUDA when visible.
#: Tests import it as ``from conftest import DEVICES``.
DEVICES: tuple[str, ...] = ("cpu",) + (("cuda",) if torch.cuda.is_available() else ())


def _cpu_rowwise_fp8() -> bool:
    from ampkit.fp8.recipe import cpu_scaled_mm_takes_rowwise_scales

    return cpu_scaled_mm_takes_rowwise_scales()


#: For fp8 tests that train a per-row recipe on the CPU: torch 2.11's CPU
#: torch._scaled_mm takes per-tensor scales only (ampkit refuses the recipe there,
#: tested in tests/fp8/test_fp8.py). Tests import it as ``from conftest import ...``.
NEEDS_CPU_ROWWISE_FP8 = pytest.mark.skipif(
    not _cpu_rowwise_fp8(),
    reason=f"torch {torch.__version__}'s CPU torch._scaled_mm takes per-tensor scales only")

#: Set by ``.ci/run``: a missing browser fails the browser tests instead of skipping them.
REQUIRE_BROWSER_VARIABLE = "AMPKIT_REQUIRE_BROWSER"
BROWSER_MISSING = ("chromium/chromedriver not found; install Debian's chromium and "
                   "chromium-driver to run it")
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--window-size=1280,4000")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def find_browser() -> tuple[str, str] | None:
    """``(chromium, chromedriver)`` paths, or ``None`` when either (or selenium) is
    missing."""
    try:
        import selenium  # noqa: F401
    except ModuleNotFoundError:
        return None
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


@pytest.fixture
def headless_chromium() -> Iterator[Any]:
    """A started headless ``selenium.webdriver.Chrome`` (Debian's chromium), quit after
    the test. Without the browser the test skips with the reason above, unless
    ``AMPKIT_REQUIRE_BROWSER=1`` (CI) makes that a failure. Any test that checks a page
    in a real browser takes this fixture."""
    found = find_browser()
    if found is None:
        if os.environ.get(REQUIRE_BROWSER_VARIABLE) == "1":
            pytest.fail(f"{BROWSER_MISSING} ({REQUIRE_BROWSER_VARIABLE}=1 requires it)")
        pytest.skip(BROWSER_MISSING)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    browser, driver = found
    with tempfile.TemporaryDirectory() as profile:
        options = webdriver.ChromeOptions()
        options.binary_location = browser
        for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={profile}"):
            options.add_argument(flag)
        chrome = webdriver.Chrome(service=Service(executable_path=driver), options=options)
        try:
            yield chrome
        finally:
            chrome.quit()


@pytest.fixture(autouse=True)
def _registered_policies_stay_local() -> Iterator[None]:
    """A policy a test registers is gone after it: listings of the presets (the CLI's
    choices, for one) must not depend on which tests ran before in the same worker."""
    import ampkit

    before = set(ampkit.available_policies())
    yield
    for name in set(ampkit.available_policies()) - before:
        ampkit.unregister_policy(name)


#: ``python -m tests.conformance``'s entry point is not a module to import (doctests).
#: Kept here: a conftest.py in tests/conformance would replace this one as the module
#: ``conftest`` that tests import ``DEVICES`` and the marks from.
collect_ignore = ["conformance/__main__.py"]


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--conformance-all``: collect the whole conformance matrix (tests/conformance);
    without it that folder collects its CI subset. Registered here, a conftest pytest
    loads at start-up in every run (options from conftests found later are not read)."""
    parser.addoption("--conformance-all", action="store_true", default=False,
                     help="run every cell of the conformance matrix (tests/conformance)")
