"""The documentation site builds from the repository with warnings as errors, every
public name has an entry in its API reference, and its pages render in a real browser.

The build is the README's command (``python -m sphinx -W --keep-going -b html docs
OUT``), run once per test session: with ``pytest -n 2`` the first worker to get here
builds, under a file lock, and the other reuses the result.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from filelock import FileLock

ROOT = Path(__file__).parents[2]
DOCS = ROOT / "docs"
sys.path.insert(0, str(DOCS / "_ext"))
from reference import (  # noqa: E402 (the path first)
    PUBLIC_MODULES,
    defining_module,
    deprecated_modules,
    public_modules,
)

GUIDES = ["install", "levels", "policies", "pure-bf16", "fp8", "loss-scaling",
          "distributed", "integrations", "tools", "accuracy", "migration", "limits",
          "benchmarks", "layout", "state", "changelog"]


@pytest.fixture(scope="session")
def site(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Path:
    """The built site's folder (``index.html``, ``objects.inv``, ...)."""
    # this session's folder: under xdist, the one the workers' own folders are in
    shared = tmp_path_factory.getbasetemp()
    if worker_id != "master":
        shared = shared.parent
    out, log = shared / "docs-site", shared / "docs-site.log"
    with FileLock(str(shared / "docs-site.lock")):
        if not (out / "objects.inv").exists() and not log.exists():
            done = subprocess.run(
                [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                 "-d", str(shared / "docs-doctrees"), str(DOCS), str(out)],
                cwd=ROOT, capture_output=True, text=True, timeout=600)
            log.write_text(f"exit {done.returncode}\n{done.stdout}\n{done.stderr}")
    text = log.read_text()
    assert text.startswith("exit 0"), f"sphinx-build -W failed:\n{text}"
    return out


def test_site_builds_with_warnings_as_errors(site: Path) -> None:
    for page in ["index", *GUIDES, "api/index", "api/ampkit", "api/tools", "api/fsdp",
                 "api/dialects", "api/integrations", "api/cli", "api/internals"]:
        assert (site / f"{page}.html").is_file(), page


def _inventory(site: Path) -> dict[str, dict[str, str]]:
    """role (``py:function``, ``std:cmdoption``, ...) -> name -> the page it is on."""
    from sphinx.util.inventory import InventoryFile

    with open(site / "objects.inv", "rb") as stream:
        inventory = InventoryFile.load(stream, "", lambda base, uri: uri)
    data = inventory.data if hasattr(inventory, "data") else inventory
    # an entry is an _InventoryItem (sphinx >= 8.2) or a (project, version, uri, text)
    # tuple
    return {role: {name: getattr(item, "uri", None) or item[2]
                   for name, item in entries.items()}
            for role, entries in data.items()}


def _documented(site: Path) -> set[str]:
    return {name for role, entries in _inventory(site).items() if role.startswith("py:")
            for name in entries}


def test_the_names_users_import_resolve_under_that_name(site: Path) -> None:
    """``ampkit.initialize`` is in ``objects.inv`` as ``ampkit.initialize`` (not only as
    ``ampkit.front_door.initialize``), on a page of the public reference, and so is
    every name of ``ampkit.__all__``, of each dialect's, of the integrations' and of
    ``ampkit.tools``'; each dialect is documented under the name the guides import it
    by; the deprecated aliases of moved modules have no entry."""
    inventory = _inventory(site)
    for role, name in [("py:class", "ampkit.autocast"), ("py:function", "ampkit.initialize"),
                       ("py:class", "ampkit.GradScaler"), ("py:class", "ampkit.AmpConfig"),
                       ("py:function", "ampkit.compare"), ("py:function", "ampkit.tune"),
                       ("py:function", "ampkit.apex.initialize"),
                       ("py:class", "ampkit.integrations.lightning.AmpkitPrecision"),
                       ("py:method", "ampkit.GradScaler.step"),
                       ("py:module", "ampkit.paddle")]:
        assert name in inventory.get(role, {}), (role, name)
        assert inventory[role][name].startswith("api/") and (
            "_generated" not in inventory[role][name]), (name, inventory[role][name])
    import ampkit.dialects

    dialects = {f"ampkit.{info.name}" for info in pkgutil.iter_modules(
        ampkit.dialects.__path__) if not info.name.startswith("_")}
    assert dialects == {"ampkit.torch", "ampkit.apex", "ampkit.paddle", "ampkit.mindspore",
                        "ampkit.mxnet"}
    assert dialects <= set(PUBLIC_MODULES)
    assert {"ampkit", "ampkit.tools", "ampkit.integrations.lightning",
            "ampkit.integrations.transformers",
            "ampkit.integrations.accelerate"} <= set(PUBLIC_MODULES)
    documented = _documented(site)
    python_pages = {name: uri for role, entries in inventory.items()
                    if role.startswith("py:") for name, uri in entries.items()}
    missing, elsewhere = [], []
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for public in [module_name, *(f"{module_name}.{name}" for name in module.__all__)]:
            if public not in documented:
                missing.append(public)
            elif "_generated" in python_pages[public]:
                elsewhere.append(f"{public}: {python_pages[public]}")
    assert len(missing) + len(elsewhere) == 0, (missing, elsewhere)
    assert not set(deprecated_modules()) & documented, set(deprecated_modules()) & documented


def test_the_command_line_has_a_reference_entry_per_option(site: Path) -> None:
    options = _inventory(site).get("std:cmdoption", {})
    for name in ["ampkit.--version", "ampkit-demo.--levels", "ampkit-compare.--inputs",
                 "ampkit-tune.--eval"]:
        assert name in options, (name, sorted(options)[:20])
        assert options[name].startswith("api/cli"), options[name]


def test_every_internal_name_has_a_reference_entry(site: Path) -> None:
    """Each name in a module's ``__all__`` is documented where it is defined, too: the
    internals' pages (a re-export, such as ``ampkit.initialize``, points at its
    defining module's entry there, besides its own public entry); names that are
    torch's own objects, re-exported by ``ampkit.torch``, are torch's to document."""
    documented = _documented(site)
    missing = []
    checked = 0
    for module in [sys.modules[name] for name in public_modules()]:
        assert module.__name__ in documented, f"module {module.__name__} has no page"
        for name in getattr(module, "__all__", ()):
            if name.startswith("__"):
                continue
            obj = getattr(module, name)
            home = defining_module(obj)
            qualname = getattr(obj, "__qualname__", None)
            if isinstance(obj, ModuleType):
                target = obj.__name__
            elif home is not None and home.split(".")[0] == "torch":
                continue  # torch's own object, re-exported by a dialect
            elif not (inspect.isclass(obj) or inspect.isroutine(obj)) or (
                    home is None or qualname is None or not home.startswith("ampkit")):
                # a constant or a type alias: documented where it is named
                target = f"{module.__name__}.{name}"
            elif qualname != name:
                # a second name for a function (``convert_model = convert_hybrid_block``):
                # documented under that name in the module that gives it
                giver = home if getattr(sys.modules[home], name, None) is obj else (
                    module.__name__)
                target = f"{giver}.{name}"
            else:
                target = f"{home}.{qualname}"
            checked += 1
            if target not in documented:
                missing.append(f"{module.__name__}.{name} (looked for {target})")
    assert checked > 150, checked  # the walk found the package's names
    assert not missing, "no reference entry for:\n" + "\n".join(missing)


def test_site_pages_render_in_headless_chromium(site: Path, headless_chromium) -> None:
    from selenium.webdriver.common.by import By

    for page, expected in [("index", "Quickstart: O2, the fp32 parameters are the truth"),
                           ("levels", "Levels and the two axes"),
                           ("api/ampkit", "ampkit.initialize"),
                           ("api/_generated/ampkit.front_door", "initialize")]:
        headless_chromium.get((site / f"{page}.html").as_uri())
        body = headless_chromium.find_element(By.TAG_NAME, "body").text
        assert expected in body, (page, body[:500])
        # furo's sidebar lists the guides on every page
        links = {a.text for a in headless_chromium.find_elements(By.CSS_SELECTOR,
                                                                  ".sidebar-tree a")}
        assert "Pure bf16 training: no fp32 copies, still converging" in links, links
