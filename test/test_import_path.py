"""No project folder stands in for an installed package, however the project is run (sglang_pic/import_path.py).

From the repository root, `python -m`, `python -c` and `python -m pytest` put the root first on sys.path, where the
design's top-level folders (`kernels/` above all: transformers imports PyPI's `kernels`) would shadow installed
packages. The folders that scripts are run from (benchmark/, examples/, scripts/, test/) go first on sys.path in
their turn, so no module in them may share a name with an installed or standard module.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_pic.import_path import drop_checkout_roots, is_checkout_root

ROOT = Path(__file__).resolve().parents[1]
TOP_LEVEL = sorted(p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith("."))
SCRIPT_FOLDERS = ("benchmark", "examples", "scripts", "test")

# Each top-level folder name's spec, as seen by a process run from the root that imported sglang_pic first.
FIND_SPECS = """
import importlib.util, json, sys
import sglang_pic
names = json.loads(sys.argv[1])
out = {}
for name in names:
    spec = importlib.util.find_spec(name)
    out[name] = [] if spec is None else [spec.origin or "", *(spec.submodule_search_locations or [])]
print(json.dumps(out))
"""


def _inside_repo(locations: list[str]) -> list[str]:
    return [loc for loc in locations if loc and Path(loc).resolve().is_relative_to(ROOT)]


def test_top_level_folders_do_not_resolve_into_the_repo_from_its_root():
    """`python -c` puts the current folder first on sys.path exactly as `python -m` does."""
    out = subprocess.run(
        [sys.executable, "-c", FIND_SPECS, json.dumps(TOP_LEVEL)], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    specs = json.loads(out.stdout)
    assert set(specs) == set(TOP_LEVEL)
    shadowing = {name: _inside_repo(locs) for name, locs in specs.items() if _inside_repo(locs)}
    assert not shadowing, f"project folders stand in for packages from the repository root: {shadowing}"


def test_top_level_folders_do_not_resolve_into_the_repo_in_this_test_run():
    """CI runs `python3 -m pytest` from the root: test/conftest.py imports sglang_pic before anything else."""
    shadowing = {}
    for name in TOP_LEVEL:
        spec = importlib.util.find_spec(name)
        locations = [] if spec is None else [spec.origin or "", *(spec.submodule_search_locations or [])]
        if _inside_repo(locations):
            shadowing[name] = _inside_repo(locations)
    assert not shadowing, shadowing


@pytest.mark.skipif(importlib.util.find_spec("kernels") is None, reason="PyPI's kernels is not installed")
def test_transformers_imports_pypi_kernels_from_the_repo_root():
    """The crash of the first start: transformers' hub-kernels integration imports PyPI's `kernels`."""
    code = "import sglang_pic, transformers.integrations.hub_kernels, kernels; print(kernels.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert not Path(out.stdout.strip()).resolve().is_relative_to(ROOT)


def test_drop_checkout_roots_takes_the_root_in_every_spelling(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(ROOT)
    elsewhere = str(tmp_path)
    path = ["", ".", str(ROOT), str(ROOT / "benchmark"), elsewhere, f"{ROOT}/test/.."]
    removed = drop_checkout_roots(path)
    assert removed == ["", ".", str(ROOT), f"{ROOT}/test/.."]
    assert path == [str(ROOT / "benchmark"), elsewhere]
    assert is_checkout_root(str(ROOT)) and not is_checkout_root(elsewhere)


@pytest.mark.parametrize("folder", SCRIPT_FOLDERS)
def test_script_folders_shadow_no_installed_module(folder: str):
    """`python benchmark/x.py` puts benchmark/ first on sys.path: its modules must not hide installed ones."""
    own = {str(ROOT), *(str(ROOT / f) for f in SCRIPT_FOLDERS)}
    elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) not in own]
    installed = {m.name for m in pkgutil.iter_modules(elsewhere)} | set(sys.stdlib_module_names)
    local = {m.name for m in pkgutil.iter_modules([str(ROOT / folder)])}
    assert not local & installed, f"{folder}/ holds modules named like installed ones: {sorted(local & installed)}"
