"""The wheel holds every module of the library and the launcher: a non-editable install
(``pip install .``) must not miss a package that the editable install of the tests finds
in the source tree. Builds the wheel from a copy of the project (setuptools of the test
venv, no network, no build/ left in the tree) and compares its files with the tree's."""

import shutil
import subprocess
import sys
import zipfile

import pytest

from helpers import JOB_SECONDS, ROOT

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

#: source directory -> the package it installs as (pyproject's package-dir).
PACKAGE_DIRS = {"popdist_lite": "popdist_lite", "launcher": "popdist_lite_launcher"}


def tree_files() -> set[str]:
    """Every module and package-data file of the source tree, as its path in the wheel."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    found = set()
    for directory, package in PACKAGE_DIRS.items():
        for path in (ROOT / directory).rglob("*"):
            rel = path.relative_to(ROOT / directory)
            if "__pycache__" in rel.parts or not path.is_file():
                continue
            owner = ".".join((package, *rel.parts[:-1]))  # the (sub)package the file is in
            if path.suffix == ".py" or rel.name in data.get(owner, ()):
                found.add("/".join((package, *rel.parts)))
    return found


def test_the_wheel_holds_every_module(tmp_path):
    pytest.importorskip("setuptools", minversion="77")
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for directory in PACKAGE_DIRS:
        shutil.copytree(ROOT / directory, source / directory, ignore=shutil.ignore_patterns("__pycache__"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp_path / "dist"), str(source)], capture_output=True, text=True,
                       timeout=JOB_SECONDS)
    assert r.returncode == 0, r.stdout + r.stderr
    [wheel] = (tmp_path / "dist").glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        packed = {n for n in z.namelist() if n.split("/")[0] in PACKAGE_DIRS.values()}
    expected = tree_files()
    assert "popdist_lite/embedding/storage/disk.py" in expected and "popdist_lite_launcher/testing/netns-agent" in expected
    missing = sorted(expected - packed)
    assert not missing, f"pyproject.toml's [tool.setuptools] packages miss: {missing}"
