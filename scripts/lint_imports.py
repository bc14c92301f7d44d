"""Run import-linter's `lint-imports` over sglang_pic laid out as it is installed, with the contracts of pyproject.toml.

pyproject.toml maps top-level folders into the package (kernels/ is sglang_pic.kernels, and so on). grimp, which
builds import-linter's graph, reads a package from one folder, so run plainly it would not see those subpackages
and would pass any contract about them. This script lays the package out as its package-dir mapping says, in a
temporary folder of symlinks, puts that first on sys.path and runs the linter from the repository root.

Usage: python scripts/lint_imports.py [lint-imports options, e.g. --verbose]
"""

from __future__ import annotations

import os
import sys
import tempfile
import tomllib
from pathlib import Path

from importlinter.cli import lint_imports_command

ROOT = Path(__file__).resolve().parents[1]


def package_dirs() -> dict[str, Path]:
    """Each package of the mapping and the folder its files come from."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {name: ROOT / folder for name, folder in setuptools["package-dir"].items()}


def lay_out(dirs: dict[str, Path], into: Path) -> None:
    """A folder per package under `into`, holding links to its source folder's entries (parents come first)."""
    for name, folder in sorted(dirs.items()):
        target = into.joinpath(*name.split("."))
        target.mkdir(parents=True)
        for entry in folder.iterdir():
            if entry.name != "__pycache__":
                (target / entry.name).symlink_to(entry)


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="sglang_pic_layout_") as layout:
        lay_out(package_dirs(), Path(layout))
        sys.path.insert(0, layout)
        os.chdir(ROOT)
        lint_imports_command.main(["--no-cache", *sys.argv[1:]], prog_name="lint-imports")


if __name__ == "__main__":
    main()
