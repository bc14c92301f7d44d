"""Shared fixtures: tiny offline checkpoints, built once per test session (a few seconds in all); and Ctrl-C stops
a run however it was started."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import ARCHS, build_tiny_model  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    """Make Ctrl-C and `kill -INT` stop the run however it was started. A shell without job control (a script
    running `python -m pytest test &`) starts background jobs with SIGINT ignored, and Python keeps it ignored:
    the run then went on to its end, and only SIGTERM stopped it, skipping the teardown that stops its servers."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def tiny_model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny_models")


def _tiny(root: Path, arch: str) -> Path:
    folder = root / arch
    return folder if (folder / "config.json").is_file() else build_tiny_model(root, arch)


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_root: Path) -> Path:
    return _tiny(tiny_model_root, "llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_model_root: Path) -> Path:
    return _tiny(tiny_model_root, "qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3(tiny_model_root: Path) -> Path:
    return _tiny(tiny_model_root, "qwen3")


@pytest.fixture(scope="session")
def tiny_mistral(tiny_model_root: Path) -> Path:
    return _tiny(tiny_model_root, "mistral")


@pytest.fixture(scope="session", params=ARCHS)
def tiny_model(request: pytest.FixtureRequest, tiny_model_root: Path) -> Path:
    """Each tiny checkpoint in turn; the folder name is the arch."""
    return _tiny(tiny_model_root, request.param)
