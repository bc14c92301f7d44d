"""sglang_pic's source files as the installed package holds them, for the scripts that read the package's imports.

python/sglang_pic/ links in the top-level kernels/, radix_ext/ and frontend_lang/ as namespace subpackages (they hold
no __init__.py, so that from the repository root they never stand in for installed packages); the walk follows those
links.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "python" / "sglang_pic"


def package_files() -> dict[Path, Path]:
    """Each .py file of the package: its path relative to the package's parent folder -> its path in the checkout."""
    out = {}
    for folder, dirs, files in os.walk(PACKAGE, followlinks=True):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if name.endswith(".py"):
                path = Path(folder, name)
                out[path.relative_to(PACKAGE.parent)] = path
    return out
