"""The documentation site builds from the repository with warnings as errors, every
public name has an entry in its API reference, and its pages render in a real browser.

The build is the README's command (``python -m sphinx -W --keep-going -b html docs
OUT``), run once per test session: with ``pytest -n 2`` the first worker to get here
builds, under a file lock, and the other reuses the result.
"""

from __future__ import annotations

import importlib
import inspect
import json
import pkgutil
import re
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from filelock import FileLock

ROOT = Path(__file__).parents[2]
DOCS = ROOT / "docs"
sys.path.insert(0, str(DOCS / "_ext"))
from reference import (  # noqa: E402 (the path first)
    PUBLIC_MODULES,
    defining_module,
    public_modules,
)

from tests.distributed_harness import MAX_STRETCH, load_factor  # noqa: E402

GUIDES = ["install", "levels", "policies", "pure-bf16", "fp8", "loss-scaling",
          "distributed", "integrations", "tools", "accuracy", "migration", "limits",
          "benchmarks", "layout", "state", "changelog"]


def _bounded(process: subprocess.Popen[str], budget: float) -> tuple[str, str]:
    """Wait for ``process`` for ``budget`` seconds of an unloaded machine: a second
    counts for less while the machine is oversubscribed (as the distributed harness
    counts), never more than ``budget * MAX_STRETCH`` wall seconds."""
    start = last = time.monotonic()
    used = 0.0
    while True:
        try:
            return process.communicate(timeout=5.0)
        except subprocess.TimeoutExpired:
            now = time.monotonic()
            used += (now - last) / load_factor()
            last = now
            if used >= budget or now - start >= budget * MAX_STRETCH:
                process.kill()
                process.communicate()
                pytest.fail(f"sphinx-build ran past {budget:.0f} s of an unloaded machine "
                            f"({now - start:.0f} s of wall time)")


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
            build = subprocess.Popen(
                [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                 "-d", str(shared / "docs-doctrees"), str(DOCS), str(out)],
                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            stdout, stderr = _bounded(build, budget=600.0)
            log.write_text(f"exit {build.returncode}\n{stdout}\n{stderr}")
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
    by."""
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
            if isinstance(obj, ModuleType) and obj.__name__.split(".")[0] == "torch":
                continue  # torch's own module (torch._C._nn), re-exported by the boundary
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


def _object_section(page: str, anchor: str) -> str:
    """The HTML of the entry ``anchor`` on ``page``: from its signature to the next
    entry of the page that is not one of its own members."""
    start = page.index(f'id="{anchor}"')
    ends = [m.start() for m in re.finditer(r'<dt class="sig sig-object py" id="([^"]+)"',
                                           page[start + 1:])
            if not m.group(1).startswith(f"{anchor}.")]
    return page[start:start + 1 + ends[0]] if ends else page[start:]


def _field_entries(section: str, field: str) -> dict[str, str]:
    """name -> what follows the name, of each entry of a field list (``Parameters``,
    ``Variables``) of the object's own description (not its members')."""
    own = section.split('<dl class="py', 1)[0]
    found = re.search(rf">{field}<.*?<dd[^>]*>(.*?)</dd>", own, re.S)
    assert found, f"no {field} list"
    entries = {}
    for item in re.findall(r"<li>(.*?)</li>", found.group(1), re.S) or [found.group(1)]:
        name = re.match(r"\s*<p>\s*<strong>([^<]+)</strong>(.*)", item, re.S)
        assert name, item[:200]
        entries[name.group(1)] = name.group(2)
    return entries


def test_every_ampkit_config_field_has_an_entry_of_its_own(site: Path) -> None:
    """Each field of :class:`ampkit.AmpConfig` is its own entry of the reference's
    field list, named alone and with no other field shown as its type (a Google-style
    ``a, b: ...`` line gave one entry named ``b`` with ``a,`` as its "type")."""
    import dataclasses

    from ampkit import AmpConfig

    uri = _inventory(site)["py:class"]["ampkit.AmpConfig"]
    page = (site / uri.split("#")[0]).read_text(encoding="utf-8")
    entries = _field_entries(_object_section(page, "ampkit.AmpConfig"), "Variables")
    fields = [f.name for f in dataclasses.fields(AmpConfig)]
    assert sorted(entries) == sorted(fields)
    for name, rest in entries.items():
        # what the entry shows before its description: its type, from the annotation
        shown = re.sub(r"<[^>]+>", "", re.split(r"\u2013|&#8211;", rest, maxsplit=1)[0])
        assert not [f for f in fields if re.search(rf"(?<![.\w]){f}\b", shown)], (name, shown)


def test_no_public_docstring_entry_names_two_parameters() -> None:
    """The docstrings' Args/Attributes entries name one parameter each: Sphinx reads
    ``a, b: ...`` as the entry ``b`` of type ``a,`` (``a`` gets no entry)."""
    joined = re.compile(r"^\s{8,}[a-z_][a-z_0-9]*, [a-z_][a-z_0-9, ]*:(\s|$)",
                        re.M)
    found = [f"{path.relative_to(ROOT)}: {match.group(0).strip()}"
             for path in sorted((ROOT / "src" / "ampkit").rglob("*.py"))
             for match in joined.finditer(path.read_text(encoding="utf-8"))
             if ">>>" not in match.group(0)]
    assert not found, "\n".join(found)


def _search_index(site: Path) -> dict[str, Any]:
    text = (site / "searchindex.js").read_text(encoding="utf-8")
    return json.loads(text[text.index("(") + 1:text.rindex(")")])


def _ranked(index: dict[str, Any], query: str) -> list[tuple[int, str]]:
    """(score, name) of the objects Sphinx's search (searchtools.js's object scoring)
    finds for a one-word ``query``, best first."""
    priority_score = {0: 15, 1: 5, 2: -5}
    found = []
    for prefix, entries in index["objects"].items():
        for _doc, _kind, priority, _anchor, name in entries:
            full = f"{prefix}.{name}" if prefix else name
            lower, last = full.lower(), full.lower().split(".")[-1]
            if query not in lower:
                continue
            score = 11 if query in (lower, last) else 6 if query in last else 0
            found.append((score + priority_score.get(priority, 0), full))
    return sorted(found, key=lambda hit: -hit[0])


def test_search_ranks_the_names_users_import_first(site: Path) -> None:
    """A search for ``initialize`` or ``GradScaler`` shows ``import ampkit``'s name
    first, alone at the top: not the internal module that defines it, nor a
    dialect's class of the same name."""
    index = _search_index(site)
    for query, first in [("initialize", "ampkit.initialize"),
                         ("gradscaler", "ampkit.GradScaler"),
                         ("compare", "ampkit.compare"), ("ampconfig", "ampkit.AmpConfig")]:
        ranked = _ranked(index, query)
        assert ranked[0][1] == first, ranked[:5]
        assert ranked[0][0] > ranked[1][0], ranked[:5]  # not first by a tie's order


_README_SECTION = re.compile(r'README(?:\'s|,)\s+"([^"]+)"')


def test_the_guides_name_only_readme_sections_that_exist() -> None:
    """A guide's words "the README's "X" section" name a heading the README has."""
    headings = [line.lstrip("#").strip() for line in
                (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
                if line.startswith("#")]
    dangling = [f"{page.name}: {name!r}" for page in sorted(DOCS.glob("*.md"))
                for name in _README_SECTION.findall(page.read_text(encoding="utf-8"))
                if not any(h.startswith(name) for h in headings)]
    assert not dangling, dangling


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
