"""No project folder stands in for an installed package, however the project is run, in the layout alone.

From the repository root, `python -m`, `python -c` and `python -m pytest` put the root first on sys.path. The design
keeps `kernels/` (PyPI also has a `kernels`, which transformers imports), `radix_ext/` and `frontend_lang/` there, so
they hold no __init__.py: a folder without one is at most a namespace portion, which any installed module or regular
package of the same name beats wherever it sits on sys.path. Python makes every folder on sys.path such a portion
(PEP 420), so "resolves to nothing" cannot be had for a name no installed package takes; what the layout guarantees is
that no name resolves to code in the repository. The folders that scripts are run from (benchmark/, examples/,
scripts/, test/) go first on sys.path in their turn, so no module in them may share a name with an installed or
standard module.
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

ROOT = Path(__file__).resolve().parents[1]
TOP_LEVEL = sorted(p.name for p in ROOT.iterdir() if p.is_dir() and p.name.isidentifier())
SCRIPT_FOLDERS = ("benchmark", "examples", "scripts", "test")
HANG_S = 300  # only against a hang: each command takes seconds

# Each top-level folder name's spec in a process run from the root that imports nothing of the project; with
# "hide-site" it first drops site-packages from sys.path, as in a venv without PyPI's kernels (or anything else).
FIND_SPECS = """
import importlib.util, json, sys
if sys.argv[2] == "hide-site":
    sys.path[:] = [p for p in sys.path if "site-packages" not in p]
out = {}
for name in json.loads(sys.argv[1]):
    spec = importlib.util.find_spec(name)
    out[name] = None if spec is None else [spec.origin, list(spec.submodule_search_locations or [])]
print(json.dumps(out))
"""


def _inside_repo(location: str | None) -> bool:
    return bool(location) and Path(location).resolve().is_relative_to(ROOT)


def _specs_from_root(site: str) -> dict[str, list | None]:
    out = subprocess.run(
        [sys.executable, "-c", FIND_SPECS, json.dumps(TOP_LEVEL), site],
        cwd=ROOT, capture_output=True, text=True, timeout=HANG_S,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize("site", ["with-site", "hide-site"])
def test_no_top_level_folder_resolves_to_code_in_the_repo(site: str):
    """Each name finds nothing, an installed module, or an empty namespace portion: never a module or a regular
    package (one with an __init__.py) inside the repository."""
    specs = _specs_from_root(site)
    assert set(specs) == set(TOP_LEVEL)
    code_in_repo = {name: spec for name, spec in specs.items() if spec and _inside_repo(spec[0])}
    assert not code_in_repo, f"project folders stand in for modules from the repository root: {code_in_repo}"
    for name, spec in specs.items():
        if spec and any(_inside_repo(loc) for loc in spec[1]):
            assert spec[0] is None, f"{name} resolves to a package in the repository: {spec}"


def test_installed_kernels_wins_over_the_repo_folder():
    """With PyPI's kernels installed (transformers pulls it in), the root's kernels/ never shadows it."""
    if importlib.util.find_spec("kernels") is None or not _installed("kernels"):
        pytest.fail("PyPI's kernels is not installed: the test extras must install it, since transformers imports it")
    origin, locations = _specs_from_root("with-site")["kernels"]
    assert not _inside_repo(origin) and not any(_inside_repo(loc) for loc in locations), (origin, locations)


def _installed(distribution: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(distribution)
    except PackageNotFoundError:
        return False
    return True


@pytest.mark.parametrize(
    "command",
    [
        ["-c", "import transformers.modeling_utils"],
        ["-c", "from transformers import AutoModelForCausalLM; import transformers.integrations.hub_kernels"],
        ["-m", "sglang.bench_serving", "--help"],
    ],
    ids=["modeling_utils", "hub_kernels", "bench_serving_help"],
)
def test_third_party_entry_points_run_from_the_repo_root(command: list[str]):
    """Programs that import transformers before (or without) sglang_pic: SGLang's client, a notebook, `-c`."""
    out = subprocess.run([sys.executable, *command], cwd=ROOT, capture_output=True, text=True, timeout=HANG_S)
    assert out.returncode == 0, out.stderr[-3000:]


@pytest.mark.parametrize("folder", SCRIPT_FOLDERS)
def test_script_folders_shadow_no_installed_module(folder: str):
    """`python benchmark/x.py` puts benchmark/ first on sys.path: its modules must not hide installed ones."""
    own = {str(ROOT), *(str(ROOT / f) for f in SCRIPT_FOLDERS)}
    elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) not in own]
    installed = {m.name for m in pkgutil.iter_modules(elsewhere)} | set(sys.stdlib_module_names)
    local = {m.name for m in pkgutil.iter_modules([str(ROOT / folder)])}
    assert not local & installed, f"{folder}/ holds modules named like installed ones: {sorted(local & installed)}"
