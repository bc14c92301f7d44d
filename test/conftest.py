"""Shared fixtures: tiny offline checkpoints, built once per test session (a few seconds in all), and the tiny-model
servers that several modules share; and Ctrl-C stops a run however it was started."""

from __future__ import annotations

import gc
import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from server_utils import start_server, stop_server  # noqa: E402
from tiny_models import ARCHS, build_tiny_model  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    """Make Ctrl-C and `kill -INT` stop the run however it was started. A shell without job control (a script
    running `python -m pytest test &`) starts background jobs with SIGINT ignored, and Python keeps it ignored:
    the run then went on to its end, and only SIGTERM stopped it, skipping the teardown that stops its servers."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Keep what collection imported (torch, transformers, every test module: half a million objects) out of the
    cycle collector's scans. Engine.shutdown runs a full collection, which took 0.3 s walking those long-lived
    objects, and hundreds of engines start and stop in a run; garbage made from here on is collected as before."""
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config: pytest.Config) -> None:
    """Hand the frozen objects back, so that the interpreter's exit frees them (nanobind reports leaks otherwise)."""
    gc.unfreeze()


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


# A server start takes about 6 s on 2 cores; modules whose tests leave a server as they found it share these.
@pytest.fixture(scope="session")
def llama_server(tiny_llama: Path):
    """The tiny llama on the default flags (test_server_native, test_sglang_bench_serving)."""
    srv = start_server(tiny_llama)
    yield srv
    stop_server(srv)


@pytest.fixture(scope="session")
def chat_server(tiny_qwen2: Path):
    """The tiny qwen2 served as `tiny-chat`, logging each request at INFO, as test_server_log reads them
    (test_server_log, test_server_openai, test_server_refusals)."""
    srv = start_server(tiny_qwen2, "--log-level", "info", "--served-model-name", "tiny-chat")
    yield srv
    stop_server(srv)
