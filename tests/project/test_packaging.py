"""The package is fit for the index: the wheel and the sdist build with the build
backend ``pyproject.toml`` names, their metadata is valid (checked by ``packaging``'s
own validator, the one ``twine check`` uses; twine itself is not in the registries this
project installs from) and says what a package page needs, the wheel holds the package
and its licence, and the sdist carries the tests, which pass when it is unpacked.

Both are built once per module: the sdist from the repository, the wheel from the
unpacked sdist (as ``pip install ampkit-X.tar.gz`` does), by the backend's own hooks
(``setuptools.build_meta``) in a subprocess.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from packaging.metadata import Metadata
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).parents[2]
URL = "https://github.com/ampkit/ampkit"


def _build(kind: str, source: Path, out: Path) -> Path:
    code = (f"from setuptools import build_meta; "
            f"print(build_meta.build_{kind}({str(out)!r}))")
    done = subprocess.run([sys.executable, "-c", code], cwd=source, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return out / done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("dists")
    # Built from a copy: the backend writes src/ampkit.egg-info where it builds, and two
    # test workers building in the one checkout at once would race on it.
    tree = tmp_path_factory.mktemp("tree") / "ampkit"
    shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "__pycache__", "*.egg-info", "build", "dist", "_build",
        ".pytest_cache", ".ruff_cache", ".mypy_cache", ".hypothesis", "ampkit-report"))
    sdist = _build("sdist", tree, out)
    unpacked = tmp_path_factory.mktemp("unpacked")
    with tarfile.open(sdist) as archive:
        archive.extractall(unpacked, filter="data")
    source = unpacked / sdist.name.removesuffix(".tar.gz")
    wheel = _build("wheel", source, tmp_path_factory.mktemp("wheel"))
    return {"sdist": sdist, "wheel": wheel, "unpacked": source}


def _wheel_metadata(wheel: Path) -> tuple[Metadata, str]:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        text = archive.read(name).decode()
    # validate=True raises on any field that breaks the core metadata specification
    return Metadata.from_email(text, validate=True), text


def test_the_build_backend_is_new_enough_for_the_spdx_license() -> None:
    import setuptools

    # (a regex: tomllib is Python 3.11's, and ampkit runs on 3.10)
    listed = re.search(r'^\[build-system\]\nrequires = \[([^\]]*)\]',
                       (ROOT / "pyproject.toml").read_text(), re.M)
    assert listed is not None
    requires = re.findall(r'"([^"]+)"', listed.group(1))
    setuptools_requirement = next(Requirement(r) for r in requires
                                  if Requirement(r).name == "setuptools")
    # PEP 639's license expression and license-files came in setuptools 77
    assert not setuptools_requirement.specifier.contains("76.1.0")
    assert setuptools_requirement.specifier.contains(setuptools.__version__)


def test_the_wheel_metadata_is_valid_and_says_what_an_index_page_needs(
        dists: dict[str, Path]) -> None:
    metadata, raw = _wheel_metadata(dists["wheel"])
    assert Version(metadata.metadata_version) >= Version("2.4")  # license expressions
    assert metadata.license_expression == "Apache-2.0"
    assert metadata.license_files == ["LICENSE"]
    assert "\nLicense: " not in raw  # the deprecated free-text field is gone
    assert metadata.project_urls is not None
    assert set(metadata.project_urls) == {"Homepage", "Documentation", "Source", "Issues",
                                          "Changelog"}
    assert all(url.startswith(URL) for url in metadata.project_urls.values())
    classifiers = metadata.classifiers or []
    assert "Typing :: Typed" in classifiers and "Programming Language :: Python :: 3.11" in (
        classifiers)
    assert not [c for c in classifiers if c.startswith("License ::")]  # PEP 639
    assert metadata.description_content_type == "text/markdown"
    assert any(r.name == "torch" for r in metadata.requires_dist or [])
    assert metadata.requires_python is not None and metadata.requires_python.contains("3.11")


def test_every_link_of_the_package_page_is_absolute(dists: dict[str, Path]) -> None:
    metadata, _ = _wheel_metadata(dists["wheel"])
    description = metadata.description or ""
    links = re.findall(r"\]\(([^)\s]+)\)", description)
    assert len(links) >= 19, links
    relative = [link for link in links if not link.startswith(("https://", "#"))]
    assert not relative, relative
    # the guides they point at are the repository's own files
    for link in links:
        if link.startswith(f"{URL}/blob/main/"):
            path = link.removeprefix(f"{URL}/blob/main/").split("#")[0]
            assert (ROOT / path).is_file(), link


def test_the_wheel_holds_the_package_its_data_and_the_license(
        dists: dict[str, Path]) -> None:
    with zipfile.ZipFile(dists["wheel"]) as archive:
        names = set(archive.namelist())
        license_name = next(n for n in names if n.endswith(".dist-info/licenses/LICENSE"))
        assert archive.read(license_name) == (ROOT / "LICENSE").read_bytes()
        entry_points = archive.read(next(n for n in names if n.endswith(
            ".dist-info/entry_points.txt"))).decode()
    assert "ampkit = ampkit.tools.cli:main" in entry_points
    source = ROOT / "src"
    expected = {path.relative_to(source).as_posix() for path in source.rglob("ampkit/**/*")
                if path.is_file() and "__pycache__" not in path.parts}
    assert {"ampkit/py.typed", "ampkit/__init__.py"} <= expected
    assert any(name.endswith(".j2") for name in expected)
    assert expected <= names, sorted(expected - names)
    assert not [n for n in names if n.startswith(("tests/", "docs/", "benchmarks/"))]


def test_the_sdist_carries_the_tests_docs_and_license(dists: dict[str, Path]) -> None:
    with tarfile.open(dists["sdist"]) as archive:
        prefix = dists["unpacked"].name
        names = {name.removeprefix(f"{prefix}/") for name in archive.getnames()}
    wanted = {"LICENSE", "README.md", "CHANGELOG.md", "pyproject.toml", "MANIFEST.in",
              "conftest.py"}
    for folder in ("tests", "docs", "benchmarks", "src/ampkit"):
        wanted |= {path.relative_to(ROOT).as_posix() for path in (ROOT / folder).rglob("*")
                   if path.is_file() and "__pycache__" not in path.parts
                   and "_generated" not in path.parts and "_build" not in path.parts}
    assert "tests/project/test_packaging.py" in wanted
    assert wanted <= names, sorted(wanted - names)[:20]
    assert not [n for n in names if "__pycache__" in n or "/_generated/" in n]


def test_the_unpacked_sdist_runs_its_own_tests(dists: dict[str, Path]) -> None:
    """A few of the sdist's tests run from the unpacked archive against its own
    ``src`` (the whole suite is CI's: it takes far longer than this test may)."""
    source = dists["unpacked"]
    env = {**os.environ, "PYTHONPATH": str(source / "src")}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "0", "-p", "no:cacheprovider", "-q",
         "--rootdir", str(source), "tests/project/test_version.py",
         "tests/scaling/test_loss_scale.py", "src/ampkit/common/arguments.py"],
        cwd=source, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert re.search(r"\b\d+ passed\b", done.stdout), done.stdout[-500:]
    assert "failed" not in done.stdout.splitlines()[-1]
    where = subprocess.run([sys.executable, "-c", "import ampkit; print(ampkit.__file__)"],
                           cwd=source, env=env, capture_output=True, text=True, timeout=60)
    assert Path(where.stdout.strip()).is_relative_to(source), where.stdout
