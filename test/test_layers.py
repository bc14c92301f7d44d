"""The package's layering: no import runs from a lower layer to a higher one (the import-linter contract in
pyproject.toml, checked over the package as installed), no two packages import each other at module top, and no
modules of the forward's attention import each other even inside functions (scripts/import_graph.py). Each failure
names the offending imports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HANG_S = 300  # only against a hang: each script takes about a second


def run_script(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, str(ROOT / "scripts" / name), *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=HANG_S)


def test_no_import_runs_upward() -> None:
    """lint-imports keeps the layers contract (a missing layer, e.g. an unmapped subpackage, fails it too)."""
    result = run_script("lint_imports.py", "--no-logo")
    assert result.returncode == 0, result.stdout + result.stderr


def test_no_package_import_cycle() -> None:
    result = run_script("import_graph.py")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.rstrip().endswith("no package cycle"), result.stdout


def test_no_module_import_cycle_among_the_attention_layers() -> None:
    """layers/ and the ForwardBatch they read: the backends import their base and the base imports no backend back
    (the factory that picks one is layers/attention_registry.py, which nothing there imports)."""
    result = run_script("import_graph.py", "--modules", "sglang_pic.layers", "sglang_pic.forward_batch")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.rstrip().endswith("no module cycle"), result.stdout
