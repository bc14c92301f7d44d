"""Run import-linter's `lint-imports` over sglang_pic laid out as it is installed, with the contracts of pyproject.toml.

kernels/, radix_ext/ and frontend_lang/ are namespace subpackages of sglang_pic, linked into python/sglang_pic/.
grimp, which builds import-linter's graph, walks only regular packages without following links, so run plainly it
would not see those subpackages and would pass any contract about them. This script lays the package out in a
temporary folder, a link per source file and an empty __init__.py in each namespace subpackage, puts that first on
sys.path and runs the linter from the repository root.

Usage: python scripts/lint_imports.py [lint-imports options, e.g. --verbose]
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from importlinter.cli import lint_imports_command
from package_tree import ROOT, package_files


def lay_out(into: Path) -> None:
    """A link to each of the package's files under `into`, and an __init__.py in every folder that lacks one."""
    for rel, path in package_files().items():
        (into / rel).parent.mkdir(parents=True, exist_ok=True)
        (into / rel).symlink_to(path)
    for folder in [into / "sglang_pic", *(into / "sglang_pic").rglob("*")]:
        if folder.is_dir() and not (folder / "__init__.py").exists():
            (folder / "__init__.py").touch()


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="sglang_pic_layout_") as layout:
        lay_out(Path(layout))
        sys.path.insert(0, layout)
        os.chdir(ROOT)
        lint_imports_command.main(["--no-cache", *sys.argv[1:]], prog_name="lint-imports")


if __name__ == "__main__":
    main()
