"""The documentation site builds from the repository with warnings as errors, every
public name has an entry in its API reference, and its pages render in a real browser.

The build is the README's command (``python -m sphinx -W --keep-going -b html docs
OUT``), run once per test session: with ``pytest -n 2`` the first worker to get here
builds, under a file lock, and the other reuses the result.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from filelock import FileLock

ROOT = Path(__file__).parents[2]
DOCS = ROOT / "docs"
sys.path.insert(0, str(DOCS / "_ext"))
from reference import defining_module, public_modules  # noqa: E402 (the path first)

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
    for page in ["index", *GUIDES, "api/index"]:
        assert (site / f"{page}.html").is_file(), page


def _documented(site: Path) -> set[str]:
    from sphinx.util.inventory import InventoryFile

    with open(site / "objects.inv", "rb") as stream:
        inventory = InventoryFile.load(stream, "", lambda base, uri: uri)
    names: set[str] = set()
    for role, entries in inventory.data.items() if hasattr(inventory, "data") else (
            inventory.items()):
        if role.startswith("py:"):
            names.update(entries)
    return names


def test_every_public_name_has_a_reference_entry(site: Path) -> None:
    """Each name in a public module's ``__all__`` is documented where it is defined
    (a re-export, such as ``ampkit.initialize``, points at its defining module's
    entry); names that are torch's own objects, re-exported by ``ampkit.torch``, are
    torch's to document."""
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
                           ("api/_generated/ampkit.front_door", "initialize")]:
        headless_chromium.get((site / f"{page}.html").as_uri())
        body = headless_chromium.find_element(By.TAG_NAME, "body").text
        assert expected in body, (page, body[:500])
        # furo's sidebar lists the guides on every page
        links = {a.text for a in headless_chromium.find_elements(By.CSS_SELECTOR,
                                                                  ".sidebar-tree a")}
        assert "Pure bf16 training: no fp32 copies, still converging" in links, links
