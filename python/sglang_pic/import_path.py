"""Keep the repository's top-level folders from standing in for installed packages.

The design puts `kernels/`, `radix_ext/`, `frontend_lang/`, `benchmark/` and `test/` at the repository root, where
they are installed as `sglang_pic.*`. But `python -m ...`, `python -c` and `python -m pytest` put the current folder
first on sys.path, so run from the root, `import kernels` finds the project's folder instead of PyPI's `kernels`
(which transformers imports while it converts a GGUF) and the first start dies. Every way of running the project
imports `sglang_pic` before anything else of its own, so this package drops the checkout's root from sys.path
then: nothing is meant to be imported from there.
"""

from __future__ import annotations

import os


def is_checkout_root(folder: str) -> bool:
    """Whether `folder` is a checkout of this project (its root holds python/sglang_pic and pyproject.toml)."""
    return os.path.isfile(os.path.join(folder, "pyproject.toml")) and os.path.isfile(
        os.path.join(folder, "python", "sglang_pic", "__init__.py")
    )


def drop_checkout_roots(path: list[str]) -> list[str]:
    """Remove, in place, every entry of `path` (a sys.path; "" is the current folder) that is a checkout's root;
    return the removed entries."""
    removed = [entry for entry in path if is_checkout_root(os.path.abspath(entry or os.curdir))]
    path[:] = [entry for entry in path if entry not in removed]
    return removed
